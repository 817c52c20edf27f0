"""Peak extra memory of each host backward op (ABI.md §9) at S = 4096, against its forward's.

    python benchmarks/backward_memory.py [--ops lstm gru ...] [--seq 4096]

For every op, the backward thunk and its forward run once each through ``host_fallback.execute`` on an
arena allocated beforehand; ``tracemalloc`` (which NumPy reports its buffers to) measures the peak of
what each allocates beyond that arena. The forward's peak is its working state (the input projection
of the whole sequence for the recurrences, the chunk states of the state-space ops): the target is a
backward within 2× of it. ``S·state`` is what a backward that kept every step's state would hold, for
scale. Shapes (f32): the recurrences batch 4, input = hidden = 128, 2 layers, bidirectional; the
state-space ops those of ``benchmarks/ssm.py`` (batch 2; selective_scan H=256 N=16, mamba2 H=8 P=64
N=64, gated_delta_net H=8 K=V=64) at the longer sequence. An op the host runs no backward of yet is
listed as such.
"""
from __future__ import annotations

import argparse
import os
import sys
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import host_fallback  # noqa: E402
from host_fallback.abi import ELEM_SIZE, FORWARD_OPS, forward_thunk, regions  # noqa: E402
from host_fallback.arena import STORAGE, view  # noqa: E402
from rlx_gpu.conformance.cases import lay_out  # noqa: E402
from rlx_gpu.units import human_bytes  # noqa: E402

RECURRENT = dict(batch=4, input_size=128, hidden=128, num_layers=2, bidirectional=True, carry=False)
SHAPES = {
    "lstm": RECURRENT, "gru": RECURRENT, "rnn": dict(RECURRENT, relu=False),
    "selective_scan": dict(batch=2, hidden=256, state_size=16),
    "mamba2": dict(batch=2, heads=8, head_dim=64, state_size=64),
    "gated_delta_net": dict(batch=2, heads=8, state_size=64, gate_per_channel=False, carry_state=False),
}

LETTERS = {"batch": "B", "seq": "S", "input_size": "I", "hidden": "H", "num_layers": "L", "heads": "H",
           "head_dim": "P", "state_size": "N"}


def state_elements(op: str, p: dict) -> int:
    """Elements of the state one step of ``op``'s forward carries (every layer and direction)."""
    if op in ("lstm", "gru", "rnn"):
        per_layer = p["batch"] * p["hidden"] * (2 if op == "lstm" else 1)
        return p["num_layers"] * (2 if p["bidirectional"] else 1) * per_layer
    if op == "selective_scan":
        return p["batch"] * p["hidden"] * p["state_size"]
    if op == "mamba2":
        return p["batch"] * p["heads"] * p["head_dim"] * p["state_size"]
    return p["batch"] * p["heads"] * p["state_size"] ** 2


def peak_extra(thunk: dict, arena: np.ndarray) -> int:
    """Peak bytes ``thunk`` allocates while it runs on (a copy of) ``arena``, the copy made beforehand."""
    work = arena.copy()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        host_fallback.execute(thunk, work)
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def measure(op: str, seq: int, rng: np.random.Generator) -> tuple[str, int, int, int] | None:
    """``(shape, forward peak, backward peak, S·state bytes)`` of ``op``, or None without a host backward."""
    if f"{op}_backward" not in host_fallback.KERNELS:
        return None
    params = dict(SHAPES[op], seq=seq)
    thunk, nbytes = lay_out(f"{op}_backward", "f32", params)
    arena = np.zeros(nbytes, np.uint8)
    for r in regions(thunk):
        if r.reads:  # small values: the state-space recurrences stay finite over the long sequence
            view(arena, r.offset, r.dtype, r.shape)[...] = (rng.standard_normal(r.shape) * 0.1).astype(STORAGE[r.dtype])
    shape = " ".join(f"{LETTERS[k]}{v}" for k, v in params.items() if k in LETTERS)
    forward = peak_extra(forward_thunk(thunk), arena)
    backward = peak_extra(thunk, arena)
    return shape, forward, backward, seq * state_elements(op, params) * ELEM_SIZE["f32"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", nargs="+", default=list(FORWARD_OPS), choices=list(FORWARD_OPS))
    parser.add_argument("--seq", type=int, default=4096)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'op':<16} {'shape':<22} {'forward':>10} {'backward':>10} {'bwd/fwd':>8} {'S·state':>10}  <= 2x")
    for op in args.ops:
        found = measure(op, args.seq, rng)
        if found is None:
            print(f"{op:<16} the host runs no {op}_backward yet")
            continue
        shape, forward, backward, every_step = found
        ratio = backward / max(forward, 1)
        print(f"{op:<16} {shape:<22} {human_bytes(forward):>10} {human_bytes(backward):>10} {ratio:>7.2f}x "
              f"{human_bytes(every_step):>10}  {'yes' if ratio <= 2 else 'NO'}")


if __name__ == "__main__":
    main()
