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

#: The namespace of every op: ``torch.ops.rlx_gpu.<name>``.
NAMESPACE = "rlx_gpu"


_LIBRARY = torch.library.Library(NAMESPACE, "DEF")


def define(name: str, schema: str, impl: Callable[..., Any], fake: Callable[..., Any],
           backward: Callable[..., Any] | None = None, setup_context: Callable[..., Any] | None = None) -> Any:
    """Register ``rlx_gpu::name`` with ``schema`` (the part after the name: ``"(Tensor x, ...) -> Tensor"``),
    ``impl`` for every device, ``fake`` for tracing and, for a differentiable op, its autograd formula
    (``torch.library.register_autograd``'s ``backward`` and ``setup_context``); returns the op overload.

    The op is declared with ``torch.library.Library`` rather than ``torch.library.custom_op``: the
    same registrations, without the Python wrappers ``custom_op`` adds around every call (about 34 µs
    for an op that mutates an argument, 2 µs otherwise, against 4 µs for the whole dispatch here: a decode
    step's budget). What those wrappers would do is done here: an argument the schema marks written
    (``Tensor(a!)``) gets its version counter advanced after ``impl`` wrote it, as an in-place torch
    operation's would be.
    """
    _LIBRARY.define(name + schema)
    qualified = f"{NAMESPACE}::{name}"
    written = [i for i, arg in enumerate(torch._C.parse_schema(name + schema).arguments)
               if arg.alias_info is not None and arg.alias_info.is_write]
    if written:
        def run(*args: Any) -> Any:
            out = impl(*args)
            for i in written:
                torch.autograd.graph.increment_version(args[i])
            return out
    else:
        run = impl
    _LIBRARY.impl(name, run, "CompositeExplicitAutograd")
    torch.library.register_fake(qualified, fake, lib=_LIBRARY)
    if backward is not None:
        torch.library.register_autograd(qualified, backward, setup_context=setup_context, lib=_LIBRARY)
    return getattr(getattr(torch.ops, NAMESPACE), name).default


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
