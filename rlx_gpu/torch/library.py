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


def define(name: str, schema: str, impl: Callable[..., Any], fake: Callable[..., Any],
           mutates: Sequence[str] = ()) -> Any:
    """Register ``rlx_gpu::name`` with ``schema`` (the part after the name: ``"(Tensor x, ...) -> Tensor"``),
    ``impl`` for CPU and CUDA tensors and ``fake`` for tracing; returns the ``CustomOpDef``."""
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=tuple(mutates), schema=schema)
    op.register_fake(fake)
    return op


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
