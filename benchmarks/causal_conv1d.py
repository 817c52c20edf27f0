"""causal_conv1d's host kernel (host_fallback.conv, conv_backward) against torch, one and two threads, in one run:
the figures issue 35 sets targets for (forward and backward ≤ 1.0x torch's depthwise ``F.conv1d`` path at
B4 S4096 D2048 W4 f32, the decode step ≤ 1.0x ``causal_conv1d_update_ref``).

    python benchmarks/causal_conv1d.py [--threads 1,2] [--runs 3] [--rounds 3] [--warmup 1] [--quick] [--split]

Cases (f32, bias, silu):

- forward B4 S4096 D2048 W4: torch as Dao-AILab's ``causal_conv1d_ref`` computes it, on its own layout
  ``(batch, dim, seqlen)`` (``F.conv1d`` depthwise, padded by width-1, the first ``seqlen`` outputs, ``F.silu``),
  against the host core on the ABI's token-major ``[B, S, D]``; each side allocates its output;
- backward, the same shape: torch's autograd backward of that forward (``torch.autograd.grad`` of x, weight and
  bias, the forward's graph kept), against the host backward (which recomputes the pre-activation);
- decode steps B1 D2048 W4 and B16 D4096 W4: ``causal_conv1d_update_ref``'s step written here in torch ops
  (the state and the token concatenated, the state shifted in place, one depthwise convolution, silu) on a
  ``(batch, dim, width-1)`` state, against the host's decode step straight on its ``[B, D, W-1]`` pool (one
  compiled call where Numba is installed; ``RLX_HOST_JIT=0`` times NumPy's step). The host's ``workers`` caps its
  decode threads: a step below ``conv.DECODE_SPLIT_WORK`` runs on one.

Before timing, each case checks that the sides agree (max |diff| of the outputs, the gradients, the state).
Then the two sides take turns, a block of ``--warmup`` untimed and ``--runs`` timed calls each, over ``--rounds``
rounds; medians in ms (decode: µs), at each thread count (``torch.set_num_threads``; the host's ``workers``).
A warning follows when other processes used the CPUs meanwhile. ``--split`` times only the host's decode step on
two workers against one (``split``). Needs torch and this repository.
"""
from __future__ import annotations

import os

for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):  # before NumPy and torch start their pools
    os.environ.setdefault(_variable, "2")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Callable  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# benchmarks/rnn.py: the CPU header, the load check and the turn-taking timer
from rnn import alternate_ms, cpu_line, cpu_ticks, warn_if_shared  # noqa: E402

from host_fallback import conv  # noqa: E402
from host_fallback.conv_backward import causal_conv1d_backward  # noqa: E402

TARGET = 1.0


@dataclass
class Pair:
    """One case at one thread count: torch's call and the host's, and how far their results differ."""

    name: str
    unit: str  # "ms" or "µs"
    torch_call: Callable[[], object]
    host_call: Callable[[int], object]  # takes the thread count
    diff: float


def conv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Dao-AILab's ``causal_conv1d_ref`` with silu: ``x (batch, dim, seqlen)``."""
    width, seqlen = weight.shape[1], x.shape[-1]
    return F.silu(F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=x.shape[1])[..., :seqlen])


def update_ref(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Dao-AILab's ``causal_conv1d_update_ref`` with silu, no ring buffer: ``x (batch, dim)``, ``conv_state
    (batch, dim, width-1)`` shifted in place."""
    extended = torch.cat([conv_state, x.unsqueeze(-1)], dim=-1)
    conv_state.copy_(extended[:, :, 1:])
    return F.silu(F.conv1d(extended, weight.unsqueeze(1), bias, groups=x.shape[1])[:, :, -1])


def _data(batch: int, seq: int, dim: int, width: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, dim, seq, generator=g)
    return x, torch.randn(dim, width, generator=g) * 0.5, torch.randn(dim, generator=g)


def forward_pairs(batch: int, seq: int, dim: int, width: int) -> list[Pair]:
    x, weight, bias = _data(batch, seq, dim, width)
    x_tok = np.ascontiguousarray(x.numpy().transpose(0, 2, 1))  # [B, S, D]
    w, b = weight.numpy(), bias.numpy()
    host = lambda threads: conv.causal_conv1d(x_tok, w, b, "silu", workers=threads)  # noqa: E731
    diff = float(np.abs(host(1) - conv_ref(x, weight, bias).numpy().transpose(0, 2, 1)).max())
    name = f"forward B{batch} S{seq} D{dim} W{width}"
    return [Pair(name, "ms", lambda: conv_ref(x, weight, bias), host, diff)]


def backward_pairs(batch: int, seq: int, dim: int, width: int) -> list[Pair]:
    x, weight, bias = (t.requires_grad_() for t in _data(batch, seq, dim, width))
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    y = conv_ref(x, weight, bias)
    torch_call = lambda: torch.autograd.grad(y, (x, weight, bias), dy, retain_graph=True)  # noqa: E731
    x_tok = np.ascontiguousarray(x.detach().numpy().transpose(0, 2, 1))
    dy_tok = np.ascontiguousarray(dy.numpy().transpose(0, 2, 1))
    w, b = weight.detach().numpy(), bias.detach().numpy()
    host = lambda threads: causal_conv1d_backward(x_tok, w, dy_tok, b, "silu", workers=threads)  # noqa: E731
    d_x, d_w, d_b = host(1)
    t_x, t_w, t_b = (g.numpy() for g in torch_call())
    diff = max(float(np.abs(d_x - t_x.transpose(0, 2, 1)).max()), float(np.abs(d_w - t_w).max() / np.abs(t_w).max()),
               float(np.abs(d_b - t_b).max() / np.abs(t_b).max()))
    return [Pair(f"backward B{batch} S{seq} D{dim} W{width}", "ms", torch_call, host, diff)]


def decode_pairs(batch: int, dim: int, width: int, pool: int = 8) -> list[Pair]:
    """``pool`` tokens drawn per case; step i takes token i % pool, the state carried from step to step."""
    x, weight, bias = _data(batch, pool, dim, width, seed=2)
    state = torch.randn(batch, dim, width - 1, generator=torch.Generator().manual_seed(3))
    tokens = [x[:, :, i].contiguous() for i in range(pool)]
    host_tokens = [np.ascontiguousarray(t.numpy()[:, None, :]) for t in tokens]
    w, b = weight.numpy(), bias.numpy()
    torch_state, host_state = state.clone(), state.numpy().copy()
    steps = {"torch": 0, "host": 0}

    def torch_call():
        steps["torch"] += 1
        return update_ref(tokens[steps["torch"] % pool], torch_state, weight, bias)

    def host_call(threads: int):
        steps["host"] += 1
        return conv.causal_conv1d(host_tokens[steps["host"] % pool], w, b, "silu", host_state, workers=threads)

    outs = [(torch_call().numpy(), host_call(1)[:, 0]) for _ in range(pool + 1)]
    diff = max(max(float(np.abs(t - h).max()) for t, h in outs), float(np.abs(torch_state.numpy() - host_state).max()))
    return [Pair(f"decode step B{batch} D{dim} W{width}", "µs", torch_call, host_call, diff)]


def run(args: argparse.Namespace) -> list[str]:
    if args.quick:
        pairs = forward_pairs(1, 64, 32, 4) + backward_pairs(1, 64, 32, 4) + decode_pairs(1, 32, 4)
    else:
        pairs = (forward_pairs(4, 4096, 2048, 4) + backward_pairs(4, 4096, 2048, 4) + decode_pairs(1, 2048, 4)
                 + decode_pairs(16, 4096, 4))
    lines = [cpu_line(), f"{'case':<34} {'threads':>7} {'torch':>10} {'host':>10}  host/torch (≤ {TARGET:.1f}x)  "
             f"max |diff|"]
    for threads in args.threads:
        torch.set_num_threads(threads)
        for pair in pairs:
            decode = pair.unit == "µs"
            runs = args.runs * (200 if decode else 1)
            print(f"  timing {pair.name} on {threads} thread(s)", file=sys.stderr, flush=True)
            t_ms, h_ms = alternate_ms([pair.torch_call, lambda: pair.host_call(threads)], runs, args.warmup * (
                20 if decode else 1), args.rounds)
            scale = 1e3 if decode else 1.0
            ratio = h_ms / t_ms
            lines.append(f"{pair.name:<34} {threads:>7} {t_ms * scale:>8.1f}{pair.unit:<2} {h_ms * scale:>8.1f}"
                         f"{pair.unit:<2}  {ratio:>6.2f}x {'✓' if ratio <= TARGET else '✗'}{'':>12}{pair.diff:.1e}")
    return lines


def split(args: argparse.Namespace) -> list[str]:
    """``--split``: the host's decode step (W4 D4096, silu) on two workers against one, forced past
    ``conv.DECODE_SPLIT_WORK``, compiled and NumPy's (``RLX_HOST_JIT``) in turns: where its thresholds belong."""
    batches = (1, 2) if args.quick else (16, 32, 64, 128, 256)
    lines = [cpu_line(), f"{'decode step, two workers against one':<38} {'work':>5} {'path':>9} {'1 worker':>10} "
             f"{'2 workers':>10}  2/1"]
    thresholds, before = conv.DECODE_SPLIT_WORK, os.environ.get("RLX_HOST_JIT")
    conv.DECODE_SPLIT_WORK = dict.fromkeys(thresholds, 0)
    try:
        for batch in batches:
            dim = 32 if args.quick else 4096
            x, weight, bias = (t.numpy() for t in _data(batch, 1, dim, 4, seed=2))
            tokens, pool = np.ascontiguousarray(x.transpose(0, 2, 1)), np.zeros((batch, dim, 3), np.float32)
            step = lambda workers: conv.causal_conv1d(tokens, weight, bias, "silu", pool, workers=workers)  # noqa: E731
            for path, env in (("compiled", "1"), ("numpy", "0")):
                use = lambda env=env: os.environ.__setitem__("RLX_HOST_JIT", env)  # noqa: E731
                one, two = alternate_ms([lambda: step(1), lambda: step(2)], args.runs * max(1, 400 // batch),
                                        args.warmup * 5, args.rounds, setups=[use, use])
                lines.append(f"{f'B{batch} D{dim} W4':<38} 2^{np.log2(batch * dim * 4):<3.0f} {path:>9} "
                             f"{one * 1e3:>8.1f}µs {two * 1e3:>8.1f}µs  {two / one:.2f}x")
    finally:
        conv.DECODE_SPLIT_WORK = thresholds
        if before is None:
            os.environ.pop("RLX_HOST_JIT")
        else:
            os.environ["RLX_HOST_JIT"] = before
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--threads", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="tiny shapes: that the script runs, not figures")
    parser.add_argument("--split", action="store_true", help="only the decode step on two workers against one")
    args = parser.parse_args(argv)
    start, t0 = cpu_ticks(), time.perf_counter()
    for line in (split if args.split else run)(args):
        print(line)
    warn_if_shared(start, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
