"""Serving a Mamba-2 layer's sequence mixing (its short convolution, then its scan): three prompts of
different lengths prefilled in one packed call into slots of two state pools, then decode steps of all
three in one call per step through the same slots, checked against running each prompt alone.

    python configs/examples/serve_mamba2.py [--device host|opencl|cuda] [--steps 4]

The prefill is one schedule over the three prompts back to back (``cu_seqlens``): a ``causal_conv1d``
thunk (silu) over the layer's ``xBC`` channels, the views of its output as ``x``, ``B`` and ``C`` (strided
copies), and a ``mamba2`` thunk; each sequence starts from its own entry of both pools (the same
``state_slots``: the convolution's last ``width-1`` inputs beside the scan's state) and leaves its final
states there. A decode step is the same schedule with one token per prompt (``cu_seqlens = [0, 1, 2, 3]``):
no torch or NumPy operation between the convolution and the scan. The pools have more entries than prompts:
the ones no prompt names are left as they were. The pools are graph inputs and outputs here so the check
can compare them; a server keeps them in a resident arena.
"""
from __future__ import annotations

import argparse

import numpy as np

import rlx_gpu

HEADS, HEAD_DIM, STATE, GROUPS, POOL = 4, 8, 16, 2, 6
WIDTH = 4  # the convolution's
CONV_DIM = HEADS * HEAD_DIM + 2 * GROUPS * STATE  # its channels: x, then B, then C (Mamba-2's xBC)
PROMPTS = (7, 19, 2)  # tokens per prompt
SLOTS = (4, 0, 2)     # the pool entry of each prompt


def layer(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The layer's parameters, as mamba_ssm keeps them (A, D and the dt bias in f32) and its convolution's."""
    return {"A": -np.exp(rng.uniform(-1.0, 0.5, HEADS)), "D": rng.standard_normal(HEADS),
            "dt_bias": rng.uniform(-2.0, -0.5, HEADS), "conv_weight": rng.standard_normal((CONV_DIM, WIDTH)) * 0.5,
            "conv_bias": rng.standard_normal(CONV_DIM) * 0.1}


def tokens(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """The per-token inputs of ``n`` tokens in one packed row (the in-projection's outputs): xbc, z, dt."""
    return {"xbc": rng.standard_normal((1, n, CONV_DIM)), "z": rng.standard_normal((1, n, HEADS, HEAD_DIM)),
            "dt": rng.standard_normal((1, n, HEADS))}


def split(g: rlx_gpu.Graph, xbc: rlx_gpu.Tensor, n: int) -> tuple[rlx_gpu.Tensor, ...]:
    """``x [1,n,H,P]``, ``B`` and ``C [1,n,G,N]``: the convolved ``xbc [1,n,CONV_DIM]``'s channels, in order."""
    x = g.strided_copy(xbc, (1, n, HEADS, HEAD_DIM), (0, CONV_DIM, HEAD_DIM, 1))
    b, c = (g.strided_copy(xbc, (1, n, GROUPS, STATE), (0, CONV_DIM, STATE, 1), HEADS * HEAD_DIM + i * GROUPS * STATE)
            for i in (0, 1))
    return x, b, c


def compiled(params: dict[str, np.ndarray], lengths: tuple[int, ...], rows: int, device: str) -> rlx_gpu.Graph:
    """The convolution and the mamba2 thunk over ``lengths`` packed tokens, starting from ``rows`` entries of
    the f32 pools (``conv_pool``, ``pool``) named by ``slots`` (or, without slots, from states per sequence)."""
    n = sum(lengths)
    g = rlx_gpu.Graph(dtype="f32")
    xbc, z, dt = g.input("xbc", (1, n, CONV_DIM)), g.input("z", (1, n, HEADS, HEAD_DIM)), g.input("dt", (1, n, HEADS))
    conv_pool, pool = g.input("conv_pool", (rows, CONV_DIM, WIDTH - 1)), g.input("pool", (rows, HEADS, HEAD_DIM, STATE))
    slots = g.input("slots", (len(lengths),), "i32") if rows != len(lengths) else None
    cu_seqlens = np.cumsum([0, *lengths])
    xbc, _ = g.causal_conv1d(xbc, params["conv_weight"], bias=params["conv_bias"], activation="silu",
                             initial_state=conv_pool, state_slots=slots, cu_seqlens=cu_seqlens, name="conv")
    x, b, c = split(g, xbc, n)
    y, _ = g.mamba2(x, dt, params["A"], b, c, D=params["D"], z=z, dt_bias=params["dt_bias"], dt_softplus=True,
                    dt_limit=(0.0, float("inf")), initial_state=pool, state_slots=slots, cu_seqlens=cu_seqlens,
                    name="ssd")
    g.output("y", y)
    return g.compile(device)


def serve(device: str, steps: int, seed: int = 0) -> dict[str, float]:
    """Prefill and ``steps`` decode steps through the pools on ``device``, then each prompt alone on the
    same device; returns the largest differences (outputs, final states of both pools, untouched entries)."""
    rng = np.random.default_rng(seed)
    params = layer(rng)
    prompt = [tokens(rng, n) for n in PROMPTS]
    decode = [[tokens(rng, 1) for _ in PROMPTS] for _ in range(steps)]
    # what earlier requests left in the pools
    pools = {"pool": (rng.standard_normal((POOL, HEADS, HEAD_DIM, STATE)) * 0.1).astype(np.float32),
             "conv_pool": rng.standard_normal((POOL, CONV_DIM, WIDTH - 1)).astype(np.float32)}
    slots = np.array(SLOTS, np.int32)

    def states(out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"pool": out["ssd.state"], "conv_pool": out["conv.state"]}

    prefill = compiled(params, PROMPTS, POOL, device)
    packed = {k: np.concatenate([p[k] for p in prompt], axis=1) for k in prompt[0]}
    out = prefill.run(**packed, **pools, slots=slots)
    served_y = [np.split(out["y"], np.cumsum(PROMPTS)[:-1], axis=1)]
    served = states(out)
    step = compiled(params, (1,) * len(PROMPTS), POOL, device)
    for tokens_now in decode:
        batch = {k: np.concatenate([t[k] for t in tokens_now], axis=1) for k in tokens_now[0]}
        out = step.run(**batch, **served, slots=slots)
        served_y.append(np.split(out["y"], len(PROMPTS), axis=1))
        served = states(out)

    worst = {"outputs": 0.0, "states": 0.0, "untouched": 0.0}
    one = compiled(params, (1,), 1, device)
    for i, n in enumerate(PROMPTS):  # each prompt alone: its own prefill, then its own decode steps
        alone = compiled(params, (n,), 1, device).run(**prompt[i], **{k: v[SLOTS[i]][None] for k, v in pools.items()})
        ys, state = [alone["y"]], states(alone)
        for tokens_now in decode:
            alone = one.run(**tokens_now[i], **state)
            ys.append(alone["y"])
            state = states(alone)
        mine = [served_y[k][i] for k in range(steps + 1)]
        worst["outputs"] = max(worst["outputs"], max(float(np.abs(a - b).max()) for a, b in zip(mine, ys)))
        worst["states"] = max(worst["states"], *(float(np.abs(served[k][SLOTS[i]] - state[k][0]).max()) for k in pools))
    others = [e for e in range(POOL) if e not in SLOTS]
    worst["untouched"] = max(float(np.abs(served[k][others] - pools[k][others]).max()) for k in pools)
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("``", ""))  # the first paragraph
    ap.add_argument("--device", default=None, help="host, opencl[:p[:d]], cuda[:n] (default: RLX_DEVICE / config)")
    ap.add_argument("--steps", type=int, default=4, help="decode steps after the prefill")
    args = ap.parse_args()
    worst = serve(args.device, args.steps)
    print(f"prompts of {', '.join(map(str, PROMPTS))} tokens in slots {', '.join(map(str, SLOTS))} of pools of {POOL}, "
          f"prefill + {args.steps} decode steps, against each prompt alone:")
    print(f"  max |diff| outputs {worst['outputs']:.2e}, final states (conv and scan) {worst['states']:.2e}, "
          f"entries no prompt names {worst['untouched']:.1e}")
    if max(worst.values()) > 1e-4 or worst["untouched"] != 0.0:
        raise SystemExit("the served prompts differ from the prompts run alone")


if __name__ == "__main__":
    main()
