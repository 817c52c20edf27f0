"""What a conformance run found: the device details, the op × dtype table (max error, worst NMSE beside
its bound, status), and the same as JSON and Markdown."""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from host_fallback.abi import OPS

from .. import __version__
from ..backends.base import DeviceInfo
from ..runtime.config import Config
from ..schedule.model import ABI_V2
from ..units import human_bytes, human_time, text_table
from .runner import Outcome

FORMAT = "rlx-gpu-conformance/1"


def device_details(info: DeviceInfo) -> list[tuple[str, str]]:
    """(label, value) lines: name, platform and driver version, memory, fp64, simulator or not."""
    d = info.details
    rows = [("device", f"{info.spec} — {info.name}")]
    if "platform" in d:
        rows.append(("platform", str(d["platform"])))
    if "driver" in d or "version" in d:
        rows.append(("version", ", driver ".join(str(d[k]) for k in ("version", "driver") if k in d)))
    if "global_mem_bytes" in d:
        rows.append(("memory", f"{human_bytes(int(d['global_mem_bytes']))} global, largest allocation "
                               f"{human_bytes(int(d.get('max_alloc_bytes', 0)))}, "
                               f"{human_bytes(int(d.get('local_mem_bytes', 0)))} local"))
    rows.append(("fp64", "yes" if info.fp64 else "no"))
    rows.append(("simulator", "yes" if d.get("simulator") else "no"))
    return rows


@dataclass(frozen=True)
class Cell:
    """The outcomes of one device × op × dtype."""

    op: str
    dtype: str
    outcomes: tuple[Outcome, ...]

    def _worst(self, attr: str) -> float | None:
        values = [getattr(o, attr) for o in self.outcomes if getattr(o, attr) is not None]
        return max(values) if values else None

    @property
    def nmse(self) -> float | None:
        return self._worst("nmse")

    @property
    def max_err(self) -> float | None:
        return self._worst("max_err")

    @property
    def status(self) -> str:
        failed = sum(o.status == "fail" for o in self.outcomes)
        skipped = sum(o.status == "skip" for o in self.outcomes)
        if failed:
            return f"FAIL {failed}/{len(self.outcomes)}"
        if skipped == len(self.outcomes):
            return "skip"
        return "ok" + (f" ({skipped} skipped)" if skipped else "")


def cells(outcomes: Iterable[Outcome]) -> dict[str, list[Cell]]:
    """Per device spec, one cell per (op, dtype) in the order the cases came."""
    grouped: dict[str, dict[tuple[str, str], list[Outcome]]] = defaultdict(dict)
    for o in outcomes:
        grouped[o.device].setdefault((o.case.op, o.case.dtype), []).append(o)
    return {spec: [Cell(op, dt, tuple(os)) for (op, dt), os in by.items()] for spec, by in grouped.items()}


def _g(value: float | None) -> str:
    return "—" if value is None else f"{value:.2g}"


#: the bound is the NMSE's (the config's tolerances), so it stands beside the NMSE; max |err| has none
HEADER = ("op", "dtype", "cases", "max |err|", "worst nmse", "nmse bound", "status")


def _rows(device_cells: Sequence[Cell], config: Config) -> list[list[str]]:
    return [[c.op, c.dtype, str(len(c.outcomes)), _g(c.max_err), _g(c.nmse),
             _g(config.tolerance(c.op, c.dtype)), c.status] for c in device_cells]


FIELD_HEADER = ("op", "version-2 field", "cases", "passed", "failed", "skipped")


def field_rows(outcomes: Iterable[Outcome]) -> list[list[str]]:
    """One row per (op, version-2 field) that some case has, and per integer tensor whose bad values
    some case checks the refusal of ("field (run-time check)"), for one device's outcomes."""
    counts: dict[tuple[str, str], dict[str, int]] = {}
    for o in outcomes:
        spec = OPS.get(o.case.op)
        if spec is None:
            continue
        names = [f"{o.case.refused} (run-time check)"] if o.case.refused else [
            f.name for f in spec.fields if f.version > 1 and o.case.has(f)]
        for name in names:
            counts.setdefault((o.case.op, name), {"pass": 0, "fail": 0, "skip": 0})[o.status] += 1
    return [[op, name, str(sum(n.values())), str(n["pass"]), str(n["fail"]), str(n["skip"])]
            for (op, name), n in counts.items()]


def failures(outcomes: Iterable[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o.status == "fail"]


def summary(outcomes: Sequence[Outcome]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"pass": 0, "fail": 0, "skip": 0})
    for o in outcomes:
        out[o.device][o.status] += 1
    return dict(out)


def text(infos: Sequence[DeviceInfo], outcomes: Sequence[Outcome], config: Config) -> str:
    """The report printed at the end of ``rlx-gpu conformance``."""
    parts = []
    by_device, counts = cells(outcomes), summary(outcomes)
    for info in infos:
        parts.append("\n".join(f"{label:<10} {value}" for label, value in device_details(info)))
        parts.append(text_table(_rows(by_device.get(info.spec, []), config), HEADER))
        fields = field_rows(o for o in outcomes if o.device == info.spec)
        if fields:
            parts.append(text_table(fields, FIELD_HEADER))
        n = counts.get(info.spec, {"pass": 0, "fail": 0, "skip": 0})
        parts.append(f"{info.spec}: {n['pass']} passed, {n['fail']} failed, {n['skip']} skipped\n")
    bad = failures(outcomes)
    if bad:
        parts.append("failures:\n" + "\n".join(f"  {o.device} {o.case.id}: {o.message}" for o in bad))
    perf = [o for o in outcomes if o.seconds is not None]
    if perf:
        parts.append(perf_text(perf))
    return "\n".join(parts)


def perf_text(perf: Sequence[Outcome]) -> str:
    rows = [[o.device, o.case.id, human_time(o.seconds),
             "—" if o.host_seconds is None else human_time(o.host_seconds),
             "—" if not o.host_seconds else f"{o.host_seconds / o.seconds:.2f}x"] for o in perf]
    return "time per run (median):\n" + text_table(rows, ("device", "case", "time", "host", "speed-up"))


def markdown(infos: Sequence[DeviceInfo], outcomes: Sequence[Outcome], config: Config, scope: str | None = None) -> str:
    """The report as Markdown; ``scope`` (what the run certifies, when not every op) goes under the title."""
    by_device, counts = cells(outcomes), summary(outcomes)
    lines = [f"# rlx-gpu conformance ({ABI_V2}, rlx_gpu {__version__})", ""]
    if scope:
        lines += [f"Certifies {scope}.", ""]
    for info in infos:
        lines += [f"## {info.spec}", ""] + [f"- {label}: {value}" for label, value in device_details(info)] + [""]
        lines += [_markdown_row(HEADER), "|" + "---|" * len(HEADER)]
        lines += [_markdown_row(row) for row in _rows(by_device.get(info.spec, []), config)]
        fields = field_rows(o for o in outcomes if o.device == info.spec)
        if fields:
            lines += ["", _markdown_row(FIELD_HEADER), "|" + "---|" * len(FIELD_HEADER)]
            lines += [_markdown_row(row) for row in fields]
        n = counts.get(info.spec, {"pass": 0, "fail": 0, "skip": 0})
        lines += ["", f"{n['pass']} passed, {n['fail']} failed, {n['skip']} skipped", ""]
        lines += [f"- FAIL `{o.case.id}`: {o.message}" for o in failures(outcomes) if o.device == info.spec]
    return "\n".join(lines).rstrip() + "\n"


def _markdown_row(cells: Sequence[str]) -> str:
    """One Markdown table row; a ``|`` inside a cell (``max |err|``) is escaped so it splits no cell."""
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def as_json(infos: Sequence[DeviceInfo], outcomes: Sequence[Outcome], config: Config, quick: bool) -> dict[str, Any]:
    return {
        "format": FORMAT, "rlx_gpu": __version__, "abi": ABI_V2, "config": config.source, "quick": quick,
        "passed": not failures(outcomes),
        "devices": [{"spec": i.spec, "backend": i.backend, "name": i.name, "fp64": i.fp64,
                     "details": {k: v for k, v in i.details.items()}} for i in infos],
        "summary": summary(outcomes),
        "results": [{"device": o.device, "case": o.case.id, "op": o.case.op, "dtype": o.case.dtype,
                     "family": o.case.family, "params": dict(o.case.params), "options": dict(o.case.options),
                     "status": o.status, "message": o.message, "nmse": o.nmse, "max_err": o.max_err,
                     "host_nmse": o.host_nmse, "bound": config.tolerance(o.case.op, o.case.dtype),
                     "seconds": o.seconds, "host_seconds": o.host_seconds} for o in outcomes],
    }


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(data, indent=1, default=str) + "\n")
