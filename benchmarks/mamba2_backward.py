"""Host mamba2 forward + backward (host_fallback) against torch autograd of the SSD chunked form, and the
backward's peak extra memory against the forward's.

    [OPENBLAS_NUM_THREADS=1] python benchmarks/mamba2_backward.py [--runs 5] [--seq 1024] [--memory-seq 4096]
                                                                  [--cpu-time]

Shape: ``benchmarks/ssm.py``'s mamba2 perf case (batch 2, heads 8, head_dim 64, state 64, f32). Ours is
the forward thunk, then the backward thunk, two ways: recomputing what it needs of the forward, and with a
saved forward (ABI.md §9.1 ``reserve``: the forward also writes the chunk states and ``y``, the backward reads
them); the four host thunks are timed in alternation (``ssm.alternating_ms``: paired under the same load). Torch is
``benchmarks/ssm.py``'s ``torch_ssd`` (the four-term SSD form of mamba_ssm's ``ssd_minimal_discrete``)
forward and ``backward()`` of the loss ``Σ dst·d_dst`` on CPU, on as many threads as ours (``threads.cores()``:
the OpenBLAS threads, at most the cores; torch's default is every core, whose threads on a loaded machine wait for
cores and slow it several times over, which made this ratio 0.04-0.09x before). Times are medians of ``--runs`` runs,
one contender at a time (``ssm.medians_ms``); ``--cpu-time`` times the process's CPU time instead of wall time
(the waits for a core of a loaded machine left out); the load average is printed beside them, since the
neighbours on a shared machine slow every column. Memory: the ``tracemalloc`` peak of one run of each
thunk at ``--memory-seq`` (the arena itself allocated before; the scratch pool emptied first, so the
forward's reused arrays count), beside the bytes of the states a chunked pass keeps (one per chunk).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import host_fallback  # noqa: E402
from host_fallback import chunked, threads  # noqa: E402
from host_fallback.abi import forward_thunk  # noqa: E402
from host_fallback.ssm import MAMBA2_CHUNK  # noqa: E402
from rlx_gpu.conformance.reference_ssm import lay_out  # noqa: E402
from backward_harness import peak_bytes, with_backward_arguments  # noqa: E402
from ssm import alternating_ms, cases, medians_ms, torch_ssd  # noqa: E402  (the perf shape and the torch twin)
import rlx_gpu  # noqa: E402


def _problem(seq: int, reserve: bool = False):
    """``(params, tensors, backward thunk, its forward, arena)`` of the perf case at ``seq``; with ``reserve``
    the two share a saved forward, which the arena holds as the forward wrote it."""
    rng = np.random.default_rng(0)
    label, op, params, tensors, *_ = cases(seq, rng)[0]
    tensors["d_dst"] = rng.standard_normal(tensors["x"].shape)
    if reserve:
        need = rlx_gpu.reserve_bytes({"op": "mamba2", "dtype": "f32", **params})
        params = {**params, "reserve": True, "reserve_bytes": need}
    thunk, arena = lay_out("mamba2_backward", "f32", params, tensors)
    forward = forward_thunk(thunk)
    if reserve:  # the forward writes dst where the backward reads d_dst: only its reserve comes back
        written, start = arena.copy(), thunk["reserve"]
        host_fallback.execute(forward, written)
        arena[start: start + thunk["reserve_bytes"]] = written[start: start + thunk["reserve_bytes"]]
    return params, tensors, thunk, forward, arena


def _peak_bytes(thunk: dict, arena: np.ndarray) -> int:
    """What one run of ``thunk`` on a copy of ``arena`` allocates at its peak, the scratch pool emptied first (so
    the arrays it reuses count)."""
    work = arena.copy()
    chunked._POOL.__dict__.pop("arrays", None)
    return peak_bytes(lambda: host_fallback.execute(thunk, work))


def main() -> None:
    parser = with_backward_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), runs=5)
    parser.add_argument("--cpu-time", action="store_true", help="the process's CPU time instead of wall time")
    args = parser.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    import torch

    torch.set_num_threads(threads.cores())
    params, tensors, thunk, forward, arena = _problem(args.seq)
    ours_fwd, ours_bwd = arena.copy(), arena.copy()  # the forward writes dst where the backward reads d_dst
    leaves = {f: torch.tensor(np.asarray(tensors[f], np.float32), requires_grad=True)
              for f in ("x", "dt", "a", "b", "c")}
    upstream = torch.tensor(np.asarray(tensors["d_dst"], np.float32))

    def torch_step() -> None:
        for leaf in leaves.values():
            leaf.grad = None
        (torch_ssd(*leaves.values()) * upstream).sum().backward()

    _, _, saving, saving_fwd, saved = _problem(args.seq, reserve=True)
    saving_out = saved.copy()
    fwd, bwd, fwd_r, bwd_r = alternating_ms([lambda: host_fallback.execute(forward, ours_fwd),
                                             lambda: host_fallback.execute(thunk, ours_bwd),
                                             lambda: host_fallback.execute(saving_fwd, saving_out),
                                             lambda: host_fallback.execute(saving, saved)], args.runs, 1, clock)
    (ref,) = medians_ms([torch_step], args.runs, 1, clock)
    print(f"mamba2 B{params['batch']} S{args.seq} H{params['heads']} P{params['head_dim']} N{params['state_size']} f32,"
          f" {'CPU' if args.cpu_time else 'wall'} time, load average {os.getloadavg()[0]:.1f}, torch threads "
          f"{torch.get_num_threads()}, reserve "
          f"{saving['reserve_bytes'] / (1 << 20):.1f} MiB")
    print(f"{'ours forward':>34} {fwd:9.1f} ms")
    for label, f, b in (("recompute", fwd, bwd), ("reserve", fwd_r, bwd_r)):
        print(f"{'ours forward, ' + label:>34} {f:9.1f} ms   {f / fwd:5.2f}x our forward")
        print(f"{'ours backward, ' + label:>34} {b:9.1f} ms   {b / fwd:5.2f}x our forward")
        print(f"{'ours forward+backward, ' + label:>34} {f + b:9.1f} ms   {(f + b) / fwd:5.2f}x our forward, "
              f"{(f + b) / ref:5.2f}x torch")
    print(f"{'torch autograd fwd+bwd':>34} {ref:9.1f} ms")

    params, _, thunk, forward, arena = _problem(args.memory_seq)
    f_peak, b_peak = _peak_bytes(forward, arena), _peak_bytes(thunk, arena)
    states = -(-args.memory_seq // MAMBA2_CHUNK) * params["batch"] * params["heads"] * params["head_dim"] * \
        params["state_size"] * 4
    mib = 1 << 20
    print(f"peak extra memory at S{args.memory_seq}: forward {f_peak / mib:.1f} MiB, backward {b_peak / mib:.1f} MiB "
          f"({b_peak / f_peak:.2f}x the forward's; the chunk states are {states / mib:.1f} MiB, "
          f"{b_peak / states:.1f}x)")


if __name__ == "__main__":
    main()
