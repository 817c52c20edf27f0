"""Host lstm / gru / rnn (host_fallback) against torch.nn.LSTM / GRU / RNN on the CPU, and each
version-2 field (ABI.md §8) beside the plain op.

    python benchmarks/rnn.py [--runs 5] [--warmup 1] [--rounds 3] [--directions auto|parallel|serial]
                             [--no-fields]

Default shape: batch 32, seq 128, input = hidden = 256, 2 layers, bidirectional, f32. torch gets as many
threads as NumPy's OpenBLAS has (printed). Each op runs on the same weights in both; the table shows the
median of ``--rounds`` x ``--runs`` timed runs (torch and host take turns, a block of ``--warmup``
untimed then ``--runs`` timed calls each, so drifting clocks or a neighbour's load hit both alike), and
the largest difference between the two outputs. Where Numba is installed (the ``jit`` extra) the host
lstm runs its compiled step (``host_fallback.jit``) and a second lstm row, in the same turns, runs
NumPy's (``RLX_HOST_JIT=0``). With lstm, a breakdown of one step follows: each part of the kernel's step
alone beside its alternative (paired, turn by turn), their sum beside the whole runs per step, host and
torch each on one thread (CPU time) and as the table ran them (wall time x threads: what the second
thread adds). A second table times every version-2 field of each op beside the plain op (the same
weights, the field's tensors drawn once), ``seq_lens`` with lengths uniform in ``[1, seq]`` also beside
torch on the same batch packed (``pack_padded_sequence``). A warning follows the tables when other
processes used the CPUs meanwhile. The header names the CPU, its vector ISA and the compiled step's width
(``RLX_HOST_JIT_WIDTH=8`` or ``16`` forces one). Needs only numpy, ml_dtypes, torch and this repository
(and Numba for the compiled step).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from functools import partial
from typing import Callable
from unittest import mock

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import host_fallback  # noqa: E402
from host_fallback import jit, threads  # noqa: E402
from host_fallback.rnn_packing import chunk_columns  # noqa: E402
from host_fallback.threads import blas_threads  # noqa: E402
from rlx_gpu.graph.torch_weights import pack_recurrent  # noqa: E402

FIELDS = {"lstm": ("x", "w_ih", "w_hh", "bias", "h0", "c0", "dst"),
          "gru": ("x", "w_ih", "w_hh", "b_ih", "b_hh", "h0", "dst"),
          "rnn": ("x", "w_ih", "w_hh", "bias", "h0", "dst")}


#: The version-2 tensors (ABI.md §8) a thunk may take besides FIELDS; ``seq_lens`` is int32.
TENSORS_V2 = ("seq_lens", "peepholes", "w_hr")


def lay_out(op: str, tensors: dict[str, np.ndarray], dst_shape: tuple[int, ...], **params):
    """An f32 thunk and its uint8 arena: ``tensors`` packed 64-byte aligned, then ``dst``."""
    offsets, cursor = {}, 0
    for name, a in [*tensors.items(), ("dst", np.empty(dst_shape, np.float32))]:
        offsets[name] = cursor
        cursor += -(-a.nbytes // 64) * 64
    arena = np.zeros(cursor, np.uint8)
    for name, a in tensors.items():
        stored = np.ascontiguousarray(a, "<i4" if name == "seq_lens" else np.float32)
        arena[offsets[name]: offsets[name] + stored.nbytes] = stored.view(np.uint8).ravel()
    thunk = {"op": op, "dtype": "f32", **params, **{f: offsets.get(f, 0) for f in FIELDS[op]},
             **{f: offsets[f] for f in TENSORS_V2 if f in offsets}}
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


def alternate_ms(fns, runs: int, warmup: int, rounds: int, setups=None) -> list[float]:
    """Median ms of each function over ``rounds`` blocks of ``warmup`` untimed then ``runs`` timed calls,
    the functions taking turns block by block, so that drifting clocks or load hit all alike and what
    one side leaves behind (BLAS or OpenMP workers still spinning) falls on a warm-up call. ``setups``:
    one callable per function, run before each of its blocks (an environment variable that picks a path)."""
    times = [[] for _ in fns]
    for _ in range(rounds):
        for k, (fn, ts) in enumerate(zip(fns, times)):
            if setups is not None:
                setups[k]()
            for _ in range(warmup):
                fn()
            for _ in range(runs):
                start = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - start)
    return [statistics.median(ts) * 1e3 for ts in times]


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    """Median µs of one call of ``fn`` over 5 blocks of ``calls`` calls, after one untimed block."""
    return paired_us([fn], calls)[0]


def paired_us(fns: list[Callable[[], object]], calls: int) -> list[float]:
    """``per_call_us`` of each of ``fns``, their blocks taking turns, so that a kernel's part and its
    alternative see the same clock and load."""
    blocks = [[] for _ in fns]
    for block in range(6):
        for fn, times in zip(fns, blocks):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            if block:
                times.append((time.perf_counter() - start) / calls)
    return [statistics.median(times) * 1e6 for times in blocks]


def one_thread_cpu_ms(fns, runs: int, rounds: int) -> list[float]:
    """Median CPU ms (this process's) of one call of each function with a one-thread BLAS and torch on
    one thread, the functions taking turns as in ``alternate_ms``: the work a call does, whatever the
    load."""
    import torch

    times = [[] for _ in fns]
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threads.single_threaded_blas():
            for _ in range(rounds):
                for fn, ts in zip(fns, times):
                    fn()
                    for _ in range(runs):
                        start = time.process_time()
                        fn()
                        ts.append(time.process_time() - start)
    finally:
        torch.set_num_threads(torch_threads)
    return [statistics.median(ts) * 1e3 for ts in times]


def lstm_step_profile(torch, B: int, S: int, H: int, chunk: int, steps: int, wall_ms: dict[str, float],
                      cpu_ms: dict[str, float], cores: int) -> None:
    """Where one lstm step of one layer-direction goes on the host: each part of the kernel's step timed
    alone with a one-thread BLAS (as each direction's thread runs it), an alternative under it, the
    parts' sum beside the whole runs' time per step (``steps`` = layers x directions x seq): host and
    torch on one thread (``cpu_ms``, CPU time), and as the main table ran them (``wall_ms``, on
    ``cores`` threads) times ``cores``: what a step costs the machine."""
    from host_fallback.activations import sigmoid_of_negated, sigmoid_then_tanh_of_scaled, tanh_through_exp

    rng = np.random.default_rng(0)
    f32 = np.float32
    w_hh, h = rng.standard_normal((4 * H, H), f32) * 0.05, rng.standard_normal((H, B), f32)
    w_t, h_t = np.ascontiguousarray(w_hh.T), np.ascontiguousarray(h.T)
    g, g_t = np.empty((4 * H, B), f32), np.empty((B, 4 * H), f32)
    x_chunk = {k: rng.standard_normal((k * H, chunk * B), f32) for k in (1, 2)}  # layer 0: I = H; layer 1: 2H
    x_whole = {k: rng.standard_normal((k * H, S * B), f32) for k in (1, 2)}
    w_ih = {k: rng.standard_normal((4 * H, k * H), f32) * 0.05 for k in (1, 2)}
    proj, whole = np.empty((4 * H, chunk * B), f32), np.empty((4 * H, S * B), f32)
    y = np.empty((2 * H, chunk * B), f32)[:H, :B]  # h's slot: this direction's rows of a layer's output chunk
    tmp, cell = np.empty((H, B), f32), rng.uniform(-2, 2, (H, B)).astype(f32)
    g[...] = rng.uniform(-3, 3, g.shape)
    proj[...] = rng.uniform(-1, 1, proj.shape)
    pre = g.copy()

    def fresh(*fns):  # each fn's µs on fresh pre-activations (their copy's time taken off)
        *us, copy = paired_us([*[lambda fn=fn: (np.copyto(g, pre), fn()) for fn in fns], lambda: np.copyto(g, pre)], 1000)
        return [t - copy for t in us]

    def cell_update():
        np.multiply(cell, g[H: 2 * H], out=cell)
        np.multiply(g[:H], g[3 * H:], out=tmp)
        np.add(cell, tmp, out=cell)

    def sigmoids_then_np_tanh():
        sigmoid_of_negated(g[: 3 * H], g[: 3 * H], None)
        np.tanh(g[3 * H:], out=g[3 * H:])

    tg, tw = torch.from_numpy(g), torch.from_numpy(w_hh)
    # (label, µs or None for a heading, its weight in the kernel's step: 1, 1/2 for each layer's projection,
    # 0 for an alternative)
    rows = []
    with threads.single_threaded_blas(), np.errstate(over="ignore"):
        torch_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            step, lanes = jit.kernel("lstm_step"), jit.lanes()
            panels = None if step is None else partial(jit.kernel("lstm_panels"), order=np.arange(4),
                                                          scales=np.ones(4, f32), lanes=lanes)
            numpy_weight = 1
            if step is not None:  # the kernel's step: W_hh·h + W_ih·x_t in register tiles and the rest, one call
                inf, out = f32(np.inf), np.empty((H, chunk * B), f32)
                packed_hh, bias = panels(w_hh), jit.kernel("lstm_panel_bias")(np.zeros(4 * H, f32), lanes)
                for k, name in ((1, "layer 0"), (2, "layer 1")):
                    packed_ih, x_t = panels(w_ih[k]), x_chunk[k][:, :B]
                    rows.append((f"one compiled step, {name}: W_hh·h + W_ih·x_t, then the rest (the kernel's)",
                                 per_call_us(lambda packed_ih=packed_ih, x_t=x_t: step(
                                     packed_hh, h, packed_ih, x_t, bias, cell, out, 0, inf, inf, f32(1), False), 400),
                                 0.5))
                rows.append(("NumPy's step instead (RLX_HOST_JIT=0, or without the jit extra):", None, 0))
                numpy_weight = 0
            ours, other, theirs = paired_us([lambda: np.matmul(w_hh, h, out=g), lambda: np.matmul(h_t, w_t, out=g_t),
                                             lambda: torch.mm(tw, torch.from_numpy(h), out=tg)], 400)
            rows += [("recurrent GEMM W_hh·hᵀ [4H,H]·[H,B], OpenBLAS", ours, numpy_weight),
                     ("  the other orientation h·W_hhᵀ [B,H]·[H,4H]", other, 0),
                     ("  torch.mm, same shape, 1 thread", theirs, 0)]
            fused, separate = fresh(lambda: sigmoid_then_tanh_of_scaled(g, 3 * H), sigmoids_then_np_tanh)
            via_exp, via_tanh = paired_us([lambda: (tanh_through_exp(cell, tmp, None), np.multiply(g[2 * H: 3 * H], tmp, out=y)),
                                           lambda: (np.tanh(cell, out=tmp), np.multiply(g[2 * H: 3 * H], tmp, out=y))], 1000)
            rows += [("add the step's projection, from its chunk", per_call_us(lambda: np.add(g, proj[:, :B], out=g), 2000),
                      numpy_weight),
                     ("gates: exp, +1 over i f o g; 1/x over i f o; 2/x - 1 over g", fused, numpy_weight),
                     ("  exp, +1, 1/x over i f o; np.tanh over g", separate, 0),
                     ("cell update c = f·c + i·g", per_call_us(cell_update, 1000), numpy_weight),
                     ("h = o·tanh(c), tanh through exp, into the chunk's slot", via_exp, numpy_weight),
                     ("  with np.tanh", via_tanh, 0)]
            for k, name in ((1, "layer 0"), (2, "layer 1")):
                chunked = per_call_us(lambda k=k: np.matmul(w_ih[k], x_chunk[k], out=proj), 100) / chunk
                rows += [(f"input projection, {name}: a {chunk}-step chunk's GEMM / {chunk}", chunked, numpy_weight / 2),
                         (f"  the whole sequence's GEMM / {S}",
                          per_call_us(lambda k=k: np.matmul(w_ih[k], x_whole[k], out=whole), 3) / S, 0)]
            x = rng.standard_normal((B, S, H), f32)
            x_tm = np.empty((S, B, H), f32)
            per_run = [("layer 0's input: the time-major copy of x", per_call_us(lambda: np.copyto(x_tm, x.transpose(1, 0, 2)), 20))]
            if panels is not None:
                per_run.append(("w_hh in the compiled step's panels, each layer-direction", per_call_us(lambda: panels(w_hh), 20)))
            w_dec, x_dec, w_copy = w_ih[1], rng.standard_normal((H, 1), f32), np.empty((4 * H, H), f32)
            g_dec = np.empty((4 * H, 1), f32)
            per_run += [("decode B=1: w_ih and w_hh copied in gate order, scaled",
                         per_call_us(lambda: [np.negative(w_dec, out=w_copy) for _ in range(2)], 200)),
                        ("  its two GEMVs on the stored weights (the kernel's)",
                         per_call_us(lambda: [np.matmul(w_dec, x_dec, out=g_dec) for _ in range(2)], 200))]
        finally:
            torch.set_num_threads(torch_threads)
    print(f"\nlstm, one step of one layer-direction (B={B} H={H}), µs, each part alone with a one-thread BLAS:")
    for label, us, _ in rows:
        print(f"  {label}" if us is None else f"  {label:<64}{us:>8.1f}")
    summed = "sum of the kernel's parts (projection: mean of the layers)"
    print(f"  {summed:<64}{sum(us * weight for _, us, weight in rows if weight):>8.1f}")
    print("whole runs / (layers·dirs·seq) steps, µs:")
    for side in ("host", "torch"):
        print(f"  {side + ', one thread (CPU time)':<64}{cpu_ms[side] * 1e3 / steps:>8.1f}")
    for side in ("host", "torch"):
        print(f"  {f'{side} as the table ran it (wall time x {cores} threads)':<64}{wall_ms[side] * 1e3 * cores / steps:>8.1f}")
    print("once per call, µs:")
    for label, us in per_run:
        print(f"  {label:<64}{us:>8.1f}")


def cpu_line() -> str:
    """The CPU's model, LLVM's name for it and its widest vector ISA, and the compiled lstm step's width:
    what every figure of the tables belongs to."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    try:
        from llvmlite import binding
    except ImportError:
        return f"CPU: {model}"
    features = binding.get_host_cpu_features()
    isa = "AVX-512" if features.get("avx512f") else "AVX2" if features.get("avx2") else "no AVX2"
    line = f"CPU: {model} ({binding.get_host_cpu_name()}, {isa}, {os.cpu_count()} CPUs)"
    if jit.kernel("lstm_step") is not None:
        forced = os.environ.get(jit.WIDTH_ENV, "").strip()
        source = f"{jit.WIDTH_ENV}={forced}" if forced else "the CPU's"
        line += f"; compiled lstm step: {jit.lanes()} float32 lanes a vector ({source})"
    return line


def torch_case(torch, op: str, x, H: int, L: int, bidi: bool):
    """``(module, its tensors with x, the thunk's params)`` of one op at the benchmark's shape."""
    B, S, _ = x.shape
    model = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn": torch.nn.RNN}[op](
        H, H, num_layers=L, bidirectional=bidi, batch_first=True)
    params = dict(batch=B, seq=S, input_size=H, hidden=H, num_layers=L, bidirectional=bidi, carry=False)
    if op == "rnn":
        params["relu"] = False
    return model, {"x": x.numpy(), **pack_recurrent(model)}, params


def variants(op: str, dirs: int, layers: int, hidden: int, seq: int, batch: int,
             rng: np.random.Generator) -> list[tuple[str, dict, dict]]:
    """``(label, thunk fields, extra tensors)`` of each version-2 field of ``op`` beside the plain op."""
    slots = {"lstm": 3, "gru": 2, "rnn": 1}[op]
    acts = {"lstm": [["hard_sigmoid", 0.2, 0.5], ["elu", 1.0, 0.0], ["softsign", 0.0, 0.0]],
            "gru": [["hard_sigmoid", 0.2, 0.5], ["scaled_tanh", 1.0, 1.0]],
            "rnn": [["leaky_relu", 0.01, 0.0]]}[op]
    lengths = rng.integers(1, seq + 1, batch).astype(np.int32)
    out = [("plain", {}, {}), ("seq_lens U[1,S]", {}, {"seq_lens": lengths}), ("clip 2", {"clip": 2.0}, {}),
           ("activations " + "/".join(a[0] for a in acts[:slots]), {"activations": acts * dirs}, {})]
    if op == "gru":
        out.append(("linear_before_reset=false", {"linear_before_reset": False}, {}))
    if op == "lstm":
        k = 1 / np.sqrt(hidden)
        out += [("peepholes", {}, {"peepholes": rng.uniform(-k, k, (layers * dirs, 3 * hidden))}),
                ("input_forget", {"input_forget": True}, {})]
    return out


def fields_table(torch, op: str, x, B: int, S: int, H: int, L: int, bidi: bool, parallel, args) -> list[tuple]:
    """Rows ``(op, label, host ms, ratio to plain, torch ms or None)`` for each field of ``op``."""
    D = 2 if bidi else 1
    rng = np.random.default_rng(1)
    model, base, params = torch_case(torch, op, x, H, L, bidi)
    runs, labels, lengths = [], [], None
    for label, fields, tensors in variants(op, D, L, H, S, B, rng):
        thunk, arena = lay_out(op, {**base, **tensors}, (B, S, D * H), **params, **fields)
        runs.append(lambda thunk=thunk, arena=arena: host_fallback.execute(thunk, arena, parallel_directions=parallel))
        labels.append(label)
        lengths = tensors.get("seq_lens", lengths)
    if op == "lstm":  # projections: the plain op's shape with proj_size H/2
        proj = torch.nn.LSTM(H, H, num_layers=L, bidirectional=bidi, batch_first=True, proj_size=H // 2)
        thunk, arena = lay_out(op, {"x": x.numpy(), **pack_recurrent(proj)}, (B, S, D * H // 2), **params,
                               proj_size=H // 2)
        runs.append(lambda thunk=thunk, arena=arena: host_fallback.execute(thunk, arena, parallel_directions=parallel))
        labels.append(f"proj_size {H // 2}")
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, torch.from_numpy(lengths.astype(np.int64)),
                                                     batch_first=True, enforce_sorted=False)
    with torch.no_grad():
        times = alternate_ms([*runs, lambda: model(x), lambda: model(packed)], args.runs, args.warmup, args.rounds)
    full_torch, packed_torch = times[-2:]
    rows = []
    for label, ms in zip(labels, times):
        against = {"plain": full_torch, "seq_lens U[1,S]": packed_torch}.get(label)
        rows.append((op, label, ms, ms / times[0], against))
    return rows


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
    ap.add_argument("--no-fields", action="store_true", help="leave out the table of version-2 fields")
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
    print(cpu_line())
    print(f"B={B} S={S} I=H={H} layers={L} {'bidirectional' if bidi else 'unidirectional'} f32; "
          f"threads: {threads} ({note}), torch.set_num_threads({threads}); host directions: {args.directions}; "
          f"median of {args.rounds}x{args.runs} runs, each block after {args.warmup} warm-up, torch and host in turns")

    torch.manual_seed(0)
    x = torch.randn(B, S, H)
    start, t0 = cpu_ticks(), time.perf_counter()
    rows, runs = [], {}
    for op in args.ops.split(","):
        model, tensors, params = torch_case(torch, op, x, H, L, bidi)
        thunk, arena = lay_out(op, tensors, (B, S, D * H), **params)

        def host(parallel=parallel, thunk=thunk, arena=arena):
            host_fallback.execute(thunk, arena, parallel_directions=parallel)

        def host_numpy(host=host):
            with mock.patch.dict(os.environ, {jit.ENV: "0"}):  # NumPy's loops even where Numba is installed
                host()

        runs[op] = (host, model)
        compiled = op == "lstm" and jit.kernel("lstm_step") is not None
        with torch.no_grad():
            sides = [lambda: model(x), host] + ([host_numpy] if compiled else [])
            torch_ms, host_ms, *numpy_ms = alternate_ms(sides, args.runs, args.warmup, args.rounds)
            want = model(x)[0].numpy()
        got = arena[thunk["dst"]: thunk["dst"] + want.nbytes].view(np.float32).reshape(want.shape)
        label = f"{op} (compiled step)" if compiled else op
        rows.append((label, torch_ms, host_ms, host_ms / torch_ms, float(np.abs(got - want).max())))
        if compiled:
            host_numpy()
            got = arena[thunk["dst"]: thunk["dst"] + want.nbytes].view(np.float32).reshape(want.shape)
            rows.append((f"{op} (NumPy step)", torch_ms, numpy_ms[0], numpy_ms[0] / torch_ms,
                         float(np.abs(got - want).max())))

    print(f"{'op':<20}{'torch ms':>10}{'host ms':>10}{'ratio':>8}{'max |diff|':>12}")
    for op, t_ms, h_ms, ratio, diff in rows:
        print(f"{op:<20}{t_ms:>10.1f}{h_ms:>10.1f}{ratio:>7.2f}x{diff:>12.1e}")
    if "lstm" in runs:
        t_ms, h_ms = next((t, h) for op, t, h, _, _ in rows if op.startswith("lstm"))
        host, model = runs["lstm"]
        with torch.no_grad():
            host_cpu, torch_cpu = one_thread_cpu_ms([lambda: host(False), lambda: model(x)], max(1, args.runs // 2),
                                                    args.rounds)
        lstm_step_profile(torch, B, S, H, chunk_columns(B, S)[0] // B, L * D * S, {"host": h_ms, "torch": t_ms},
                          {"host": host_cpu, "torch": torch_cpu}, threads)
    if not args.no_fields:
        rows = [r for op in args.ops.split(",") for r in fields_table(torch, op, x, B, S, H, L, bidi, parallel, args)]
        print("\nversion-2 fields, host ms and the ratio to the plain op (torch: the full batch beside plain, "
              "the packed batch beside seq_lens):")
        print(f"{'op':<6}{'field':<42}{'host ms':>10}{'/plain':>8}{'torch ms':>10}{'host/torch':>12}")
        for op, label, ms, ratio, against in rows:
            versus = f"{against:>10.1f}{ms / against:>11.2f}x" if against else ""
            print(f"{op:<6}{label:<42}{ms:>10.1f}{ratio:>7.2f}x{versus}")
    warn_if_shared(start, t0)


if __name__ == "__main__":
    main()
