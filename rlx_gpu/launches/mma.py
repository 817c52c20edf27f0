"""The tensor-core variant of a chunked kernel's launch (issue 38): the ``RLX_MMA`` define, by dtype and device.

The chunk GEMMs of mamba2 (and its chunked backward's state products), gated_delta_net and mamba3 (C.B^T, the
intra-chunk product with x, the state products; mamba3's chunked backward's scores; gated_delta_net's chunked
backward's state products Y.S0^T, dO.S0^T, U.dS_L^T) have a CUDA-only fast path beside their portable FP32 FMA
text (DESIGN.md principle 1), chosen at compile time: ``RLX_MMA`` 1 takes 16-bit inputs (a f16 / bf16 thunk's own
type) with f32 accumulation, 2 rounds an f32 thunk's operands to TF32, only where asked for (the config's
``cuda.tf32`` or ``RLX_CUDA_TF32=1``, which also let cuBLAS's f32 gemms use TF32; off by default, as torch's
``allow_tf32``). A device says which it may take in ``DeviceLimits.mma``: the CUDA backend sets it from the
compute capability, OpenCL never (0), so an OpenCL launch never carries the define and its prelude refuses one.
"""
from __future__ import annotations

from .limits import DeviceLimits

MMA_NONE, MMA_16BIT, MMA_TF32 = 0, 1, 2
#: the compute capability whose tensor cores take every operand type above (bf16 and TF32 arrived with sm_80)
MMA_MIN_CAPABILITY = (8, 0)
SIXTEEN_BIT = ("f16", "bf16")
#: the edge of an MMA tile: gated_delta_net_state_pass's variant gives a work-group one tile of value columns
MMA_TILE = 16
#: the program families whose chunked kernels have the variant, and the variant each dtype builds (NVRTC's
#: program list; OpenCL builds none)
MMA_FAMILIES = ("ssm", "gdn", "mamba3", "mamba2_backward", "mamba3_backward", "gdn_backward")
MMA_OF_DTYPE = {"f16": MMA_16BIT, "bf16": MMA_16BIT, "f32": MMA_TF32}


def device_mma(capability: tuple[int, int], tf32: bool) -> int:
    """The ``DeviceLimits.mma`` of a CUDA device of compute ``capability``: 16-bit from sm_80 on, and TF32
    there too when ``tf32`` asks for it."""
    if capability < MMA_MIN_CAPABILITY:
        return MMA_NONE
    return MMA_TF32 if tf32 else MMA_16BIT


def mma_defines(lim: DeviceLimits, dtype: str) -> tuple[tuple[str, int], ...]:
    """The ``RLX_MMA`` define of a gpu-target chunked launch of ``dtype`` on a device with ``lim``; none (the
    portable path) for f64, for f32 without TF32, and wherever the device has no tensor-core variant."""
    if lim.target != "gpu":
        return ()
    if dtype in SIXTEEN_BIT and lim.mma >= MMA_16BIT:
        return (("RLX_MMA", MMA_16BIT),)
    if dtype == "f32" and lim.mma >= MMA_TF32:
        return (("RLX_MMA", MMA_TF32),)
    return ()
