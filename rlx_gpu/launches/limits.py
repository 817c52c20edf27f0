"""Compile-time sizes shared by the kernel text and the launch geometry, and a device's limits."""
from __future__ import annotations

from dataclasses import dataclass

GEMM_TILE = 16  # the gemm kernel's square tile: a work-group of GEMM_TILE**2 items
STATE_MAX = 256  # longest private state row of the ssm / gdn kernels (ABI.md asks for 256)
RNN_PERSIST_MAX = 1024  # largest hidden size the persistent recurrent kernel holds in local memory

#: Emitted as ``#define`` lines by kernel_source, so the kernels and the planners agree.
CONSTANTS = {"GEMM_TILE": GEMM_TILE, "STATE_MAX": STATE_MAX, "RNN_PERSIST_MAX": RNN_PERSIST_MAX}


@dataclass(frozen=True)
class DeviceLimits:
    """What launch geometry must respect on one device."""

    max_work_group: int
    local_mem_bytes: int
    fp64: bool
