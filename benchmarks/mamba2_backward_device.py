"""mamba2's device backward at the gpu target: its chunked form against the step walk, and both against the
forward, timed in alternation (paired under the same load).

    PYTHONPATH=. RLX_TARGET=gpu python benchmarks/mamba2_backward_device.py [--repeat N] [--device opencl:P:D]

Shape: batch 2, seq 1024, heads 8, head_dim 64, state 64, f32 (``benchmarks/ssm_device.py``'s mamba2). Each
round runs the forward (chunked), the chunked backward and the step walk once each (``ssm_kernel`` "chunked" /
"lanes" forces the backward's form); the table gives the medians over the rounds and their ratios. On PoCL (a
CPU) with the gpu target forced, the figures rank the forms' work and parallelism, not a GPU's. Times exclude
compilation and transfers.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from benchmarks.backends import lay_out, open_opencl, warm_launcher, with_device_arguments

SHAPE = dict(batch=2, seq=1024, heads=8, head_dim=64, state_size=64)


def main() -> None:
    parser = with_device_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--seq", type=int, default=SHAPE["seq"])
    args = parser.parse_args()
    _, session = open_opencl(args.device)
    rng = np.random.default_rng(0)
    shape = dict(SHAPE, seq=args.seq)
    forward = dict(op="mamba2", **shape, x=0, dt=0, a=0, b=0, c=0, dst=0)
    backward = dict(op="mamba2_backward", **shape)
    runs = {"forward": warm_launcher(session, *lay_out(forward, rng), ssm_kernel="chunked"),
            "backward chunked": warm_launcher(session, *lay_out(backward, rng), ssm_kernel="chunked"),
            "backward step walk": warm_launcher(session, *lay_out(backward, rng), ssm_kernel="lanes")}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeat):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    med = {name: float(np.median(t)) for name, t in times.items()}
    print(f"target {session.limits.target}; {shape}, f32; medians of {args.repeat} paired rounds; "
          f"load {os.getloadavg()[0]:.2f}")
    for name, t in med.items():
        print(f"  {name:20s} {t * 1e3:9.2f} ms  {t / med['forward']:6.2f}x forward")
    print(f"  step walk / chunked: {med['backward step walk'] / med['backward chunked']:.2f}x")


if __name__ == "__main__":
    main()
