"""The border between torch tensors and compiled schedules.

``run_graph`` runs a graph built once per signature: the first call with a (key, input shapes and
dtypes, device) compiles it and keeps the ``Executable`` with its call plan (``runtime.call_plan``:
the resident arena, the bound launches, where each input and output lies), so a training loop or a
decode loop plans nothing after its first step. CPU tensors are read where they lie, with their own
strides (one copy, into the arena; none for a weight whose stamp is unchanged), and the outputs come
back as torch tensors on the inputs' device, in their storage dtype (a bf16 output is bf16), wrapping
the plan's new arrays without a copy. CUDA tensors never cross to the host: ``run_on_stream`` copies
them device to device into the plan's arena and its outputs out of it, on torch's current stream.

The device follows the tensors: CPU tensors run on the default device (``RLX_DEVICE``, else the
config's ``device``, whose ``auto`` takes a GPU or accelerator, else the host), tensors on ``cuda:N`` on the
CUDA backend's device N.
"""
from __future__ import annotations

import functools
import itertools
import threading
import weakref
from typing import Any, Callable, Hashable, Mapping, Sequence

import ml_dtypes
import numpy as np
import torch

from host_fallback.environ import ENVIRON as _ENVIRON, key as _environ_key

from ..errors import RlxError
from ..graph.builder import Graph
from ..graph.lowering import Executable
from ..runtime.call_plan import CallPlan
from ..runtime.executor import RunReport
from ..runtime.registry import device_variables

#: torch dtype -> ABI element type (ABI.md §1; i32 for the integer tensors of §8).
DTYPES: dict[torch.dtype, str] = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16",
                                  torch.bfloat16: "bf16", torch.int32: "i32"}
TORCH_DTYPES: dict[str, torch.dtype] = {v: k for k, v in DTYPES.items()}
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_NUMPY = frozenset(d for d in DTYPES if d is not torch.bfloat16)  # the dtypes Tensor.numpy() views as they are
CPU = torch.device("cpu")
_TENSOR = torch.Tensor  # a global read, not a module attribute's, in call_key's loop over a call's arguments
_PARAMETER = torch.nn.Parameter
#: How many compiled signatures are kept (the oldest compiled is dropped past it: a lookup on the hot path
#: reorders nothing).
CACHE_SIZE = 256

_cache: dict[Hashable, Executable] = {}  # in the order compiled
_bound: dict[Hashable, "BoundCall | None"] = {}  # a call's signature -> its bound call (None: not bindable)
_cache_lock = threading.Lock()
_last = threading.local()  # the CallPlan of this thread's latest call
#: The clear functions of the per-signature caches kept beside the bridge's own (``kept_per_signature``).
_other_caches: list[Callable[[], None]] = []


@functools.cache
def _device_variables() -> tuple[Any, ...]:
    """The variables that choose the default device, as keys of ``_ENVIRON``."""
    return tuple(map(_environ_key, device_variables()))


def default_device() -> tuple[Any, ...]:
    """The values of the variables that choose the default device, read on every call (what a test or a
    process that changes ``RLX_DEVICE`` between calls relies on: the values are part of a signature, so
    each gets a schedule of its own)."""
    return tuple(map(_ENVIRON.get, _device_variables()))


def rlx_dtype(t: torch.Tensor, what: str = "tensor") -> str:
    """The ABI element type of ``t``; a dtype the ABI has not (int64, complex, ...) is refused naming ``what``."""
    try:
        return DTYPES[t.dtype]
    except KeyError:
        raise NotImplementedError(f"{what} is {t.dtype}; rlx_gpu runs {', '.join(map(str, DTYPES))}") from None


def device_for(*tensors: Any) -> str | None:
    """The device spec the torch tensors among ``tensors`` run on: ``None`` (the default device) for CPU
    tensors, ``"cuda:N"`` for tensors on CUDA device N; tensors on different devices are refused."""
    devices = {t.device for t in tensors if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        raise RlxError(f"the tensors of one call lie on different devices ({', '.join(sorted(map(str, devices)))}); "
                       f"move them to one with .to(device)")
    device = devices.pop() if devices else torch.device("cpu")
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    raise NotImplementedError(f"tensors on {device} have no rlx_gpu backend; use CPU or CUDA tensors")


#: A graph input's shape and ABI element type: what a call's schedule is compiled for.
Spec = tuple[tuple[int, ...], str]


def specs_of(inputs: Mapping[str, torch.Tensor]) -> dict[str, Spec]:
    """The ``Spec`` of each tensor of ``inputs``."""
    return {name: (tuple(t.shape), rlx_dtype(t, name)) for name, t in inputs.items()}


def plan_for(key: Hashable, build: Callable[[], Graph], specs: Mapping[str, Spec], device: str | None) -> CallPlan:
    """The ``CallPlan`` of ``build()`` (a graph whose inputs are ``specs``) on ``device``, compiled on first
    use and kept per signature: ``key`` (the call's structure), the device and the specs."""
    # the default device is looked up when the plan first runs: the variables that choose it are part of
    # the signature, so a test or a process that changes RLX_DEVICE gets a schedule of its own
    where = device or default_device()
    signature = (key, where, tuple(specs.items()))
    exe = _cache.get(signature)
    if exe is not None:
        return exe.plan
    exe = build().compile(device)
    with _cache_lock:
        exe = _cache.setdefault(signature, exe)
        while len(_cache) > CACHE_SIZE:
            _cache.pop(next(iter(_cache)))  # the oldest compiled
    return exe.plan


def host_array(t: torch.Tensor) -> np.ndarray:
    """A tensor's memory as a NumPy array of its own shape and strides: no copy for a CPU tensor (bf16 as
    ``ml_dtypes.bfloat16``), a copy to the host for another device's."""
    if type(t) is torch.Tensor and t.dtype in _NUMPY and t.is_cpu and not t.requires_grad:
        return t.numpy()  # the common case first: a decode step makes a dozen of these
    if t.requires_grad:
        t = t.detach()
    if not t.is_cpu:
        t = t.cpu()
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.numpy()


def tensor(a: np.ndarray, home: torch.device) -> torch.Tensor:
    """A new array of a call's output as a torch tensor on ``home`` (no copy on the CPU)."""
    t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == BFLOAT16 else torch.from_numpy(a)
    return t if home == CPU else t.to(home)


class _Stamps:
    """Stamps of parameters for a call plan (``CallPlan``: an input given with the stamp of its last write
    is not written again): equal while the tensor holds the same values, as far as torch tells.

    Only a ``torch.nn.Parameter`` (or a view of one: ``D[:, None].expand(...)``) gets a stamp; another
    tensor gets ``None`` (written on every call): activations change every call, a tensor computed from a
    parameter (``-exp(A_log)``) is a new tensor every call, and a tool such as
    ``torch.autograd.gradcheck`` changes its inputs through ``.data``, which torch's version counter does
    not see. A stamp is (the serial of the parameter, its ``_version``, data pointer, shape and strides of
    the view): the parameter gets a serial the first time it is seen and keeps it while it lives, so one
    that reuses a dead one's ``id`` or memory gets a new stamp. An in-place torch operation (an optimizer
    step) advances ``_version``; a write through a parameter's ``.data`` does not, and needs
    ``rlx_gpu.torch.clear_cache()``.
    """

    def __init__(self) -> None:
        self._serials: dict[int, tuple[weakref.ref, int]] = {}
        self._next = itertools.count()
        self._lock = threading.Lock()

    def __call__(self, t: torch.Tensor) -> Hashable | None:
        owner = t._base if t._base is not None else t
        # a Parameter itself, then a plain tensor, first: Parameter's isinstance is a Python metaclass check (a
        # microsecond a call: a training step stamps every parameter twice)
        kind = type(owner)
        if kind is not _PARAMETER and (kind is torch.Tensor or not isinstance(owner, torch.nn.Parameter)):
            return None
        key = id(owner)
        entry = self._serials.get(key)
        if entry is None or entry[0]() is not owner:
            with self._lock:
                entry = (weakref.ref(owner, lambda _, key=key: self._serials.pop(key, None)), next(self._next))
                self._serials[key] = entry
        return entry[1], owner._version, t.data_ptr(), t.shape, t.stride(), t.dtype


stamp = _Stamps()


def run_graph(key: Hashable, build: Callable[[], Graph], inputs: Mapping[str, torch.Tensor], *,
              device: str | None = None, stamps: Mapping[str, Hashable] | None = None) -> dict[str, torch.Tensor]:
    """Run the graph ``build()`` makes (its inputs named as ``inputs``) on ``inputs``; its outputs by name.

    ``key`` names the graph's structure (the op and its static arguments): the graph is built and
    compiled once per ``key``, input shapes and dtypes, and device (``device``, else the tensors'), and
    called through its ``CallPlan`` (``run_arrays``).
    """
    first = next(iter(inputs.values()), None)
    if on_cuda(first):  # on torch's current stream, device to device
        device = device if device is not None else device_for(*inputs.values())
        return run_arrays(key, build, specs_of(inputs), inputs, device, stamps)
    specs, arrays, on_cpu = {}, {}, True
    for name, t in inputs.items():  # one pass: a decode step's call has a dozen inputs and no time to spare
        specs[name] = (t.shape, rlx_dtype(t, name))
        arrays[name] = host_array(t)
        on_cpu = on_cpu and t.is_cpu
    if device is None and not on_cpu:
        device = device_for(*inputs.values())
    home = first.device if not on_cpu else CPU
    outputs = run_arrays(key, build, specs, arrays, device, stamps)
    return {name: tensor(a, home) for name, a in outputs.items()}


class BoundCall:
    """One signature's call on tensors in host memory, bound once: its ``CallPlan``, where each input of
    the plan lies among the caller's arguments, which inputs are given with their stamps (``stamp``), and
    which outputs the caller takes. A call (``__call__`` on tensors, ``arrays`` on NumPy arrays) moves the
    inputs in, runs the plan and hands out the new output arrays (as CPU tensors, without a copy): no
    name, spec or signature is worked out again.
    """

    __slots__ = ("plan", "order", "stamped", "outputs", "plain")

    def __init__(self, plan: CallPlan, positions: Mapping[str, int], stamped: Sequence[str], outputs: Sequence[str]):
        """``positions``: each plan input's index among the arguments a call gets; ``stamped``: the inputs
        given with their stamps (parameters); ``outputs``: the plan's outputs a call returns, in order."""
        self.plan = plan
        self.order = tuple(positions[name] for name in plan.inputs)
        self.stamped = tuple((i, positions[name]) for i, name in enumerate(plan.inputs) if name in stamped)
        self.outputs = tuple(plan.outputs.index(name) for name in outputs)
        # no bf16 among the inputs and outputs: Tensor.numpy(force=True) and torch.from_numpy take them as they
        # are (a CPU tensor's view, detached), without host_array's and tensor's cases (a decode step's µs)
        tensors = plan.schedule.tensors
        self.plain = all(tensors[name].dtype != "bf16" for name in (*plan.inputs, *plan.outputs))

    def arrays(self, values: Any, stamps: Any = None, into: Sequence[np.ndarray | None] | None = None
               ) -> list[np.ndarray]:
        """The call on host arrays, each input's at its position of ``values`` (a sequence, or a mapping
        by name; its stamp, if stamped, at the same position of ``stamps``): the outputs taken, new
        arrays in their storage dtype, or written to the arrays of ``into`` (in the order taken; None: new)."""
        if into is not None:
            placed: list[np.ndarray | None] = [None] * len(self.plan.outputs)
            for i, target in zip(self.outputs, into):
                placed[i] = target
            into = placed
        return self.run([values[i] for i in self.order], None if stamps is None else self._stamps(stamps.__getitem__),
                         into)

    def __call__(self, tensors: Sequence[torch.Tensor | Any]) -> list[torch.Tensor]:
        """The call on CPU tensors, each input's at its position of ``tensors`` (a stamped one with
        ``stamp``'s): the outputs taken, new CPU tensors in their storage dtype."""
        stamps = self._stamps(lambda at: stamp(tensors[at]))
        if self.plain:
            return [torch.from_numpy(a) for a in self.run([tensors[i].numpy(force=True) for i in self.order], stamps)]
        return [tensor(a, CPU) for a in self.run([host_array(tensors[i]) for i in self.order], stamps)]

    def _stamps(self, of: Callable[[int], Hashable | None]) -> list[Hashable | None] | None:
        """The stamps in the plan's order, ``of(position)`` for each stamped input (None without any)."""
        if not self.stamped:
            return None
        stamps: list[Hashable | None] = [None] * len(self.order)
        for i, at in self.stamped:
            stamps[i] = of(at)
        return stamps

    def run(self, given: list[Any], stamps: list[Hashable | None] | None,
            into: Sequence[np.ndarray | None] | None = None) -> list[np.ndarray]:
        """The plan's call on ``given`` and ``stamps`` (None: none) in the order of its inputs and ``into`` in
        the order of its outputs (``CallPlan.call``): the outputs taken, in the order taken."""
        out = self.plan.call(given, stamps, into)
        _last.plan = self.plan
        return [out[i] for i in self.outputs]


def bound_call(signature: Hashable, bind: Callable[[], BoundCall | None], lead: Any) -> BoundCall | None:
    """The ``BoundCall`` of ``signature`` (what decides a call's schedule and bindings: the op, its statics,
    its tensors' shapes, dtypes and devices, and ``default_device()``), ``bind()`` on its first call (None:
    a call the caller runs otherwise, kept as such); None for a call whose ``lead`` tensor is in CUDA
    memory (``on_cuda``: it takes torch's stream)."""
    if on_cuda(lead):
        return None
    try:
        return _bound[signature]
    except KeyError:
        pass
    bound = bind()
    with _cache_lock:
        if len(_bound) >= CACHE_SIZE:  # a bound call holds a plan the compiled cache may have dropped
            _bound.clear()
        _bound[signature] = bound
    return bound


#: What ``hot_path`` answers for a signature whose hot path has not been worked out yet.
UNBUILT = object()


def call_key(*args: Any) -> tuple:
    """A call's signature as a hot path is kept by: each tensor's type, shape, strides, dtype and whether it
    lies in CPU memory (nothing of its data or address; only CPU calls get a hot path, so the device
    beyond that tells nothing), any other argument (hashable) itself, then the values that choose the default
    device (``default_device()``'s, read here)."""
    return (*[(type(a), a.shape, a.stride(), a.dtype, a.is_cpu) if isinstance(a, _TENSOR) else a for a in args],
            *map(_ENVIRON.get, _device_variables()))  # map: no comprehension's frame


class _HotPaths(dict):
    """A call signature (``call_key``) -> its hot path: a function doing all a call of that signature needs, its
    static checks passed and its call plan bound, worked out by ``keep_hot_path`` after the signature's first
    call ran the whole way; None for a signature that has none; ``UNBUILT`` (read, not kept) before."""

    def __missing__(self, key: Hashable) -> object:
        return UNBUILT


_hot = _HotPaths()
#: ``hot_path(key)``: the hot path kept for a call signature (``_HotPaths``), read without a Python frame.
hot_path = _hot.__getitem__


def keep_hot_path(key: Hashable, build: Callable[[], "Callable[..., Any] | None"]) -> None:
    """Keep ``build()`` as the hot path of ``key`` (None: the signature always takes the whole way)."""
    path = build()
    with _cache_lock:
        if len(_hot) >= CACHE_SIZE:  # a hot path holds a plan the compiled cache may have dropped
            _hot.clear()
        _hot[key] = path


def run_arrays(key: Hashable, build: Callable[[], Graph], specs: Mapping[str, Spec], arrays: Mapping[str, Any],
               device: str | None, stamps: Mapping[str, Hashable] | None = None) -> dict[str, Any]:
    """``run_graph`` on host arrays (any strides and float dtypes: the plan converts them to each input's
    storage type as it copies them in, none for a weight whose stamp is unchanged); the outputs are new
    arrays in their storage dtype. On CUDA tensors (any strides and float dtypes too), the same on torch's
    current stream (``run_on_stream``), the outputs new CUDA tensors."""
    plan = plan_for(key, build, specs, device)
    first = next(iter(arrays.values()), None)
    if on_cuda(first):
        outputs = run_on_stream(plan, arrays, stamps, first.device)
    else:
        outputs = plan(arrays, stamps)
    _last.plan = plan
    return outputs


def on_cuda(t: Any) -> bool:
    """Whether ``t`` is a torch tensor in CUDA memory, which a call takes on torch's stream (``run_on_stream``)."""
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"


def run_on_stream(plan: CallPlan, inputs: Mapping[str, torch.Tensor], stamps: Mapping[str, Hashable] | None,
                  home: torch.device) -> dict[str, torch.Tensor]:
    """``plan`` (on CUDA) called on CUDA tensors on torch's current stream of ``home`` (``CallPlan.on_stream``):
    each input in the dtype its arena place stores, dense (a torch op on that stream where it is not yet),
    each output a new ``torch.empty`` on ``home`` (torch's allocator: a captured call's outputs come from
    the graph's pool) filled device to device. Nothing waits for the device, so a warmed-up call can be
    captured in a ``torch.cuda.CUDAGraph``."""
    tensors = plan.schedule.tensors
    given = {name: t.detach().to(TORCH_DTYPES[tensors[name].dtype]).contiguous() for name, t in inputs.items()}
    outputs = {name: torch.empty(tensors[name].shape, dtype=TORCH_DTYPES[tensors[name].dtype], device=home)
               for name in plan.outputs}
    with torch.cuda.device(home):  # torch's __dlpack__ exports only tensors of the current device
        plan.on_stream(given, outputs, torch.cuda.current_stream(home).cuda_stream, stamps)
    return outputs


def kept_per_signature(clear: Callable[[], None]) -> Callable[[], None]:
    """Register ``clear``, which empties a per-signature cache kept outside this module (a step's route with
    its bound call, packed weights): ``clear_cache`` calls it. Returns ``clear``."""
    _other_caches.append(clear)
    return clear


def clear_cache() -> None:
    """Drop every compiled signature, bound call and hot path, and every cache registered with
    ``kept_per_signature`` (their resident arenas are freed with them, this thread's latest plan too)."""
    with _cache_lock:
        _cache.clear()
        _bound.clear()
        _hot.clear()
    for clear in _other_caches:
        clear()
    _last.plan = None


def last_report() -> RunReport | None:
    """How this thread's latest call ran (each thunk's backend and seconds), or None before any call:
    what a benchmark subtracts from a call's time to see what the bridge adds."""
    plan = getattr(_last, "plan", None)
    return None if plan is None else plan.last_report
