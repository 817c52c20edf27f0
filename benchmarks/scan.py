"""Time and memory of host ``scan_backward`` against the sequence length, per recompute strategy.

Runs the tanh-RNN cell of ``tests/test_scan_host.py`` (f32, carry [2, 3]) for T = 64 … 16384 with
every carry saved (K = T), √T checkpoints with the segment cache, and one checkpoint with
treeverse. Prints medians and writes a log–log plot of the carries held against T to
``benchmarks/out/scan_memory.png``.

    PYTHONPATH=. python benchmarks/scan.py [--max-t 16384] [--repeats 3]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import matplotlib

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' cells, run from anywhere
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from host_fallback.scan import HostMemory, run_scan_backward  # noqa: E402
from tests.test_scan_host import Problem, Rnn  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"

# (label, checkpoints for a length T, recompute strategy)
CONFIGS = [
    ("K=T (all saved)", lambda t: t, "segment"),
    ("K=isqrt(T) segment", math.isqrt, "segment"),
    ("K=1 treeverse", lambda t: 1, "treeverse"),
]


def measure(length: int, k: int, how: str, repeats: int) -> dict:
    """Median seconds, peak extra bytes and body runs of one backward sweep."""
    p = Problem(Rnn("f32"), length)
    thunk = p.backward("scan_backward", save_trajectory=False, k=k)  # runs the checkpointed forward once
    times = []
    for _ in range(repeats):
        mem = HostMemory()
        start = time.perf_counter()
        run_scan_backward(mem, thunk, p.arena, recompute=how)
        times.append(time.perf_counter() - start)
    c = p.rnn.carry_bytes
    bodies = p.rnn.vjp["arena_bytes"] + (p.rnn.cell["arena_bytes"] if 0 < k < length else 0)
    rows = k if 0 < k < length else length
    return {
        "seconds": statistics.median(times),
        "peak": mem.peak,
        "carries": rows + (mem.peak - bodies) // c,  # trajectory rows plus the driver's own carries
        "recompute": (mem.runs - length) / length,  # forward_body runs per step
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
