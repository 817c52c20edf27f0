"""Launch geometry of mamba3_backward's chunked form (ABI.md §9, §11) at the gpu target: kernels/mamba3_chunk_backward.cl.

From M3C_MIN_SEQ tokens on (the forward's rule for its chunked prefill; ``ssm_kernel="chunked"`` forces it,
"lanes" keeps the step walk), for batch rows of a thunk below f64 whose tiles the device takes, the backward runs in
the forward's chunks of M3C_Q tokens: launches/mamba3.py's turn launch (q~, k~ and the angles per token), then
``mamba3_cb_states`` (a work-group per (head, chunk slot, M3C_PT state rows): each chunk's own state and its share of
the entering state's gradient), ``mamba3_cb_pass`` (an item per (row, head, state row): the states entering each
chunk and the gradients of those leaving it) and ``mamba3_cb_chunk`` (a work-group per (head, chunk slot): the
scores q~.k~^T and gy.v^T, every token's gradients), whose partials launches/mamba3.py's per-token, angle and reduce
launches finish as the step walk's (one block; the per-token launch ``direct``). On a device with tensor cores
``mamba3_cb_chunk`` takes the MMA variant (``RLX_MMA``: its two scores, and its four state products from split
operands, x = hi + lo: rounded once to 16 bits they push the angles' gradient past the conformance bounds; D·k̃ and
S_in·q̃ per (token, row) through scratch, ``pr``); the others run in the portable program (mamba3_cb_states' products
stay f32). Packed sequences and f64 keep the step walk.
"""
from __future__ import annotations

from typing import Any, Callable

from .core import SCRATCH, Launch, Thunk
from .limits import DeviceLimits
from .mma import MMA_TF32, mma_defines
from .ssm import chunk_slots, takes_chunked

#: each kernel, in launch order: launches/mamba3.py's argument groups, then its own arguments
KERNELS = {
    "mamba3_cb_states": (("base", "coeffs", "values"), ("K", "gob", "qrb", "krb", "gyb", "ownb", "downb", "decb")),
    "mamba3_cb_pass": (("base", "coeffs", "state", "rows"),
                       ("K", "dstb", "dvsb", "ownb", "downb", "decb", "endsb", "dvinb")),
    "mamba3_cb_chunk": (("base", "coeffs", "values", "state", "rows"),
                        ("K", "W", "gob", "dvb", "dzb", "dstb", "dksb", "qrb", "krb", "gyb", "ownb", "downb", "endsb",
                         "dvinb", "partb", "dk0b", "ddpb", "prb")),
}
#: launches/mamba3.py's launch of a kernel of the mamba3_backward program: (kernel, global size, local size, defines)
LaunchOf = Callable[[str, tuple, tuple, tuple], Launch]


def _local_bytes(lim: DeviceLimits, dtype: str) -> int:
    """LOCAL memory the larger of mamba3_cb_states and mamba3_cb_chunk takes (kernels/mamba3_chunk_backward.cl), the
    second in the portable text or its MMA variant (operands of 2 bytes, or 4 with TF32)."""
    q, pt, lanes = lim.tune("M3C_Q"), lim.tune("M3C_PT"), lim.tune("M3C_LANES")
    mma = dict(mma_defines(lim, dtype)).get("RLX_MMA")
    op = 4 if not mma or mma == MMA_TF32 else 2
    states = 3 * q * 4 + 4 * q + 2 * q * pt * 4
    chunk = 6 * q * 4 + 4 * q + 2 * q * q * 4 + 4 * lanes * 4 + q * pt * op + (q * 16 * op if mma else 0)
    return max(states, chunk)


def takes(fwd: Thunk, lim: DeviceLimits, ssm_kernel: str = "auto") -> bool:
    """Whether mamba3_backward of ``fwd`` (completed, in the forward's field names) runs chunked: the gpu target,
    batch rows, below f64, the forward's rule for its chunked form, and a device that takes its work-groups and
    LOCAL tiles."""
    return (lim.target == "gpu" and fwd["cu_seqlens"] is None and fwd["dtype"] != "f64"
            and takes_chunked(lim, fwd["seq"], "M3C_MIN_SEQ", ssm_kernel)
            and lim.max_work_group >= lim.tune("M3C_LANES") and _local_bytes(lim, fwd["dtype"]) <= lim.local_mem_bytes)


def scratch(fwd: Thunk, lim: DeviceLimits) -> dict[str, int]:
    """The chunked form's scratch parts (reals of the compute type) beside the step walk's common ones: gy per token,
    each chunk slot's own state (then the entering one), its share of the entering gradient (then the leaving one's
    gradient), decay and rows of <D, S_leaving>, each row's incoming d_v_state; with the MMA variant of
    mamba3_cb_chunk its state products D·k̃ and S_in·q̃ per (token, row)."""
    h, p, n, k = fwd["heads"], fwd["head_dim"], fwd["state_size"], chunk_slots(fwd, lim.tune("M3C_Q"))
    products = {"pr": fwd["batch"] * fwd["seq"] * h * 2 * p} if mma_defines(lim, fwd["dtype"]) else {}
    return {"gy": fwd["batch"] * fwd["seq"] * h * p, "own": h * k * p * n, "down": h * k * p * n, "dec": h * k,
            "ends": h * k * p, "dvin": fwd["batch"] * h * p, **products}


def slots(fwd: Thunk, lim: DeviceLimits) -> int:
    """The chunk slots of a head: the partial sets of d_d (one per slot)."""
    return chunk_slots(fwd, lim.tune("M3C_Q"))


def launches(fwd: Thunk, lim: DeviceLimits, launch: LaunchOf) -> list[Launch]:
    """The three launches between the turn and the per-token launch, through ``launch``."""
    lanes, heads, p = lim.tune("M3C_LANES"), fwd["heads"], fwd["head_dim"]
    k = slots(fwd, lim)
    tiles = heads * k * -(-p // lim.tune("M3C_PT"))
    items = fwd["batch"] * heads * p
    local = min(items, 64)
    return [launch("mamba3_cb_states", (tiles * lanes,), (lanes,), ()),
            launch("mamba3_cb_pass", (-(-items // local) * local,), (local,), ()),
            launch("mamba3_cb_chunk", (heads * k * lanes,), (lanes,), mma_defines(lim, fwd["dtype"]))]


def arguments(fwd: Thunk, lim: DeviceLimits) -> dict[str, Any]:
    """The chunked kernels' own size argument (launches/mamba3.py gives the partials' W and the scratch parts); the
    portable program's ``prb``, unread, where no ``pr`` part is laid out."""
    return dict(K=slots(fwd, lim), **({} if mma_defines(lim, fwd["dtype"]) else {"prb": (SCRATCH, 0)}))
