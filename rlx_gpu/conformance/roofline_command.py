"""``rlx-gpu roofline``: the roofline model's table (``conformance.roofline``), per op and kernel at the GPU shapes."""
from __future__ import annotations

import argparse
from typing import Sequence

from host_fallback.abi import DTYPES

from ..errors import InputError
from ..launches.mma import MMA_16BIT, MMA_NONE, MMA_TF32
from .roofline import ANCHORS, EFFICIENCY, H200_BANDWIDTH, SHAPES, UNIT_TITLES, Row, op_row

#: ``--tensor-cores``: the ``DeviceLimits.mma`` each choice plans with
TENSOR_CORES = {"16bit": MMA_16BIT, "tf32": MMA_TF32, "none": MMA_NONE}

def shown_units(dtype: str) -> tuple[str, ...]:
    """The units a table at ``dtype`` has columns for: its FMA units (FP64 for f64), and the tensor cores'."""
    return ("fp64" if dtype == "f64" else "fma", "mma16", "tf32")


def header(dtype: str) -> tuple[str, ...]:
    return ("op / kernel", "launches", *(f"{UNIT_TITLES[u]} GFLOP" for u in shown_units(dtype)), "read GB",
            "written GB", "FLOPs at peak ms", f"bytes at {H200_BANDWIDTH / 1e12:.1f} TB/s ms", "H200 floor ms",
            f"at {EFFICIENCY:.0%} of peak ms", "published (H200)")


def _number(value: float) -> str:
    """Three significant digits, thousands grouped; 0 as a dash."""
    if not value:
        return "—"
    if value < 0.001:
        return "<0.001"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def cells(row: Row, name: str, shown: Sequence[str], published: str = "") -> list[str]:
    """The table's cells of ``row`` (FLOPs in GFLOP, bytes in GB, times in ms)."""
    if row.undeclared:
        name += " (a kernel declares no cost: counted as nothing)"
    return [name, str(row.launches), *(_number(row.flops.get(u, 0.0) / 1e9) for u in shown),
            _number(row.read / 1e9), _number(row.written / 1e9), _number(row.compute_s() * 1e3),
            _number(row.memory_s() * 1e3), _number(row.floor_s() * 1e3), _number(row.predicted_s() * 1e3), published]


def table(shapes: Sequence[str], dtype: str, tensor_cores: int = MMA_16BIT) -> str:
    """The Markdown table: per shape its op's row (with the anchors' published times), then each kernel's, planned
    for an H200 taking the tensor-core variants ``tensor_cores`` (``DeviceLimits.mma``)."""
    columns = header(dtype)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for shape in shapes:
        total = op_row(shape, dtype, tensor_cores)
        published = "; ".join(f"{name} {ms} ms" for name, ms in ANCHORS.get(shape, ()))
        for name, row, note in ((f"**{total.name}**", total, published),
                                *((f"· {p.name}", p, "") for p in total.parts)):
            lines.append("| " + " | ".join(cells(row, name, shown_units(dtype), note)) + " |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    unknown = [s for s in args.shape or () if s not in SHAPES]
    if unknown:
        raise InputError(f"--shape {unknown[0]!r}: expected one of {', '.join(SHAPES)}")
    print(table(args.shape or list(SHAPES), args.dtype, TENSOR_CORES[args.tensor_cores]))
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``roofline`` on the ``rlx-gpu`` command line."""
    parser = subparsers.add_parser(
        "roofline", help="the H200 roofline of every kernel at the GPU shapes, on paper (no GPU needed)",
        description="Plan each GPU shape's op for an H200 (gpu target) and print, per op and kernel, its FLOPs by "
                    "unit (FP32 FMA or tensor-core MMA where a launch carries RLX_MMA), bytes read and written, "
                    "launches, the H200 floor (peak, memory bound) and the time at 50%% of peak, beside the "
                    "anchors' published times. A model on paper: a GPU run replaces it (tools/gpu_check.py).")
    parser.add_argument("--dtype", default="bf16", choices=[d for d in DTYPES if d != "f64"] + ["f64"],
                        help="the thunks' dtype (default bf16, the anchors')")
    parser.add_argument("--shape", action="append", metavar="NAME", help="one shape (repeatable; default all): "
                        + "; ".join(SHAPES))
    parser.add_argument("--tensor-cores", default="16bit", choices=list(TENSOR_CORES),
                        help="the tensor-core variants the H200 takes: 16bit (the default, as the CUDA backend "
                        "plans on sm_80 and later), tf32 (also f32 thunks, as with cuda.tf32 or RLX_CUDA_TF32=1) or "
                        "none (the portable FP32 FMA kernels)")
    parser.set_defaults(handler=run)
