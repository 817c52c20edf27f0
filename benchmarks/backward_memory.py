"""Peak extra memory and time of each host backward op (ABI.md §9) at S = 4096, with a saved forward (§9.1's
``reserve``) and without (the backward recomputes), against the forward's.

    python benchmarks/backward_memory.py [--ops lstm gru ...] [--seq 4096] [--runs 3] [--batch 4] [--hidden 128]
                                         [--threads 1]

Per op, one backward thunk without a reserve and one with, on the same input values. Memory: each thunk runs
through ``host_fallback.execute`` on a copy of an arena allocated beforehand, once untraced (a process's first
compiled kernel loads them all), then once more while ``tracemalloc`` (which NumPy reports its buffers to)
measures the peak of what it allocates beyond that arena (the reserve is in the arena: not counted), the
host's scratch pool emptied first. The forward's peak is its working state (the
layers' outputs of the recurrences, the chunk states of the state-space ops): the target is a backward
within 2x of it, with or without a reserve. Time: each run times the plain forward then the backward that
recomputes, and the forward writing the reserve then the backward reading it (arena copies outside the
clock); the table holds the medians of each run's own ratios, recompute over reserve, of forward + backward
and of the backward alone (paired: a neighbour's load slows both sides of a run). The first run warms up
and is not counted. ``--threads`` sets the BLAS's threads (``OPENBLAS_NUM_THREADS``, set before NumPy loads;
a two-thread BLAS on tiny GEMMs loses most of its time waiting where neighbours load the cores). The load
average is printed beside the table.

Shapes (f32): the recurrences ``--batch`` 4, input = hidden = ``--hidden`` 128, 2 layers, bidirectional (the
issue's B32 I=H=256 takes minutes a run at this length on two cores); the state-space ops those of
``benchmarks/ssm.py`` (batch 2; selective_scan H=256 N=16, mamba2 H=8 P=64 N=64, gated_delta_net H=8
K=V=64) at the longer sequence.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import host_fallback  # noqa: E402
from backward_harness import blas_threads, peak_bytes  # noqa: E402
from host_fallback import chunked  # noqa: E402
from host_fallback.abi import forward_thunk, regions  # noqa: E402
from host_fallback.arena import STORAGE, view  # noqa: E402
from rlx_gpu.conformance.cases import lay_out  # noqa: E402
from rlx_gpu.schedule.reserve import reserve_bytes  # noqa: E402
from rlx_gpu.units import human_bytes  # noqa: E402

RECURRENT = ("lstm", "gru", "rnn")
STATE_SPACE = {"selective_scan": dict(batch=2, hidden=256, state_size=16),
               "mamba2": dict(batch=2, heads=8, head_dim=64, state_size=64),
               "gated_delta_net": dict(batch=2, heads=8, state_size=64, gate_per_channel=False, carry_state=False)}
LETTERS = {"batch": "B", "seq": "S", "input_size": "I", "hidden": "H", "num_layers": "L", "heads": "H",
           "head_dim": "P", "state_size": "N"}


def shape_of(op: str, args: argparse.Namespace) -> dict:
    """The forward fields of ``op``'s thunks at ``args.seq``."""
    if op in RECURRENT:
        return dict(batch=args.batch, input_size=args.hidden, hidden=args.hidden, num_layers=2, bidirectional=True,
                    carry=False, seq=args.seq, **({"relu": False} if op == "rnn" else {}))
    return dict(STATE_SPACE[op], seq=args.seq)


class Side:
    """One backward thunk of ``op`` (with a reserve where ``saved``), its forward, and an arena with every input
    set from ``values`` (by field; drawn where missing, small: the state-space recurrences stay finite over the
    long sequence); ``fresh()`` gives a working copy with ``d_dst`` in place and the reserve (if any) written."""

    def __init__(self, op: str, params: dict, values: dict[str, np.ndarray], rng: np.random.Generator, saved: bool):
        if saved:
            params = dict(params, reserve=True, reserve_bytes=reserve_bytes({"op": op, "dtype": "f32", **params}))
        self.thunk, nbytes = lay_out(f"{op}_backward", "f32", params)
        self.forward = forward_thunk(self.thunk)
        self.arena = np.zeros(nbytes, np.uint8)
        for r in regions(self.thunk):
            if r.reads and r.field != "reserve":
                if r.field not in values:
                    values[r.field] = (rng.standard_normal(r.shape) * 0.1).astype(STORAGE[r.dtype])
                view(self.arena, r.offset, r.dtype, r.shape)[...] = values[r.field]
        d_dst = next(r for r in regions(self.thunk) if r.field == "d_dst")
        self.d_dst = slice(d_dst.offset, d_dst.offset + d_dst.nbytes)  # where the forward writes dst
        if saved:  # the reserve, as the forward writes it
            written = self.arena.copy()
            host_fallback.execute(self.forward, written)
            span = slice(self.thunk["reserve"], self.thunk["reserve"] + self.thunk["reserve_bytes"])
            self.arena[span] = written[span]
        self.work = self.arena.copy()
        self.run_forward = host_fallback.bound_kernel(self.forward, {})
        self.run_backward = host_fallback.bound_kernel(self.thunk, {})

    def peak(self, thunk: dict) -> int:
        """The peak extra bytes of one run of ``thunk`` (this side's forward or backward) on a fresh copy, after
        one run not traced: a process's first call of a compiled kernel imports and loads them all (Numba's
        own allocations, about 33 MiB: not the op's)."""
        self.work[...] = self.arena
        host_fallback.execute(thunk, self.work)
        self.work[...] = self.arena
        chunked._POOL.__dict__.pop("arrays", None)  # the scratch pool's arrays count where a run makes them
        return peak_bytes(lambda: host_fallback.execute(thunk, self.work))

    def timed(self) -> tuple[float, float]:
        """``(forward, backward)`` seconds of one forward then one backward."""
        self.work[...] = self.arena
        start = time.perf_counter()
        self.run_forward(self.work)
        middle = time.perf_counter()
        self.work[self.d_dst] = self.arena[self.d_dst]  # the forward wrote dst over d_dst (outside the clock)
        middle_after = time.perf_counter()
        self.run_backward(self.work)
        return middle - start, time.perf_counter() - middle_after


def measure(op: str, args: argparse.Namespace, rng: np.random.Generator) -> dict:
    """Peaks (forward, backward with and without reserve) and the paired time ratios of ``op``."""
    params, values = shape_of(op, args), {}
    plain, saved = Side(op, params, values, rng, False), Side(op, params, values, rng, True)
    out = {"shape": " ".join(f"{LETTERS[k]}{v}" for k, v in params.items() if k in LETTERS),
           "forward": plain.peak(plain.forward), "recompute": plain.peak(plain.thunk),
           "reserve": saved.peak(saved.thunk)}
    rows = []
    for run in range(args.runs + 1):  # the first run warms up (compiles): not counted
        (pf, pb), (sf, sb) = plain.timed(), saved.timed()
        if run:
            rows.append(((pf + pb) / (sf + sb), pb / sb, pf + pb, sf + sb))
    for k, name in enumerate(("fb_ratio", "b_ratio", "fb_recompute", "fb_reserve")):
        out[name] = statistics.median(r[k] for r in rows)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("``", ""))
    ops = [*RECURRENT, *STATE_SPACE]
    parser.add_argument("--ops", nargs="+", default=ops, choices=ops)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="the recurrences' batch")
    parser.add_argument("--hidden", type=int, default=128, help="the recurrences' input and hidden size")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads")
    args = parser.parse_args()
    blas_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"load average {os.getloadavg()[0]:.1f}; BLAS threads {args.threads}; medians of {args.runs} paired runs")
    head = (f"{'op':<16} {'shape':<21} {'forward':>9} {'bwd recomp':>10} {'bwd reserve':>11} {'recomp/fwd':>10} "
            f"{'reserve/fwd':>11} {'f+b recomp':>10} {'f+b reserve':>11} {'recomp/reserve f+b':>18} {'bwd':>5}")
    print(head)
    print("-" * len(head))
    for op in args.ops:
        m = measure(op, args, rng)
        print(f"{op:<16} {m['shape']:<21} {human_bytes(m['forward']):>9} {human_bytes(m['recompute']):>10} "
              f"{human_bytes(m['reserve']):>11} {m['recompute'] / m['forward']:>9.2f}x "
              f"{m['reserve'] / m['forward']:>10.2f}x {m['fb_recompute'] * 1e3:>8.0f}ms {m['fb_reserve'] * 1e3:>9.0f}ms "
              f"{m['fb_ratio']:>17.2f}x {m['b_ratio']:>4.2f}x", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
