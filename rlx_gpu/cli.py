"""The ``rlx-gpu`` command: ``devices``, ``run``, ``plan``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .conformance.cases import lay_out
from .errors import RlxError
from .runtime.executor import get_device
from .runtime.registry import discover, open_session
from .schedule.io import load_schedule, read_source
from .schedule.model import Schedule
from .schedule.ops import DTYPES, SPECS, footprint
from .units import human_bytes, human_time


def _table(rows: list[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [list(map(str, header))] + [list(map(str, r)) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_devices(args: argparse.Namespace) -> int:
    statuses = discover()
    for st in statuses:
        print(f"{st.name}: {'available' if st.available else 'unavailable — ' + str(st.reason)}")
        for info in st.devices:
            print(f"  {info.spec:<14} {info.name}{'' if info.fp64 else '  (no fp64)'}")
    for st in (s for s in statuses if s.available):
        session = open_session(st.devices[0])
        print(f"\nsupport on {session.info.spec} (✓ runs there, · falls back to the host):")
        rows, reasons = [], {}
        for op in SPECS:
            marks = []
            for dtype in DTYPES:
                thunk, _ = lay_out(op, dtype)
                why = session.unsupported(thunk)
                marks.append("✓" if why is None else "·")
                if why:
                    reasons.setdefault(why, []).append(f"{op}:{dtype}")
            rows.append([op, *marks])
        print(_table(rows, ["op", *DTYPES]))
        for why, where in reasons.items():
            print(f"  · {', '.join(where)}: {why}")
    return 0


def _load_target(target: str | None) -> tuple[Schedule, dict[str, np.ndarray]]:
    """A schedule file (with seeded random inputs) or an example model (with its own inputs)."""
    raw = None if target is None else read_source(Path(target) if Path(target).exists() else target)
    if raw is not None and "abi" in raw:
        schedule = load_schedule(raw)
        rng = np.random.default_rng(0)
        inputs = {n: rng.standard_normal(schedule.tensors[n].shape) * 0.5 for n in schedule.inputs}
        return schedule, inputs
    from .graph.models import build_model

    executable, inputs = build_model(target or "demo")
    return executable.schedule, inputs


def _outputs(schedule: Schedule, arena: np.ndarray) -> dict[str, np.ndarray]:
    return {n: schedule.tensors[n].read(arena) for n in schedule.outputs}


def _nmse(got: np.ndarray, ref: np.ndarray) -> float:
    g, r = got.astype(np.float64), ref.astype(np.float64)
    return float(np.sum((g - r) ** 2) / max(np.sum(r ** 2), 1e-300))


def cmd_run(args: argparse.Namespace) -> int:
    schedule, inputs = _load_target(args.target)
    arena = schedule.pristine_arena()
    for name, values in inputs.items():
        schedule.tensors[name].write(arena, values)
    device = get_device(args.device)
    for _ in range(max(args.repeat, 1)):
        result = device.run(schedule, arena, profile=True)
    report = device.last_report
    rows = [[r.index, r.op, r.dtype, r.backend, human_time(r.seconds),
             human_bytes(r.copied_bytes) if r.copied_bytes else ""] for r in report.records]
    print(f"device {device.spec} ({device.session.info.name}), arena {human_bytes(schedule.arena_bytes)}")
    print(_table(rows, ["#", "op", "dtype", "backend", "time", "fallback copies"]))
    print(f"total {human_time(report.seconds)}, {len(report.records)} thunks, "
          f"{human_bytes(report.fallback_bytes)} copied for fallbacks")
    if args.repeat <= 1 and device.spec != "host":
        print("(times of a first run include kernel builds; --repeat 3 shows the third run)")
    outputs = _outputs(schedule, result)
    if args.out:
        np.savez(args.out, **outputs)
        print(f"wrote {', '.join(outputs)} to {args.out}")
    if not args.check:
        return 0
    reference = _outputs(schedule, get_device("host").run(schedule, arena))
    ok = True
    rows = []
    for name, got in outputs.items():
        ref = reference[name]
        dtype = schedule.tensors[name].dtype
        tol = device.config.tolerance("default", dtype)
        finite_match = np.array_equal(np.isfinite(got.astype(np.float64)), np.isfinite(ref.astype(np.float64)))
        err = _nmse(np.nan_to_num(got.astype(np.float64)), np.nan_to_num(ref.astype(np.float64)))
        worst = float(np.max(np.abs(got.astype(np.float64) - ref.astype(np.float64)), initial=0.0))
        good = finite_match and err <= tol
        ok &= good
        rows.append([name, dtype, f"{worst:.3g}", f"{err:.3g}", f"{tol:.0e}", "ok" if good else "FAIL"])
    print("\ncheck against the host reference:")
    print(_table(rows, ["output", "dtype", "max |err|", "nmse", "bound", ""]))
    return 0 if ok else 1


def cmd_plan(args: argparse.Namespace) -> int:
    schedule = load_schedule(Path(args.schedule))
    device = get_device(args.device)
    rows, total = [], 0
    for thunk, a in zip(schedule.thunks, device.place(schedule)):
        copied = ""
        if a.backend != device.session.info.backend:
            reads, writes = footprint(thunk)
            nbytes = sum(r.nbytes for r in reads + writes)
            total += nbytes
            copied = f"{human_bytes(sum(r.nbytes for r in reads))} in, {human_bytes(sum(r.nbytes for r in writes))} out"
        rows.append([a.index, a.op, a.dtype, a.backend, a.reason, copied])
    print(f"plan on {device.spec} (fallback policy {device.config.fallback}, config {device.config.source})")
    print(_table(rows, ["#", "op", "dtype", "backend", "why", "fallback copies"]))
    print(f"fallback copies per run: {human_bytes(total)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlx-gpu", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("devices", help="backends, devices, why any is unavailable, and the op × dtype support matrix")
    run = sub.add_parser("run", help="run a schedule or example model (default: the bundled demo)")
    run.add_argument("target", nargs="?", help="schedule (.json/.yaml) or example model (path or name)")
    run.add_argument("--device", help="host | opencl[:p[:d]] | cuda[:n] | auto (default: RLX_DEVICE, then config)")
    run.add_argument("--check", action="store_true", help="compare every output with the host reference")
    run.add_argument("--out", help="write the outputs to this .npz file")
    run.add_argument("--repeat", type=int, default=1, help="run this many times and report the last run")
    plan = sub.add_parser("plan", help="the backend chosen for each thunk and why, without running")
    plan.add_argument("schedule")
    plan.add_argument("--device")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"devices": cmd_devices, "run": cmd_run, "plan": cmd_plan}[args.command]
    try:
        return handler(args)
    except RlxError as err:
        print(f"rlx-gpu {args.command}: {type(err).__name__}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
