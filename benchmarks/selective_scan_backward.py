"""Host selective_scan_backward: forward + backward against torch autograd and against our forward; peak memory.

    [OPENBLAS_NUM_THREADS=1] python benchmarks/selective_scan_backward.py [--runs 5] [--seq 1024] [--memory-seq 4096]

Shape: benchmarks/ssm.py's selective_scan (batch 2, H=256, N=16, f32). Columns: the median of ``--runs``
runs of our forward thunk, of our backward thunk, their sum over the forward (target <= 3), and
the Mamba-1 reference loop (benchmarks/ssm.py's ``torch_mamba1``: mamba_ssm's ``selective_scan_ref``
math, its steps unbound rather than indexed, which under autograd costs O(S^2)) forward and backward
under torch autograd on the CPU, against which ours is a ratio (target <= 0.5). ``--fields`` adds d,
z and the softplus-ed delta bias to both sides. A second row runs the forward writing a saved forward (ABI.md
§9.1 ``reserve``: the states every 32 steps) and the backward reading it, timed in alternation with the first.

Memory (at ``--memory-seq``): the peak of what each thunk allocates beyond its arena, traced with
``tracemalloc`` (NumPy reports its buffers to it), for the forward and for the backward, and their
ratio (target <= 2); beside them the bytes of one state ``[B, H, N]`` and the backward's checkpoints.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import host_fallback  # noqa: E402
import rlx_gpu  # noqa: E402
from host_fallback.selective_scan_backward import CHUNK  # noqa: E402
from rlx_gpu.conformance.reference_ssm import lay_out  # noqa: E402
from backward_harness import peak_bytes, print_head, with_backward_arguments  # noqa: E402
from ssm import alternating_ms, medians_ms, torch_mamba1  # noqa: E402  (the harness and twin of benchmarks/ssm.py)

B, H, N = 2, 256, 16


def tensors(seq: int, fields: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """benchmarks/ssm.py's selective_scan inputs (and with ``fields`` d, z and a delta bias)."""
    out = {"x": rng.standard_normal((B, seq, H)), "delta": rng.uniform(0.01, 0.2, (B, seq, H)),
           "a": -rng.uniform(0.5, 4, (H, N)), "b": rng.standard_normal((B, seq, N)),
           "c": rng.standard_normal((B, seq, N))}
    if fields:
        out.update(d=rng.standard_normal(H), z=rng.standard_normal((B, seq, H)), delta_bias=rng.uniform(-4, -2, H))
    return out


def thunks(seq: int, fields: bool, rng: np.random.Generator, reserve: bool = False):
    """``(forward thunk, its arena, backward thunk, its arena)`` on the same inputs, ``d_dst`` random; with
    ``reserve`` the backward's arena holds the saved forward its forward wrote."""
    params = {"batch": B, "seq": seq, "hidden": H, "state_size": N}
    if reserve:
        params.update(reserve=True, reserve_bytes=rlx_gpu.reserve_bytes({"op": "selective_scan", "dtype": "f32",
                                                                         **params}))
    knobs = dict(d=True, z=True, delta_bias=True, delta_softplus=True) if fields else {}
    grads = dict(d_d=True, d_z=True, d_delta_bias=True) if fields else {}
    values = tensors(seq, fields, rng)
    forward = lay_out("selective_scan", "f32", {**params, **knobs}, values)
    backward = lay_out("selective_scan_backward", "f32", {**params, **knobs, **grads},
                       {**values, "d_dst": rng.standard_normal((B, seq, H))})
    if reserve:
        host_fallback.execute(*forward)
        (f, fa), (b, ba) = forward, backward
        ba[b["reserve"]: b["reserve"] + b["reserve_bytes"]] = fa[f["reserve"]: f["reserve"] + f["reserve_bytes"]]
    return (*forward, *backward), values


def torch_step(values: dict[str, np.ndarray], d_dst: np.ndarray):
    """The torch twin's forward and backward as one call (gradients of every input)."""
    import torch

    leaves = {f: torch.tensor(v, dtype=torch.float32, requires_grad=True) for f, v in values.items()}
    upstream = torch.tensor(d_dst, dtype=torch.float32)

    def run() -> None:
        for leaf in leaves.values():
            leaf.grad = None
        delta = leaves["delta"]
        if "delta_bias" in leaves:
            delta = torch.nn.functional.softplus(delta + leaves["delta_bias"])
        y = torch_mamba1(leaves["x"], delta, leaves["a"], leaves["b"], leaves["c"])
        if "d" in leaves:
            y = (y + leaves["d"] * leaves["x"]) * torch.nn.functional.silu(leaves["z"])
        y.backward(upstream)
    return run


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def main() -> None:
    ap = with_backward_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), runs=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--fields", action="store_true", help="add d, z and the softplus-ed delta bias")
    args = ap.parse_args()
    threads = int(os.environ.get("OPENBLAS_NUM_THREADS", os.cpu_count() or 1))
    import torch
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    (fwd, fwd_arena, bwd, bwd_arena), values = thunks(args.seq, args.fields, rng)
    (rfwd, rfwd_arena, rbwd, rbwd_arena), _ = thunks(args.seq, args.fields, np.random.default_rng(0), reserve=True)
    ours = alternating_ms([lambda: host_fallback.execute(fwd, fwd_arena), lambda: host_fallback.execute(bwd, bwd_arena),
                           lambda: host_fallback.execute(rfwd, rfwd_arena),
                           lambda: host_fallback.execute(rbwd, rbwd_arena)], args.runs, args.warmup)
    d_dst = next(r for r in host_fallback.regions(bwd) if r.field == "d_dst")
    upstream = bwd_arena[d_dst.offset: d_dst.offset + d_dst.nbytes].view(np.float32).reshape(d_dst.shape)
    twin = medians_ms([torch_step(values, upstream)], args.runs, args.warmup)[0]  # torch last: its threads spin
    total = ours[0] + ours[1]
    print(f"host CPU, f32, B{B} S{args.seq} H{H} N{N}{' + d, z, delta_bias, softplus' if args.fields else ''}; "
          f"{os.cpu_count()} cores; OpenBLAS and torch {threads} threads; medians of {args.runs} runs; chunk {CHUNK}")
    head = (f"{'':>10}{'forward ms':>11}{'backward ms':>13}{'fwd+bwd ms':>12}{'/ forward':>11}{'torch fwd+bwd ms':>18}"
            f"{'ours / torch':>14}")
    print_head(head)
    print(f"{'recompute':>10}{ours[0]:>11.1f}{ours[1]:>13.1f}{total:>12.1f}{total / ours[0]:>11.2f}{twin:>18.1f}"
          f"{total / twin:>14.3f}")
    saved = ours[2] + ours[3]  # (over the plain forward)
    print(f"{'reserve':>10}{ours[2]:>11.1f}{ours[3]:>13.1f}{saved:>12.1f}{saved / ours[0]:>11.2f}{twin:>18.1f}"
          f"{saved / twin:>14.3f}")

    (fwd, fwd_arena, bwd, bwd_arena), _ = thunks(args.memory_seq, args.fields, np.random.default_rng(1))
    forward_peak = peak_bytes(lambda: host_fallback.execute(fwd, fwd_arena))
    backward_peak = peak_bytes(lambda: host_fallback.execute(bwd, bwd_arena))
    state = B * H * N * 4
    print(f"\npeak extra memory at S={args.memory_seq} (beyond the arena; one state [B,H,N] is {mib(state)}, "
          f"the backward's {-(-args.memory_seq // CHUNK)} checkpoints {mib(-(-args.memory_seq // CHUNK) * state)}):")
    print(f"forward {mib(forward_peak)}, backward {mib(backward_peak)}, backward / forward "
          f"{backward_peak / forward_peak:.2f}")


if __name__ == "__main__":
    main()
