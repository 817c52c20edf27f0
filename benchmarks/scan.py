"""Time and memory of host ``scan_backward`` against the sequence length, per recompute strategy.

Runs the tanh-RNN cell of the conformance suite (``rlx_gpu.conformance.scan_cell``; f32, carry
[2, 3]) for T = 64 … 16384 with every carry saved (K = T), √T checkpoints with the segment cache,
and one checkpoint with treeverse. Prints medians and writes a log–log plot of the carries held
against T to ``benchmarks/out/scan_memory.png``.

Needs rlx_gpu installed (or run from the checkout) and matplotlib, the ``[bench]`` extra:

    pip install -e ".[bench]" && python benchmarks/scan.py [--max-t 16384] [--repeats 3]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # rlx_gpu from this checkout when not installed
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ModuleNotFoundError as err:
    sys.exit(f"benchmarks/scan.py needs matplotlib for its plot: pip install -e '.[bench]' ({err})")

from host_fallback.abi import regions  # noqa: E402
from host_fallback.arena import STORAGE  # noqa: E402
from host_fallback.scan import HostMemory, run_scan_backward  # noqa: E402
from rlx_gpu.conformance import scan_cell  # noqa: E402
from rlx_gpu.conformance.cases import lay_out  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"

# (label, checkpoints for a length T, recompute strategy)
CONFIGS = [
    ("K=T (all saved)", lambda t: t, "segment"),
    ("K=isqrt(T) segment", math.isqrt, "segment"),
    ("K=1 treeverse", lambda t: 1, "treeverse"),
]


def backward_case(length: int, k: int) -> tuple[scan_cell.Cell, dict, np.ndarray]:
    """The cell, a ``scan_backward`` thunk over it with ``k`` checkpoints, and its outer arena filled."""
    cell = scan_cell.cell("f32", bcast_bias=False)
    thunk, nbytes = lay_out("scan_backward", "f32", scan_cell.fields("scan_backward", cell, length, False, k))
    values = scan_cell.inputs("scan_backward", cell, scan_cell.problem("scan_backward", cell, length, False, 1), k)
    arena = np.zeros(nbytes, np.uint8)
    for r in regions(thunk):
        if r.field in values:
            raw = np.asarray(values[r.field], np.float64).astype(STORAGE["f32"]).view(np.uint8).ravel()
            arena[r.offset: r.offset + raw.size] = raw
    return cell, thunk, arena


def measure(length: int, k: int, how: str, repeats: int) -> dict:
    """Median seconds, peak extra bytes and body runs of one backward sweep."""
    cell, thunk, arena = backward_case(length, k)
    times = []
    for _ in range(repeats):
        mem = HostMemory()
        start = time.perf_counter()
        run_scan_backward(mem, thunk, arena, recompute=how)
        times.append(time.perf_counter() - start)
    c = cell.carry_bytes
    bodies = cell.vjp["arena_bytes"] + (cell.forward["arena_bytes"] if 0 < k < length else 0)
    rows = k if 0 < k < length else length
    return {
        "seconds": statistics.median(times),
        "peak": mem.peak,
        "carries": rows + (mem.peak - bodies) // c,  # trajectory rows plus the driver's own carries
        "recompute": (mem.runs - length) / length,  # forward_body runs per step
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--max-t", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3, help="runs per point for T ≤ 1024 (one above)")
    args = parser.parse_args()
    lengths = [4**e for e in range(3, 8) if 4**e <= args.max_t]

    results: dict[str, list[dict]] = {label: [] for label, _, _ in CONFIGS}
    print(f"{'T':>6} {'config':<20} {'K':>6} {'median s':>9} {'vs K=T':>7} {'peak extra B':>13} "
          f"{'carries held':>13} {'fwd runs/T':>10}")
    for length in lengths:
        repeats = args.repeats if length <= 1024 else 1
        base = None
        for label, k_of, how in CONFIGS:
            k = k_of(length)
            r = measure(length, k, how, repeats)
            results[label].append(r)
            base = base or r["seconds"]
            print(f"{length:>6} {label:<20} {k:>6} {r['seconds']:>9.3f} {r['seconds'] / base:>6.2f}x "
                  f"{r['peak']:>13} {r['carries']:>13} {r['recompute']:>10.2f}")

    OUT.mkdir(exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 5))
    for label, _, _ in CONFIGS:
        held = [r["carries"] for r in results[label]]
        ax.loglog(lengths, held, "o-", label=label)
        for length, r in zip(lengths, results[label]):
            ax.annotate(f"×{r['recompute']:.1f}", (length, r["carries"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("carries held (trajectory rows + recompute cache)")
    ax.set_title("host scan_backward memory; ×r = forward_body runs / T")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(OUT / "scan_memory.png", dpi=120)
    print(f"plot: {OUT / 'scan_memory.png'}")


if __name__ == "__main__":
    main()
