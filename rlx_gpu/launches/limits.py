"""Compile-time sizes shared by the kernel text and the launch geometry, and a device's limits."""
from __future__ import annotations

from dataclasses import dataclass

GEMM_TILE = 16  # the gemm kernel's square tile: a work-group of GEMM_TILE**2 items
GEMM_RM, GEMM_CN = 8, 16  # each gemm item computes GEMM_RM rows x GEMM_CN consecutive columns
STATE_MAX = 256  # longest private state row of the ssm / gdn kernels (ABI.md asks for 256)
RNN_RB = {4: 2, 3: 4, 1: 8}  # batch rows per item of the per-step recurrent kernel, by gate count
RNN_JB = 16  # consecutive hidden units per item of the per-step recurrent kernel
RNN_PERSIST_MAX = 1024  # largest hidden size the persistent recurrent kernel holds in local memory

#: Emitted as ``#define`` lines by kernel_source, so the kernels and the planners agree.
CONSTANTS = {
    "GEMM_TILE": GEMM_TILE, "GEMM_RM": GEMM_RM, "GEMM_CN": GEMM_CN,
    "STATE_MAX": STATE_MAX, "RNN_PERSIST_MAX": RNN_PERSIST_MAX, "RNN_JB": RNN_JB,
    "RNN_RB_G4": RNN_RB[4], "RNN_RB_G3": RNN_RB[3], "RNN_RB_G1": RNN_RB[1], "RNN_RB_MAX": max(RNN_RB.values()),
}


@dataclass(frozen=True)
class DeviceLimits:
    """What launch geometry must respect on one device."""

    max_work_group: int
    local_mem_bytes: int
    fp64: bool
