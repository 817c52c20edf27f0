"""Launch geometry of the chunked mamba2_backward (ABI.md §9) at the gpu target: kernels/mamba2_backward.cl.

From M2_MIN_SEQ steps on (as the forward's chunked form), for batch rows of a thunk below f64, the backward
runs in the forward's chunks of M2_Q steps: the forward's own ``mamba2_chunk_state`` (each chunk's state from
zero and its decay, in the forward's program), then ``mamba2_backward_dstate``, ``mamba2_backward_pass`` and
``mamba2_backward_chunk``, whose partials ``ssm_backward_reduce`` sums (launches/ssm_backward.py gives the
reduce launches: the step walk's, over other partials, in the ssm_backward program). Given a saved forward
(ABI.md §9.1: its states leave chunks of 64 tokens) and M2_Q equal to that chunk length, no mamba2_chunk_state
runs: the pass takes the states entering each chunk from the reserve (variant SSM_RESERVE; the dstate launch writes
the chunks' decays then), and the chunk kernel its scores C.B^T and outputs y; with another M2_Q all is recomputed,
the reserve unread. Packed sequences (cu_seqlens) keep the step walk. launches/ssm_backward.py registers the op
against this program (``FAMILY``). Where the device takes a tensor-core variant (``launches.mma``), dstate's and the
chunk kernel's run (the chunk kernel's state products through scratch: ``ends``, ``starts``), and the forward's
mamba2_chunk_state's from split operands (``SPLIT_STATES``).
"""
from __future__ import annotations

from typing import Any, Callable

from host_fallback.abi.ssm import mamba2_reserve_slots

from .arguments import kernel_launch
from .core import ARENA, SCRATCH, Launch, LaunchPlan, Thunk, grid, linear_local
from .limits import DeviceLimits
from .mma import mma_defines
from .ssm import TEXTS, chunk_slots, dt_limits, field_defines, saved, takes_chunked, tensors

#: the program of these kernels, and the texts before kernels/mamba2_backward.cl in it (the forward's, whose chunk
#: helpers it calls, the split tensor-core operands of its RLX_MMA variant among them)
FAMILY, SHARED_TEXTS = "mamba2_backward", TEXTS + ("ssm.cl",)

#: the define of mamba2_chunk_state's variant from split operands, as this backward recomputes the chunk states
SPLIT_STATES = (("M2_SPLIT_STATES", 1),)

#: field -> the chunked kernels' tensor parameter that takes it (kernels/mamba2_backward.cl)
_TENSOR_PARAMS = {"x": "xb", "dt": "dtb", "a": "ab", "b": "bb", "c": "cb", "bias": "biasb", "d": "skb", "z": "zb",
                  "state": "stb", "state_slots": "slb", "d_dst": "gb", "d_x": "dxb", "d_dt": "ddtb", "d_z": "dzb",
                  "d_state": "dstb"}

#: launches/ssm_backward.py's scratch layout: (dtype, part -> reals) -> (part -> byte offset, bytes in all)
Layout = Callable[[str, dict[str, int]], tuple[dict[str, int], int]]
#: and its reduce launch: (output offset, outputs, partial sets, per set, scratch offset, stored in the parameter
#: type, dtype, limits, defines) -> the launch
Reduce = Callable[[int, int, int, int, int, bool, str, DeviceLimits, tuple], Launch]


def takes(fwd: Thunk, lim: DeviceLimits, ssm_kernel: str = "auto") -> bool:
    """Whether mamba2_backward of ``fwd`` (completed, in the forward's field names) runs chunked: the gpu target,
    batch rows, below f64, and the forward's rule for its chunked form (``ssm_kernel``: "lanes" keeps the step
    walk, "chunked" forces this)."""
    return (lim.target == "gpu" and fwd["cu_seqlens"] is None and fwd["dtype"] != "f64"
            and takes_chunked(lim, fwd["seq"], "M2_MIN_SEQ", ssm_kernel))


def _saved_outputs(fwd: Thunk, reads: bool) -> dict[str, Any]:
    """mamba2_backward_chunk's saved-forward arguments: the reserve's y (``ryb``) and scores (``rwo``) when it
    ``reads`` them, else offset 0 (never read)."""
    if not reads:
        return dict(ryb=(ARENA, 0), rwo=0)
    at = {slot.name: fwd["reserve"] + slot.offset for slot in mamba2_reserve_slots(fwd)}
    return dict(ryb=(ARENA, at["y"]), rwo=at["scores"])


def plan(fwd: Thunk, lim: DeviceLimits, layout: Layout, reduce: Reduce) -> LaunchPlan:
    """The chunked backward of ``fwd`` (the backward thunk completed, in the forward's view): scratch laid out by
    ``layout``, the partials summed by ``reduce``'s launches (the step walk's own)."""
    r, s, heads, p, n, g, dt = fwd["batch"], fwd["seq"], fwd["heads"], fwd["head_dim"], fwd["state_size"], \
        fwd["groups"], fwd["dtype"]
    q, k, tokens = lim.tune("M2_Q"), chunk_slots(fwd, lim.tune("M2_Q")), fwd["batch"] * fwd["seq"]
    reserve = saved(fwd)
    reads = fwd.get("reserve") is not None and reserve["RQ"] == q  # the saved states are this chunking's
    variant = mma_defines(lim, dt)
    # the chunk kernel's RLX_MMA variant: its state products D·b and (not from a reserve) S_in·c per (token, row)
    products = {"ends": tokens * heads * p, **({} if reads else {"starts": tokens * heads * p})} if variant else {}
    at, total = layout(dt, {"states": heads * k * p * n, "decays": heads * k, "grads": heads * k * p * n,
                             "finals": r * heads * p * n, "gy": tokens * heads * p,
                             "db": tokens * heads * n, "dc": tokens * heads * n,
                             "da": k * heads, "dd": k * heads, "dbias": k * heads, **products})
    fields = tuple(f for f in field_defines(fwd) if reads or f[0] != "SSM_RESERVE")
    mine = dict(S=s, HD=heads, P=p, N=n, K=k)
    scratch = {name: (SCRATCH, at[part]) for name, part in (("sb", "states"), ("eb", "decays"), ("ddb", "grads"),
                                                            ("fb", "finals"), ("gyb", "gy"))}

    def arena(*names: str) -> dict[str, tuple]:
        return tensors(fwd, names, _TENSOR_PARAMS)

    def launch(kernel: str, size: tuple, local: tuple, args: dict[str, Any], *parts: str, mma: bool = False) -> Launch:
        """A launch of this program; ``mma``: with the kernel's RLX_MMA variant where the device takes one
        (mamba2_backward_dstate's and mamba2_backward_chunk's; the pass has none, so it runs in the portable
        program)."""
        return kernel_launch(FAMILY, kernel, dt, size, local, {**args, **{x: scratch[x] for x in parts}},
                             target="gpu", defines=fields + (variant if mma else ()))

    lanes = lim.tune("M2_LANES")
    tiles = ((heads * k * -(-p // lim.tune("M2_PT")) * lanes,), (lanes,))  # (chunk slot, M2_PT rows of P)
    # the forward's chunk_state, its MMA variant from split operands (M2_SPLIT_STATES): the states it builds feed the
    # log-decay's gradient, sums of cancelling terms gy.y - u.du, which states rounded once to 16 bits push past the
    # conformance bounds
    own = kernel_launch("ssm", "mamba2_chunk_state", dt, *tiles,
                        dict(R=r, **mine, G=g, **arena("x", "dt", "a", "b", "bias"), cub=(ARENA, 0), **dt_limits(fwd),
                             sb=scratch["sb"], eb=scratch["eb"], tb=(SCRATCH, 0)), target="gpu",
                        defines=fields + (variant + SPLIT_STATES if variant else ()))
    chunk_groups = ((heads * k * q,), (q,))
    dstate = launch("mamba2_backward_dstate", *tiles,
                    dict(**mine, G=g, **arena("dt", "a", "c", "bias", "z", "d_dst"), **dt_limits(fwd)), "gyb", "ddb",
                    "eb", mma=True)
    elements = r * heads * p * n
    local = (linear_local(elements),)
    state_pass = launch("mamba2_backward_pass", grid((elements,), local), local,
                        dict(R=r, **mine, **arena("state", "state_slots", "d_state"), **reserve), "sb", "eb", "ddb",
                        "fb")
    chunk = launch("mamba2_backward_chunk", *chunk_groups,
                   dict(**mine, T=tokens, G=g, **arena("x", "dt", "a", "b", "c", "bias", "d", "z", "d_dst", "d_x",
                                                       "d_dt", "d_z"),
                        pbcb=(SCRATCH, at["db"]), pco=at["dc"], psb=(SCRATCH, at["da"]), pdo=at["dd"],
                        pbiaso=at["dbias"], **_saved_outputs(fwd, reads), mpb=(SCRATCH, at.get("ends", 0)),
                        mso=at.get("starts", 0), **dt_limits(fwd)),
                   "gyb", "sb", "fb", "ddb", mma=True)
    sums = [("d_b", tokens * g * n, heads // g, "db", False), ("d_c", tokens * g * n, heads // g, "dc", False),
            ("d_a", heads, k, "da", True), ("d_d", heads, k, "dd", True), ("d_dt_bias", heads, k, "dbias", True)]
    reduces = [reduce(fwd[field], m, sets, 1, at[part], as_param, dt, lim, fields)
               for field, m, sets, part, as_param in sums if fwd.get(field) is not None]
    first = () if reads else (own,)
    return LaunchPlan((*first, dstate, state_pass, chunk, *reduces), total,
                      (f"chunked Q={q}" + (", the saved forward's states" if reads else ""),))
