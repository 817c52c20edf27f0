"""The representative conformance cases: the cheapest cases that together launch every kernel variant.

A kernel implementation that is slow to build or to run (Oclgrind's simulation, Intel's CPU runtime at two
seconds a program) is checked on these rather than on every quick case: per kernel target, the cheapest case
(fewest work-items) for every (op, kernel, compile-time variant) the cases launch, and one combined-field
case per op.
"""
from __future__ import annotations

import math

from host_fallback.abi import SCAN_OPS, used

from .. import launches
from ..runtime.options import RunOptions
from .devices import find, open_device
from . import runner


def plans(spec: str, target: str, cases: list, per_kernel: bool = False) -> list[tuple[set, int, int]]:
    """Per case: the kernels it launches as (op, family, kernel, defines; no defines for a ``PER_KERNEL``
    family, or for any with ``per_kernel``), its work-items and its launch scratch bytes, planned (not run) for
    the device ``spec`` at ``target``. ``per_kernel`` suits a second compiler of the text whose every
    compile-time variant is built anyway (the OpenCL build check): its cases then run each kernel once.

    A scan-family case is its op (its body thunks' kernels are the body ops' own), costed by its arena's size.
    A combined-field case (``catalog.Case.combined``) stands for its op alone: its kernels are the single-field
    cases' own, compiled with several fields' defines at once, so a costly implementation runs one combination
    per op and target, of those with the most fields (the first OpenCL implementation runs every one).
    """
    limits = open_device(find(spec), target).limits
    laid_out = [runner.lay_out(case) for case in cases]
    most = {}
    for case, laid in zip(cases, laid_out):
        if case.combined:
            most[case.op] = max(most.get(case.op, 0), len(used(laid.thunk)))
    out = []
    for case, laid in zip(cases, laid_out):
        if case.op in SCAN_OPS:
            out.append(({(case.op, "scan", case.op, ())}, laid.arena.size, 0))
            continue
        if case.op not in launches.PLANNERS:  # no device kernel: it runs on the host, nothing to check
            out.append((set(), 0, 0))
            continue
        plan = launches.plan(laid.thunk, limits, **RunOptions.build(**case.options).planner_keywords)
        items = [item for item in plan.launches if not item.empty]
        kernels = {(case.op, i.family, i.kernel, () if per_kernel or i.family in PER_KERNEL else i.defines)
                   for i in items}
        if case.combined:
            kernels = {(case.op, "combined", "", ())} if len(used(laid.thunk)) == most[case.op] else set()
        out.append((kernels, sum(math.prod(i.global_size) for i in items), plan.scratch_bytes))
    return out


#: families checked once per (op, kernel) rather than per compile-time variant: the recurrent backward, whose
#: variants are the forward's cell (each checked through the forward's cases) and whose every case runs a
#: launch per step and layer in both walks (per variant it was 18 cases, four minutes, at each target)
PER_KERNEL = {"rnn_backward"}
PREFERRED = {"cpu": ("f16", "bf16", "f32", "f64"), "gpu": ("f32", "bf16", "f16", "f64")}


def representative(planned: list[tuple[set, int, int]], dtypes: list[str], target: str) -> list[int]:
    """Indices of the cheapest cases that together launch every kernel variant the cases launch
    (``dtypes``: each case's; ties go to the target's ``PREFERRED`` order)."""
    order = PREFERRED.get(target, ())
    covered: set = set()
    chosen = []
    rank = {d: order.index(d) if d in order else len(order) for d in set(dtypes)}
    for index in sorted(range(len(planned)), key=lambda i: (planned[i][1], rank[dtypes[i]])):
        if planned[index][0] - covered:
            chosen.append(index)
            covered |= planned[index][0]
    return chosen
