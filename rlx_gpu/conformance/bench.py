"""Timings of the conformance cases per device, an anchor beside them where one is installed
(PyTorch's nn.LSTM / nn.GRU / nn.RNN on the CPU for the recurrent ops), and the plot drawn from them.

The JSON and the table are written wherever the timings are; the plot (``bench.png`` beside
``bench.json``) where matplotlib is installed.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..backends.base import DeviceInfo
from ..errors import RlxError
from ..units import human_time, text_table
from .catalog import Case
from .runner import Outcome

FORMAT = "rlx-gpu-bench/1"
TORCH_DTYPES = {"f32": "float32", "f64": "float64"}


def _torch_time(case: Case, repeats: int) -> float | None:
    """Median seconds of the matching torch.nn recurrent layer's forward, or None where none matches."""
    if case.op not in ("lstm", "gru", "rnn") or case.dtype not in TORCH_DTYPES:
        return None
    try:
        import torch
    except ImportError:
        return None
    p = case.params
    dtype = getattr(torch, TORCH_DTYPES[case.dtype])
    kind = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn": torch.nn.RNN}[case.op]
    extra = {"nonlinearity": "relu" if p.get("relu") else "tanh"} if case.op == "rnn" else {}
    layer = kind(p["input_size"], p["hidden"], p["num_layers"], batch_first=True,
                 bidirectional=p["bidirectional"], dtype=dtype, **extra)
    x = torch.randn(p["batch"], p["seq"], p["input_size"], dtype=dtype)
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            layer(x)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def anchors(cases: Iterable[Case], repeats: int) -> dict[str, dict[str, float]]:
    """``{case id: {"torch (CPU)": seconds}}`` for the cases an installed anchor covers."""
    out = {}
    for case in cases:
        seconds = _torch_time(case, repeats)
        if seconds is not None:
            out[case.id] = {"torch (CPU)": seconds}
    return out


def timings(infos: Sequence[DeviceInfo], outcomes: Iterable[Outcome], anchor_times: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The plot's data: per timed case, seconds per device, the host and any anchor."""
    rows: dict[str, dict[str, Any]] = {}
    for o in outcomes:
        if o.seconds is None:
            continue
        row = rows.setdefault(o.case.id, {"case": o.case.id, "op": o.case.op, "dtype": o.case.dtype,
                                          "params": dict(o.case.params), "seconds": {}})
        row["seconds"][o.device] = o.seconds
        if o.host_seconds is not None:
            row["seconds"].setdefault("host", o.host_seconds)
        row["seconds"].update(anchor_times.get(o.case.id, {}))
    return {"format": FORMAT, "devices": [{"spec": i.spec, "name": i.name} for i in infos], "cases": list(rows.values())}


INSTALL_HINT = 'pip install matplotlib (in a checkout: pip install -e ".[bench]")'
ANCHOR = "torch (CPU)"
# one colour per backend, the same in every plot; several devices of a backend take its shades in turn
COLOURS = {"host": ("#7f7f7f", "#b0b0b0"), "opencl": ("#1f77b4", "#6baed6", "#08306b"),
           "cuda": ("#2ca02c", "#74c476", "#00441b"), "torch": ("#ff7f0e", "#fdae6b")}
OTHER_COLOUR = "#9467bd"


def plotting_missing() -> str | None:
    """Why the plot cannot be drawn here (matplotlib missing, with the install line), else None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"drawing the plot needs matplotlib, which is not installed: {INSTALL_HINT}"
    return None


def json_path(plot_path: str | Path) -> Path:
    """The JSON written beside a plot: the same name with ``.json``."""
    return Path(plot_path).with_suffix(".json")


def write_json(plot_path: str | Path, data: dict[str, Any]) -> Path:
    """Write the timings beside the plot's name; returns the JSON's path."""
    path = json_path(plot_path)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def series(data: dict[str, Any]) -> list[str]:
    """The timed series in a fixed order: the devices as listed, then the host, then the anchors."""
    named = {name for row in data["cases"] for name in row["seconds"]}
    devices = [d["spec"] for d in data["devices"] if d["spec"] in named and d["spec"] != "host"]
    rest = sorted(named - set(devices) - {"host"})
    return devices + (["host"] if "host" in named else []) + rest


def colours(names: Sequence[str]) -> dict[str, str]:
    """A colour per series by its backend (``opencl:1:0`` is opencl, ``torch (CPU)`` torch)."""
    out, used = {}, {}
    for name in names:
        backend = name.split(":")[0].split(" ")[0]
        shades = COLOURS.get(backend, (OTHER_COLOUR,))
        out[name] = shades[used.get(backend, 0) % len(shades)]
        used[backend] = used.get(backend, 0) + 1
    return out


def table(data: dict[str, Any]) -> str:
    """The timings as a text table: a column per series (devices, host, torch), the device/host ratio."""
    names = series(data)
    devices = [n for n in names if n != "host" and n != ANCHOR and "host" in names]
    rows = []
    for row in data["cases"]:
        seconds = row["seconds"]
        cells = [row["case"]] + [human_time(seconds[n]) if n in seconds else "—" for n in names]
        cells += [f"{seconds['host'] / seconds[d]:.2f}x" if d in seconds and "host" in seconds else "—"
                  for d in devices]
        rows.append(cells)
    header = ["case", *names, *(f"host/{d}" for d in devices)]
    return "time per run (median):\n" + text_table(rows, header)


def draw(path: str | Path, data: dict[str, Any]) -> None:
    """Draw ``data`` to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    fig = figure(data)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def figure(data: dict[str, Any]) -> Any:
    """The plot of ``data`` as a matplotlib figure: a group of bars per case, a fixed colour per backend."""
    missing = plotting_missing()
    if missing:
        raise RlxError(missing)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    cases = data["cases"]
    if not cases:
        raise RlxError("no case was timed (every one failed or was skipped); nothing to plot")
    names = series(data)
    colour = colours(names)
    height = 0.8 / len(names)
    row_inches = max(0.16 * len(names), 0.3)  # a case's group of bars, taller than its 7-point label
    fig, ax = plt.subplots(figsize=(10, 1.2 + row_inches * len(cases)))
    for k, name in enumerate(names):
        ys = [i + k * height for i, row in enumerate(cases) if name in row["seconds"]]
        xs = [row["seconds"][name] * 1e3 for row in cases if name in row["seconds"]]
        ax.barh(ys, xs, height=height, label=name, color=colour[name])
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(cases))], [row["case"] for row in cases], fontsize=7)
    ax.set_ylim(len(cases) - 0.1, -0.2)
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())  # the log axis' minor labels would overlap the major ones
    ax.set_xlabel("milliseconds per run (median; log scale)")
    ax.set_title("rlx-gpu: time per op and shape")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)  # beside, over no bar
    fig.tight_layout()
    return fig
