"""The roofline model: what each kernel of an op must take on an H200, on paper, from its launch plan.

For a shape, the op's thunk is planned for the reference GPU (``limits.REFERENCE_GPU``, gpu target: the same
launches a CUDA device would run), with the tensor-core variants an H200 takes (``launches.mma``: 16-bit by
default, TF32 where asked for, none to see the portable FP32 FMA path) and each launch asked for its declared cost (``launches.cost``): FLOPs and
bytes. The GEMM-shaped FLOPs of a launch built with the define ``RLX_MMA`` run on the tensor cores (1: f16/bf16
inputs with f32 accumulation, 2: TF32 for an f32 thunk that asks for it), as do a 16-bit gemm's, which the CUDA
backend hands to cuBLAS; every other FLOP runs on the FP32 (f64: FP64) FMA units. A kernel's floor is the larger
of its FLOPs at the peak of each unit it uses and its bytes at the memory bandwidth; the prediction takes the
FLOPs at 50% of each unit's peak (the bytes still at the full bandwidth). Launch latency is not modelled (the
launch counts are shown). Nothing here has run on a GPU: ``tools/gpu_check.py`` times the kernels against fla /
mamba_ssm where one is available.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from host_fallback.abi import BACKWARD
from host_fallback.abi.gdn import reserve_bytes

from .. import launches
from ..launches import Launch
from ..launches.cost import Cost, launch_cost
from ..launches.limits import REFERENCE_GPU
from ..launches.mma import MMA_16BIT, MMA_TF32
from .cases import GPU_SHAPES, lay_out

#: H200 SXM peaks (NVIDIA H200 Tensor Core GPU datasheet, 2024: FP32 67 TFLOPS, FP64 34, TF32 Tensor Core
#: 989 and BF16/FP16 Tensor Core 1,979 "with sparsity", i.e. 494.5 and 989.5 dense; GPU memory bandwidth
#: 4.8 TB/s), FLOP/s per unit and bytes/s
H200 = {"fma": 67e12, "fp64": 34e12, "mma16": 989.5e12, "tf32": 494.5e12}
H200_BANDWIDTH = 4.8e12
#: the fraction of a unit's peak the predicted times assume
EFFICIENCY = 0.5
UNIT_TITLES = {"fma": "FMA", "fp64": "FP64", "mma16": "MMA 16-bit", "tf32": "MMA TF32"}
#: RLX_MMA's values (issue 38): the unit a launch's GEMM-shaped FLOPs run on
MMA_UNITS = {MMA_16BIT: "mma16", MMA_TF32: "tf32"}
#: the kernels the CUDA backend hands to cuBLAS (backends/cublas_calls.py) and the unit cuBLAS runs them on by
#: dtype: 16-bit inputs on the tensor cores (f32 accumulation); f32 in FP32 (TF32 only with cuda.tf32 or
#: RLX_CUDA_TF32=1), f64 in FP64 (the FMA units of the model)
CUBLAS_KERNELS = frozenset({"gemm"})
CUBLAS_UNITS = {"f16": "mma16", "bf16": "mma16"}
#: the forward shapes: docs/kernels.md's GPU shapes (issue 12), mamba3 at mamba2's (mamba_ssm's B8 S4096 H32 P64
#: N128; num_angles N/4, what the Mamba3 layer's rope_fraction 0.5 gives), and the one fla and FlashQLA publish
#: for the gated_delta_net forward on an H200
FORWARD_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    **GPU_SHAPES,
    "mamba3 B8 S4096 H32 P64 N128 A32": ("mamba3", dict(batch=8, seq=4096, heads=32, head_dim=64, state_size=128,
                                                        num_angles=32)),
    "gdn fla B1 S32768 H16 HV64 K128 V128": ("gated_delta_net", dict(
        batch=1, seq=32768, heads=16, value_heads=64, state_size=128, value_size=128, gate_per_channel=False,
        carry_state=False)),
}
#: every shape: the forward ones, then the backward op of each forward sequence (ABI.md §9) at its shape
SHAPES = {**FORWARD_SHAPES, **{f"{name} backward": (f"{op}_backward", params)
                               for name, (op, params) in FORWARD_SHAPES.items()
                               if f"{op}_backward" in BACKWARD and params["seq"] > 1}}
#: gated_delta_net's backward shapes again reading a saved forward (ABI.md §9.1; its chunked form), a reserve large
#: enough for every dtype (an f64 one)
SHAPES.update({f"{name} backward, reserve": (f"{op}_backward", dict(params, reserve=True, reserve_bytes=reserve_bytes(
    dict(params, dtype="f64")))) for name, (op, params) in FORWARD_SHAPES.items()
    if op == "gated_delta_net" and params["seq"] > 1})
#: published H200 times (ms) of the anchors at a shape, bf16 (issue 38)
ANCHORS = {"gdn fla B1 S32768 H16 HV64 K128 V128": (("fla chunk_gated_delta_rule", 3.33), ("FlashQLA", 1.52))}


def units(launch: Launch, cost: Cost) -> dict[str, float]:
    """The launch's FLOPs by the unit that runs them on CUDA."""
    plain = "fp64" if launch.dtype == "f64" else "fma"
    if launch.kernel in CUBLAS_KERNELS:
        mma = CUBLAS_UNITS.get(launch.dtype, plain)
    else:
        mma = MMA_UNITS.get(dict(launch.defines).get("RLX_MMA", 0), plain)
    out = {plain: cost.other}
    out[mma] = out.get(mma, 0.0) + cost.gemm
    return out


@dataclass
class Row:
    """One kernel of a plan (all its launches), or a whole op: FLOPs by unit, bytes, launch count."""

    name: str
    launches: int = 0
    flops: dict[str, float] = field(default_factory=dict)
    read: float = 0.0
    written: float = 0.0
    undeclared: bool = False
    parts: list[Row] = field(default_factory=list)  # an op's kernels (their times add)

    def add(self, launch: Launch, cost: Cost | None) -> None:
        self.launches += 1
        if cost is None:
            self.undeclared = True
            return
        for unit, count in units(launch, cost).items():
            self.flops[unit] = self.flops.get(unit, 0.0) + count
        self.read += cost.read
        self.written += cost.written

    def compute_s(self, efficiency: float = 1.0) -> float:
        """Seconds of FLOPs at ``efficiency`` of each unit's H200 peak (an op: its kernels' sum)."""
        if self.parts:
            return sum(p.compute_s(efficiency) for p in self.parts)
        return sum(count / (H200[unit] * efficiency) for unit, count in self.flops.items())

    def memory_s(self) -> float:
        if self.parts:
            return sum(p.memory_s() for p in self.parts)
        return (self.read + self.written) / H200_BANDWIDTH

    def floor_s(self) -> float:
        """The H200 floor: per kernel the larger of its FLOPs at peak and its bytes at the bandwidth."""
        if self.parts:
            return sum(p.floor_s() for p in self.parts)
        return max(self.compute_s(), self.memory_s())

    def predicted_s(self) -> float:
        """Per kernel the larger of its FLOPs at EFFICIENCY of peak and its bytes at the bandwidth."""
        if self.parts:
            return sum(p.predicted_s() for p in self.parts)
        return max(self.compute_s(EFFICIENCY), self.memory_s())


def plan_rows(plan: launches.LaunchPlan) -> list[Row]:
    """One row per kernel of ``plan`` (in launch order), its launches' costs summed."""
    rows: dict[str, Row] = {}
    for launch in plan.launches:
        rows.setdefault(launch.kernel, Row(launch.kernel)).add(launch, launch_cost(launch))
    return list(rows.values())


def op_row(shape: str, dtype: str, tensor_cores: int = MMA_16BIT) -> Row:
    """The op of ``SHAPES[shape]`` at ``dtype`` planned for the reference GPU taking the tensor-core variants
    ``tensor_cores`` (``DeviceLimits.mma``): its kernels' rows as parts."""
    op, params = SHAPES[shape]
    thunk, _ = lay_out(op, dtype, params)
    parts = plan_rows(launches.plan(thunk, replace(REFERENCE_GPU, mma=tensor_cores)))
    total = Row(f"{shape} {dtype}", sum(p.launches for p in parts), undeclared=any(p.undeclared for p in parts),
                parts=parts)
    for part in parts:
        for unit, count in part.flops.items():
            total.flops[unit] = total.flops.get(unit, 0.0) + count
        total.read += part.read
        total.written += part.written
    return total
