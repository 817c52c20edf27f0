"""The representative conformance cases: the cheapest cases that together launch every kernel variant.

A kernel implementation that is slow to build or to run is checked on these rather than on every quick case.
Oclgrind's simulation (``plans`` and ``representative``): per kernel target, the cheapest case (fewest
work-items) for every (op, kernel, compile-time variant) the cases launch, and one combined-field case per op.
A second compiler of the text whose every variant the OpenCL build check builds (Intel's CPU runtime, one to
three seconds a program: ``fewest_builds``): the cases that run every kernel of every family and every op on
its families for the fewest program builds.
"""
from __future__ import annotations

import math

from host_fallback.abi import SCAN_OPS, used

from .. import launches
from ..runtime.options import RunOptions
from .devices import find, open_device
from . import runner


def plans(spec: str, target: str, cases: list) -> list[tuple[set, int, int]]:
    """Per case: the kernels it launches as (op, family, kernel, defines; no defines for a ``PER_KERNEL``
    family), its work-items and its launch scratch bytes, planned (not run) for the device ``spec`` at ``target``.

    A scan-family case is its op (its body thunks' kernels are the body ops' own), costed by its arena's size.
    A combined-field case (``catalog.Case.combined``) stands for its op alone: its kernels are the single-field
    cases' own, compiled with several fields' defines at once, so a costly implementation runs one combination
    per op and target, of those with the most fields (the first OpenCL implementation runs every one).
    """
    limits = open_device(find(spec), target).limits
    laid_out = [runner.lay_out(case) for case in cases]
    most = _most_fields(cases, laid_out)
    out = []
    for case, laid in zip(cases, laid_out):
        if case.op in SCAN_OPS:
            out.append(({(case.op, "scan", case.op, ())}, laid.arena.size, 0))
            continue
        if case.op not in launches.PLANNERS:  # no device kernel: it runs on the host, nothing to check
            out.append((set(), 0, 0))
            continue
        plan = _plan(case, laid, limits)
        items = [item for item in plan.launches if not item.empty]
        kernels = {(case.op, i.family, i.kernel, () if i.family in PER_KERNEL else i.defines) for i in items}
        if case.combined:
            kernels = {(case.op, "combined", "", ())} if len(used(laid.thunk)) == most[case.op] else set()
        out.append((kernels, sum(math.prod(i.global_size) for i in items), plan.scratch_bytes))
    return out


def fewest_builds(spec: str, target: str, cases: list) -> list[int]:
    """Indices of cases that together run, on the device ``spec`` at ``target``, every kernel of every program
    family the cases launch, every op on each family it launches, every scan op and one combined-field case per
    op (of those with the most fields, as in ``plans``), chosen for the fewest program builds: for a second
    compiler of the text whose every compile-time variant is built anyway (the OpenCL build check), where a
    program's build (1 to 3 seconds on Intel's runtime) costs far more than running a case.

    Greedy: next comes the case with the fewest programs not yet built per item it newly covers, then the
    fewest work-items (a scan case: its arena's bytes, its body programs counted as one).
    """
    limits = open_device(find(spec), target).limits
    laid_out = [runner.lay_out(case) for case in cases]
    most = _most_fields(cases, laid_out)
    covers, builds, work = [], [], []
    for case, laid in zip(cases, laid_out):
        if case.op in SCAN_OPS or case.op not in launches.PLANNERS:  # the latter runs on the host: nothing to cover
            scan = {(case.op, "scan")} if case.op in SCAN_OPS else set()
            covers.append(scan), builds.append(scan), work.append(laid.arena.size)
            continue
        items = [item for item in _plan(case, laid, limits).launches if not item.empty]
        if case.combined:
            covers.append({(case.op, "combined")} if len(used(laid.thunk)) == most[case.op] else set())
        else:
            covers.append({(i.family, i.kernel) for i in items} | {(case.op, i.family) for i in items})
        builds.append({(i.family, i.dtype, i.src_dtype, i.defines) for i in items})
        work.append(sum(math.prod(i.global_size) for i in items))
    covered, built, chosen = set(), set(), []
    while True:
        left = [i for i in range(len(cases)) if covers[i] - covered]
        if not left:
            return chosen
        best = min(left, key=lambda i: (len(builds[i] - built) / len(covers[i] - covered), work[i]))
        chosen.append(best)
        covered |= covers[best]
        built |= builds[best]


def _plan(case, laid, limits) -> launches.LaunchPlan:
    return launches.plan(laid.thunk, limits, **RunOptions.build(**case.options).planner_keywords)


def _most_fields(cases: list, laid_out: list) -> dict[str, int]:
    """Per op with combined-field cases: the most version-2 and optional fields one of them uses."""
    most: dict[str, int] = {}
    for case, laid in zip(cases, laid_out):
        if case.combined:
            most[case.op] = max(most.get(case.op, 0), len(used(laid.thunk)))
    return most


#: families checked once per (op, kernel) rather than per compile-time variant: the recurrent backward, whose
#: variants are the forward's cell (each checked through the forward's cases) and whose every case runs a
#: launch per step and layer in both walks (per variant it was 18 cases, four minutes, at each target)
PER_KERNEL = {"rnn_backward"}
PREFERRED = {"cpu": ("f16", "bf16", "f32", "f64"), "gpu": ("f32", "bf16", "f16", "f64")}


def representative(planned: list[tuple[set, int, int]], dtypes: list[str], target: str) -> list[int]:
    """Indices of the cheapest cases that together launch every kernel variant the cases launch
    (``dtypes``: each case's; ties go to the target's ``PREFERRED`` order).

    Greedy from the fewest work-items: a case joins when it launches a variant no case before it launched.
    A case that joined for a variant the larger cases after it also launch is then left out, the largest
    first, where the others chosen launch every variant it launches (at the gpu target 10 of 112 cases, 16 of
    Oclgrind's 169 CPU seconds)."""
    order = PREFERRED.get(target, ())
    covered: set = set()
    chosen = []
    rank = {d: order.index(d) if d in order else len(order) for d in set(dtypes)}
    for index in sorted(range(len(planned)), key=lambda i: (planned[i][1], rank[dtypes[i]])):
        if planned[index][0] - covered:
            chosen.append(index)
            covered |= planned[index][0]
    for index in sorted(chosen, key=lambda i: -planned[i][1]):
        others = [planned[i][0] for i in chosen if i != index]
        if planned[index][0] <= set().union(*others):
            chosen.remove(index)
    return chosen
