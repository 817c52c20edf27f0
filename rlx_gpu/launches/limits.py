"""A device's limits and target, and the per-target tuning constants shared by kernels and planners.

The constants in ``TUNING`` are tuning, not semantics: blockings, work-group shapes, state sizes held
in registers. ``backends.programs.defines`` emits the launch's target's table as ``#define`` lines, and the
planners read the same table through ``DeviceLimits.tune``, so kernel text and geometry agree.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from .activation_codes import ACTIVATION_CODES

TARGETS = ("cpu", "gpu")
TARGET_ENV = "RLX_TARGET"  # forces a target (e.g. gpu shapes on PoCL); unset: the device type decides

#: CUDA's grid caps (work-groups per dimension); every gpu-target launch keeps within them
CUDA_MAX_GRID = (2**31 - 1, 65535, 65535)
UNBOUNDED_GRID = (2**63 - 1,) * 3

_SHARED = {
    "STATE_MAX": 256,  # longest state row of the ssm / gdn kernels (ABI.md asks for 256)
    "RNN_PERSIST_MAX": 1024,  # largest hidden size the persistent recurrent kernel holds in local memory
    "SSMB_Q": 32,  # steps between the checkpoints of the state-space backward kernels
}

#: Per target, every tuning constant: the shared ones below, then those a planner module adds for its own kernels
#: (``add_tuning``).
TUNING: dict[str, dict[str, int]] = {
    # shaped for AVX2 registers and L1 (PoCL)
    "cpu": {
        **_SHARED,
        "GEMM_LX": 8, "GEMM_LY": 8,  # the gemm's work-group: items along (column runs, row blocks)
        "GEMM_RM": 6, "GEMM_CN": 16,  # each gemm item computes GEMM_RM rows x GEMM_CN consecutive columns
        "M2_PB": 16,  # state rows (head_dim positions) per work-item of the mamba2 kernel
        "SS_TC": 8,  # channels per work-item of a selective_scan decode step (seq 1)
        "GDN_CJ": 8,  # value columns per work-item of the gated_delta_net kernels
        "GDN_DJ": 32,  # value columns per work-item of its decode step (gated_delta_net_step)
        # the per-step recurrent kernel: batch rows and consecutive hidden units per item, by gate count
        "RNN_RB_G4": 3, "RNN_RB_G3": 4, "RNN_RB_G1": 6, "RNN_RB_MAX": 6,
        "RNN_JB_G4": 8, "RNN_JB_G3": 8, "RNN_JB_G1": 16,
        "RNN_WPAD": 16,  # reals between W_hh^T rows past G*HP, so that a 4 KiB row stride does not alias in L1
        "RNN_JB": 16,  # W_hh^T rows are padded to a multiple of this (a multiple of every RNN_JB_G*)
        "RNN_PERSIST_ROWS": 2,  # (batch row, direction) pairs up to which the persistent kernel wins (PoCL, 2 cores)
        "SSMB_BLOCKS": 16,  # state-space backward: blocks of a group's channels (heads) walked by separate items
    },
    # shaped for warps, shared memory and many SMs (sm_90 budgets checked by tests/devices/test_ptxas.py)
    "gpu": {
        **_SHARED,
        # LOCAL-tiled gemm: a GEMM_TILE x GEMM_TILE block of D per work-group of GEMM_LX x GEMM_LX items,
        # each item GEMM_TM x GEMM_TM outputs strided by GEMM_LX (conflict-free LOCAL reads, coalesced
        # stores), the reduction staged GEMM_TK at a time through LOCAL memory
        "GEMM_LX": 16, "GEMM_LY": 16, "GEMM_TM": 8, "GEMM_TK": 16, "GEMM_TILE": 128,
        "M2_PB": 16,
        "GDN_CJ": 8,
        # the per-step recurrent kernel: a work-group of RNN_GU consecutive units (coalesced W_hh^T
        # reads) x RNN_GK slices of the reduction (summed through LOCAL memory), RNN_RB batch rows
        # per item sharing each weight read
        "RNN_GU": 16, "RNN_GK": 16, "RNN_RB": 4,
        "RNN_WPAD": 0,  # no cache-set aliasing to avoid: rows stay contiguous
        "RNN_JB": 16,  # W_hh^T rows padded to a multiple of RNN_GU
        "RNN_PERSIST_ROWS": 0,  # one work-group per (row, direction) cannot fill a GPU: always per step
        # state-space kernels: a row's state spread over lanes, SSM_LANE_W values each in registers
        # (sm_90 f32/f16/bf16: 39-68 registers, no stack), in work-groups of up to SSM_WG lanes
        "SSM_LANE_W": 8, "SSM_WG": 128,
        # chunked selective_scan: SSC_CB channels per work-group, SSC_SL lanes per channel, SSC_T steps per lane
        "SSC_CB": 4, "SSC_SL": 32, "SSC_T": 8, "SSC_MIN_SEQ": 64,
        # chunked mamba2 (SSD): chunks of M2_Q steps, M2_PT rows of P and M2_NT state columns per tile,
        # M2_LANES lanes per work-group
        "M2_Q": 64, "M2_PT": 16, "M2_NT": 16, "M2_LANES": 256, "M2_MIN_SEQ": 64,
        # chunked gated_delta_net (WY form): chunks of GDN_Q steps, work-groups of GDN_LANES lanes, key
        # channels staged GDN_NT at a time; the state pass gives each lane GDN_PJ value columns of one
        # key row (at most GDN_SPMAX strips of them per group), chunk_out GDN_OT value columns per group
        "GDN_Q": 64, "GDN_LANES": 256, "GDN_NT": 16, "GDN_PJ": 4, "GDN_SPMAX": 16, "GDN_OT": 32,
        "GDN_MIN_SEQ": 64,
        "SSMB_BLOCKS": 64,
    },
}

#: gpu target: the state sizes the state-space kernels are compiled for (a launch takes the smallest
#: one >= its state_size)
SSM_VARIANTS = (16, 32, 64, 128, 256)


def state_variant(n: int) -> tuple[tuple[str, int], ...]:
    """The gpu program variant of the state-space kernels for state_size ``n``: ``SSM_N`` (the
    compiled state size) and ``SSM_L`` (lanes per state row)."""
    if n > SSM_VARIANTS[-1]:
        raise ValueError(f"state_size={n} has no gpu kernel variant; the largest is {SSM_VARIANTS[-1]}")
    size = next(v for v in SSM_VARIANTS if v >= n)
    return (("SSM_N", size), ("SSM_L", max(1, size // TUNING["gpu"]["SSM_LANE_W"])))


#: the gate counts the recurrent kernels are compiled for: lstm 4, gru 3, rnn 1
RNN_GATE_COUNTS = (4, 3, 1)


def gate_variant(gates: int) -> tuple[tuple[str, int], ...]:
    """The program variant of the recurrent kernels (every target) for an op of ``gates`` gates:
    ``RNN_GATES``."""
    if gates not in RNN_GATE_COUNTS:
        raise ValueError(f"a recurrent op of {gates} gates has no kernel variant; the kernels are built for "
                         f"{', '.join(map(str, RNN_GATE_COUNTS))}")
    return (("RNN_GATES", gates),)


#: the gated_delta_net program variant of ABI.md §8's optional fields (launches/gdn.py)
GDN_V2 = (("GDN_V2", 1),)


#: rnn's relu (version 1): its activation is a compile-time variant like every other
RNN_RELU_VARIANT = (("RNN_GATES", 1), ("RNN_ACT_F0", ACTIVATION_CODES["relu"]))
#: Representative version-2 programs of the recurrent family (a thunk's program is ``launches.rnn.variant``'s,
#: one of thousands): per op every optional field at once, with activations that take alpha and beta, different
#: per direction.
RNN_FIELD_VARIANTS = (
    (("RNN_GATES", 4), ("RNN_ACT_F0", ACTIVATION_CODES["hard_sigmoid"]), ("RNN_ACT_G0", ACTIVATION_CODES["elu"]),
     ("RNN_ACT_H0", ACTIVATION_CODES["scaled_tanh"]), ("RNN_ACT_H1", ACTIVATION_CODES["softsign"]), ("RNN_LENS", 1),
     ("RNN_CLIP", 1), ("RNN_PEEP", 1), ("RNN_IFG", 1), ("RNN_PROJ", 1)),
    (("RNN_GATES", 3), ("RNN_ACT_F0", ACTIVATION_CODES["leaky_relu"]), ("RNN_ACT_G0", ACTIVATION_CODES["affine"]),
     ("RNN_ACT_G1", ACTIVATION_CODES["softplus"]), ("RNN_LENS", 1), ("RNN_CLIP", 1), ("RNN_LBR0", 1)),
    (("RNN_GATES", 1), ("RNN_ACT_F0", ACTIVATION_CODES["thresholded_relu"]),
     ("RNN_ACT_F1", ACTIVATION_CODES["sigmoid"]), ("RNN_LENS", 1), ("RNN_CLIP", 1)),
)


#: Per kernel family: the compile-time variants (extra ``#define`` sets) built ahead and checked (NVRTC's
#: program list, the ptxas budgets) at a target, as ``((name, value), ...)`` tuples: every one a planner may
#: request, but for the recurrent family, whose planner builds any combination of its fields on demand.
#: Families not listed (here or by their planner module's ``add_variants``) build one program per dtype.
VARIANTS: dict[tuple[str, str], tuple[tuple[tuple[str, int], ...], ...]] = {
    # ssm and gdn: () builds the chunked forms (no state-size variant), the others the lanes kernels
    ("ssm", "gpu"): ((),) + tuple(state_variant(n) for n in SSM_VARIANTS),
    # gdn: each again with GDN_V2, the variant that honours ABI.md §8's varlen, slots, q/k norm, wide state
    ("gdn", "gpu"): tuple(base + v2 for v2 in ((), GDN_V2) for base in ((),) + tuple(state_variant(n) for n in SSM_VARIANTS)),
    ("gdn", "cpu"): ((), GDN_V2),
    # rnn and its backward: one program per op (its gate count) at each target, and the representative
    # version-2 ones
    **{(family, target): (tuple(gate_variant(g) for g in RNN_GATE_COUNTS) + (RNN_RELU_VARIANT,)
                          + RNN_FIELD_VARIANTS) for family in ("rnn", "rnn_backward") for target in TARGETS},
}


def add_tuning(owner: str, **per_target: Mapping[str, int]) -> None:
    """Add the tuning constants of ``owner``'s kernels (a planner module, on import) for each target named; a
    name another owner already took is an error (every program's ``#define`` block holds them all)."""
    for target, constants in per_target.items():
        if target not in TARGETS:
            raise ValueError(f"{owner}: tuning for target {target!r}; the targets are {', '.join(TARGETS)}")
        taken = sorted(set(constants) & set(TUNING[target]))
        if taken:
            raise ValueError(f"{owner}: tuning constant(s) {taken} of target {target!r} are taken already")
        TUNING[target].update(constants)


def add_variants(family: str, **per_target: tuple[tuple[tuple[str, int], ...], ...]) -> None:
    """Declare the compile-time variants of ``family`` at each target named (what ``VARIANTS`` holds), from the
    planner module of the family, on import."""
    for target, defines in per_target.items():
        if (family, target) in VARIANTS:
            raise ValueError(f"the variants of kernel family {family!r} at target {target!r} are declared already")
        VARIANTS[(family, target)] = tuple(defines)


def variants(family: str, target: str) -> tuple[tuple[tuple[str, int], ...], ...]:
    """The ``defines`` tuples a planner may give launches of ``family`` at ``target`` (``((),)`` for a
    family without variants)."""
    return VARIANTS.get((family, target), ((),))


def requested_target(detected: str) -> str:
    """``$RLX_TARGET`` when set (``cpu`` or ``gpu``), else ``detected`` (the device type's target)."""
    forced = os.environ.get(TARGET_ENV, "").strip().lower()
    if forced and forced not in TARGETS:
        raise ValueError(f"{TARGET_ENV}={forced!r} is not a target; use one of {', '.join(TARGETS)} (or unset it)")
    return forced or detected


@dataclass(frozen=True)
class DeviceLimits:
    """What launch geometry must respect on one device, and the target its kernels are shaped for.

    ``max_grid`` counts work-groups per dimension (CUDA's ``gridDim``); at the gpu target it is never
    above CUDA's caps, so a plan made on an OpenCL GPU also launches on CUDA.
    """

    max_work_group: int
    local_mem_bytes: int
    fp64: bool
    target: str = "cpu"
    sub_group: int = 1  # warp / wavefront / preferred work-group multiple
    compute_units: int = 1
    max_grid: tuple[int, int, int] = UNBOUNDED_GRID
    mma: int = 0  # the tensor-core variants its chunk GEMMs may take (launches/mma.py): 0 none, 1 16-bit, 2 and TF32

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"DeviceLimits target {self.target!r} is not one of {', '.join(TARGETS)}")
        if self.target == "gpu":
            object.__setattr__(self, "max_grid", tuple(min(a, b) for a, b in zip(self.max_grid, CUDA_MAX_GRID)))

    def tune(self, name: str) -> int:
        """The tuning constant ``name`` of this device's target (the value its kernels were built with)."""
        return TUNING[self.target][name]


#: The GPU the gpu tuning is sized for: an H200 (sm_90, 132 SMs, 228 KiB shared memory per SM); the
#: geometry test and docs/kernels.md's work-group column plan against it.
REFERENCE_GPU = DeviceLimits(max_work_group=1024, local_mem_bytes=228 * 1024, fp64=True, target="gpu",
                             sub_group=32, compute_units=132, max_grid=CUDA_MAX_GRID)
