"""Host selective_scan / mamba2 / gated_delta_net: fast path against the step path and torch.

    [OPENBLAS_NUM_THREADS=1] python benchmarks/ssm.py [--runs 7] [--warmup 1] [--crossover | --split | --v2]

Shapes (batch 2, seq 1024, f32): mamba2 H=8 P=64 N=64; gated_delta_net H=8 N=64 with per-head and
per-channel gates; selective_scan H=256 N=16. Every host kernel runs through
``host_fallback.execute`` on a uint8 arena. Columns: the median of ``--runs`` timed runs of the
path the kernel chooses, of its step path (the recurrence vectorized over batch, heads and state),
their ratio, and a torch CPU implementation of the same algorithm written here (SSD chunked,
GDN chunked per-head, the Mamba-1 reference loop) with its ratio to ours. The fast paths split the
batch x heads (channels) recurrences across the cores OpenBLAS was given (``host_fallback.threads``);
the step path runs on one thread, its fastest (two threads trade the GIL over its small per-step
arrays). ``--crossover`` instead times step against fast path at short sequences, which sets the
``*_STEP_MAX`` rules; ``--split`` times the fast paths on one thread and on every core as the work
grows, which sets ``threads.SPLIT_MIN_WORK``. ``--v2`` times ABI.md §8's forms of selective_scan and
mamba2 against the plain op: the fused knobs (d, z, the delta/dt bias, softplus and limit) and a
packed batch of mixed-length sequences against an equal-length batch of as many tokens.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import host_fallback  # noqa: E402
from host_fallback import gdn, ssm  # noqa: E402
from host_fallback.threads import cores  # noqa: E402
from rlx_gpu.conformance.reference_ssm import lay_out  # noqa: E402  (the arena harness the tests use)


def medians_ms(fns, runs: int, warmup: int, clock=time.perf_counter) -> list[float]:
    """Median wall time (or ``clock``'s) of each of ``fns`` over ``runs`` calls after ``warmup``, one contender at a
    time: interleaving them lets torch's and OpenBLAS's idle threads, which spin for a while after
    each call, steal the cores from whichever runs next."""
    medians = []
    for fn in fns:
        for _ in range(warmup):
            fn()
        spent = []
        for _ in range(runs):
            start = clock()
            fn()
            spent.append(clock() - start)
        medians.append(statistics.median(spent) * 1e3)
    return medians


def alternating_ms(fns, runs: int, warmup: int, clock=time.perf_counter) -> list[float]:
    """Median wall time (or ``clock``'s) of each of ``fns`` over ``runs`` rounds that call each once in turn (host
    kernels only: on a shared machine, contenders timed in turn see the same load)."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    spent: list[list[float]] = [[] for _ in fns]
    for _ in range(runs):
        for fn, times in zip(fns, spent):
            start = clock()
            fn()
            times.append(clock() - start)
    return [statistics.median(times) * 1e3 for times in spent]


def cases(seq: int, rng: np.random.Generator):
    """``(label, op, params, tensors, path_for, fast path name)`` for each benchmarked op."""
    b = 2
    k = rng.standard_normal((b, seq, 8, 64))
    gdn_common = {"q": rng.standard_normal((b, seq, 8, 64)), "k": k / np.linalg.norm(k, axis=-1, keepdims=True),
                  "v": rng.standard_normal((b, seq, 8, 64)), "beta": rng.uniform(0, 1, (b, seq, 8))}
    gdn_params = {"batch": b, "seq": seq, "heads": 8, "state_size": 64, "carry_state": False}
    return [
        ("mamba2 H8 P64 N64", "mamba2", {"batch": b, "seq": seq, "heads": 8, "head_dim": 64, "state_size": 64},
         {"x": rng.standard_normal((b, seq, 8, 64)), "dt": rng.uniform(0.01, 0.2, (b, seq, 8)),
          "a": -rng.uniform(0.5, 4, 8), "b": rng.standard_normal((b, seq, 8, 64)) / 8,
          "c": rng.standard_normal((b, seq, 8, 64))}, ssm.path_for, "chunked"),
        ("gdn per-head H8 N64", "gated_delta_net", {**gdn_params, "gate_per_channel": False},
         {**gdn_common, "g": rng.uniform(-0.5, 0, (b, seq, 8))}, gdn.path_for, "chunked"),
        ("gdn per-channel H8 N64", "gated_delta_net", {**gdn_params, "gate_per_channel": True},
         {**gdn_common, "g": rng.uniform(-0.5, 0, (b, seq, 8, 64))}, gdn.path_for, "chunked"),
        ("selective_scan H256 N16", "selective_scan", {"batch": b, "seq": seq, "hidden": 256, "state_size": 16},
         {"x": rng.standard_normal((b, seq, 256)), "delta": rng.uniform(0.01, 0.2, (b, seq, 256)),
          "a": -rng.uniform(0.5, 4, (256, 16)), "b": rng.standard_normal((b, seq, 16)),
          "c": rng.standard_normal((b, seq, 16))}, ssm.path_for, "blocked"),
    ]


# --- torch implementations of the same algorithms, for the side-by-side column -------------------

def torch_ssd(x, dt, a, b, c, length=64):
    """SSD chunked (mamba2), the four-term form with a segment-sum decay mask."""
    import torch
    bsz, seq, h, p = x.shape
    chunks = seq // length
    x, b, c = (t.reshape(bsz, chunks, length, h, -1).permute(0, 3, 1, 2, 4) for t in (x * dt[..., None], b, c))
    cum = torch.cumsum((dt * a).reshape(bsz, chunks, length, h).permute(0, 3, 1, 2), -1)  # [B, H, C, L]
    diff = cum[..., :, None] - cum[..., None, :]
    mask = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    ratios = torch.exp(diff.masked_fill(~mask, -torch.inf))
    y = ((c @ b.transpose(-1, -2)) * ratios) @ x
    local = (x * torch.exp(cum[..., -1:] - cum)[..., None]).transpose(-1, -2) @ b  # [B, H, C, P, N]
    state, starts = torch.zeros_like(local[:, :, 0]), []
    for k in range(chunks):
        starts.append(state)
        state = torch.exp(cum[..., k, -1])[..., None, None] * state + local[:, :, k]
    y = y + torch.exp(cum)[..., None] * (c @ torch.stack(starts, 2).transpose(-1, -2))
    return y.permute(0, 2, 3, 1, 4).reshape(bsz, seq, h, p)


def torch_gdn(q, k, v, g, beta, length=64):
    """GDN chunked (per-head gates), the WY / UT-transform form."""
    import torch
    bsz, seq, h, n = q.shape
    chunks = seq // length
    q, k, v = (t.reshape(bsz, chunks, length, h, n).permute(0, 3, 1, 2, 4) for t in (q, k, v))
    g, beta = (t.reshape(bsz, chunks, length, h).permute(0, 3, 1, 2) for t in (g, beta))
    cum = torch.cumsum(g, -1)
    mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    ratios = torch.exp((cum[..., :, None] - cum[..., None, :]).masked_fill(~mask, -torch.inf))
    a = ((k @ k.transpose(-1, -2)) * ratios).tril(-1) * beta[..., None]
    eye = torch.eye(length, dtype=q.dtype, device=q.device)
    t = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)
    w, u = t @ (k * (beta * torch.exp(cum))[..., None]), t @ (v * beta[..., None])
    qk = (q @ k.transpose(-1, -2)) * ratios / math.sqrt(n)
    s, out = torch.zeros(bsz, h, n, n, dtype=q.dtype, device=q.device), []
    for c in range(chunks):
        uc = u[:, :, c] - w[:, :, c] @ s
        out.append(q[:, :, c] * torch.exp(cum[:, :, c])[..., None] / math.sqrt(n) @ s + qk[:, :, c] @ uc)
        last = cum[:, :, c, -1:]
        s = torch.exp(last)[..., None] * s + (k[:, :, c] * torch.exp(last - cum[:, :, c])[..., None]).transpose(-1, -2) @ uc
    return torch.stack(out, 2).permute(0, 2, 3, 1, 4).reshape(bsz, seq, h, n)


def torch_mamba1(x, delta, a, b, c):
    """The Mamba-1 reference loop: one step at a time over ``[B, H, N]``.

    The steps are taken with ``unbind``, not by indexing as mamba_ssm's ``selective_scan_ref`` does: under
    autograd each indexed step's backward adds a zero-filled gradient of the whole ``[B, S, H, N]`` input
    (B2 S1024 H256 N16: 183 s for one forward and backward, against 2 s unbound)."""
    import torch
    dA = torch.exp(delta[..., None] * a)  # [B, S, H, N]
    dBx = (delta * x)[..., None] * b[:, :, None, :]
    h, ys = torch.zeros(x.shape[0], a.shape[0], a.shape[1], dtype=x.dtype, device=x.device), []
    for decay, term, read in zip(dA.unbind(1), dBx.unbind(1), c.unbind(1)):
        h = decay * h + term
        ys.append(torch.einsum("bhn,bn->bh", h, read))
    return torch.stack(ys, 1)


TORCH = {"mamba2": (torch_ssd, ("x", "dt", "a", "b", "c")),
         "gated_delta_net": (torch_gdn, ("q", "k", "v", "g", "beta")),
         "selective_scan": (torch_mamba1, ("x", "delta", "a", "b", "c"))}


def torch_twin(op, params, tensors):
    """The torch twin as a no-argument callable, or ``None`` where there is none (or no torch)."""
    try:
        import torch
    except ImportError:
        return None
    if op == "gated_delta_net" and params["gate_per_channel"]:
        return None
    fn, fields = TORCH[op]
    args = [torch.from_numpy(np.asarray(tensors[f], np.float32)) for f in fields]

    def run():
        with torch.no_grad():
            return fn(*args).numpy()
    return run


#: Lengths of the packed sequences of ``--v2``: 2048 tokens, as the equal-length batch 2 x 1024.
PACKED = (100, 700, 37, 411, 800)


def v2_cases(rng: np.random.Generator):
    """``(label, op, plain params, tensors, fused params, packed params)`` of ``--v2``: the fused params
    add every knob to the plain op; the packed params hold the same 2048 tokens as ``PACKED`` sequences."""
    seq, b = 1024, 2
    cu = np.concatenate([[0], np.cumsum(PACKED)]).tolist()
    packed = {"batch": 1, "seq": b * seq, "cu_seqlens": cu}
    out = []
    for label, op, params, tensors, _, _ in cases(seq, rng):
        if op == "gated_delta_net":
            continue
        h = params["hidden"] if op == "selective_scan" else params["heads"]
        bias = "delta_bias" if op == "selective_scan" else "dt_bias"
        tensors = dict(tensors, d=rng.standard_normal(h), z=rng.standard_normal(tensors["x"].shape),
                       **{bias: rng.uniform(-4, -2, h)})
        fused = dict(params, d=True, z=True, **{bias: True},
                     **({"delta_softplus": True} if op == "selective_scan" else {"dt_softplus": True,
                                                                                 "dt_limit": [0.0, None]}))
        out.append((label, op, params, tensors, fused, dict(params, **packed)))
    return out


def v2_table(args) -> None:
    """The ``--v2`` table: plain op, fused knobs, equal-length batch and packed batch, and the ratios."""
    head = (f"{'op':<26}{'plain ms':>10}{'fused ms':>10}{'fused/plain':>12}{'B2x1024 ms':>12}{'packed ms':>11}"
            f"{'packed/equal':>13}")
    print(f"packed: one row of {len(PACKED)} sequences {'+'.join(map(str, PACKED))} = 2048 tokens (varlen), "
          f"equal: batch 2 x 1024; default paths")
    print(head)
    print("-" * len(head))
    for label, op, plain, tensors, fused, packed in v2_cases(np.random.default_rng(0)):
        flat = {f: v.reshape(1, -1, *v.shape[2:]) if v.ndim >= 3 else v for f, v in tensors.items()}
        laid = [lay_out(op, "f32", plain, tensors), lay_out(op, "f32", fused, tensors),
                lay_out(op, "f32", packed, flat)]
        times = alternating_ms([lambda t=t, a=a: host_fallback.execute(t, a) for t, a in laid], args.runs, args.warmup)
        print(f"{label:<26}{times[0]:>10.1f}{times[1]:>10.1f}{times[1] / times[0]:>12.2f}{times[0]:>12.1f}"
              f"{times[2]:>11.1f}{times[2] / times[0]:>13.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--crossover", action="store_true", help="time step against fast path at short sequences")
    ap.add_argument("--split", action="store_true", help="time the fast paths on one thread and on every core")
    ap.add_argument("--v2", action="store_true", help="time the fused knobs and a packed batch against the plain op")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    # torch gets the thread count OpenBLAS was started with, so both sides use the same cores
    threads = int(os.environ.get("OPENBLAS_NUM_THREADS", os.cpu_count() or 1))
    try:
        import torch
        torch.set_num_threads(threads)
    except ImportError:
        pass
    print(f"host CPU, f32, batch 2; {os.cpu_count()} cores; OpenBLAS and torch {threads} threads; "
          f"medians of {args.runs} runs")
    if args.crossover:
        print(f"{'op':<26}" + "".join(f"{f'seq {s}':>16}" for s in (1, 2, 4, 8, 16, 32, 64)))
        print(f"{'':<26}" + f"{'step/fast ms':>16}" * 7)
        for index in range(4):
            row = ""
            for seq in (1, 2, 4, 8, 16, 32, 64):
                label, op, params, tensors, _, fast = cases(seq, np.random.default_rng(seq))[index]
                thunk, arena = lay_out(op, "f32", params, tensors)
                step, quick = medians_ms([lambda: host_fallback.execute(thunk, arena, path="step"),
                                          lambda: host_fallback.execute(thunk, arena, path=fast)], args.runs, args.warmup)
                row += f"{step:>8.2f}/{quick:<7.2f}"
            print(f"{label:<26}{row}")
        return
    if args.v2:
        v2_table(args)
        return
    if args.split:
        every = cores()
        print(f"fast path on 1 thread / on {every}: ms; the last column is what the kernel picks by itself")
        for index in range(4):
            for seq in (64, 128, 256, 512, 1024):
                label, op, params, tensors, path_for, fast = cases(seq, np.random.default_rng(seq))[index]
                thunk, arena = lay_out(op, "f32", params, tensors)
                one, split = medians_ms([lambda w=w: host_fallback.execute(thunk, arena, path=fast, workers=w)
                                         for w in (1, every)], args.runs, args.warmup)
                print(f"{label:<26} seq {seq:>4}  {one:8.2f} / {split:<8.2f} {one / split:5.2f}x   {path_for(thunk)}")
        return
    head = f"{'op':<28}{'path':>28}{'ms':>9}{'step ms':>10}{'step/ours':>10}{'torch ms':>10}{'torch/ours':>11}{'max rel diff':>14}"
    print(head)
    print("-" * len(head))
    rows = []
    for label, op, params, tensors, path_for, _ in cases(args.seq, rng):
        thunk, arena = lay_out(op, "f32", params, tensors)
        ours, step = medians_ms([lambda: host_fallback.execute(thunk, arena),
                                 lambda: host_fallback.execute(thunk, arena, path="step")], args.runs, args.warmup)
        host_fallback.execute(thunk, arena)
        dst = next(r for r in host_fallback.regions(thunk) if r.field == "dst")
        out = arena[dst.offset: dst.offset + dst.nbytes].view(np.float32).reshape(dst.shape).copy()
        rows.append((label, path_for(thunk), ours, step, out, torch_twin(op, params, tensors)))
    # torch last: its idle OpenMP threads spin after each call and would slow whatever ran next
    for label, path, ours, step, out, twin in rows:
        if twin:
            t_ms = medians_ms([twin], args.runs, args.warmup)[0]
            diff = float(np.max(np.abs(twin() - out)) / np.max(np.abs(out)))
            torch_cols = f"{t_ms:>10.1f}{t_ms / ours:>11.2f}{diff:>14.1e}"
        else:
            torch_cols = f"{'-':>10}{'-':>11}{'-':>14}"
        print(f"{label:<28}{path:>28}{ours:>9.1f}{step:>10.1f}{step / ours:>10.2f}{torch_cols}")


if __name__ == "__main__":
    main()
