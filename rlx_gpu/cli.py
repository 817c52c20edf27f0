"""The ``rlx-gpu`` command line: devices, run, plan, export, import (and conformance, bench)."""
from __future__ import annotations

import argparse
import faulthandler
import io
import os
import sys
import warnings
from pathlib import Path
from typing import Sequence, TextIO

import numpy as np

from host_fallback.abi import DTYPES, OPS, footprint

from . import __version__
from .conformance import command as conformance_command
from .conformance import roofline_command
from .conformance.cases import lay_out
from .conformance.compare import nmse
from .errors import InputError, RlxError
from .runtime.executor import Device, get_device
from .runtime.config import load_config
from .runtime.registry import choose, discover, open_session
from .schedule.io import load_schedule, save_schedule
from .schedule.model import Schedule
from .units import human_bytes, human_time, plural
from .units import text_table as _table


def cmd_devices(args: argparse.Namespace) -> int:
    statuses = discover()
    try:
        default, why = choose(None, load_config())
    except RlxError as err:  # a device variable or config naming a missing device: the listing still helps
        default, why = None, f"{type(err).__name__}: {err}"
    for st in statuses:
        print(f"{st.name}: {'available' if st.available else 'unavailable — ' + str(st.reason)}")
        for info in st.devices:
            simulator = bool(info.details.get("simulator"))
            notes = "".join(f"  ({note})" for note, shown in (
                ("no fp64", not info.fp64), ("a simulator", simulator),
                ("a CPU device", info.cpu and info.backend != "host" and not simulator),
                (f"matrix units: {', '.join(info.details.get('matrix_extensions', ()))}",
                 bool(info.details.get("matrix_extensions")))) if shown)
            print(f"  {info.spec:<14} {info.name}{notes}{'  ← default' if info == default else ''}")
        for info in st.refused:
            print(f"  {info.spec:<14} {info.name}  (cannot run here: {info.details['unusable']})")
    print(f"\ndefault device: {default.spec if default else 'none'}\n  {why}")
    for info in (i for s in statuses if s.available for i in s.devices):
        session = open_session(info)
        print(f"\nsupport on {session.info.spec} (✓ runs there, · falls back to the host):")
        rows, reasons = [], {}
        for op in OPS:
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


def _load_target(target: str | None, inputs_file: str | None = None, say_random: bool = False,
                 shapes: dict[str, list[int]] | None = None) -> tuple[Schedule, dict[str, np.ndarray]]:
    """A schedule file (inputs from ``inputs_file``, else seeded random ones) or a model (its own inputs).

    A target is a schedule when it is a JSON file, an ONNX model (``.onnx``, imported) or a YAML file
    with an ``abi`` key; any other
    existing text file is a model file, and a name that is no file names a bundled example model.
    ``say_random`` warns when a schedule's inputs are random, naming an ``.npz`` of the same name beside it.
    ``shapes`` fixes the symbolic sizes of an ONNX model's inputs (``--shape``).
    """
    path = Path(target) if target else None
    if shapes and not (path is not None and path.suffix == ".onnx"):
        raise InputError(f"--shape sizes the inputs of an ONNX model (.onnx); {target or 'the demo'} is none")
    if path is not None and path.is_file() and path.suffix not in (".json", ".onnx"):
        _refuse_binary(path)
    if path is not None and path.is_file() and (path.suffix in (".json", ".onnx") or "abi" in (_yaml_keys(path))):
        schedule = _import_onnx(path, shapes) if path.suffix == ".onnx" else load_schedule(path)
        rng = np.random.default_rng(0)
        inputs = {n: rng.standard_normal(schedule.tensors[n].shape) * 0.5 for n in schedule.inputs}
        if say_random and not inputs_file and schedule.inputs:
            beside = path.with_suffix(".npz")
            hint = f"; {beside} lies beside it: add --inputs {beside}" if beside.is_file() else ""
            warnings.warn(f"schedule {path}: no --inputs given, so its inputs {', '.join(schedule.inputs)} "
                          f"are seeded random numbers{hint}", stacklevel=2)
    else:
        from .graph.models import build_model

        executable, inputs = build_model(target or "demo")
        schedule = executable.schedule
    if inputs_file:
        inputs.update(_read_inputs(inputs_file, schedule))
    return schedule, inputs


def _import_onnx(path: Path, shapes: dict[str, list[int]] | None = None) -> Schedule:
    """The schedule of an ONNX model file (rlx_gpu.onnx, the ``onnx`` extra)."""
    from .onnx import load

    return load(path, shapes=shapes)


def _shape_option(text: str) -> tuple[str, list[int]]:
    """``NAME=2,5,3`` of ``import --shape`` and ``run --shape``."""
    name, _, sizes = text.rpartition("=")
    try:
        shape = [int(d) for d in sizes.split(",")]
    except ValueError:
        shape = []
    if not name or not shape or any(d < 0 for d in shape):
        raise argparse.ArgumentTypeError(f"expected NAME=SIZE,SIZE,... (e.g. X=5,2,3), got {text!r}")
    return name, shape


def cmd_import(args: argparse.Namespace) -> int:
    """Write the schedule of an ONNX model."""
    out = conformance_command.writable_path(args.out, "-o")
    schedule = _import_onnx(Path(args.model), dict(args.shape or []))
    save_schedule(schedule, out)
    print(f"wrote the schedule of {args.model} ({plural(len(schedule.thunks), 'thunk')}, arena "
          f"{human_bytes(schedule.arena_bytes)}; inputs {', '.join(schedule.inputs) or 'none'}, outputs "
          f"{', '.join(schedule.outputs)}) to {out}")
    print(f"run it with: rlx-gpu run {out}")
    return 0


def _refuse_binary(path: Path) -> None:
    """An ``InputError`` when ``path`` is not UTF-8 text: no schedule or model file, maybe an inputs ``.npz``."""
    try:
        with path.open("rb") as stream:
            stream.read(1 << 16).decode("utf-8")
    except UnicodeDecodeError:
        pass
    except OSError as err:
        raise InputError(f"{path}: cannot read it: {err.strerror}") from err
    else:
        return
    hint = (f"; an .npz holds a schedule's inputs: rlx-gpu run SCHEDULE.json --inputs {path}"
            if path.suffix == ".npz" else "")
    raise InputError(f"{path} is not a text file, so neither a schedule (.json, or .yaml with an abi key) "
                     f"nor a model file (.yaml){hint}")


def _yaml_keys(path: Path) -> list[str]:
    """The top-level keys of a YAML file (none when it does not parse: the model reader then says why)."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return []
    return list(data) if isinstance(data, dict) else []


def _read_inputs(path: str, schedule: Schedule) -> dict[str, np.ndarray]:
    """Named inputs from an ``.npz`` (what ``export`` writes), each checked against the schedule."""
    try:
        with np.load(path) as npz:
            given = {name: npz[name] for name in npz.files}
    except (OSError, ValueError) as err:
        raise InputError(f"inputs {path}: cannot read an .npz file: {err}") from err
    for name, values in given.items():
        if name not in schedule.inputs:
            raise InputError(f"inputs {path}: {name!r} is no input of the schedule; its inputs: "
                             f"{', '.join(schedule.inputs)}")
        if values.shape != schedule.tensors[name].shape:
            raise InputError(f"inputs {path}: {name!r} has shape {list(values.shape)}, expected "
                             f"{list(schedule.tensors[name].shape)}")
    missing = [name for name in schedule.inputs if name not in given]
    if missing:
        raise InputError(f"inputs {path}: no {', '.join(map(repr, missing))}; the schedule's inputs are "
                         f"{', '.join(schedule.inputs)}, and the file must hold every one "
                         f"(`rlx-gpu export` writes them all)")
    return given


def _outputs(schedule: Schedule, arena: np.ndarray) -> dict[str, np.ndarray]:
    return {n: schedule.tensors[n].read(arena) for n in schedule.outputs}


def cmd_run(args: argparse.Namespace) -> int:
    out = conformance_command.writable_path(args.out, "--out") if args.out else None
    schedule, inputs = _load_target(args.target, args.inputs, say_random=True, shapes=dict(args.shape or []))
    arena = schedule.pristine_arena()
    for name, values in inputs.items():
        schedule.tensors[name].write(arena, values)
    device = get_device(args.device)
    for _ in range(args.repeat):
        result = device.run(schedule, arena, profile=True)
    report = device.last_report
    rows = [[r.index, r.op, r.dtype, r.backend, human_time(r.seconds),
             human_bytes(r.copied_bytes) if r.copied_bytes else ""] for r in report.records]
    print(f"device {device.spec} ({device.session.info.name}), arena {human_bytes(schedule.arena_bytes)}")
    print(_table(rows, ["#", "op", "dtype", "backend", "time", "fallback copies"]))
    print(f"total {human_time(report.seconds)}, {plural(len(report.records), 'thunk')}, "
          f"{human_bytes(report.fallback_bytes)} copied for fallbacks")
    if args.repeat <= 1 and device.spec != "host":
        print("(times of a first run include kernel builds; --repeat 3 shows the third run)")
    outputs = _outputs(schedule, result)
    if out is not None:
        np.savez(out, **outputs)
        print(f"wrote {', '.join(outputs)} to {out}")
    if not args.check:
        return 0
    if device.spec == "host":
        return _check_against_float64(schedule, arena, device)
    reference = _outputs(schedule, get_device("host").run(schedule, arena))
    ok = True
    rows = []
    for name, got in outputs.items():
        ref = reference[name]
        dtype = schedule.tensors[name].dtype
        tol = device.config.tolerance("schedule", dtype)
        finite_match = np.array_equal(np.isfinite(got.astype(np.float64)), np.isfinite(ref.astype(np.float64)))
        err = nmse(got, ref)
        worst = float(np.max(np.abs(got.astype(np.float64) - ref.astype(np.float64)), initial=0.0))
        good = finite_match and err <= tol
        ok &= good
        rows.append([name, dtype, f"{worst:.3g}", f"{err:.3g}", f"{tol:.0e}", "ok" if good else "FAIL"])
    print("\ncheck against the host reference:")
    print(_table(rows, ["output", "dtype", "max |err|", "nmse", "nmse bound", "result"]))
    return 0 if ok else 1


def _check_against_float64(schedule: Schedule, arena: np.ndarray, device: Device) -> int:
    """On the host, each thunk against the float64 reference of its op (the host against itself proves nothing)."""
    from .conformance.schedule_check import check_on_host

    checks = check_on_host(schedule, arena, device.config, device.options.host_keywords)
    rows = [[c.index, c.op, c.dtype, "" if c.max_err is None else f"{c.max_err:.3g}",
             "" if c.nmse is None else f"{c.nmse:.3g}", "" if c.bound is None else f"{c.bound:.0e}",
             ("ok" if c.passed else "FAIL") if c.nmse is not None else "not checked", c.note] for c in checks]
    print("\ncheck of each thunk against the float64 reference of ABI.md, on the host's inputs to it:")
    print(_table(rows, ["#", "op", "dtype", "max |err|", "nmse", "nmse bound", "result", "note"]))
    return 0 if all(c.passed for c in checks) else 1


def cmd_plan(args: argparse.Namespace) -> int:
    schedule, _ = _load_target(args.target)
    device = get_device(args.device)
    rows, total, per_step = [], 0, 0
    for a in device.place(schedule):
        copied = ""
        if a.copied_bytes:
            reads, writes = footprint(a.thunk)
            copied = f"{human_bytes(sum(r.nbytes for r in reads))} in, {human_bytes(sum(r.nbytes for r in writes))} out"
            if a.nested:
                per_step += a.copied_bytes
                copied += " per body run"
            else:
                total += a.copied_bytes
        rows.append([a.where if a.nested else a.index, a.op, a.dtype, a.backend, a.reason, copied])
    print(f"plan on {device.spec} (fallback policy {device.config.fallback}, config {device.config.source})")
    print(_table(rows, ["#", "op", "dtype", "backend", "why", "fallback copies"]))
    print(f"fallback copies per run: {human_bytes(total)}"
          + (f", plus {human_bytes(per_step)} per run of the bodies with host thunks" if per_step else ""))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write a model's schedule and, beside it, its seeded inputs as ``.npz``."""
    out = conformance_command.writable_path(args.out, "-o")
    inputs_path = conformance_command.writable_path(args.inputs, "--inputs") if args.inputs else out.with_suffix(".npz")
    schedule, inputs = _load_target(args.target)
    save_schedule(schedule, out)
    np.savez(inputs_path, **{n: np.asarray(v) for n, v in inputs.items()})
    print(f"wrote the schedule ({plural(len(schedule.thunks), 'thunk')}, arena {human_bytes(schedule.arena_bytes)}) to {out}"
          f" and its inputs {', '.join(inputs)} to {inputs_path}")
    print(f"run it with: rlx-gpu run {out} --inputs {inputs_path}")
    return 0


DESCRIPTION = """\
Recurrent and sequence kernels behind one arena-offset ABI (docs/abi.md), on the host (NumPy) and on
OpenCL and CUDA devices (`rlx-gpu devices` says which run here).

examples:
  rlx-gpu devices                          what can run here, per device, op and dtype; the default device and why
  rlx-gpu run --check                      the bundled demo on the default device, checked
  rlx-gpu run gdn --device host --check    an example model, each thunk checked against float64
  rlx-gpu plan configs/examples/gdn.yaml   the backend of each thunk and why
  rlx-gpu export demo -o demo.json         write a schedule (and demo.npz, its inputs)
  rlx-gpu run demo.json --inputs demo.npz  run a schedule file
  rlx-gpu import model.onnx -o model.json  an ONNX model as a schedule (rlx-gpu run model.onnx runs it)

example models (configs/examples/*.yaml): {models}
"""

EPILOG = """\
environment:
  RLX_DEVICE     the device when --device is not given (host | opencl[:p[:d]] | cuda[:n] | auto; auto, the
                 config's default, takes a GPU or accelerator, else the host: a CPU OpenCL device runs when named)
  PYOPENCL_CTX   without RLX_DEVICE: the OpenCL device, as pyopencl reads it (0, 0:1, or a name)
  RLX_CONFIG     a config file over configs/default.yaml (device, priority, fallback, overrides,
                 scan, tolerances)
  RLX_TARGET     cpu | gpu: force the kernel shapes (unset: the device type decides)
  RLX_CACHE_DIR  where the CUDA backend keeps its cubins (default ~/.cache/rlx_gpu/cubin)
  RLX_OPENCL_CACHE_DIR  where the OpenCL backend keeps program binaries (default ~/.cache/rlx_gpu/opencl; not PoCL's)
"""

DEBUG_HELP = "show the traceback of an error (before or after the command)"
DEVICE_HELP = "host | opencl[:p[:d]] | cuda[:n] | auto (default: RLX_DEVICE, then PYOPENCL_CTX, then the config)"
SHAPE_HELP = "the sizes of an ONNX graph input whose shape is symbolic, e.g. x=2,5,3 (repeatable)"
TARGET_HELP = ("a schedule (.json, or .yaml with an abi key), an ONNX model (.onnx), a model file (.yaml), or the "
               "name of an example model (default: demo)")


def build_parser() -> argparse.ArgumentParser:
    from .graph.models import list_models

    parser = argparse.ArgumentParser(prog="rlx-gpu", description=DESCRIPTION.format(models=", ".join(list_models())),
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("devices", help="backends, devices, why any is unavailable, the default device and why, and "
                   "the op × dtype support matrix")
    run = sub.add_parser("run", help="run a schedule or model (default: the bundled demo)")
    run.add_argument("target", nargs="?", help=TARGET_HELP)
    run.add_argument("--device", help=DEVICE_HELP)
    run.add_argument("--check", action="store_true",
                     help="compare every output with the host (on the host itself: every thunk with the float64 "
                     "reference of its op) and exit 1 when an NMSE exceeds its bound in the config's tolerances "
                     "(schedule; on the host, the op's) or the non-finite values differ")
    run.add_argument("--inputs", metavar="F.npz", help="every input of a schedule by name (what export writes; "
                     "without it a schedule's inputs are seeded random numbers)")
    run.add_argument("--out", metavar="F.npz", help="write the outputs to this .npz file")
    run.add_argument("--repeat", type=conformance_command.positive_int, default=1,
                     help="run this many times (>= 1) and report the last run")
    run.add_argument("--shape", action="append", type=_shape_option, metavar="NAME=D,D,...", help=SHAPE_HELP)
    plan = sub.add_parser("plan", help="the backend chosen for each thunk and why, without running")
    plan.add_argument("target", nargs="?", help=TARGET_HELP)
    plan.add_argument("--device", help=DEVICE_HELP)
    export = sub.add_parser("export", help="write the schedule of a model (and its inputs as .npz)")
    export.add_argument("target", nargs="?", help=TARGET_HELP)
    export.add_argument("-o", "--out", required=True, metavar="F.json",
                        help="the schedule file (.json; .yaml/.yml writes YAML)")
    export.add_argument("--inputs", metavar="F.npz", help="the inputs file (default: the schedule's name with .npz)")
    imports = sub.add_parser("import", help="write the schedule of an ONNX model (LSTM, GRU, RNN, Scan and their glue)")
    imports.add_argument("model", help="the ONNX model (.onnx)")
    imports.add_argument("-o", "--out", required=True, metavar="F.json",
                         help="the schedule file (.json; .yaml/.yml writes YAML)")
    imports.add_argument("--shape", action="append", type=_shape_option, metavar="NAME=D,D,...", help=SHAPE_HELP)
    conformance_command.add_parser(sub)
    roofline_command.add_parser(sub)
    for command in sub.choices.values():  # --debug after the command too; SUPPRESS keeps one given before it
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser


def _one_line_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                      file: TextIO | None = None, line: str | None = None) -> None:
    print(f"rlx-gpu: warning: {message}", file=file or sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    # a driver that crashes (a segfault in an OpenCL runtime's compiled kernel) still leaves the Python stack
    # that led there; a build error names the command that builds its program alone (backends.opencl_builds)
    try:
        faulthandler.enable()
    except io.UnsupportedOperation:  # a stderr without a file descriptor (captured): no stack to leave then
        pass
    args = build_parser().parse_args(argv)
    handler = {"devices": cmd_devices, "run": cmd_run, "plan": cmd_plan, "export": cmd_export,
               "import": cmd_import}.get(args.command) \
        or args.handler
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warning
            code = handler(args)
        sys.stdout.flush()  # inside the try: a reader that went away is met here, not at exit
        return code
    except RlxError as err:
        if args.debug:
            raise
        print(f"rlx-gpu {args.command}: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader went away (`rlx-gpu devices | head`): stop quietly, and keep Python's exit flush quiet too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
