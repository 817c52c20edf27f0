"""Print docs/kernels.md's per-kernel table: sm_90 resources of every gpu-target CUDA program (NVRTC +
ptxas, no GPU needed) and the work-groups each kernel exposes at the issue's GPU shapes (planned for
an H200-like device, nothing allocated).

    python tools/kernel_table.py [--target gpu|cpu]
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlx_gpu import launches  # noqa: E402
from rlx_gpu.backends import nvrtc, programs  # noqa: E402
from rlx_gpu.conformance import cases  # noqa: E402
from rlx_gpu.launches.limits import REFERENCE_GPU, DeviceLimits, variants  # noqa: E402

DTYPES = ("f32", "f16", "bf16", "f64")


def exposure(target: str) -> dict[str, list[str]]:
    """kernel -> ``"shape: G groups x L"`` for the GPU shapes (largest launch of each kernel per shape)."""
    lim = REFERENCE_GPU if target == "gpu" else DeviceLimits(1024, 1 << 20, True)
    out: dict[str, list[str]] = defaultdict(list)
    for name, (op, params) in cases.GPU_SHAPES.items():
        thunk, _ = cases.lay_out(op, "f32", params)
        best: dict[str, tuple[int, int]] = {}
        for launch in launches.plan(thunk, lim).launches:
            groups = 1
            for g in launch.groups:
                groups *= g
            items = 1
            for size in launch.local_size:
                items *= size
            best[launch.kernel] = max(best.get(launch.kernel, (0, 0)), (groups, items))
        for kernel, (groups, items) in best.items():
            out[kernel].append(f"{name}: {groups:,} x {items}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="gpu", choices=("gpu", "cpu"))
    args = parser.parse_args()
    usage: dict[tuple[str, str], dict[str, nvrtc.Usage]] = defaultdict(dict)
    for family in programs.FAMILIES:
        for defines in variants(family, args.target):
            tag = family + "".join(f" {k}={v}" for k, v in defines)
            for dtype in DTYPES:
                prog = programs.program("cuda", family, dtype, None, args.target, defines)
                for kernel, use in nvrtc.resource_usage(nvrtc.build(prog).log).items():
                    usage[(tag, kernel)][dtype] = use
    groups = exposure(args.target)
    print("| kernel | registers f32 / f16 / bf16 / f64 | stack B (f32 / f16 / bf16 / f64) | spills B st+ld (f32 / f16 / bf16 / f64) "
          "| shared B f32 | work-groups x items at the GPU shapes |")
    print("|---|---|---|---|---|---|")
    for (tag, kernel), per in sorted(usage.items()):
        # "—": the kernel is not in that dtype's program (mamba2's chunked kernels have no f64 build)
        regs = " / ".join(str(per[d].registers) if d in per else "—" for d in DTYPES)
        stack = " / ".join(str(per[d].stack) if d in per else "—" for d in DTYPES)
        spill = " / ".join(f"{per[d].spill_stores + per[d].spill_loads}" if d in per else "—" for d in DTYPES)
        name = kernel if tag.split()[0] == tag else f"{kernel} ({tag.split(' ', 1)[1]})"
        print(f"| {name} | {regs} | {stack} | {spill} | {per['f32'].shared} | {'; '.join(groups.get(kernel, [])) or '—'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
