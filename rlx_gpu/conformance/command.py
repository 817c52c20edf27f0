"""``rlx-gpu conformance`` and ``rlx-gpu bench``: certify devices, and time them against the host."""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import TextIO

from host_fallback.abi import BACKWARD, DTYPES, OPS

from ..errors import InputError, RlxError
from ..launches.limits import TARGETS
from ..runtime.config import load_config
from ..runtime.registry import open_session, status
from . import bench, catalog, devices, report, runner

#: What ``conformance --grad`` certifies: the backward ops of ABI.md §9 and the scan family's reverse mode.
GRADIENT_OPS = (*BACKWARD, "scan_backward", "scan_backward_xs")
GRADIENT_SCOPE = (f"the backward ops only (--grad): {', '.join(GRADIENT_OPS)}; the forward ops are certified "
                  "without --grad")

DEVICE_HELP = ("host | opencl[:p[:d]] | cuda[:n]; repeat for several (default: every available device but "
               "simulators; `rlx-gpu devices` lists them)")


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (a count of runs), else a usage error saying so."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def writable_path(path: str | Path, what: str) -> Path:
    """``path`` (an output file) when its directory exists and is writable (checked before a run, not after); else ``InputError``."""
    path = Path(path)
    folder = path.parent
    if not folder.is_dir():
        raise InputError(f"{what} {path}: the directory {folder} does not exist; create it or choose another path")
    if not os.access(folder, os.W_OK):
        raise InputError(f"{what} {path}: the directory {folder} is not writable; choose another path")
    return path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``conformance`` and ``bench`` on the ``rlx-gpu`` command line."""
    conf = subparsers.add_parser(
        "conformance", help="certify devices: every op × dtype × shape against float64 references and the host",
        description="Run every conformance case (guard bytes around every tensor, float64 reference, host "
                    "parity, NaN/Inf positions, NMSE bounds from the config's `tolerances`) on each device; "
                    "print the op × dtype table and exit 1 on any failure.")
    _common(conf)
    conf.add_argument("--quick", action="store_true", help="small shapes only (seconds; what Oclgrind runs)")
    conf.add_argument("--grad", action="store_true",
                      help="certify only the backward ops (training): " + ", ".join(GRADIENT_OPS))
    conf.add_argument("--json", metavar="F", help="write every result, the devices and the summary as JSON")
    conf.add_argument("--markdown", metavar="F", help="write the report as Markdown")
    conf.add_argument("--perf", action="store_true", help="also time each passing case (median) against the host")
    conf.add_argument("--plot", metavar="F.png", help="with --perf: plot the times (and write F.json beside it)")
    conf.add_argument("--repeat", type=positive_int, default=5, help="timed runs per case with --perf (default 5)")
    conf.set_defaults(handler=run)
    bench_parser = subparsers.add_parser(
        "bench", help="time the conformance cases per device against the host and anchors (torch); PNG + JSON",
        description="Time each case (median of --repeat runs after a warm-up) on every device and the host, "
                    "with PyTorch beside the recurrent ops where it is installed; write the plot and its JSON.")
    _common(bench_parser, default_dtypes=("f32",))
    bench_parser.add_argument("--repeat", type=positive_int, default=5, help="timed runs per case (default 5)")
    bench_parser.add_argument("--plot", metavar="F.png", default="bench.png", help="the plot (default bench.png); "
                              "its data goes to the same name with .json")
    bench_parser.set_defaults(handler=run_bench)


def _common(parser: argparse.ArgumentParser, default_dtypes: tuple[str, ...] | None = None) -> None:
    parser.add_argument("--device", action="append", metavar="D", help=DEVICE_HELP)
    parser.add_argument("--target", choices=TARGETS, help="force the kernel shapes of the opencl/cuda devices "
                        "(e.g. gpu on PoCL; default: each device's own, or RLX_TARGET)")
    parser.add_argument("--ops", nargs="+", choices=list(OPS), metavar="OP", help="only these ops (default: all)")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), metavar="DT", default=default_dtypes,
                        help=f"only these dtypes, of {', '.join(DTYPES)} (default: {', '.join(default_dtypes or DTYPES)})")


class Progress:
    """A live line per op on a terminal; otherwise one plain line when each op is done on a device."""

    def __init__(self, cases: list[catalog.Case], stream: TextIO):
        self.totals = Counter(c.op for c in cases)
        self.stream, self.tty = stream, stream.isatty()
        self.done: Counter = Counter()
        self.failed: Counter = Counter()
        self.skipped: Counter = Counter()

    def __call__(self, outcome: runner.Outcome) -> None:
        key = (outcome.device, outcome.case.op)
        self.done[key] += 1
        self.failed[key] += outcome.status == "fail"
        self.skipped[key] += outcome.status == "skip"
        total = self.totals[outcome.case.op]
        line = f"{outcome.device:<12} {outcome.case.op:<17} {self.done[key]:>3}/{total}"
        if self.failed[key]:
            line += f"  {self.failed[key]} FAILED"
        if self.done[key] == total:
            passed = total - self.failed[key] - self.skipped[key]
            final = f"{outcome.device:<12} {outcome.case.op:<17} {passed} passed, {self.failed[key]} failed, " \
                    f"{self.skipped[key]} skipped"
            self.stream.write(("\r\x1b[K" if self.tty else "") + final + "\n")
        elif self.tty:
            self.stream.write("\r\x1b[K" + line)
        self.stream.flush()


def _selected(args: argparse.Namespace, quick: bool) -> list[catalog.Case]:
    ops = args.ops
    if getattr(args, "grad", False):
        other = sorted(set(ops or ()) - set(GRADIENT_OPS))
        if other:
            raise InputError(f"--grad certifies the backward ops, and --ops {' '.join(other)} names forward ops; "
                             f"choose among {', '.join(GRADIENT_OPS)}, or leave out --grad")
        ops = ops or GRADIENT_OPS
    chosen = catalog.select(catalog.cases(quick=quick), ops, args.dtypes)
    order = {op: i for i, op in enumerate(OPS)}
    return sorted(chosen, key=lambda c: order[c.op])  # stable: one op's cases together, for the progress lines


def _sessions(args: argparse.Namespace) -> list:
    infos = devices.resolve(args.device)
    return [devices.open_device(info, None if info.backend == "host" else args.target) for info in infos]


def run(args: argparse.Namespace) -> int:
    config = load_config()
    for what, path in (("--json", args.json), ("--markdown", args.markdown), ("--plot", args.plot)):
        if path:
            writable_path(path, what)
    sessions = _sessions(args)
    cases = _selected(args, args.quick)
    if not cases:
        raise RlxError(f"no conformance case matches --ops {args.ops} --dtypes {args.dtypes}")
    host = open_session(status("host").devices[0])
    outcomes = runner.run(sessions, cases, config, host, Progress(cases, sys.stderr),
                          perf_repeats=args.repeat if args.perf else 0)
    infos = [s.info for s in sessions]
    scope = GRADIENT_SCOPE if args.grad else None
    if scope:
        print(f"certifies {scope}")
    if args.target:
        print(f"kernel target forced to {args.target} on " + ", ".join(i.spec for i in infos if i.backend != "host"))
    print(report.text(infos, outcomes, config))
    if args.json:
        report.write_json(args.json, {**report.as_json(infos, outcomes, config, args.quick), "target": args.target,
                                      "scope": "backward ops" if args.grad else "all ops"})
        print(f"wrote {args.json}")
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write(report.markdown(infos, outcomes, config, scope))
        print(f"wrote {args.markdown}")
    if args.plot:
        if not args.perf:
            raise RlxError("--plot draws the --perf times: add --perf")
        _plot(args.plot, infos, outcomes)
    return 1 if report.failures(outcomes) else 0


def run_bench(args: argparse.Namespace) -> int:
    """Time the cases; write the JSON and the table always, and the plot where matplotlib is installed.

    The host is the baseline column of every row, so it is timed as a device of its own only when it is
    the one device asked for.
    """
    config = load_config()
    writable_path(args.plot, "--plot")
    cannot_draw = bench.plotting_missing()
    if cannot_draw:
        warnings.warn(f"{cannot_draw}; the timings go to the table and {bench.json_path(args.plot)} without the plot")
    sessions = _sessions(args)
    devices_timed = [s for s in sessions if s.info.backend != "host"] or sessions
    cases = [c for c in _selected(args, quick=False) if c.family in ("thunk", "scan")]
    host = open_session(status("host").devices[0])
    baseline = None if all(s.info.backend == "host" for s in devices_timed) else host
    outcomes = runner.run(devices_timed, cases, config, baseline, Progress(cases, sys.stderr), perf_repeats=args.repeat)
    data = bench.timings([s.info for s in devices_timed], outcomes, bench.anchors(cases, args.repeat))
    print(bench.table(data))
    json_file = bench.write_json(args.plot, data)
    print(f"wrote {json_file}")
    if not cannot_draw:
        bench.draw(args.plot, data)
        print(f"wrote {args.plot}")
    bad = report.failures(outcomes)
    for o in bad:
        print(f"FAIL {o.device} {o.case.id}: {o.message} (not timed)")
    return 1 if bad else 0


def _plot(path: str, infos: list, outcomes: list[runner.Outcome]) -> None:
    """``conformance --perf --plot``: the JSON, then the plot (which needs matplotlib)."""
    data = bench.timings(infos, outcomes, {})
    json_file = bench.write_json(path, data)
    missing = bench.plotting_missing()
    if missing:
        raise RlxError(f"{missing}; wrote {json_file} without the plot")
    bench.draw(path, data)
    print(f"wrote {path} and {json_file}")
