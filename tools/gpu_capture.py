"""The capture section of tools/gpu_check.py: one decode step of each op family in a ``torch.cuda.CUDAGraph``.

``rlx_gpu.torch`` calls on CUDA tensors run on torch's current stream, device to device and without
waiting (``CallPlan.on_stream``), so a decode step can be captured as torch's own ops are: warmed up
eagerly on a side stream, captured once, replayed. For each step — ``selective_state_update`` in the
Mamba-2 form (its state updated in place), ``fused_recurrent_gated_delta_rule`` with T=1 and a carried
state, one step of ``rlx_gpu.torch.LSTM`` — STEPS replays of the graph are compared with STEPS eager
calls from the same start (max |diff| of the output and of the carried state, which must stay within
a few ulps of the step's own rounding) and timed against them: µs per replay and per eager call.
"""
from __future__ import annotations

import time
from typing import Any, Callable

STEPS = 20  # decode steps compared and timed, replayed and eager
TOLERANCE = 1e-4  # f32: a replay runs the eager call's kernels on the same data, so they agree to rounding


def _mamba2_step(torch, device) -> tuple[Callable[[], Any], list]:
    """mamba_ssm's Mamba-2 decode step (B1 H8 P64 N64): dt, A, D and dt_bias tied along P."""
    from rlx_gpu.torch import selective_state_update

    g = torch.Generator(device=device).manual_seed(0)
    B, H, P, N = 1, 8, 64, 64

    def rand(*shape):
        return torch.randn(*shape, device=device, generator=g)
    state, x = rand(B, H, P, N) * 0.1, rand(B, H, P)
    dt = rand(B, H)[..., None].expand(B, H, P)
    A = (-torch.rand(H, device=device, generator=g))[:, None, None].expand(H, P, N)
    Bm, Cm = rand(B, 1, N), rand(B, 1, N)
    D, dt_bias = rand(H)[:, None].expand(H, P), rand(H)[:, None].expand(H, P)

    def step():
        return selective_state_update(state, x, dt, A, Bm, Cm, D, None, dt_bias, True)
    return step, [state]


def _gdn_step(torch, device):
    """fla's gated delta rule decode (B1 H8 K=V=64, T=1), the state carried by a copy into its buffer."""
    from rlx_gpu.torch import fused_recurrent_gated_delta_rule

    g = torch.Generator(device=device).manual_seed(1)
    B, H, K = 1, 8, 64
    q, k, v = (torch.nn.functional.normalize(torch.randn(B, 1, H, K, device=device, generator=g), dim=-1) for _ in range(3))
    gate = -torch.rand(B, 1, H, device=device, generator=g)
    beta = torch.rand(B, 1, H, device=device, generator=g)
    state = torch.randn(B, H, K, K, device=device, generator=g) * 0.1

    def step():
        o, final = fused_recurrent_gated_delta_rule(q, k, v, gate, beta=beta, initial_state=state,
                                                    output_final_state=True)
        state.copy_(final)
        return o
    return step, [state]


def _lstm_step(torch, device):
    """One step of ``rlx_gpu.torch.LSTM`` (B1 I=H=256), h and c carried by copies into their buffers."""
    import rlx_gpu.torch as rt

    torch.manual_seed(2)
    lstm = rt.LSTM(256, 256, batch_first=True).to(device)
    x = torch.randn(1, 1, 256, device=device)
    h, c = torch.zeros(1, 1, 256, device=device), torch.zeros(1, 1, 256, device=device)

    def step():
        with torch.no_grad():
            y, (h1, c1) = lstm(x, (h, c))
        h.copy_(h1)
        c.copy_(c1)
        return y
    return step, [h, c]


CASES = (("selective_state_update mamba2 B1 H8 P64 N64", _mamba2_step),
         ("fused_recurrent_gated_delta_rule T1 B1 H8 K=V=64", _gdn_step),
         ("rlx_gpu.torch.LSTM one step B1 I=H=256", _lstm_step))


def _compare(torch, make: Callable) -> tuple[float, float, float]:
    """(max |diff| of output and carried state after STEPS replays vs STEPS eager calls, µs per replay,
    µs per eager call)."""
    device = torch.device("cuda", torch.cuda.current_device())
    step, carried = make(torch, device)
    start = [t.clone() for t in carried]

    def reset():
        for t, s in zip(carried, start):
            t.copy_(s)

    def timed(run: Callable[[], object]) -> tuple[object, float]:
        reset()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(STEPS):
            out = run()
        torch.cuda.synchronize()
        return out, (time.perf_counter() - t0) / STEPS * 1e6

    side = torch.cuda.Stream()  # torch's recipe: warm up on a side stream, then capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    eager_out, eager_us = timed(step)
    eager = [eager_out.clone(), *(t.clone() for t in carried)]
    reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    _, replay_us = timed(graph.replay)
    diff = max(float((a.double() - b.double()).abs().max()) for a, b in zip(eager, [static_out, *carried]))
    return diff, replay_us, eager_us


def decode_steps(ck, shared: dict) -> None:
    import torch

    if not torch.cuda.is_available():
        ck.add("capture", "all", "fail", f"torch {torch.__version__} has no CUDA device (built for "
               f"{torch.version.cuda or 'the CPU only'})")
        return
    for label, make in CASES:
        if ck.left() < 20:
            ck.add("capture", label, "fail", "not run: time budget spent")
            continue
        try:
            diff, replay_us, eager_us = _compare(torch, make)
        except Exception as err:  # one op's failure must not hide the others'
            ck.add("capture", label, "fail", f"{type(err).__name__}: {str(err)[:300]}")
            continue
        ck.add("capture", label, "ok" if diff <= TOLERANCE else "fail",
               f"max |diff| {diff:.2e} over {STEPS} steps; {replay_us:.1f} µs per replay, {eager_us:.1f} µs eager "
               f"({eager_us / replay_us:.1f}x)")
