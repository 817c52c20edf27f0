"""What one launch does on paper: its FLOPs, the GEMM-shaped part of them, and the bytes it moves.

The roofline model (``rlx-gpu roofline``, tools/roofline.py) reads a thunk's launch plan and asks each launch
for its cost. A kernel's cost is declared beside its planner (``ssm_cost``, ``gdn_cost``, ``rnn_cost``):
``@declare("kernel")`` on a function of the launch and its arguments by parameter name (what the planner
passed: the fields, the chunk count, the flags), reading the geometry the plan chose (``launch.groups``,
its compile-time defines and tuning constants) where the work depends on it.

Conventions: a multiply-add is 2 FLOPs, a multiply, add, exp, sqrt or division 1. GEMM-shaped FLOPs are the
multiply-adds of products of matrix tiles (what a tensor core's MMA instruction can run); the rest
(elementwise work, recurrences over steps, triangular solves row by row) are ``other``. Bytes: each
tensor or scratch region a launch reads is counted once and each it writes once, at the size it is
stored in (caches and re-reads are not modelled). The FLOPs are those of the algorithm the kernel's loops
run (a tile computed on zeros past a partial chunk counts; index arithmetic does not).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from host_fallback.abi import ELEM_SIZE

from .arguments import named
from .core import Launch, real_size
from .limits import TUNING
from .signatures import signature


@dataclass(frozen=True)
class Cost:
    """FLOPs (``gemm``: GEMM-shaped, ``other``: the rest) and bytes (``read``, ``written``) of a launch."""

    gemm: float = 0.0
    other: float = 0.0
    read: float = 0.0
    written: float = 0.0

    @property
    def flops(self) -> float:
        return self.gemm + self.other

    def __add__(self, more: Cost) -> Cost:
        return Cost(self.gemm + more.gemm, self.other + more.other, self.read + more.read,
                    self.written + more.written)


#: a kernel's cost: ``(launch, arguments by parameter name) -> Cost``
CostOf = Callable[[Launch, Mapping[str, Any]], Cost]

#: kernel name -> its declared cost (one kernel name is one kernel text per family and target)
DECLARED: dict[str, CostOf] = {}


def declare(*kernels: str) -> Callable[[CostOf], CostOf]:
    """Register the decorated function as the cost of each kernel of ``kernels``."""
    def register(cost: CostOf) -> CostOf:
        for kernel in kernels:
            if kernel in DECLARED:
                raise ValueError(f"the cost of kernel {kernel!r} is declared twice")
            DECLARED[kernel] = cost
        return cost
    return register


def launch_cost(launch: Launch) -> Cost | None:
    """The declared cost of ``launch``, or None where its kernel declares none."""
    cost = DECLARED.get(launch.kernel)
    if cost is None:
        return None
    return cost(launch, named(signature(launch.family, launch.kernel, launch.target), launch.args))


def tuned(launch: Launch, name: str) -> int:
    """A tuning constant the launch's program is built with (``limits.TUNING`` of its target)."""
    return TUNING[launch.target][name]


def defined(launch: Launch, name: str, default: int = 0) -> int:
    """The value of one of the launch's own compile-time defines, ``default`` where it has none."""
    return dict(launch.defines).get(name, default)


def stored(launch: Launch) -> int:
    """Bytes of one value as the arena stores the launch's dtype."""
    return ELEM_SIZE[launch.dtype]


def real(launch: Launch) -> int:
    """Bytes of one value of the compute type (what scratch holds)."""
    return real_size(launch.dtype)


def group_count(launch: Launch) -> int:
    """Work-groups of the launch, over all dimensions."""
    count = 1
    for groups in launch.groups:
        count *= groups
    return count


def tokens(args: Mapping[str, Any]) -> int:
    """Tokens of a thunk whose planner passes R rows of S steps and a varlen flag (then S packed tokens)."""
    return args["S"] if args["varlen"] else args["R"] * args["S"]


def chunk_steps(seq: int, rows: int, q: int, varlen: bool) -> list[int]:
    """The step count of every chunk of ``q`` steps the chunked kernels lay out: each of ``rows`` rows of ``seq``
    steps has its own, the last one partial; with varlen (lengths unknown on paper) the ``seq`` packed tokens in
    full chunks and one partial."""
    per_row = [q] * (seq // q) + ([seq % q] if seq % q else [])
    return per_row if varlen else per_row * rows
