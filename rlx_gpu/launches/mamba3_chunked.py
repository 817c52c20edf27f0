"""Launch geometry of mamba3's chunked prefill (ABI.md §11's informative note), both targets: kernels/mamba3.cl's
``mamba3_chunk_*`` kernels and ``mamba3_state_pass``.

Four launches over scratch in the compute type: each token's turned q and k into chunk slots of ``M3C_Q`` tokens
(a work-item per (row, head, pair), the angle walked over the row as the step kernels walk it); each chunk's own
state (a work-group per (head, chunk slot, ``M3C_PT`` state rows)); the inter-chunk pass (a work-item per state
element of a (row, head)); the chunk outputs, the intra-chunk products as LOCAL tiles (work-groups as the second
launch's). A row (a batch row, or one packed sequence) starts a chunk; a head has ``chunk_slots`` slots. The step
recurrence (launches/mamba3.py) keeps decode and sequences under ``M3C_MIN_SEQ`` tokens, and f64 at the gpu target
(its tiles would pass CUDA's 48 KiB of static shared memory); the ``ssm_kernel`` run option forces either form.
"""
from __future__ import annotations

from .arguments import kernel_launch
from .core import SCRATCH, LaunchPlan, Thunk, ceil_to, grid, linear_local, real_size
from .limits import DeviceLimits, add_tuning
from .ssm import chunk_slots, takes_chunked

# M3C_MIN_SEQ: where the chunked form overtakes the step recurrence at B2 H8 P64 N64 f32 (paired medians on the
# 2-core test machine, loaded): cpu target, PoCL 3.1 at 12-16 tokens (Intel's CPU runtime about 16); gpu target on
# PoCL 40-48 (it ranks the forms' work and barrier counts, not a GPU's latency hiding; no GPU measured)
add_tuning(__name__, cpu={
    # chunks of M3C_Q tokens, work-groups of M3C_LANES items, M3C_PT state rows per tile (M3C_PS per item of a chunk's
    # own state; M3C_PT a multiple of M3C_PP), state columns staged M3C_NT at a time (gpu)
    "M3C_Q": 32, "M3C_LANES": 32, "M3C_PT": 64, "M3C_PS": 64, "M3C_NT": 16, "M3C_MIN_SEQ": 16,
    "M3C_PP": 64,  # state rows per item of the inter-chunk pass (a tile: its inner loop vectorizes)
}, gpu={
    "M3C_Q": 64, "M3C_LANES": 256, "M3C_PT": 16, "M3C_PS": 4, "M3C_NT": 16, "M3C_MIN_SEQ": 48, "M3C_PP": 1,
})

#: the chunked form's kernels, in launch order
KERNELS = ("mamba3_chunk_turn", "mamba3_chunk_state", "mamba3_state_pass", "mamba3_chunk_scan")


def takes_chunked_form(t: Thunk, lim: DeviceLimits, ssm_kernel: str) -> bool:
    """Whether ``t`` (completed) runs the chunked form: by ``ssm_kernel`` ("auto": from M3C_MIN_SEQ tokens on;
    "lanes" or "chunked" force one), never for f64 at the gpu target."""
    return takes_chunked(lim, t["seq"], "M3C_MIN_SEQ", ssm_kernel) and not (lim.target == "gpu" and t["dtype"] == "f64")


def scratch_reals(t: Thunk, lim: DeviceLimits, rows: int, slots: int) -> int:
    """Reals of the compute type the chunked form's scratch holds (kernels/mamba3.cl's m3c_scratch): q~ and k~ per
    (head, slot, step), a state (its rows rounded up to whole tiles) and a decay per (head, slot), each row's
    initial key."""
    h, n = t["heads"], t["state_size"]
    return (2 * h * slots * lim.tune("M3C_Q") * n + h * slots * ceil_to(t["head_dim"], lim.tune("M3C_PT")) * n
            + h * slots + rows * h * n)


def plan(t: Thunk, lim: DeviceLimits, args: dict[str, object]) -> LaunchPlan:
    """The chunked form's launches for ``t`` (completed) with the step kernels' ``args`` (launches/mamba3.py)."""
    q, lanes, dt = lim.tune("M3C_Q"), lim.tune("M3C_LANES"), t["dtype"]
    slots = chunk_slots(t, q)
    rows, heads, pairs = args["R"], t["heads"], t["state_size"] // 2
    args = dict(args, K=slots, sb=(SCRATCH, 0))
    tiles = heads * slots * -(-t["head_dim"] // lim.tune("M3C_PT"))
    turns = rows * heads * (pairs if lim.target == "gpu" else 1)  # gpu: an item per pair; cpu: all of a head's
    passes = rows * heads * t["state_size"] * -(-t["head_dim"] // lim.tune("M3C_PP"))
    # cpu: small groups of independent items (a group runs on one core), gpu: up to 256 lanes
    gpu = lim.target == "gpu"
    turn_local, pass_local = linear_local(turns, 64 if gpu else 1), linear_local(passes, 256 if gpu else 16)
    shapes = {"mamba3_chunk_turn": (grid((turns,), (turn_local,)), (turn_local,)),
              "mamba3_chunk_state": ((tiles * lanes,), (lanes,)),
              "mamba3_state_pass": (grid((passes,), (pass_local,)), (pass_local,)),
              "mamba3_chunk_scan": ((tiles * lanes,), (lanes,))}
    launches = tuple(kernel_launch("mamba3", kernel, dt, *shapes[kernel], args, target=lim.target)
                     for kernel in KERNELS)
    return LaunchPlan(launches, scratch_reals(t, lim, rows, slots) * real_size(dt), (f"chunked Q={q}",))
