"""gated_delta_net on an OpenCL device: version-2 forms against version 1, decode steps, varlen batches.

    PYTHONPATH=. python benchmarks/gdn_device.py [--target cpu|gpu] [--repeat N] [--rounds R] [--device opencl:P:D]
    PYTHONPATH=<other checkout> python benchmarks/gdn_device.py --v1   # version-1 rows only: a before/after run

Pairs printed side by side, f32, times per call (median of ``--repeat`` calls, then the median of
``--rounds`` rounds that alternate the two sides), the arena on the device, planning and compilation
excluded:
- decode steps with a carried state (B1 and B32, H=16, K=V=128) in the version-1 form against the
  same step through state slots with q/k L2-norm (the GDN_V2 program variant);
- a varlen batch of four sequences of mixed lengths (T tokens) against an equal-length batch of the
  same T tokens (the target: packed <= 1.1x).
``--training`` prints the training rows instead (B2 S1024 H8 K=V=64, per-head gates): the forward, the
forward writing a saved forward (ABI.md §9.1 ``reserve``), the backward recomputing its forward and the
backward reading the reserve, taking turns, each over the plain forward (issue 36's target: the backward
<= 4x its forward at the cpu target); ``--per-channel`` the same with per-channel gates, and a last row: the
backward reading the reserve by the step walk (``ssm_kernel="lanes"``, the path before the chunked form took
per-channel gates), so that one run pairs before and after.
``--v1`` prints the version-1 rows alone (prefill and decode of benchmarks/backends.py, the decode
steps above), so that two checkouts can be timed in alternating processes. ``--target gpu`` forces the
gpu-target kernels (lanes and chunked forms) on PoCL.
"""
from __future__ import annotations

import argparse

import numpy as np

from benchmarks.backends import median_time
import host_fallback
import rlx_gpu
from host_fallback.abi import forward_thunk, regions
from host_fallback.arena import STORAGE
from rlx_gpu.conformance import cases
from rlx_gpu.conformance.devices import find, open_device

DECODE = dict(seq=1, heads=16, state_size=128, gate_per_channel=False, carry_state=True)
PACKED_LENGTHS = (1500, 530, 1800, 266)  # no multiples of a chunk
PREFILL = dict(heads=8, state_size=64, gate_per_channel=False, carry_state=False)


def v1_rows() -> list[tuple[str, dict]]:
    return [
        ("prefill B2 S1024 H8 N64", dict(PREFILL, batch=2, seq=1024)),
        ("prefill per-ch B2 S1024", dict(PREFILL, batch=2, seq=1024, gate_per_channel=True)),
        ("decode B8 H8 N64", dict(PREFILL, batch=8, seq=1, carry_state=True)),
        ("decode B1 H16 K=V=128", dict(DECODE, batch=1)),
        ("decode B32 H16 K=V=128", dict(DECODE, batch=32)),
    ]


def pairs() -> list[tuple[str, dict, dict]]:
    """(label, version-1 or equal-length params, version-2 params)."""
    out = []
    for b in (1, 32):
        slotted = dict(DECODE, batch=b, state_slots=list(range(b))[::-1], num_slots=b, qk_l2norm=True)
        out.append((f"decode B{b} v1 | slots+norm", dict(DECODE, batch=b), slotted))
    total = sum(PACKED_LENGTHS)
    cu = list(np.cumsum((0,) + PACKED_LENGTHS))
    out.append((f"T={total}: B4x{total // 4} | varlen", dict(PREFILL, batch=4, seq=total // 4),
                dict(PREFILL, batch=1, seq=total, cu_seqlens=[int(c) for c in cu])))
    return out


def lay_out(params: dict, rng: np.random.Generator, op: str = "gated_delta_net") -> tuple[dict, np.ndarray]:
    """An ``op`` thunk of ``params`` in an arena of random inputs (decays below 1) and its int tensors."""
    thunk, nbytes = cases.lay_out(op, "f32", dict(params))
    ints = cases.int_values(dict(params))
    arena = np.zeros(nbytes, np.uint8)
    for r in regions(thunk):
        if r.dtype == "i32":
            values = np.asarray(ints[r.field], STORAGE["i32"])
        elif r.reads:
            values = rng.standard_normal(r.shape) * 0.3
            values = (-np.abs(values) if r.field == "g" else values).astype(STORAGE[r.dtype])
        else:
            continue
        arena[r.offset: r.offset + r.nbytes] = values.reshape(-1).view(np.uint8)
    return thunk, arena


def timer(session, params: dict, rng: np.random.Generator, repeat: int, laid: tuple[dict, np.ndarray] | None = None,
          **options):
    """A function giving the median time of ``repeat`` runs of ``params`` (planned once, warmed up), or of the
    thunk and arena ``laid``; ``options``: run options (``ssm_kernel``)."""
    thunk, arena = laid or lay_out(params, rng)
    dev = session.upload(arena)
    run = session.runner(thunk, _options(**options))

    def once():
        run(dev)
        session.finish()

    once()
    return lambda: median_time(once, repeat)


def training_rows(params: dict, rng: np.random.Generator) -> list[tuple[str, dict, np.ndarray]]:
    """(label, thunk, arena): the forward, the forward writing a reserve, the backward without and with one, on
    one arena (the backward's, its reserve of ``rlx_gpu.reserve_bytes`` and the forward's dst past it; the
    backward reading the reserve the host's forward wrote there: random bytes would be subnormal floats, which
    cost a CPU up to a hundred times a normal one)."""
    need = rlx_gpu.reserve_bytes({"op": "gated_delta_net", "dtype": "f32", **params})
    backward, arena = lay_out(dict(params, reserve=True, reserve_bytes=need), rng, "gated_delta_net_backward")
    writing = dict(forward_thunk(backward), dst=-(-arena.size // 256) * 256)
    dst = next(r for r in regions(writing) if r.field == "dst")
    arena = np.concatenate([arena, np.zeros(dst.offset + dst.nbytes - arena.size, np.uint8)])
    host_fallback.execute(writing, arena)
    plain = {k: v for k, v in writing.items() if k not in ("reserve", "reserve_bytes")}
    recompute = {k: v for k, v in backward.items() if k not in ("reserve", "reserve_bytes")}
    return [("forward", plain, arena), ("forward writing a reserve", writing, arena),
            ("backward recomputing", recompute, arena), ("backward reading the reserve", backward, arena)]


def print_training(session, rng: np.random.Generator, repeat: int, rounds: int, per_channel: bool) -> None:
    """The training rows (``per_channel`` gates: and the step walk's backward from the reserve), taking turns in
    every round; medians, each over the plain forward."""
    rows = training_rows(dict(PREFILL, batch=2, seq=1024, gate_per_channel=per_channel), rng)
    times = [timer(session, {}, rng, repeat, (thunk, arena)) for _, thunk, arena in rows]
    labels = [label for label, _, _ in rows]
    if per_channel:
        times.append(timer(session, {}, rng, repeat, rows[-1][1:], ssm_kernel="lanes"))
        labels.append("backward (reserve), the step walk")
    runs = [[time() for time in times] for _ in range(rounds)]
    medians = [float(np.median([r[i] for r in runs])) for i in range(len(times))]
    gates = "per-channel" if per_channel else "per-head"
    print(f"{'training B2 S1024 H8 K=V=64 ' + gates:<34} {'ms':>9} {'/ forward':>10}")
    for label, ms in zip(labels, medians):
        print(f"{label:<34} {ms * 1e3:>9.3f} {ms / medians[0]:>10.2f}")


def _options(**options):
    from rlx_gpu.runtime.options import RunOptions

    return RunOptions.build(**options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default=None)
    parser.add_argument("--v1", action="store_true", help="the version-1 rows only")
    parser.add_argument("--only", default="", help="the rows whose label holds this text")
    parser.add_argument("--training", action="store_true", help="the forward and backward, with and without reserve")
    parser.add_argument("--per-channel", action="store_true", help="--training with per-channel gates")
    args = parser.parse_args()
    session = open_device(find(args.device or "opencl"), args.target)
    rng = np.random.default_rng(0)
    print(f"device: {session.info.name} ({session.info.spec}); target {args.target}; f32; "
          f"median of {args.rounds} rounds of medians of {args.repeat}")
    if args.training:
        print_training(session, rng, args.repeat, args.rounds, args.per_channel)
        return
    if args.v1:
        print(f"{'version 1':<28} {'ms':>9}")
        for label, params in (row for row in v1_rows() if args.only in row[0]):
            time = timer(session, params, rng, args.repeat)
            print(f"{label:<28} {np.median([time() for _ in range(args.rounds)]) * 1e3:>9.3f}")
        return
    print(f"{'pair':<34} {'left ms':>9} {'right ms':>9} {'right/left':>11}")
    for label, left, right in (row for row in pairs() if args.only in row[0]):
        times = (timer(session, left, rng, args.repeat), timer(session, right, rng, args.repeat))
        rounds = [(times[0](), times[1]()) for _ in range(args.rounds)]
        a, b = (float(np.median([r[i] for r in rounds])) for i in (0, 1))
        print(f"{label:<34} {a * 1e3:>9.3f} {b * 1e3:>9.3f} {b / a:>11.2f}")


if __name__ == "__main__":
    main()
