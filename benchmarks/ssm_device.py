"""State-space kernels on an OpenCL device: the gpu target's lanes kernel against its chunked form, and
the cost of the version-2 fields at the device's target.

    PYTHONPATH=. RLX_TARGET=gpu python benchmarks/ssm_device.py [--repeat N] [--device opencl:P:D]
    PYTHONPATH=. [RLX_TARGET=cpu|gpu] python benchmarks/ssm_device.py --fields [--repeat N]

For selective_scan (B=2, H=256, N=16), mamba2 (B=2, H=8, P=64, N=64) and gated_delta_net (B=2, H=4,
N=64, both gate kinds), f32, at growing sequence lengths: the median time of the lanes kernel (one step
per barrier) and of the chunked form, and their ratio; this sets the SSC_MIN_SEQ / M2_MIN_SEQ /
GDN_MIN_SEQ rules of ``launches.limits.TUNING['gpu']``. On
PoCL (a CPU) both run with the gpu target forced, so the figures rank the forms' work and barrier
counts, not a GPU's latency hiding. Times exclude compilation and transfers.

``--fields`` (ABI.md §8) times selective_scan (B=2, S=1024, H=256, N=16) and mamba2 (B=2, S=1024, H=8,
P=64, N=64), f32, at the device's target: the plain op; the op with the fused knobs (d, z, the
delta / dt bias and softplus), against the plain op; and a varlen batch of sequences of mixed lengths
(``MIXED``) packed into the same 2048 tokens, against the equal-length batch of two.
"""
from __future__ import annotations

import argparse

import numpy as np

from benchmarks.backends import lay_out, median_time, open_opencl, warm_launcher, with_device_arguments

SEQS = (1, 16, 32, 64, 128, 256, 1024)
#: the packed sequences of ``--fields``: 2048 tokens, as the plain batch of two sequences of 1024
MIXED = (700, 512, 400, 300, 136)


def thunks(seq: int) -> list[tuple[str, dict]]:
    return [
        ("selective_scan", dict(op="selective_scan", batch=2, seq=seq, hidden=256, state_size=16,
                                x=0, delta=0, a=0, b=0, c=0, dst=0)),
        ("mamba2", dict(op="mamba2", batch=2, seq=seq, heads=8, head_dim=64, state_size=64,
                        x=0, dt=0, a=0, b=0, c=0, dst=0)),
        *[(f"gdn {'channel' if pc else 'head'}", dict(op="gated_delta_net", batch=2, seq=seq, heads=4, state_size=64,
                                                      gate_per_channel=pc, carry_state=True, q=0, k=0, v=0, g=0,
                                                      beta=0, state=0, dst=0)) for pc in (False, True)],
    ]


def field_thunks() -> list[tuple[str, dict, dict, dict]]:
    """(op, plain thunk, with the fused knobs, packed varlen) for ``--fields``."""
    plain = {"selective_scan": thunks(1024)[0][1], "mamba2": thunks(1024)[1][1]}
    knobs = {"selective_scan": dict(d=True, z=True, delta_bias=True, delta_softplus=True),
             "mamba2": dict(d=True, z=True, dt_bias=True, dt_softplus=True)}
    cu = np.concatenate([[0], np.cumsum(MIXED)]).tolist()
    return [(op, t, dict(t, **knobs[op]), dict(t, batch=1, seq=cu[-1], cu_seqlens=cu)) for op, t in plain.items()]


def time_thunk(session, template: dict, rng: np.random.Generator, repeat: int, **options) -> float:
    """Median seconds of one launch of ``template`` laid out on ``session`` (after a warm-up launch)."""
    return median_time(warm_launcher(session, *lay_out(template, rng), **options), repeat)


def fields_table(session, repeat: int) -> None:
    rng = np.random.default_rng(0)
    print(f"target {session.limits.target}; medians of {repeat}; f32; packed: {len(MIXED)} sequences of {MIXED}")
    print(f"{'op':<16} {'plain ms':>9} {'knobs ms':>9} {'knobs/plain':>12} {'packed ms':>10} {'packed/plain':>13}")
    for op, plain, knobs, packed in field_thunks():
        times = [time_thunk(session, t, rng, repeat) for t in (plain, knobs, packed)]
        print(f"{op:<16} {times[0] * 1e3:>9.2f} {times[1] * 1e3:>9.2f} {times[1] / times[0]:>12.2f} "
              f"{times[2] * 1e3:>10.2f} {times[2] / times[0]:>13.2f}")


def main() -> None:
    parser = with_device_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--fields", action="store_true", help="the version-2 fields' cost at the device's target")
    args = parser.parse_args()
    info, session = open_opencl(args.device)
    print(f"device: {info.name} ({info.spec})")
    if args.fields:
        fields_table(session, args.repeat)
        return
    if session.limits.target != "gpu":
        raise SystemExit("run with RLX_TARGET=gpu: this compares the gpu-target kernels")
    rng = np.random.default_rng(0)
    print(f"target gpu; medians of {args.repeat}; f32")
    print(f"{'op':<16} {'seq':>6} {'lanes ms':>10} {'chunked ms':>11} {'chunked/lanes':>14}")
    for seq in SEQS:
        for label, template in thunks(seq):
            times = [time_thunk(session, template, rng, args.repeat, ssm_kernel=kernel) for kernel in ("lanes", "chunked")]
            print(f"{label:<16} {seq:>6} {times[0] * 1e3:>10.2f} {times[1] * 1e3:>11.2f} {times[1] / times[0]:>14.2f}")


if __name__ == "__main__":
    main()
