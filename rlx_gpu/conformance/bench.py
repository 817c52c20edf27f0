"""Timings of the conformance cases per device, an anchor beside them where one is installed
(PyTorch's nn.LSTM / nn.GRU / nn.RNN on the CPU for the recurrent ops), and the plot drawn from them.

The plot and its JSON are written together: ``bench.png`` and ``bench.json``.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..backends.base import DeviceInfo
from ..errors import RlxError
from .catalog import Case
from .runner import Outcome

FORMAT = "rlx-gpu-bench/1"
TORCH_DTYPES = {"f32": "float32", "f64": "float64"}


def _torch_time(case: Case, repeats: int) -> float | None:
    """Median seconds of the matching torch.nn recurrent layer's forward, or None where none matches."""
    try:
        import torch
    except ImportError:
        return None
    p = case.params
    if case.op not in ("lstm", "gru", "rnn") or case.dtype not in TORCH_DTYPES:
        return None
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


def write(path: str | Path, data: dict[str, Any]) -> Path:
    """Draw ``data`` to ``path`` (PNG) and write it beside as JSON; returns the JSON's path."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RlxError("drawing the plot needs matplotlib: pip install 'rlx_gpu[bench]'") from err
    path = Path(path)
    json_path = path.with_suffix(".json")
    json_path.write_text(json.dumps(data, indent=1) + "\n")
    cases = data["cases"]
    if not cases:
        raise RlxError("no case was timed (every one failed or was skipped); nothing to plot")
    series = list(dict.fromkeys(name for row in cases for name in row["seconds"]))
    height = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(9, 1.0 + 0.22 * len(cases) * max(len(series), 2)))
    for k, name in enumerate(series):
        ys = [i + k * height for i, row in enumerate(cases) if name in row["seconds"]]
        xs = [row["seconds"][name] * 1e3 for row in cases if name in row["seconds"]]
        ax.barh(ys, xs, height=height, label=name)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(cases))], [row["case"] for row in cases], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("milliseconds per run (median; log scale)")
    ax.set_title("rlx-gpu: time per op and shape")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return json_path
