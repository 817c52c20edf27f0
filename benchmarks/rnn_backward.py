"""Host lstm / gru / rnn forward + backward (host_fallback) against torch autograd of nn.LSTM / GRU / RNN.

    python benchmarks/rnn_backward.py [--ops lstm gru rnn] [--shape large|small] [--runs 3] [--torch-threads N]
                                      [--cpu-time]

``--shape large`` (the default): batch 32, seq 128, input = hidden = 256, 2 layers, bidirectional; ``small``:
configs/examples/train_lstm_lm.py's char LSTM LM (batch 8, seq 24, input 16, hidden 32, 2 layers, one
direction), where the whole-sequence kernels (host_fallback/lstm_sequence.py) run the lstm. f32, weights
uniform in ±1/sqrt(hidden) as torch initialises them. Ours is the forward thunk then the
backward thunk (which recomputes the forward inside); torch is one forward and ``backward()`` of the
same loss ``Σ dst·d_dst``. Medians of ``--runs`` runs each, taking turns; the load average is printed
beside the table, since neighbours on the machine slow both sides (torch's threads most of all).
``--cpu-time`` times the CPU each side spends instead, both on one thread (``OPENBLAS_NUM_THREADS=1``
set before NumPy loads, ``torch.set_num_threads(1)``): on a machine busy with other work that is
the comparison that holds still.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import host_fallback  # noqa: E402
from host_fallback.abi import forward_thunk, regions  # noqa: E402
from host_fallback.arena import view  # noqa: E402
from rlx_gpu.conformance.cases import lay_out  # noqa: E402

SHAPES = {"large": dict(batch=32, seq=128, input_size=256, hidden=256, num_layers=2, bidirectional=True, carry=False),
          "small": dict(batch=8, seq=24, input_size=16, hidden=32, num_layers=2, bidirectional=False, carry=False)}


def _ours(op: str, shape: dict, rng: np.random.Generator):
    """The backward thunk of ``op``, its forward, and an arena with every input set."""
    thunk, nbytes = lay_out(f"{op}_backward", "f32", dict(shape, **({"relu": False} if op == "rnn" else {})))
    arena = np.zeros(nbytes, np.uint8)
    bound = 1 / np.sqrt(shape["hidden"])
    for r in regions(thunk):
        if r.reads:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", nargs="+", default=["lstm", "gru", "rnn"], choices=["lstm", "gru", "rnn"])
    parser.add_argument("--shape", choices=list(SHAPES), default="large")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--torch-threads", type=int, default=None, help="default: torch's own choice")
    parser.add_argument("--cpu-time", action="store_true", help="CPU time of each side on one thread")
    args = parser.parse_args()
    if args.cpu_time and os.environ.get("OPENBLAS_NUM_THREADS") != "1":  # BLAS reads it when it loads
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    import torch

    if args.torch_threads or args.cpu_time:
        torch.set_num_threads(1 if args.cpu_time else args.torch_threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    rng = np.random.default_rng(0)
    print(f"load average {os.getloadavg()[0]:.1f}; torch threads {torch.get_num_threads()}")
    print(f"{'op':<5} {'ours fwd':>9} {'ours bwd':>9} {'torch f+b':>10} {'ours f+b / torch':>17}")
    shape = SHAPES[args.shape]
    calls = 1 if args.shape == "large" else 200  # a small thunk takes ~0.1 ms: a run times many
    dirs = 2 if shape["bidirectional"] else 1
    for op in args.ops:
        thunk, forward, arena = _ours(op, shape, rng)
        module = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn": torch.nn.RNN}[op](
            shape["input_size"], shape["hidden"], num_layers=shape["num_layers"], bidirectional=shape["bidirectional"],
            batch_first=True)
        x = torch.randn(shape["batch"], shape["seq"], shape["input_size"], requires_grad=True)
        d_dst = torch.randn(shape["batch"], shape["seq"], dirs * shape["hidden"])

        def torch_run() -> None:
            (module(x)[0] * d_dst).sum().backward()

        # as a runtime runs them: each kernel bound once (its thunk-only setup done), then called per arena
        run_forward, run_backward = host_fallback.bound_kernel(forward, {}), host_fallback.bound_kernel(thunk, {})
        run_forward(arena.copy()), run_backward(arena.copy()), torch_run()  # compiled, warmed
        ours_f = _median(lambda: run_forward(arena.copy()), args.runs, clock, calls)
        ours_b = _median(lambda: run_backward(arena.copy()), args.runs, clock, calls)
        theirs = _median(torch_run, args.runs, clock, calls)
        print(f"{op:<5} {ours_f * 1e3:>7.3g}ms {ours_b * 1e3:>7.3g}ms {theirs * 1e3:>8.3g}ms "
              f"{(ours_f + ours_b) / theirs:>17.2f}")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
