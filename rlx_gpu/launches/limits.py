"""Compile-time sizes shared by the kernel text and the launch geometry, and a device's limits."""
from __future__ import annotations

from dataclasses import dataclass

GEMM_LOCAL = (8, 8)  # the gemm kernel's work-group: items along (column runs, row blocks)
GEMM_RM, GEMM_CN = 6, 16  # each gemm item computes GEMM_RM rows x GEMM_CN consecutive columns
M2_PB = 16  # state rows (head_dim positions) per work-item of the mamba2 kernel
GDN_CJ = 8  # value columns per work-item of the gated_delta_net kernels
STATE_MAX = 256  # longest private state row of the ssm / gdn kernels (ABI.md asks for 256)
SSM_VARIANTS = (16, 32, 64, 128, 256)  # gpu target: the state sizes the ssm / gdn kernels are compiled for
SSM_LANE_W = 8  # gpu target: state values per lane (ptxas sm_90, f32/f16/bf16: 39-68 registers, no stack)
SSM_WG = 128  # gpu target: largest work-group of the ssm / gdn kernels (their LOCAL arrays are sized by it)
M2_Q, M2_PT, M2_NT, M2_LANES = 64, 16, 16, 256  # gpu target, chunked mamba2: chunk, rows and state tile per group, lanes
SSC_CB, SSC_SL, SSC_T = 4, 32, 8  # gpu target, chunked selective_scan: channels per group, lanes per channel, steps per lane
RNN_RB = {4: 3, 3: 4, 1: 6}  # batch rows per item of the per-step recurrent kernel, by gate count
RNN_JBG = {4: 8, 3: 8, 1: 16}  # consecutive hidden units per item of the per-step kernel, by gate count
RNN_WPAD = 16  # reals between W_hh^T rows past G*HP, so that a 4 KiB row stride does not alias in L1
RNN_JB = 16  # W_hh^T rows are padded to a multiple of this (a multiple of every RNN_JBG)
RNN_PERSIST_MAX = 1024  # largest hidden size the persistent recurrent kernel holds in local memory

#: Emitted as ``#define`` lines by kernel_source, so the kernels and the planners agree.
CONSTANTS = {
    "GEMM_RM": GEMM_RM, "GEMM_CN": GEMM_CN,
    "STATE_MAX": STATE_MAX, "M2_Q": M2_Q, "M2_PT": M2_PT, "M2_NT": M2_NT, "M2_LANES": M2_LANES, "SSC_CB": SSC_CB, "SSC_SL": SSC_SL, "SSC_T": SSC_T, "GDN_CJ": GDN_CJ, "M2_PB": M2_PB, "RNN_PERSIST_MAX": RNN_PERSIST_MAX, "RNN_JB": RNN_JB, "RNN_WPAD": RNN_WPAD,
    "RNN_RB_G4": RNN_RB[4], "RNN_RB_G3": RNN_RB[3], "RNN_RB_G1": RNN_RB[1], "RNN_RB_MAX": max(RNN_RB.values()),
    "RNN_JB_G4": RNN_JBG[4], "RNN_JB_G3": RNN_JBG[3], "RNN_JB_G1": RNN_JBG[1],
}


@dataclass(frozen=True)
class DeviceLimits:
    """What launch geometry must respect on one device."""

    max_work_group: int
    local_mem_bytes: int
    fp64: bool
    target: str = "cpu"  # "cpu" | "gpu": which kernel shapes the planners choose
