"""lstm / gru / rnn, selective_scan and mamba2 forward + backward on an OpenCL device: the backward reading a saved
forward (ABI.md §9.1) against the backward running the forward again, paired.

    python benchmarks/rnn_reserve_device.py [--device opencl:1:0] [--targets cpu gpu] [--ops lstm gru rnn]
                                            [--shape moderate] [--runs 7]
    python benchmarks/rnn_reserve_device.py --ops selective_scan mamba2 [--targets cpu]

Shapes: ``moderate`` is batch 8, seq 128, input = hidden = 128, one layer, one direction; ``target`` issue 36's
training shape (batch 32, seq 128, input = hidden = 256, 2 layers, bidirectional). The state-space ops take their
own shape whatever ``--shape`` says (``SSM_SHAPES``: benchmarks/ssm_device.py's: selective_scan B2 S1024 H256 N16,
mamba2 B2 S1024 H8 P64 N64). f32. A run is the forward thunk
then its backward thunk on one arena resident on the device, with a reserve (the forward writes it, the backward
reads it) or without (the backward recomputes); the two alternate, so that each pair sees the same load, after one
untimed run of each that builds the programs; so do the forward thunks alone (writing the reserve or not) and
the backward thunks alone (reading it, or recomputing).
Printed: the medians, the median of the per-pair ratios, and the load average before and after.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import rlx_gpu  # noqa: E402
from host_fallback.abi import regions  # noqa: E402
from rlx_gpu.conformance import runner  # noqa: E402
from rlx_gpu.conformance.catalog import Case  # noqa: E402
from rlx_gpu.conformance.devices import find, open_device  # noqa: E402
from rlx_gpu.launches.limits import TARGETS  # noqa: E402

SHAPES = {
    "moderate": dict(batch=8, seq=128, input_size=128, hidden=128, num_layers=1, bidirectional=False, carry=False),
    "target": dict(batch=32, seq=128, input_size=256, hidden=256, num_layers=2, bidirectional=True, carry=False),
}
SSM_SHAPES = {"selective_scan": dict(batch=2, seq=1024, hidden=256, state_size=16),
              "mamba2": dict(batch=2, seq=1024, heads=8, head_dim=64, state_size=64)}
OPS = ("lstm", "gru", "rnn", *SSM_SHAPES)


def _thunks(op: str, params: dict) -> tuple[list[dict], list[dict], np.ndarray]:
    """``(with a reserve, without)``, each the forward and backward thunks, and the arena they share (the
    backward's, lengthened by the forward's ``dst``)."""
    need = rlx_gpu.reserve_bytes({"op": op, "dtype": "f32", **params})
    laid = runner.lay_out(Case(f"{op}_backward", "f32", dict(params, reserve=True, reserve_bytes=need)))
    backward = dict(laid.thunk)
    dst = -(-laid.arena.size // 256) * 256
    forward = {k: v for k, v in backward.items() if not k.startswith("d_")}
    forward.update(op=op, dst=dst)
    out = next(r for r in regions(forward) if r.field == "dst")
    arena = np.zeros(out.offset + out.nbytes, np.uint8)
    arena[:laid.arena.size] = laid.arena
    plain = [{k: v for k, v in t.items() if k not in ("reserve", "reserve_bytes")} for t in (forward, backward)]
    return [forward, backward], plain, arena


def _time(session, thunks: list[dict], arena) -> float:
    start = time.perf_counter()
    for thunk in thunks:
        session.launch(thunk, arena)
    session.finish()
    return time.perf_counter() - start


def _pairs(session, saved: list[dict], plain: list[dict], arena, runs: int) -> tuple[float, float, float]:
    """Medians of ``runs`` alternating runs of the thunks ``saved`` and ``plain``, and of their per-pair ratio."""
    pairs = []
    for run in range(runs):
        order = (saved, plain) if run % 2 == 0 else (plain, saved)
        first, second = (_time(session, thunks, arena) for thunks in order)
        pairs.append((first, second) if run % 2 == 0 else (second, first))
    return (statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs),
            statistics.median(p[0] / p[1] for p in pairs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="opencl:1:0")
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--ops", nargs="+", default=["lstm", "gru", "rnn"], choices=OPS)
    parser.add_argument("--shape", default="moderate", choices=list(SHAPES))
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}; {args.device}, {args.shape} {SHAPES[args.shape]}, f32, "
          f"medians of {args.runs} pairs")
    print(f"{'':<13} " + " ".join(f"{part:^29}" for part in ("forward + backward", "forward", "backward")))
    print(f"{'target':<7} {'op':<5} " + " ".join([f"{'reserve':>10} {'recompute':>10} {'ratio':>7}"] * 3)
          + "  backward/forward (reserve, recompute)")
    for target in args.targets:
        session = open_device(find(args.device), target)
        for op in args.ops:
            params = SSM_SHAPES.get(op) or dict(SHAPES[args.shape], **({"relu": False} if op == "rnn" else {}))
            saved, plain, host_arena = _thunks(op, params)
            arena = session.alloc(host_arena.size, "a benchmark arena")
            try:
                session.write(arena, 0, host_arena)
                with np.errstate(all="ignore"):
                    _time(session, saved, arena), _time(session, plain, arena)  # build the programs
                    timed = [_pairs(session, saved[part], plain[part], arena, args.runs)
                             for part in (slice(0, 2), slice(0, 1), slice(1, 2))]
            finally:
                session.free(arena)
            (_, _, _), (fwd_saving, fwd, _), (bwd_reading, bwd, _) = timed
            print(f"{target:<7} {op:<5} " + " ".join(f"{a * 1e3:>8.1f}ms {b * 1e3:>8.1f}ms {r:>7.2f}"
                                                     for a, b, r in timed)
                  + f"  {bwd_reading / fwd:.2f} {bwd / fwd:.2f}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
