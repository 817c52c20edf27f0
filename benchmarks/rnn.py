"""Host lstm / gru / rnn (host_fallback) against torch.nn.LSTM / GRU / RNN on the CPU.

    python benchmarks/rnn.py [--runs 5] [--warmup 1] [--rounds 3] [--directions auto|parallel|serial]

Default shape: batch 32, seq 128, input = hidden = 256, 2 layers, bidirectional, f32. torch gets as
many threads as NumPy's OpenBLAS has (printed). Each op runs on the same weights in both; the table
shows the median of ``--rounds`` x ``--runs`` timed runs (torch and host take turns, a block of
``--warmup`` untimed then ``--runs`` timed calls each, so drifting clocks or a neighbour's load hit
both alike), and the largest difference between the two outputs. A warning follows the table when other processes used the CPUs meanwhile. Needs only numpy, ml_dtypes, torch and this repository.
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
from host_fallback.threads import blas_threads  # noqa: E402
from rlx_gpu.graph.torch_weights import pack_recurrent  # noqa: E402

FIELDS = {"lstm": ("x", "w_ih", "w_hh", "bias", "h0", "c0", "dst"),
          "gru": ("x", "w_ih", "w_hh", "b_ih", "b_hh", "h0", "dst"),
          "rnn": ("x", "w_ih", "w_hh", "bias", "h0", "dst")}


def lay_out(op: str, tensors: dict[str, np.ndarray], dst_shape: tuple[int, ...], **params):
    """An f32 thunk and its uint8 arena: ``tensors`` packed 64-byte aligned, then ``dst``."""
    offsets, cursor = {}, 0
    for name, a in [*tensors.items(), ("dst", np.empty(dst_shape, np.float32))]:
        offsets[name] = cursor
        cursor += -(-a.nbytes // 64) * 64
    arena = np.zeros(cursor, np.uint8)
    for name, a in tensors.items():
        arena[offsets[name]: offsets[name] + a.nbytes] = np.ascontiguousarray(a, np.float32).view(np.uint8).ravel()
    thunk = {"op": op, "dtype": "f32", **params, **{f: offsets.get(f, 0) for f in FIELDS[op]}}
    return thunk, arena


def cpu_ticks() -> tuple[int, int] | None:
    """(busy ticks of the whole machine, ticks of this process), to tell when others shared the CPUs."""
    try:
        with open("/proc/stat") as f:
            v = [int(n) for n in f.readline().split()[1:]]
    except OSError:
        return None
    t = os.times()
    return sum(v) - v[3] - v[4], round((t.user + t.system) * os.sysconf("SC_CLK_TCK"))


def warn_if_shared(start: tuple[int, int] | None, t0: float) -> None:
    """Print a warning when other processes used the CPUs since ``start = cpu_ticks()`` at ``t0``."""
    end = cpu_ticks()
    if start and end:
        others = (end[0] - start[0]) - (end[1] - start[1])
        share = others / ((time.perf_counter() - t0) * os.sysconf("SC_CLK_TCK") * (os.cpu_count() or 1))
        if share > 0.05:
            print(f"warning: other processes used {share:.0%} of the CPUs meanwhile; these figures are unreliable")


def alternate_ms(fns, runs: int, warmup: int, rounds: int) -> list[float]:
    """Median ms of each function over ``rounds`` blocks of ``warmup`` untimed then ``runs`` timed calls,
    the functions taking turns block by block, so that drifting clocks or load hit all alike and what
    one side leaves behind (BLAS or OpenMP workers still spinning) falls on a warm-up call."""
    times = [[] for _ in fns]
    for _ in range(rounds):
        for fn, ts in zip(fns, times):
            for _ in range(warmup):
                fn()
            for _ in range(runs):
                start = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - start)
    return [statistics.median(ts) * 1e3 for ts in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--size", type=int, default=256, help="input_size = hidden")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--unidirectional", action="store_true")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per round and side")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs before each round's timed ones")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, torch and host taking turns")
    ap.add_argument("--directions", choices=("auto", "parallel", "serial"), default="auto",
                    help="host: two directions in two threads, one after the other, or the kernel's choice")
    ap.add_argument("--ops", default="lstm,gru,rnn")
    args = ap.parse_args()

    import torch

    threads = blas_threads()
    note = "NumPy's OpenBLAS"
    if threads is None:
        threads, note = os.cpu_count() or 1, "OpenBLAS not found; os.cpu_count()"
    torch.set_num_threads(threads)
    B, S, H, L = args.batch, args.seq, args.size, args.layers
    bidi = not args.unidirectional
    D = 2 if bidi else 1
    parallel = {"auto": None, "parallel": True, "serial": False}[args.directions]
    print(f"B={B} S={S} I=H={H} layers={L} {'bidirectional' if bidi else 'unidirectional'} f32; "
          f"threads: {threads} ({note}), torch.set_num_threads({threads}); host directions: {args.directions}; "
          f"median of {args.rounds}x{args.runs} runs, each block after {args.warmup} warm-up, torch and host in turns")

    torch.manual_seed(0)
    x = torch.randn(B, S, H)
    start, t0 = cpu_ticks(), time.perf_counter()
    rows = []
    for op in args.ops.split(","):
        model = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn": torch.nn.RNN}[op](
            H, H, num_layers=L, bidirectional=bidi, batch_first=True)
        tensors = {"x": x.numpy(), **pack_recurrent(model)}
        params = dict(batch=B, seq=S, input_size=H, hidden=H, num_layers=L, bidirectional=bidi, carry=False)
        if op == "rnn":
            params["relu"] = False
        thunk, arena = lay_out(op, tensors, (B, S, D * H), **params)

        with torch.no_grad():
            torch_ms, host_ms = alternate_ms(
                [lambda: model(x), lambda: host_fallback.execute(thunk, arena, parallel_directions=parallel)],
                args.runs, args.warmup, args.rounds)
            want = model(x)[0].numpy()
        got = arena[thunk["dst"]: thunk["dst"] + want.nbytes].view(np.float32).reshape(want.shape)
        rows.append((op, torch_ms, host_ms, host_ms / torch_ms, float(np.abs(got - want).max())))

    print(f"{'op':<6}{'torch ms':>10}{'host ms':>10}{'ratio':>8}{'max |diff|':>12}")
    for op, t_ms, h_ms, ratio, diff in rows:
        print(f"{op:<6}{t_ms:>10.1f}{h_ms:>10.1f}{ratio:>7.2f}x{diff:>12.1e}")
    warn_if_shared(start, t0)


if __name__ == "__main__":
    main()
