"""Serving a Mamba-2 layer: three prompts of different lengths prefilled in one packed thunk into
slots of a state pool, then decode steps of all three in one thunk per step through the same slots,
checked against running each prompt alone.

    python configs/examples/serve_mamba2.py [--device host|opencl|cuda] [--steps 4]

The prefill is one ``mamba2`` thunk over the three prompts back to back (``cu_seqlens``), each
sequence starting from its own entry of the pool (``state_slots``) and leaving its final state there;
a decode step is the same thunk with one token per prompt (``cu_seqlens = [0, 1, 2, 3]``). The pool
has more entries than prompts: the ones no prompt names are left as they were. The pool is a graph
input and output here so the check can compare it; a server keeps it in a resident arena.
"""
from __future__ import annotations

import argparse

import numpy as np

import rlx_gpu

HEADS, HEAD_DIM, STATE, GROUPS, POOL = 4, 8, 16, 2, 6
PROMPTS = (7, 19, 2)  # tokens per prompt
SLOTS = (4, 0, 2)     # the pool entry of each prompt


def layer(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The layer's parameters, as mamba_ssm keeps them (A, D and the dt bias in f32)."""
    return {"A": -np.exp(rng.uniform(-1.0, 0.5, HEADS)), "D": rng.standard_normal(HEADS),
            "dt_bias": rng.uniform(-2.0, -0.5, HEADS)}


def tokens(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """The per-token inputs of ``n`` tokens in one packed row: x, z, dt, B, C."""
    return {"x": rng.standard_normal((1, n, HEADS, HEAD_DIM)), "z": rng.standard_normal((1, n, HEADS, HEAD_DIM)),
            "dt": rng.standard_normal((1, n, HEADS)), "b": rng.standard_normal((1, n, GROUPS, STATE)),
            "c": rng.standard_normal((1, n, GROUPS, STATE))}


def compiled(params: dict[str, np.ndarray], lengths: tuple[int, ...], rows: int, device: str) -> rlx_gpu.Graph:
    """One mamba2 thunk over ``lengths`` packed tokens, starting from ``rows`` entries of an f32 pool
    named by ``slots`` (or, without slots, from a state per sequence)."""
    n = sum(lengths)
    g = rlx_gpu.Graph(dtype="f32")
    x, z = g.input("x", (1, n, HEADS, HEAD_DIM)), g.input("z", (1, n, HEADS, HEAD_DIM))
    dt, b, c = g.input("dt", (1, n, HEADS)), g.input("b", (1, n, GROUPS, STATE)), g.input("c", (1, n, GROUPS, STATE))
    pool = g.input("pool", (rows, HEADS, HEAD_DIM, STATE))
    slots = g.input("slots", (len(lengths),), "i32") if rows != len(lengths) else None
    y, _ = g.mamba2(x, dt, params["A"], b, c, D=params["D"], z=z, dt_bias=params["dt_bias"], dt_softplus=True,
                    dt_limit=(0.0, float("inf")), initial_state=pool, state_slots=slots,
                    cu_seqlens=np.cumsum([0, *lengths]), name="ssd")
    g.output("y", y)
    return g.compile(device)


def serve(device: str, steps: int, seed: int = 0) -> dict[str, float]:
    """Prefill and ``steps`` decode steps through the pool on ``device``, then each prompt alone on the
    same device; returns the largest differences (outputs, final states, untouched pool entries)."""
    rng = np.random.default_rng(seed)
    params = layer(rng)
    prompt = [tokens(rng, n) for n in PROMPTS]
    decode = [[tokens(rng, 1) for _ in PROMPTS] for _ in range(steps)]
    pool = (rng.standard_normal((POOL, HEADS, HEAD_DIM, STATE)) * 0.1).astype(np.float32)  # earlier requests left it
    slots = np.array(SLOTS, np.int32)

    prefill = compiled(params, PROMPTS, POOL, device)
    packed = {k: np.concatenate([p[k] for p in prompt], axis=1) for k in prompt[0]}
    out = prefill.run(**packed, pool=pool, slots=slots)
    served_y = [np.split(out["y"], np.cumsum(PROMPTS)[:-1], axis=1)]
    served_pool = out["ssd.state"]
    step = compiled(params, (1,) * len(PROMPTS), POOL, device)
    for tokens_now in decode:
        batch = {k: np.concatenate([t[k] for t in tokens_now], axis=1) for k in tokens_now[0]}
        out = step.run(**batch, pool=served_pool, slots=slots)
        served_y.append(np.split(out["y"], len(PROMPTS), axis=1))
        served_pool = out["ssd.state"]

    worst = {"outputs": 0.0, "states": 0.0, "untouched": 0.0}
    for i, n in enumerate(PROMPTS):  # each prompt alone: its own prefill, then its own decode steps
        state = pool[SLOTS[i]][None]
        alone = compiled(params, (n,), 1, device).run(**prompt[i], pool=state)
        ys, state = [alone["y"]], alone["ssd.state"]
        one = compiled(params, (1,), 1, device)
        for tokens_now in decode:
            alone = one.run(**tokens_now[i], pool=state)
            ys.append(alone["y"])
            state = alone["ssd.state"]
        served = [served_y[0][i]] + [served_y[k][i] for k in range(1, steps + 1)]
        worst["outputs"] = max(worst["outputs"], max(float(np.abs(a - b).max()) for a, b in zip(served, ys)))
        worst["states"] = max(worst["states"], float(np.abs(served_pool[SLOTS[i]] - state[0]).max()))
    others = [e for e in range(POOL) if e not in SLOTS]
    worst["untouched"] = float(np.abs(served_pool[others] - pool[others]).max())
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("``", ""))  # the first paragraph
    ap.add_argument("--device", default=None, help="host, opencl[:p[:d]], cuda[:n] (default: RLX_DEVICE / config)")
    ap.add_argument("--steps", type=int, default=4, help="decode steps after the prefill")
    args = ap.parse_args()
    worst = serve(args.device, args.steps)
    print(f"prompts of {', '.join(map(str, PROMPTS))} tokens in slots {', '.join(map(str, SLOTS))} of a pool of {POOL}, "
          f"prefill + {args.steps} decode steps, against each prompt alone:")
    print(f"  max |diff| outputs {worst['outputs']:.2e}, final states {worst['states']:.2e}, "
          f"entries no prompt names {worst['untouched']:.1e}")
    if max(worst.values()) > 1e-4 or worst["untouched"] != 0.0:
        raise SystemExit("the served prompts differ from the prompts run alone")


if __name__ == "__main__":
    main()
