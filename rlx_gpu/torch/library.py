"""The ``rlx_gpu`` namespace of ``torch.library``: how this package's custom ops are declared.

Every function and module of ``rlx_gpu.torch`` runs through ops registered here
(``torch.ops.rlx_gpu.<name>``), so ``torch.compile`` (Dynamo, AOTAutograd, Inductor) and
``torch.export`` see each call as one opaque op: its fake implementation gives the output shapes,
dtypes and strides without touching data, its autograd formula is registered beside it, and an op
that writes an argument in place declares it in its schema (``Tensor(a!)``).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch._functorch.utils import enable_single_level_autograd_function, unwrap_dead_wrappers
from torch.autograd import forward_ad as _forward_ad
from torch.autograd.graph import increment_version

#: The namespace of every op: ``torch.ops.rlx_gpu.<name>``.
NAMESPACE = "rlx_gpu"


_LIBRARY = torch.library.Library(NAMESPACE, "DEF")
_RUNS: dict[Any, Callable[..., Any]] = {}  # op overload -> its implementation (what its device keys run)
_AUTOGRAD: dict[Any, Callable[..., Any]] = {}  # a differentiable op overload -> its Autograd kernel
#: The tensor types a direct call takes: a subclass (a fake tensor, a functional tensor) goes to the dispatcher.
PLAIN = (torch.Tensor, torch.nn.Parameter)
# what ``untraced`` and ``runs_directly`` ask on every call, bound once: a decode step's module and attribute
# lookups in torch's large namespaces miss the cache its kernel's weights have just swept (µs each)
_is_compiling = torch.compiler.is_compiling
_function_mode = torch._C._is_torch_function_mode_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch = torch._C._are_functorch_transforms_active  # a vmap, grad ... layer: FuncTorchDynamicLayerFrontMode


def _transforms() -> bool:
    """Whether a functorch transform is active (vmap, grad, jvp ...) or a level of forward-mode AD is open
    (``torch.autograd.forward_ad.dual_level``, which torch.func.jvp opens too): then a call goes through the
    dispatcher, whose Autograd kernel refuses a tangent (``_refuse_tangents``)."""
    return _functorch() or _forward_ad._current_level >= 0


def _refuse_tangents(op: Any, args: Sequence[Any]) -> None:
    """Raise where an argument of ``op`` carries a forward-mode tangent: no op here has a forward derivative,
    and without this check its outputs would carry none, a zero directional derivative given silently."""
    for i, t in _tensors(args):
        if _forward_ad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(
                f"{op._schema.name}: forward-mode AD is not supported (argument '{op._schema.arguments[i].name}' "
                f"carries a tangent: torch.func.jvp / jacfwd / torch.autograd.forward_ad); the op has no forward "
                f"derivative. Use reverse mode: torch.func.grad or vjp, or torch.autograd")
_grad_enabled = torch.is_grad_enabled
_any_requires_grad = torch._C._any_requires_grad


def define(name: str, schema: str, impl: Callable[..., Any], fake: Callable[..., Any],
           backward: Callable[..., Any] | None = None, setup_context: Callable[..., Any] | None = None,
           once_differentiable: bool = False) -> Any:
    """Register ``rlx_gpu::name`` with ``schema`` (the part after the name: ``"(Tensor x, ...) -> Tensor"``),
    ``impl`` for every device, ``fake`` for tracing and, for a differentiable op, its autograd formula
    (``backward`` and ``setup_context``, as ``torch.library.register_autograd`` takes them); returns the op
    overload. ``once_differentiable``: the op is another's backward, of no derivative of its own
    (``_once_differentiable_kernel``).

    The op is declared with ``torch.library.Library`` rather than ``torch.library.custom_op``: the
    same registrations, without the Python wrappers ``custom_op`` and ``register_autograd`` add around
    every call (about 34 µs for an op that mutates an argument, 2 µs otherwise, against 4 µs for the
    whole dispatch here: a decode step's budget). What those wrappers would do is done here: an argument
    the schema marks written (``Tensor(a!)``) gets its version counter advanced after ``impl`` wrote it,
    as an in-place torch operation's would be, and the Autograd kernel is ``_autograd_kernel``.
    """
    _LIBRARY.define(name + schema)
    qualified = f"{NAMESPACE}::{name}"
    written = [i for i, arg in enumerate(torch._C.parse_schema(name + schema).arguments)
               if arg.alias_info is not None and arg.alias_info.is_write]
    if written:
        def run(*args: Any) -> Any:
            out = impl(*args)
            for i in written:
                increment_version(args[i])
            return out
    else:
        run = impl
    _LIBRARY.impl(name, run, "CompositeExplicitAutograd")
    _RUNS[getattr(getattr(torch.ops, NAMESPACE), name).default] = run
    torch.library.register_fake(qualified, fake, lib=_LIBRARY)
    op = getattr(getattr(torch.ops, NAMESPACE), name).default
    if backward is not None:
        _AUTOGRAD[op] = _autograd_kernel(op, run, backward, setup_context)
        _LIBRARY.impl(name, _AUTOGRAD[op], "Autograd", with_keyset=True)
    elif once_differentiable:
        _LIBRARY.impl(name, _once_differentiable_kernel(op, run), "Autograd", with_keyset=True)
    return op


#: The dispatch keys below Autograd that are a device's own kernel: nothing (a fake tensor, a dispatch mode,
#: functionalization) stands between Autograd and ``impl`` when the next key is one of these.
_DEVICE_KEYS = frozenset({torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA})
_BELOW_AUTOGRAD = torch._C._after_autograd_keyset


def _below_autograd(op: Any, run: Callable[..., Any], keyset: Any, args: Sequence[Any]) -> Any:
    """``op`` on ``args`` past its Autograd kernel: its implementation ``run`` straight where the next dispatch key
    is the device's own (or ``keyset`` is None: ``direct``'s eager call), else redispatched to what stands between
    (a fake tensor, a dispatch mode, functionalization, a functorch transform's lower level)."""
    rest = None if keyset is None else keyset & _BELOW_AUTOGRAD
    if rest is None or rest.highestPriorityTypeId() in _DEVICE_KEYS:
        return run(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op.redispatch(rest, *args)


def _tensors(args: Sequence[Any]) -> Any:
    """The tensors among ``args``, a ``Tensor[]``'s elements too, each with its argument's index."""
    for i, arg in enumerate(args):
        for t in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(t, torch.Tensor):
                yield i, t


def _autograd_kernel(op: Any, run: Callable[..., Any], backward: Callable[..., Any],
                     setup_context: Callable[..., Any]) -> Callable[..., Any]:
    """The Autograd kernel of ``op``: what ``torch.library.register_autograd`` registers (an
    ``autograd.Function`` whose forward runs the op below autograd and calls ``setup_context``, whose
    backward calls ``backward`` with ``ctx.needs_input_grad`` per schema argument), without its
    general-purpose wrapping (a pytree over every argument, twice, for the ``Tensor[]`` of the recurrent
    ops' weights: about 90 µs of a training step's 2 ms). ``backward`` returns one gradient per schema
    argument, a list for a ``Tensor[]``. Where the next dispatch key is the device's own, the op's
    implementation ``run`` is called straight away rather than through a second pass of the dispatcher (a
    decode step's few microseconds), also inside the ``autograd.Function``; ``direct`` calls the kernel
    itself with the keyset None (an eager call on plain tensors: the device's kernel next).

    Under torch.func's ``grad`` or ``vjp`` the kernel runs on the transform's wrapped tensors, as a C++ op's
    Autograd kernel does: the Function (in the ``setup_context`` form functorch requires) is applied there
    as a single-level one, its forward redispatches below autograd (the transform unwraps, calls the op a
    level down) and its ``backward`` gets the wrapped gradients. ``Function.apply`` would hand it to
    ``custom_function_call``, which is not dispatched from inside an Autograd kernel: the kernel calls
    ``_FunctionBase.apply``, eagerly too (without ``Function.apply``'s ``inspect.signature`` binding)."""
    lists = frozenset(i for i, arg in enumerate(op._schema.arguments) if str(arg.type) == "List[Tensor]")
    def nested(flat: Sequence[Any], sizes: Sequence[int]) -> list[Any]:
        """The schema's arguments from the flat ones: ``sizes[i]`` elements for a list, -1 for a value."""
        out, at = [], 0
        for size in sizes:
            out.append(list(flat[at: at + size]) if size >= 0 else flat[at])
            at += max(size, 1)
        return out

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(keyset: Any, sizes: tuple[int, ...], *flat: Any) -> Any:
            return _below_autograd(op, run, keyset, nested(flat, sizes))

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            sizes = inputs[1]
            setup_context(ctx, tuple(nested(inputs[2:], sizes)), output)
            ctx.sizes = sizes

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
            flat_needs = ctx.needs_input_grad
            needs = nested(flat_needs[2:], ctx.sizes)
            ctx.needs_input_grad = tuple(any(n) if isinstance(n, list) else n for n in needs)
            try:  # per schema argument while ``backward`` runs; a graph kept for another backward needs it back
                per_argument = backward(ctx, *grads)
            finally:
                ctx.needs_input_grad = flat_needs
            flat: list[Any] = [None, None]
            for i, g in enumerate(per_argument):
                if i in lists:
                    flat.extend(g if g is not None else [None] * ctx.sizes[i])
                else:
                    flat.append(g)
            return tuple(flat)

    apply = super(torch.autograd.Function, Function).apply  # torch's C++ apply: what Function.apply ends in

    def kernel(keyset: Any, *args: Any) -> Any:
        if _forward_ad._current_level >= 0:
            _refuse_tangents(op, args)
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            sizes = tuple(len(a) if i in lists else -1 for i, a in enumerate(args))
            flat = [t for i, a in enumerate(args) for t in (a if i in lists else (a,))]
            if _transforms():
                with enable_single_level_autograd_function():
                    return apply(keyset, sizes, *flat)
            return apply(keyset, sizes, *unwrap_dead_wrappers(flat))
        return _below_autograd(op, run, keyset, args)
    return kernel


def _once_differentiable_kernel(op: Any, run: Callable[..., Any]) -> Callable[..., Any]:
    """The Autograd kernel of a backward op: it runs the op below autograd and, where autograd would record the
    call (a backward with ``create_graph=True``, ``torch.func.grad`` of a gradient), passes its outputs through a
    node that raises when differentiated, as torch's ``once_differentiable`` does: the gradients themselves stay
    usable, a second derivative is refused (torch's fallback for an op of no Autograd kernel warned and gave
    zeros)."""
    message = (f"{op._schema.name} has no derivative: a second derivative through rlx_gpu's ops (a gradient "
               f"differentiated again: create_graph=True, torch.func.grad of grad, hessian) is not supported").encode()

    def kernel(keyset: Any, *args: Any) -> Any:
        out = _below_autograd(op, run, keyset, args)
        if not (torch.is_grad_enabled() and torch._C._any_requires_grad(*args)):
            return out
        # the node's edges lead to the arguments autograd follows, so a derivative of an output reaching them
        # passes through it (and raises); its outputs share the outputs' memory
        at = [i for i, t in enumerate(out) if t is not None and t.is_floating_point()]
        needed = [t for _, t in _tensors(args) if t.requires_grad]
        marked = torch._C._functions.DelayedError(message, len(at) + len(needed))(*(out[i] for i in at), *needed)
        for i, t in zip(at, marked):
            out[i] = t
        return out
    return kernel


def direct(op: Any) -> Callable[..., Any]:
    """``op`` (an op ``define`` made) as the frontends call it: its implementation itself, where the
    dispatcher would do nothing but reach it, else ``op``. That is an eager call (not traced by Dynamo,
    no torch function or dispatch mode, no functorch transform) on plain tensors of which autograd
    records nothing (grad disabled, or none requires it): the dispatcher's two passes and the Python
    kernel's frames cost a decode step about as much as its kernel (on an Intel Xeon, 20 of ~75 µs). Such a
    call of which autograd records something goes to the op's Autograd kernel itself (``_autograd_kernel``)
    rather than through the dispatcher's pass to it (a training step's forward, about 20 µs)."""
    run, recorded = _RUNS[op], _AUTOGRAD.get(op)

    def call(*args: Any) -> Any:
        if not untraced():
            return op(*args)
        for a in args:
            if isinstance(a, torch.Tensor) and type(a) not in PLAIN or type(a) is list and not all(
                    type(t) in PLAIN for t in a):
                return op(*args)
        if _grad_enabled() and _any_requires_grad(*args):
            return op(*args) if recorded is None else recorded(None, *args)
        return run(*args)
    return call


def untraced() -> bool:
    """Whether a call now runs eagerly with nothing between its caller and the dispatcher's device kernel:
    not traced by Dynamo, no torch function or dispatch mode, no functorch transform (what ``direct`` and a
    hot path, ``bridge.hot_path``, require besides plain tensors of which autograd records nothing). Traced
    code sees ``torch.compiler.is_compiling()`` (bound as ``_is_compiling``) first, so Dynamo never reads the rest."""
    return not (_is_compiling() or _function_mode() or _dispatch_modes() or _transforms())


def runs_directly(*args: Any) -> bool:
    """Whether a call on ``args`` may skip the dispatcher: ``untraced()``, and autograd records nothing of
    it (grad disabled, or no argument requires it; a list's tensors are looked into)."""
    return untraced() and not (_grad_enabled() and _any_requires_grad(*args))


def empty(like: torch.Tensor) -> torch.Tensor:
    """The stand-in for an output a call does not produce (a final state without an initial one): a
    tensor of no elements (an op returns tensors, never None)."""
    return like.new_empty((0,))


def dense(shape: Sequence[int], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new contiguous tensor of ``shape`` on ``like``'s device: what the ops return, real or fake."""
    return torch.empty(tuple(shape), dtype=dtype or like.dtype, device=like.device)


def schema_args(tensors: Sequence[str], optional: Sequence[str], statics: Sequence[tuple[str, str]]) -> str:
    """The argument list of a schema: required tensors, optional tensors, then the typed statics."""
    return ", ".join([f"Tensor {t}" for t in tensors] + [f"Tensor? {t}" for t in optional]
                     + [f"{kind} {name}" for name, kind in statics])
