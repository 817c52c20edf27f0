"""Run conformance cases on a device: one runner for ``rlx-gpu conformance`` and the pytest suite.

Each case is laid out with ``GUARD`` canary bytes around every tensor, run on the device, and
checked: (1) no byte the thunk may not write changed, (2) NaN/+Inf/-Inf positions and (3) NMSE
against a float64 reference written from ABI.md, and (4) NaN/Inf positions and NMSE against
``host_fallback`` on the same bytes. NMSE bounds come from the ``tolerances`` table of the config.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping

import numpy as np

import host_fallback
from host_fallback.abi import BACKWARD, OPS, SCAN_OPS, Region, complete, regions
from host_fallback.abi.reserve import RESERVE
from host_fallback.arena import STORAGE

from ..backends.base import Session
from ..errors import RunError
from ..runtime.config import Config
from ..runtime.executor import Device
from ..runtime.options import RunOptions
from . import scan_cell
from .cases import int_values, lay_out as place, schedule_of
from .catalog import Case
from .compare import nmse, non_finite_mismatch
from .references import REFERENCES

GUARD = 1024
SPECIALS = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0])


@dataclass(frozen=True)
class Outcome:
    """What one case did on one device; errors are the worst over its output tensors."""

    device: str
    case: Case
    status: str                  # "pass", "fail" or "skip"
    message: str = ""            # why it failed or was skipped
    nmse: float | None = None    # against the float64 reference
    max_err: float | None = None
    host_nmse: float | None = None  # against host_fallback
    seconds: float | None = None       # --perf: median time of one run on the device
    host_seconds: float | None = None  # --perf: the same on the host


@dataclass(frozen=True)
class Laid:
    """A case placed in an arena: canaries everywhere, sampled inputs over them, and its reference."""

    thunk: dict[str, Any]
    arena: np.ndarray
    regions: tuple[Region, ...]
    reference: Callable[[], dict[str, np.ndarray]]

    def view(self, arena: np.ndarray, field: str) -> np.ndarray:
        """``field`` of ``arena`` as float64 values (scan-family slots in the thunk's dtype)."""
        r = next(r for r in self.regions if r.field == field)
        dtype = self.thunk["dtype"] if r.dtype == "u8" else r.dtype
        return arena[r.offset: r.offset + r.nbytes].view(STORAGE[dtype]).astype(np.float64)


def sample(op: str, params: Mapping[str, Any], field: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Inputs in the range each op is defined on (its definition's ``OpDef.sample``: positive log args,
    decays below 1 ...); a backward op's forward inputs as its forward's."""
    return OPS[op].sample(field, params, rng.standard_normal(shape))


def _store(arena: np.ndarray, r: Region, dtype: str, values: np.ndarray) -> None:
    raw = np.asarray(values, np.float64).astype(STORAGE[dtype]).reshape(-1).view(np.uint8)
    arena[r.offset: r.offset + raw.size] = raw


def lay_out(case: Case) -> Laid:
    """Place ``case`` with ``GUARD`` canary bytes around every tensor and fill its inputs."""
    rng = np.random.default_rng(case.seed)
    if case.op in SCAN_OPS:
        return _lay_out_scan(case, rng)
    thunk, nbytes = place(case.op, case.dtype, dict(case.params), guard=GUARD)
    placed = tuple(regions(thunk))
    arena = rng.integers(0, 256, nbytes, dtype=np.uint8)  # canaries everywhere, inputs overwrite below
    ints = int_values(dict(case.params))
    for r in placed:
        if r.dtype == "i32":
            _store(arena, r, r.dtype, np.asarray(ints[r.field]))
        elif r.reads and r.dtype != "u8":
            _store(arena, r, r.dtype, sample(case.op, case.params, r.field, r.shape, rng))
    if case.op in BACKWARD and thunk.get("reserve") is not None:
        _save_forward(thunk, arena)
    if case.poison:
        r = next(r for r in placed if r.field == case.poison)
        view = arena[r.offset: r.offset + r.nbytes].view(STORAGE[r.dtype])
        if case.poison_step is None:
            view[: SPECIALS.size * 3: 3] = SPECIALS.astype(STORAGE[r.dtype])
        else:  # [batch, seq, ...]: the first element of step poison_step of batch row 0
            view[case.poison_step * int(np.prod(r.shape[2:]))] = case.poison_value
    pristine = arena.copy()

    def reference() -> dict[str, np.ndarray]:
        if case.op == "copy":
            return {}
        by_field = {r.field: r for r in placed}

        def load(field: str) -> np.ndarray:
            r = by_field[field]
            return pristine[r.offset: r.offset + r.nbytes].view(STORAGE[r.dtype]).astype(np.float64).reshape(r.shape)
        with np.errstate(all="ignore"):
            return REFERENCES[case.op](complete(thunk), load)
    return Laid(thunk, arena, placed, reference)


def _save_forward(thunk: Mapping[str, Any], arena: np.ndarray) -> None:
    """Fill a backward thunk's reserve (ABI.md §9.1) as its forward on the host writes it: the forward runs on a
    copy (it updates carried states in place) with its ``dst`` past the arena; the reserve comes back. A
    device under test then reads a reserve the host wrote."""
    forward = {k: v for k, v in thunk.items() if k in OPS[BACKWARD[thunk["op"]]].keys}
    forward.update(op=BACKWARD[thunk["op"]], dst=-(-arena.size // 256) * 256)
    dst = next(r for r in regions(forward) if r.field == "dst")
    longer = np.zeros(dst.offset + dst.nbytes, np.uint8)
    longer[: arena.size] = arena
    host_fallback.execute(forward, longer)
    start, end = thunk["reserve"], thunk["reserve"] + thunk["reserve_bytes"]
    arena[start:end] = longer[start:end]


def _lay_out_scan(case: Case, rng: np.random.Generator) -> Laid:
    save, k, length = case.params["save_trajectory"], case.params["num_checkpoints"], case.params["length"]
    cell = scan_cell.cell(case.dtype, bcast_bias=case.op == "scan")
    fields = scan_cell.fields(case.op, cell, length, save, k)
    if case.params.get("forward_body") is False:
        fields["forward_body"] = None
    thunk, nbytes = place(case.op, case.dtype, fields, guard=GUARD)
    placed = tuple(regions(thunk))
    problem = scan_cell.problem(case.op, cell, length, save, case.seed)
    arena = rng.integers(0, 256, nbytes, dtype=np.uint8)
    values = scan_cell.inputs(case.op, cell, problem, k)
    for r in placed:
        if r.field in values:
            _store(arena, r, case.dtype, values[r.field])
    return Laid(thunk, arena, placed, lambda: scan_cell.reference(case.op, cell, problem, save, k))


# ---------------------------------------------------------------- checks
class Mismatch(Exception):
    """A check failed; the message says which and by how much."""


def _run(session: Session, thunk: Mapping[str, Any], arena: np.ndarray, options: Mapping[str, Any],
         config: Config) -> np.ndarray:
    """The arena after ``thunk`` ran as a one-thunk schedule through the executor, the path every run
    takes (validation, placement of a scan's body thunks, the device's runner)."""
    device = Device(session, config, RunOptions.build(config, **options))
    return device.run(schedule_of(dict(thunk), arena.size), arena)


def _check_guards(laid: Laid, got: np.ndarray) -> None:
    mask = np.ones(laid.arena.size, bool)
    for r in laid.regions:
        if r.writes:
            mask[r.offset: r.offset + r.nbytes] = False
    changed = np.flatnonzero((laid.arena != got) & mask)
    if changed.size:
        raise Mismatch(f"bytes outside the outputs changed at offsets {changed[:8].tolist()} "
                       f"({changed.size} in all; guard zones of {GUARD} bytes surround every tensor)")


def _compare(laid: Laid, got: np.ndarray, want: Mapping[str, np.ndarray], bound: float, what: str) -> tuple[float, float]:
    """Worst (NMSE, max |error|) over ``want``'s fields; raises ``Mismatch`` on a NaN/Inf position or bound."""
    worst, max_err = 0.0, 0.0
    dtype = laid.thunk["dtype"]
    for field, values in want.items():
        have = laid.view(got, field)
        exact = np.asarray(values, np.float64).reshape(-1)
        r = next(r for r in laid.regions if r.field == field)
        stored = exact.astype(STORAGE[dtype if r.dtype == "u8" else r.dtype]).astype(np.float64)
        mismatch = non_finite_mismatch(have, stored)
        if mismatch is not None:
            name, differ = mismatch
            raise Mismatch(f"{what}: {name} positions of {field} differ at elements {differ[:8].tolist()} "
                           f"({differ.size} in all)")
        err = nmse(have, exact)
        finite = np.isfinite(exact)
        max_err = max(max_err, float(np.max(np.abs(have[finite] - exact[finite]), initial=0.0)))
        worst = max(worst, err)
        if not err <= bound:
            raise Mismatch(f"{what}: NMSE of {field} is {err:.3g} > {bound:.3g} (tolerances in the config)")
    return worst, max_err


def _host_keywords(options: Mapping[str, Any]) -> dict[str, Any]:
    return RunOptions.build(**options).host_keywords


def check(session: Session, case: Case, config: Config, host: Session | None = None) -> Outcome:
    """Run ``case`` on ``session`` and check it (``host``: the session for host parity, None to skip it)."""
    laid = lay_out(case)
    spec = session.info.spec
    if case.refused:  # the check of run-time data comes before any kernel: every device makes it
        return _check_refused(session, case, laid, config)
    why = session.unsupported(laid.thunk)
    if why is not None:
        return Outcome(spec, case, "skip", why)
    bound = config.tolerance(case.op, case.dtype)
    err = max_err = host_err = None
    try:
        with np.errstate(all="ignore"):
            got = _run(session, laid.thunk, laid.arena, case.options, config)
        _check_guards(laid, got)
        if case.op == "copy":
            src, dst, n = laid.thunk["src"], laid.thunk["dst"], laid.thunk["nbytes"]
            if not np.array_equal(got[dst: dst + n], laid.arena[src: src + n]):
                raise Mismatch("copy: the destination bytes differ from the source")
            err = max_err = 0.0
        else:
            err, max_err = _compare(laid, got, laid.reference(), bound, "vs float64 reference")
        if host is not None and case.op in host_fallback.KERNELS:
            expected = laid.arena.copy()
            with np.errstate(all="ignore"):
                host_fallback.execute(laid.thunk, expected, **_host_keywords(case.options))
            if case.op == "copy":
                if not np.array_equal(got, expected):
                    raise Mismatch("vs host_fallback: the arenas differ after the copy")
                host_err = 0.0
            else:
                # a saved forward is opaque bytes, not values of the thunk's dtype (the tests compare its layout)
                want = {r.field: laid.view(expected, r.field) for r in laid.regions if r.writes and r.field != RESERVE}
                host_err, _ = _compare(laid, got, want, bound, "vs host_fallback")
    except Mismatch as failed:
        return Outcome(spec, case, "fail", str(failed), err, max_err, host_err)
    except Exception as crashed:  # a device error is a failed case, reported with the others
        return Outcome(spec, case, "fail", f"{type(crashed).__name__}: {crashed}", err, max_err, host_err)
    return Outcome(spec, case, "pass", "", err, max_err, host_err)


def _check_refused(session: Session, case: Case, laid: Laid, config: Config) -> Outcome:
    """A run-time data case: the device refuses the run with a RunError naming the field, before it writes."""
    spec, given = session.info.spec, laid.arena.copy()
    try:
        _run(session, laid.thunk, laid.arena, case.options, config)
    except RunError as refused:
        if f"field {case.refused!r}" not in str(refused):
            return Outcome(spec, case, "fail", f"refused, but naming another field: {refused}")
        if not np.array_equal(given, laid.arena):
            return Outcome(spec, case, "fail", "refused, but the caller's arena changed")
        return Outcome(spec, case, "pass", "")
    except Exception as crashed:
        return Outcome(spec, case, "fail", f"{type(crashed).__name__} instead of RunError: {crashed}")
    return Outcome(spec, case, "fail", f"ran although {case.refused} breaks its rule (expected RunError)")


# ---------------------------------------------------------------- timing (--perf)
def time_case(session: Session, case: Case, repeats: int) -> float:
    """Median seconds of one run of ``case`` on ``session`` (after one untimed run that builds kernels)."""
    laid = lay_out(case)
    arena = session.alloc(laid.arena.size, "a conformance arena")
    try:
        session.write(arena, 0, laid.arena)
        times = []
        with np.errstate(all="ignore"):
            for _ in range(repeats + 1):
                start = time.perf_counter()
                session.launch(laid.thunk, arena, **case.options)
                session.finish()
                times.append(time.perf_counter() - start)
    finally:
        session.free(arena)
    return statistics.median(times[1:])


def run(sessions: Iterable[Session], cases: Iterable[Case], config: Config, host: Session | None,
        progress: Callable[[Outcome], None] = lambda outcome: None, perf_repeats: int = 0) -> list[Outcome]:
    """Every case on every session, in order; ``progress`` sees each outcome as it comes."""
    cases = list(cases)
    out = []
    for session in sessions:
        parity = None if host is None or session.info.backend == "host" else host
        for case in cases:
            outcome = check(session, case, config, parity)
            if perf_repeats and outcome.status == "pass":
                outcome = _timed(outcome, session, host, case, perf_repeats)
            progress(outcome)
            out.append(outcome)
    return out


def _timed(outcome: Outcome, session: Session, host: Session | None, case: Case, repeats: int) -> Outcome:
    seconds = time_case(session, case, repeats)
    host_seconds = time_case(host, case, repeats) if host is not None else None
    return replace(outcome, seconds=seconds, host_seconds=host_seconds)
