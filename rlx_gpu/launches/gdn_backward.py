"""Launch geometry of the chunked gated_delta_net_backward (ABI.md §9), every target: kernels/gdn_chunk_backward.cl.

With batch rows, the backward runs in the chunks of a saved forward (ABI.md §9.1: per chunk of 32 tokens the state
leaving it, the decayed Gram products, the WY inverse and U): the reserve's, or without one the forward's kernels
recompute it into scratch (launches/gdn.py's ``recompute_saved``: at the cpu target the walk recording it, at the gpu
target ``gdn_reserve_walk``; then ``gdn_reserve_grams``, ``gdn_reserve_inverse``). Then ``gdn_chunk_back_pass`` (the
reverse pass over the chunks, a work-item per block of state columns: the whole row of V at the cpu target, one column
at the gpu target (up to 256 lanes; its RLX_MMA variant, at most 128 in whole warps, takes dU's K·dS_L and dS0's
products on the tensor cores): dU, Y = inverse^T dU, d_v and the state's gradient entering each chunk), then
``gdn_chunk_back_grads`` (every chunk at once, a work-item per token: the gradients of q, k, beta and g through the
chunk's products; on a device with tensor cores its RLX_MMA variant, ``launches.mma``, takes the state products Y·S0ᵀ,
dO·S0ᵀ and U·dS_Lᵀ there), and the step walk's ``gdn_backward_qk`` sums the value heads' d_q, d_k partials in order (and
takes qk_l2norm's derivative); with qk_l2norm the forward's ``gdn_qk_norm`` writes 1/|q|, 1/|k| first. Per-channel gates
take the same kernels (GDNB_GATE_K): the decays per (token, key channel) in scratch, d_g per key channel. Packed
sequences and ``ssm_kernel="lanes"`` keep the step walk (launches/ssm_backward.py), which hooks this plan in.
"""
from __future__ import annotations

from typing import Callable

from host_fallback.abi import complete
from host_fallback.abi.gdn import RESERVE_CHUNK, gdn_scale, reserve_bytes, reserve_slots

from . import gdn
from .arguments import kernel_launch
from .core import ARENA, SCRATCH, Launch, LaunchPlan, Thunk, real_size
from .limits import DeviceLimits
from .mma import mma_defines

#: the program of these kernels (kernels/gdn_chunk_backward.cl comes before kernels/gdn_backward.cl in it)
FAMILY, TEXT = "gdn_backward", "gdn_chunk_backward.cl"

#: field -> the kernels' tensor parameter that takes it (kernels/gdn_chunk_backward.cl, gdn_backward_qk's)
_TENSOR_PARAMS = {"q": "qb", "k": "kb", "v": "vb", "g": "gb", "beta": "betab", "state": "stb",
                  "state_slots": "slb", "d_dst": "gob", "d_v": "dvb", "d_g": "dgb", "d_beta": "dbetab",
                  "d_state": "dstb", "d_q": "dqb", "d_k": "dkb"}
#: the most lanes of gdn_chunk_back_pass at the gpu target, and warps of its RLX_MMA variant (a column a lane where
#: V allows; kernels/gdn_chunk_backward.cl's GDNC_PASS_LANES, GDNC_PW)
PASS_LANES, PASS_WARPS = 256, 4
#: reserve slot -> the kernels' parameter that reads it
_RESERVE_PARAMS = {"states": "rsb", "qk": "rqb", "kk": "rkb", "inverse": "rib", "u": "rub"}

#: launches/ssm_backward.py's scratch layout: (dtype, part -> reals) -> (part -> byte offset, bytes in all)
Layout = Callable[[str, dict[str, int]], tuple[dict[str, int], int]]


def takes(t: Thunk, ssm_kernel: str = "auto") -> bool:
    """Whether gated_delta_net_backward of ``t`` (completed) runs chunked: batch rows, unless ``ssm_kernel`` is
    "lanes" (the step walk)."""
    return t["cu_seqlens"] is None and ssm_kernel != "lanes"


def plan(t: Thunk, lim: DeviceLimits, layout: Layout, defines: tuple[tuple[str, int], ...]) -> LaunchPlan:
    """The chunked backward of ``t`` (completed): scratch laid out by ``layout``, every launch of the gdn_backward
    program with the step walk's ``defines`` (its variant of the fields)."""
    t = complete(t)
    b, s, h, hv, k, v, dt = t["batch"], t["seq"], t["heads"], t["value_heads"], t["state_size"], t["value_size"], \
        t["dtype"]
    tokens, chunks, ratio = b * s, -(-s // RESERVE_CHUNK), hv // h
    # per-channel gates: the cumulative log-decays and the rows of their gradients, per (slot, token, key channel)
    channels = b * chunks * hv * RESERVE_CHUNK * k if t["gate_per_channel"] else 0
    # the reserve's saved forward, else one recomputed into scratch (at the cpu target beside the walk's output and
    # the copy of the carried state it walks)
    reads = t.get("reserve") is not None
    recorded = 0 if reads else -(-reserve_bytes(t) // real_size(dt))
    at, total = layout(dt, {"nrm": 2 * tokens * h if t["qk_l2norm"] else 0, "ds": b * hv * (chunks + 1) * k * v,
                            "s0": b * hv * k * v, "saved": recorded,
                            "out": tokens * hv * v if recorded and lim.target == "cpu" else 0,
                            "state": -(-gdn.state_bytes(t) // real_size(dt)) if recorded else 0,
                            "dec": gdn.decay_reals(t) if recorded and lim.target == "cpu" else 0,
                            "y": b * chunks * hv * RESERVE_CHUNK * v, "dq": ratio * tokens * h * k,
                            "dk": ratio * tokens * h * k, "ck": channels, "dc": channels, "tl": channels})
    nrm = (SCRATCH, at["nrm"]) if t["qk_l2norm"] else (ARENA, 0)
    scratch = dict(nb=nrm, dsb=(SCRATCH, at["ds"]), s0b=(SCRATCH, at["s0"]), yb=(SCRATCH, at["y"]),
                   ckb=(SCRATCH, at["ck"]))
    buffer, start = (ARENA, t["reserve"]) if reads else (SCRATCH, at["saved"])
    slots = {slot.name: (buffer, start + slot.offset) for slot in reserve_slots(t)}
    reserve = {_RESERVE_PARAMS[name]: place for name, place in slots.items()}
    recompute = () if reads else gdn.recompute_saved(t, lim, slots, nrm, (SCRATCH, at["out"]), (SCRATCH, at["state"]),
                                                     (SCRATCH, at["dec"]))
    dims = dict(S=s, H=h, HV=hv, K=k, V=v, scale=gdn_scale(t))

    def tensors(*names: str) -> dict[str, tuple]:
        return {_TENSOR_PARAMS[f]: (ARENA, t.get(f) or 0) for f in names}  # state, d_state: with carry_state

    def launch(kernel: str, groups: int, lanes: int, args: dict[str, object], *slots: str,
               mma: tuple[tuple[str, int], ...] = ()) -> Launch:
        return kernel_launch(FAMILY, kernel, dt, (groups * lanes,), (lanes,),
                             {**args, **{p: reserve[p] for p in slots}}, target=lim.target, defines=defines + mma)
    # the cpu target walks a block's columns in its inner loops (vectorized), the gpu target a column per lane
    mma = mma_defines(lim, dt)
    cj = v if lim.target == "cpu" else -(-v // (32 * PASS_WARPS if mma else PASS_LANES))
    lanes = -(-v // cj)
    if mma:  # the pass's variant: whole warps (its tiles of K·dS_L and dS0 a warp's each in turn)
        lanes = -(-lanes // 32) * 32
    reverse = launch("gdn_chunk_back_pass", b * hv, lanes,
                     dict(dims, CJ=cj, **tensors("q", "k", "g", "beta", "state", "state_slots", "d_dst", "d_v",
                                                 "d_state"), **scratch), "rqb", "rib", mma=mma)
    grads = launch("gdn_chunk_back_grads", b * chunks * hv, RESERVE_CHUNK,
                   dict(dims, T=tokens, **tensors("q", "k", "v", "g", "beta", "d_dst", "d_g", "d_beta"),
                        **scratch, dqb=(SCRATCH, at["dq"]), dkb=(SCRATCH, at["dk"]), dcb=(SCRATCH, at["dc"]),
                        tlb=(SCRATCH, at["tl"])), "rsb", "rqb", "rkb", "rub", mma=mma)
    e = tokens * h
    qk = launch("gdn_backward_qk", -(-e // 64), 64,
                dict(E=e, K=k, blocks=ratio, **tensors("q", "k", "d_q", "d_k"), scb=(SCRATCH, at["dq"]),
                     dkso=at["dk"]))
    norms = gdn.qk_norms(t, gdn.shape(t), lim, nrm)
    note = "the saved forward's" if reads else "the saved forward recomputed"
    return LaunchPlan((*norms, *recompute, reverse, grads, qk), total, (f"chunked Q={RESERVE_CHUNK}, {note}",))
