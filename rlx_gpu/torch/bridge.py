"""The border between torch tensors and compiled schedules.

``run_graph`` runs a graph built once per signature: the first call with a (key, input shapes and
dtypes, device) compiles it and keeps the ``Executable`` with its resident arena, so a training
loop or a decode loop plans nothing after its first step. Tensors go in through DLPack (host tensors
are read where they lie: one copy, into the arena) and the outputs come back as torch tensors on the
inputs' device, in their storage dtype (a bf16 output is bf16).

The device follows the tensors: CPU tensors run on the default device (``RLX_DEVICE``, else the
config's ``device``, whose ``auto`` takes a GPU or accelerator, else the host), tensors on ``cuda:N`` on the
CUDA backend's device N.
"""
from __future__ import annotations

import collections
import functools
import os
import threading
from typing import Any, Callable, Hashable, Mapping

import torch

from ..errors import RlxError
from ..graph.builder import Graph
from ..graph.lowering import Executable
from ..runtime.executor import RunReport
from ..runtime.registry import device_variables

#: torch dtype -> ABI element type (ABI.md §1; i32 for the integer tensors of §8).
DTYPES: dict[torch.dtype, str] = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16",
                                  torch.bfloat16: "bf16", torch.int32: "i32"}
TORCH_DTYPES: dict[str, torch.dtype] = {v: k for k, v in DTYPES.items()}
#: How many compiled signatures are kept (the least recently used one is dropped past it).
CACHE_SIZE = 256

_cache: collections.OrderedDict[Hashable, Executable] = collections.OrderedDict()
_cache_lock = threading.Lock()
_last = threading.local()  # the Executable of this thread's latest call


@functools.cache
def _device_variables() -> tuple[str, ...]:
    return device_variables()


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


def compiled(key: Hashable, build: Callable[[], Graph], inputs: Mapping[str, torch.Tensor],
             device: str | None) -> Executable:
    """The ``Executable`` of ``build()`` for this signature, compiled on first use and kept."""
    # the default device is looked up when the Executable first runs: the variables that choose it are
    # part of the signature, so a test or a process that changes RLX_DEVICE gets a schedule of its own
    where = device or tuple(os.environ.get(v) for v in _device_variables())
    signature = (key, where, tuple((name, tuple(t.shape), t.dtype) for name, t in inputs.items()))
    with _cache_lock:
        exe = _cache.get(signature)
        if exe is not None:
            _cache.move_to_end(signature)
            return exe
    exe = build().compile(device)
    with _cache_lock:
        exe = _cache.setdefault(signature, exe)
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return exe


def run_graph(key: Hashable, build: Callable[[], Graph], inputs: Mapping[str, torch.Tensor], *,
              device: str | None = None) -> dict[str, torch.Tensor]:
    """Run the graph ``build()`` makes (its inputs named as ``inputs``) on ``inputs``; its outputs by name.

    ``key`` names the graph's structure (the op and its static arguments): the graph is built and
    compiled once per ``key``, input shapes and dtypes, and device (``device``, else the tensors').
    """
    device = device if device is not None else device_for(*inputs.values())
    exe = compiled(key, build, inputs, device)
    home = next(iter(inputs.values())).device if inputs else torch.device("cpu")
    arrays = {name: t.detach().contiguous() if t.device.type == "cpu" else t.detach().cpu().contiguous()
              for name, t in inputs.items()}
    outputs = exe.run(**arrays)
    _last.exe = exe
    tensors = exe.schedule.tensors
    return {name: torch.from_numpy(a).to(device=home, dtype=TORCH_DTYPES[tensors[name].dtype])
            for name, a in outputs.items()}


def clear_cache() -> None:
    """Drop every compiled signature (their resident arenas are freed with them)."""
    with _cache_lock:
        _cache.clear()


def last_report() -> RunReport | None:
    """How this thread's latest call ran (each thunk's backend and seconds), or None before any call:
    what a benchmark subtracts from a call's time to see what the bridge adds."""
    exe = getattr(_last, "exe", None)
    return None if exe is None else exe.device.last_report
