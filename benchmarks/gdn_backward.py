"""Host gated_delta_net forward + backward (host_fallback) against torch autograd of fla's chunked reference.

    [OPENBLAS_NUM_THREADS=N] python benchmarks/gdn_backward.py [--runs 3] [--seq 1024] [--memory-seq 4096] [--cpu-time]

Shapes of ``benchmarks/ssm.py`` (batch 2, seq 1024, H=8, K=V=64, f32, unit keys, beta in (0, 1), log-decays
in (-0.5, 0)), per-head and per-channel gates. Ours is the forward thunk then the backward thunk, two ways:
recomputing what it needs of the forward, and with a saved forward (ABI.md §9.1 ``reserve``: the forward also
writes the chunk states, the decayed products, their inverses and u, the backward reads them); torch is one
forward and ``backward()`` of the same loss ``Σ dst·d_dst`` through a float32 torch rewrite of fla's
``naive_chunk_gated_delta_rule`` math (chunks of 64, the triangular solve by forward substitution row by row;
per-channel gates with the decays of each key channel, as fla's KDA reference does). Rows: per way our forward
and backward ms, their sum over our forward alone (the forward without a reserve; target <= 2.5 with the
reserve), over the recomputing way's sum (the paired figure, steadiest under load), over torch's
forward+backward (target <= 0.5), the largest gradient difference relative to torch's largest. Medians of
``--runs`` runs, the five contenders taking turns (paired under the same load); ``--cpu-time`` times the process's
CPU time instead of wall time (a loaded machine's waits for a core left out; with N threads, all of theirs).

The memory table runs at ``--memory-seq`` (target: the backward's peak extra memory <= 2x the
forward's, both measured with tracemalloc, which sees every NumPy allocation), beside the forward's
state footprint: the chunk-entry states the chunked form keeps (S / 32 states of H x K x V per row).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import host_fallback  # noqa: E402
from host_fallback import gdn  # noqa: E402
from host_fallback.abi import forward_thunk, regions  # noqa: E402
from host_fallback.arena import view  # noqa: E402
from rlx_gpu.conformance.cases import lay_out  # noqa: E402
from rlx_gpu.units import human_bytes  # noqa: E402
import rlx_gpu  # noqa: E402
from backward_harness import peak_bytes, print_head, with_backward_arguments  # noqa: E402
from ssm import alternating_ms  # noqa: E402  (benchmarks/ssm.py: medians of runs taking turns)

HEADS, SIZE, BATCH = 8, 64, 2


def _inputs(seq: int, per_channel: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
    shape = (BATCH, seq, HEADS, SIZE)
    k = rng.standard_normal(shape)
    return {"q": rng.standard_normal(shape), "k": k / np.linalg.norm(k, axis=-1, keepdims=True),
            "v": rng.standard_normal(shape), "beta": rng.uniform(0, 1, shape[:3]),
            "g": rng.uniform(-0.5, 0, shape if per_channel else shape[:3]), "d_dst": rng.standard_normal(shape)}


def _ours(seq: int, per_channel: bool, values: dict[str, np.ndarray], reserve: bool = False):
    """``(forward thunk, backward thunk, arena)``: the forward writes its output where the backward reads ``d_dst``
    from, so both run on one arena; ``d_dst`` is restored before every backward. With ``reserve`` the forward
    writes a saved forward the backward reads."""
    params = dict(batch=BATCH, seq=seq, heads=HEADS, state_size=SIZE, gate_per_channel=per_channel, carry_state=False)
    if reserve:
        need = rlx_gpu.reserve_bytes({"op": "gated_delta_net", "dtype": "f32", **params})
        params.update(reserve=True, reserve_bytes=need)
    thunk, nbytes = lay_out("gated_delta_net_backward", "f32", params)
    arena = np.zeros(nbytes, np.uint8)
    for r in regions(thunk):
        if r.field in values:
            view(arena, r.offset, r.dtype, r.shape)[...] = values[r.field]
    return forward_thunk(thunk), thunk, arena


def _torch_chunked(q, k, v, g, beta, scale: float, length: int = 64):
    """fla's naive chunked gated delta rule in torch: ``[B, T, H, K]`` in, ``[B, T, H, V]`` out, from a zero state."""
    import torch
    b, seq, h, n = q.shape
    chunks = seq // length
    per_channel = g.dim() == 4

    def split(x):  # [B, T, H, ...] -> [B, H, C, L, ...]
        return x.reshape(b, chunks, length, h, *x.shape[3:]).movedim(3, 1)

    q, k, v, g, beta = (split(x) for x in (q * scale, k, v, g, beta))
    cum = g.cumsum(3)  # [B, H, C, L] or [B, H, C, L, K]
    lower = torch.ones(length, length, dtype=torch.bool).tril()
    if per_channel:  # decay of every key channel between each later step r and earlier step s
        ratio = torch.exp((cum[..., :, None, :] - cum[..., None, :, :]).masked_fill(~lower[..., None], -torch.inf))
        kk = torch.einsum("...ri,...rsi,...si->...rs", k * beta[..., None], ratio, k)
        qk = torch.einsum("...ri,...rsi,...si->...rs", q, ratio, k)
    else:
        ratio = torch.exp((cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, -torch.inf))
        kk, qk = (k * beta[..., None]) @ k.transpose(-1, -2) * ratio, q @ k.transpose(-1, -2) * ratio
    attn = -kk.masked_fill(~lower.tril(-1), 0)  # strictly lower
    rows = [attn[..., 0, :]]
    for i in range(1, length):  # (I + A)^-1 by forward substitution, one row at a time
        done = torch.stack(rows, -2)
        rows.append(attn[..., i, :] + (attn[..., i, :i, None] * done[..., :i, :]).sum(-2))
    solve = torch.stack(rows, -2) + torch.eye(length, dtype=q.dtype)
    gamma = torch.exp(cum) if per_channel else torch.exp(cum)[..., None]
    values, decayed_keys = solve @ (v * beta[..., None]), solve @ (k * beta[..., None] * gamma)
    qk = qk.masked_fill(~lower, 0)
    state = torch.zeros(b, h, n, v.shape[-1], dtype=q.dtype)
    out = []
    for c in range(chunks):
        fresh = values[:, :, c] - decayed_keys[:, :, c] @ state
        out.append((q[:, :, c] * gamma[:, :, c]) @ state + qk[:, :, c] @ fresh)
        to_end = torch.exp(cum[:, :, c, -1:] - cum[:, :, c])
        to_end = to_end if per_channel else to_end[..., None]
        through = torch.exp(cum[:, :, c, -1])
        through = through[..., None] if per_channel else through[..., None, None]
        state = through * state + (k[:, :, c] * to_end).transpose(-1, -2) @ fresh
    return torch.stack(out, 2).movedim(1, 3).reshape(b, seq, h, -1)


def _torch_run(values: dict[str, np.ndarray]):
    """A callable running torch's forward + backward; it returns ``{d_NAME: gradient}``."""
    import torch

    def run():
        leaves = {f: torch.tensor(values[f], dtype=torch.float32, requires_grad=True) for f in ("q", "k", "v", "g", "beta")}
        out = _torch_chunked(*leaves.values(), SIZE ** -0.5)
        (out * torch.tensor(values["d_dst"], dtype=torch.float32)).sum().backward()
        return {f"d_{f}": leaf.grad.numpy() for f, leaf in leaves.items()}
    return run


def _steps(forward: dict, backward: dict, arena: np.ndarray):
    """``(run the forward, run the backward, the gradients after one more forward and backward)`` on one copy of
    ``arena`` (``_ours``)."""
    d_dst = next(r for r in regions(backward) if r.field == "d_dst")
    work = arena.copy()

    def fwd() -> None:
        host_fallback.execute(forward, work)

    def bwd() -> None:
        work[d_dst.offset: d_dst.offset + d_dst.nbytes] = arena[d_dst.offset: d_dst.offset + d_dst.nbytes]
        host_fallback.execute(backward, work)

    def gradients() -> dict[str, np.ndarray]:
        fwd()
        bwd()
        return {r.field: view(work, r.offset, r.dtype, r.shape) for r in regions(backward) if r.field.startswith("d_")}
    return fwd, bwd, gradients


def main() -> None:
    parser = with_backward_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), runs=3)
    parser.add_argument("--cpu-time", action="store_true", help="the process's CPU time instead of wall time")
    args = parser.parse_args()
    import torch
    threads = int(os.environ.get("OPENBLAS_NUM_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(threads)
    print(f"host CPU, f32, batch {BATCH}, seq {args.seq}, H={HEADS} K=V={SIZE}; OpenBLAS and torch {threads} threads; "
          f"medians of {args.runs} runs ({'CPU' if args.cpu_time else 'wall'} time); "
          f"load average {os.getloadavg()[0]:.1f}")
    clock = time.process_time if args.cpu_time else time.perf_counter
    head = (f"{'gates, way':<22}{'fwd ms':>9}{'bwd ms':>9}{'(f+b)/f':>9}{'/recompute':>11}{'torch ms':>10}"
            f"{'ours/torch':>12}{'max rel diff':>14}")
    print_head(head)
    for per_channel in (False, True):
        values = _inputs(args.seq, per_channel, np.random.default_rng(0))
        steps = {way: _steps(*_ours(args.seq, per_channel, values, way == "reserve"))
                 for way in ("recompute", "reserve")}
        twin = _torch_run(values)
        f_ms, b_ms, fr_ms, br_ms, t_ms = alternating_ms([*steps["recompute"][:2], *steps["reserve"][:2], twin],
                                                        args.runs, 1, clock)
        gates = "per-channel" if per_channel else "per-head"
        for way, (fw, bw) in (("recompute", (f_ms, b_ms)), ("reserve", (fr_ms, br_ms))):
            ours = steps[way][2]()
            diff = max(float(np.max(np.abs(ours[f] - x)) / np.max(np.abs(x))) for f, x in twin().items())
            print(f"{gates + ', ' + way:<22}{fw:>9.1f}{bw:>9.1f}{(fw + bw) / f_ms:>9.2f}"
                  f"{(fw + bw) / (f_ms + b_ms):>11.2f}{t_ms:>10.1f}{(fw + bw) / t_ms:>12.2f}{diff:>14.1e}")
    print()
    seq = args.memory_seq
    states = BATCH * HEADS * SIZE * SIZE * 4 * -(-seq // gdn.CHUNK)
    print(f"peak extra memory at seq {seq} (tracemalloc); the forward's chunk-entry states: {human_bytes(states)}")
    head = f"{'gates':<12}{'forward':>12}{'backward':>12}{'bwd/fwd':>9}{'bwd/states':>12}"
    print_head(head)
    for per_channel in (False, True):
        values = _inputs(seq, per_channel, np.random.default_rng(1))
        forward, backward, arena = _ours(seq, per_channel, values)
        del values
        host_fallback.execute(backward, arena.copy())  # warm: imports, scratch pools, thread pool
        first, second = arena.copy(), arena.copy()
        f_peak = peak_bytes(lambda: host_fallback.execute(forward, first))
        b_peak = peak_bytes(lambda: host_fallback.execute(backward, second))
        print(f"{'per-channel' if per_channel else 'per-head':<12}{human_bytes(f_peak):>12}{human_bytes(b_peak):>12}"
              f"{b_peak / f_peak:>9.2f}{b_peak / states:>12.2f}")


if __name__ == "__main__":
    main()
