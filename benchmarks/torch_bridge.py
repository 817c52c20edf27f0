"""What rlx_gpu.torch adds per call over the compiled schedule it runs: batch-1 decode steps on the host.

    python benchmarks/torch_bridge.py [--runs 200] [--rounds 5] [--warmup 20]

Cases (f32, one token, state carried): mamba_ssm's ``selective_state_update`` in Mamba-2's heads form
(H=24 P=64 N=128, and a small H=2 P=16 N=16), fla's ``fused_recurrent_gated_delta_rule`` (H=16
K=V=128 and H=2 K=V=16, initial state in, final state out) and ``mamba_chunk_scan_combined`` at one
token (H=24 P=64 N=128, final states out). "torch call" is the rlx_gpu.torch function as a model calls
it, torch tensors in and out (the state updated in place where the anchor does); "raw" is
``Executable.run`` of the very schedule that call compiled (the bridge's cache entry), on the NumPy
arrays the bridge handed it. The overhead is their difference: argument mapping, the autograd
Function, the signature lookup, DLPack in, torch tensors out. Medians in µs of ``--rounds`` blocks of
``--runs`` calls of the calling thread's CPU time, the paths taking turns block by block; the target is 30 µs.
"of it: mapping" is the function's own share (the bridge answered from a recording). One torch thread
(tiny tensors; on a loaded machine more threads only wait for each other). Needs torch and this
repository.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

os.environ.setdefault("RLX_DEVICE", "host")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from rlx_gpu.torch import bridge, fused, fused_recurrent_gated_delta_rule, mamba_chunk_scan_combined  # noqa: E402
from rlx_gpu.torch import selective_state_update  # noqa: E402

TARGET_US = 30.0


def state_update_case(heads: int, head_dim: int, state: int) -> Callable[[], Any]:
    """Mamba-2's decode step as transformers' Mamba2Mixer makes it (per-head values broadcast along P)."""
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(1, heads, head_dim, state, generator=g)
    x = torch.randn(1, heads, head_dim, generator=g)
    dt = torch.randn(1, heads, 1, generator=g).expand(-1, -1, head_dim)
    A = (-torch.rand(heads, generator=g))[:, None, None].expand(-1, head_dim, state)
    D = torch.randn(heads, generator=g)[:, None].expand(-1, head_dim)
    dt_bias = torch.randn(heads, generator=g)[:, None].expand(-1, head_dim)
    B, C = torch.randn(1, 1, state, generator=g), torch.randn(1, 1, state, generator=g)
    return lambda: selective_state_update(pool, x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True)


def gdn_case(heads: int, size: int) -> Callable[[], Any]:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, heads, size, generator=g) for _ in range(3))
    gate, beta = -torch.rand(1, 1, heads, generator=g), torch.rand(1, 1, heads, generator=g)
    h0 = torch.randn(1, heads, size, size, generator=g)
    return lambda: fused_recurrent_gated_delta_rule(q, k, v, gate, beta=beta, initial_state=h0, output_final_state=True)


def ssd_case(heads: int, head_dim: int, state: int) -> Callable[[], Any]:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 1, heads, head_dim, generator=g)
    dt, A, D = torch.randn(1, 1, heads, generator=g), -torch.rand(heads, generator=g), torch.randn(heads, generator=g)
    B, C = torch.randn(1, 1, 1, state, generator=g), torch.randn(1, 1, 1, state, generator=g)
    h0 = torch.randn(1, heads, head_dim, state, generator=g)
    return lambda: mamba_chunk_scan_combined(x, dt, A, B, C, 64, D=D, initial_states=h0, dt_softplus=True,
                                             return_final_states=True)


def raw_call(call: Callable[[], Any]) -> Callable[[], Any]:
    """``Executable.run`` of the schedule ``call`` compiled, on the arrays the bridge gave it."""
    bridge.clear_cache()
    call()
    (exe,) = bridge._cache.values()
    seen: dict[str, Any] = {}
    run = exe.run

    def recording(**arrays: Any) -> Any:
        seen.update(arrays)
        return run(**arrays)

    exe.run = recording
    call()
    exe.run = run
    return lambda: exe.run(**seen)


def mapping_only(call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` with the bridge answered from a recording: what the function itself does per call (mapping the
    anchor's arguments onto the op's, putting the state back), apart from the bridge and the run."""
    recorded: dict[str, Any] = {}
    run_graph = fused.run_graph

    def recording(key: Any, build: Any, inputs: Any, **options: Any) -> Any:
        recorded["outputs"] = run_graph(key, build, inputs, **options)
        return recorded["outputs"]

    fused.run_graph = recording
    call()

    def replay() -> Any:
        fused.run_graph = lambda *args, **options: recorded["outputs"]
        try:
            return call()
        finally:
            fused.run_graph = run_graph
    return replay


def alternate_us(fns: list[Callable[[], Any]], runs: int, rounds: int, warmup: int) -> list[float]:
    """Median CPU µs per call of each function over ``rounds`` blocks of ``runs``, taking turns block by block
    (the calling thread's CPU time: what a call costs, apart from the time other processes hold the CPU)."""
    blocks: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, times in zip(fns, blocks):
            for _ in range(warmup):
                fn()
            start = time.thread_time()
            for _ in range(runs):
                fn()
            times.append((time.thread_time() - start) / runs * 1e6)
    return [statistics.median(times) for times in blocks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = {
        "selective_state_update H=24 P=64 N=128": state_update_case(24, 64, 128),
        "selective_state_update H=2 P=16 N=16": state_update_case(2, 16, 16),
        "fused_recurrent_gated_delta_rule H=16 K=V=128": gdn_case(16, 128),
        "fused_recurrent_gated_delta_rule H=2 K=V=16": gdn_case(2, 16),
        "mamba_chunk_scan_combined L=1 H=24 P=64 N=128": ssd_case(24, 64, 128),
    }
    print(f"{'case (host, B=1, one token)':48} {'torch call':>10} {'raw':>7} {'overhead':>8} {'of it: mapping':>14}"
          f"  target (CPU µs)")
    for name, call in cases.items():
        with torch.no_grad():
            raw, mapping = raw_call(call), mapping_only(call)
            ours, theirs, own = alternate_us([call, raw, mapping], args.runs, args.rounds, args.warmup)
        over = ours - theirs
        verdict = "met" if over <= TARGET_US else "missed"
        print(f"{name:48} {ours:10.1f} {theirs:7.1f} {over:8.1f} {own:14.1f}  {verdict}")


if __name__ == "__main__":
    main()
