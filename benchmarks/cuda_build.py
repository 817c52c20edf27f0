"""Cold build of every CUDA program: NVRTC -> sm_XY cubin with the CUDA backend's options, no cache.

    PYTHONPATH=. python benchmarks/cuda_build.py [--target gpu|cpu] [--arch sm_90] [--workers 1]

Prints the seconds per family (summed over its programs), the program count and total, and the source
bytes compiled: what a first run on a fresh machine pays before its first launch (the disk cache,
``backends/cubin_cache.py``, pays it once per machine).
"""
from __future__ import annotations

import argparse
import collections
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rlx_gpu.backends import nvrtc
from rlx_gpu.backends.cubin_cache import CubinCache, nvrtc_version


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="gpu", choices=("cpu", "gpu"))
    parser.add_argument("--arch", default=nvrtc.CUBIN_ARCH)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    progs = nvrtc.programs(args.target)
    spent: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.Counter()
    with tempfile.TemporaryDirectory() as tmp:
        cache = CubinCache(args.arch, nvrtc.OPTIONS, nvrtc.build, nvrtc_version(), Path(tmp))

        def build(prog):
            t0 = time.perf_counter()
            cache.get(prog)
            return prog, time.perf_counter() - t0

        start = time.perf_counter()
        with ThreadPoolExecutor(args.workers) as pool:
            for prog, seconds in pool.map(build, progs):
                spent[prog.family] += seconds
                count[prog.family] += 1
        wall = time.perf_counter() - start
    print(f"{args.target} target, {args.arch}, {args.workers} worker(s), NVRTC {nvrtc_version()}")
    print("| family | programs | seconds |\n|---|---|---|")
    for family in sorted(spent):
        print(f"| {family} | {count[family]} | {spent[family]:.1f} |")
    source = sum(len(p.source) for p in progs)
    print(f"| all | {len(progs)} | {wall:.1f} wall |\n{source / 1024:.0f} KiB of source compiled")


if __name__ == "__main__":
    main()
