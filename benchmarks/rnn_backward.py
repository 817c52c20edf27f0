"""Host lstm / gru / rnn forward + backward (host_fallback) against torch autograd of nn.LSTM / GRU / RNN,
with the saved forward (ABI.md §9.1's reserve) and without (the backward recomputes the forward).

    python benchmarks/rnn_backward.py [--ops lstm gru rnn] [--shape large|small] [--runs 5] [--threads 1]
                                      [--cpu-time]

``--shape large`` (the default): batch 32, seq 128, input = hidden = 256, 2 layers, bidirectional; ``small``:
configs/examples/train_lstm_lm.py's char LSTM LM (batch 8, seq 24, input 16, hidden 32, 2 layers, one
direction), where the whole-sequence kernels (host_fallback/lstm_sequence.py) run the lstm. f32, weights
uniform in ±1/sqrt(hidden) as torch initialises them. Ours is the forward thunk then the backward thunk:
``recompute`` the plain forward and a backward that runs the forward again inside, ``reserve`` a forward
that writes the reserve and a backward that reads it; torch is one forward and ``backward()`` of the same
loss ``Σ dst·d_dst``. Each run times the five calls in turn (arena copies outside the clock); the table
holds medians of the times and of each run's own ratios (paired: a neighbour's load slows one run of
every side). ``--threads`` sets both BLAS's (``OPENBLAS_NUM_THREADS``, set before NumPy loads) and torch's;
``--cpu-time`` times CPU time instead of wall time. The load average is printed beside the table.
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
from host_fallback import gemm  # noqa: E402
from backward_harness import blas_threads  # noqa: E402
from host_fallback.abi import forward_thunk, regions  # noqa: E402
from host_fallback.arena import view  # noqa: E402
from rlx_gpu.conformance.cases import lay_out  # noqa: E402
from rlx_gpu.schedule.reserve import reserve_bytes  # noqa: E402

SHAPES = {"large": dict(batch=32, seq=128, input_size=256, hidden=256, num_layers=2, bidirectional=True, carry=False),
          "small": dict(batch=8, seq=24, input_size=16, hidden=32, num_layers=2, bidirectional=False, carry=False)}


def _ours(op: str, shape: dict, rng: np.random.Generator, saved: bool):
    """The backward thunk of ``op`` (with a reserve where ``saved``), its forward, and an arena with every
    input set."""
    params = dict(shape, **({"relu": False} if op == "rnn" else {}))
    if saved:
        params.update(reserve=True, reserve_bytes=reserve_bytes({"op": op, "dtype": "f32", **params}))
    thunk, nbytes = lay_out(f"{op}_backward", "f32", params)
    arena = np.zeros(nbytes, np.uint8)
    bound = 1 / np.sqrt(shape["hidden"])
    for r in regions(thunk):
        if r.reads and r.field != "reserve":
            weight = r.field.startswith("w_") or r.field in ("bias", "b_ih", "b_hh")
            values = rng.uniform(-bound, bound, r.shape) if weight else rng.standard_normal(r.shape)
            view(arena, r.offset, r.dtype, r.shape)[...] = values
    return thunk, forward_thunk(thunk), arena


def _median(fn, runs: int, clock=time.perf_counter, calls: int = 1) -> float:
    """The median over ``runs`` of the time a call takes, each run the mean of ``calls`` calls."""
    times = []
    for _ in range(runs):
        start = clock()
        for _ in range(calls):
            fn()
        times.append((clock() - start) / calls)
    return statistics.median(times)


def _timed(fn, clock) -> float:
    start = clock()
    fn()
    return clock() - start


def _pair(op: str, shape: dict, rng: np.random.Generator, saved: bool):
    """``(forward, backward)`` of ``op``: each takes an arena that ``fresh()`` (untimed) gives."""
    thunk, forward, arena = _ours(op, shape, rng, saved)
    run_forward, run_backward = host_fallback.bound_kernel(forward, {}), host_fallback.bound_kernel(thunk, {})
    d_dst = next(r for r in regions(thunk) if r.field == "d_dst")
    span = slice(d_dst.offset, d_dst.offset + d_dst.nbytes)  # the forward writes dst there: put d_dst back
    work = arena.copy()

    def fresh() -> np.ndarray:
        work[...] = arena
        return work

    def backward(a: np.ndarray) -> None:
        a[span] = arena[span]
        run_backward(a)
    return run_forward, backward, fresh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", nargs="+", default=["lstm", "gru", "rnn"], choices=["lstm", "gru", "rnn"])
    parser.add_argument("--shape", choices=list(SHAPES), default="large")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="BLAS and torch threads")
    parser.add_argument("--cpu-time", action="store_true", help="CPU time instead of wall time")
    args = parser.parse_args()
    blas_threads(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    rng = np.random.default_rng(0)
    products = "compiled tiles" if gemm.compiled() else "NumPy's BLAS"
    print(f"load average {os.getloadavg()[0]:.1f}; threads {args.threads}; {args.shape}; medians of {args.runs}; "
          f"large products: {products} (OpenBLAS core {gemm.blas_core()}; {gemm.ENV} to force)")
    print(f"{'op':<5} {'recompute f+b':>13} {'reserve f+b':>12} {'torch f+b':>10} {'recompute/torch':>16} "
          f"{'reserve/torch':>14} {'reserve/recompute':>18}")
    shape = SHAPES[args.shape]
    dirs = 2 if shape["bidirectional"] else 1
    for op in args.ops:
        module = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn": torch.nn.RNN}[op](
            shape["input_size"], shape["hidden"], num_layers=shape["num_layers"], bidirectional=shape["bidirectional"],
            batch_first=True)
        x = torch.randn(shape["batch"], shape["seq"], shape["input_size"], requires_grad=True)
        d_dst = torch.randn(shape["batch"], shape["seq"], dirs * shape["hidden"])

        def torch_run() -> None:
            (module(x)[0] * d_dst).sum().backward()

        sides = {saved: _pair(op, shape, rng, saved) for saved in (False, True)}
        rows = []
        for run in range(args.runs + 1):  # the first run compiles and warms: not counted
            times = {}
            for saved, (forward, backward, fresh) in sides.items():
                a = fresh()
                times[saved] = _timed(lambda: forward(a), clock) + _timed(lambda: backward(a), clock)
            times["torch"] = _timed(torch_run, clock)
            if run:
                rows.append(times)
        med = {k: statistics.median(r[k] for r in rows) for k in (False, True, "torch")}
        ratio = {name: statistics.median(r[a] / r[b] for r in rows)
                 for name, a, b in (("rt", False, "torch"), ("st", True, "torch"), ("sr", True, False))}
        print(f"{op:<5} {med[False] * 1e3:>11.4g}ms {med[True] * 1e3:>10.4g}ms {med['torch'] * 1e3:>8.4g}ms "
              f"{ratio['rt']:>16.2f} {ratio['st']:>14.2f} {ratio['sr']:>18.2f}")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
