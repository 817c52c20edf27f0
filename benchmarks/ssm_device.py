"""gpu-target state-space kernels on an OpenCL device: lanes (step) kernel against the chunked form.

    PYTHONPATH=. RLX_TARGET=gpu python benchmarks/ssm_device.py [--repeat N] [--device opencl:P:D]

For selective_scan (B=2, H=256, N=16), mamba2 (B=2, H=8, P=64, N=64) and gated_delta_net (B=2, H=4,
N=64, both gate kinds), f32, at growing sequence lengths: the median time of the lanes kernel (one step
per barrier) and of the chunked form, and their ratio; this sets the SSC_MIN_SEQ / M2_MIN_SEQ /
GDN_MIN_SEQ rules of ``launches.limits.TUNING['gpu']``. On
PoCL (a CPU) both run with the gpu target forced, so the figures rank the forms' work and barrier
counts, not a GPU's latency hiding. Times exclude compilation and transfers.
"""
from __future__ import annotations

import argparse

import numpy as np

from benchmarks.backends import lay_out, median_time
from rlx_gpu.backends import opencl
from rlx_gpu.conformance.devices import find

SEQS = (1, 16, 32, 64, 128, 256, 1024)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    info = find(args.device or "opencl")  # a spec that names no device lists the ones there are
    session = opencl.open(info)
    if session.limits.target != "gpu":
        raise SystemExit("run with RLX_TARGET=gpu: this compares the gpu-target kernels")
    rng = np.random.default_rng(0)
    print(f"device: {info.name} ({info.spec}); target gpu; medians of {args.repeat}; f32")
    print(f"{'op':<16} {'seq':>6} {'lanes ms':>10} {'chunked ms':>11} {'chunked/lanes':>14}")
    for seq in SEQS:
        for label, template in thunks(seq):
            t, arena = lay_out(template, rng)
            dev = session.alloc(arena.size)
            session.write(dev, 0, arena)
            times = []
            for kernel in ("lanes", "chunked"):
                def run():
                    session.launch(t, dev, ssm_kernel=kernel)
                    session.finish()
                run()  # compile and warm up
                times.append(median_time(run, args.repeat))
            print(f"{label:<16} {seq:>6} {times[0] * 1e3:>10.2f} {times[1] * 1e3:>11.2f} {times[1] / times[0]:>14.2f}")


if __name__ == "__main__":
    main()
