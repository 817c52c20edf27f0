"""Launch geometry of selective_scan and mamba2 (ABI.md §4 and the version-2 fields of §8).

cpu target: one work-item per state row (mamba2: per M2_PB rows) walks the sequence; a selective_scan decode
step (seq 1) gives each item SS_TC channels. gpu target: the
state of one row spread across the lanes of a work-group (``state_lanes``, its size a compile-time
variant) for decode and short sequences; from SSC_MIN_SEQ / M2_MIN_SEQ steps on, the chunked forms.
A row is a batch row or, with ``cu_seqlens``, one packed sequence. The version-2 fields a thunk uses
select a compile-time variant of the kernels (``field_defines``); the kernels take every optional
tensor as an argument, at offset 0 where the thunk has none (the variant never reads it). A saved forward
(``reserve``, ABI.md §9.1) is the variant SSM_RESERVE: the kernels store its states (mamba2: and outputs) as they
walk, and mamba2's scores take a launch of their own (``_mamba2_scores``); the decode forms give way to the walks.
"""
from __future__ import annotations

import math
from typing import Any

from host_fallback.abi import complete
from host_fallback.abi.ssm import RESERVE_CHUNK, SCAN_RESERVE_CHUNK

from .arguments import kernel_launch
from .core import ARENA, SCRATCH, Launch, LaunchPlan, Thunk, ceil_to, grid, linear_local, real_size
from .limits import DeviceLimits, state_variant
from .mma import mma_defines
from .registry import register

Defines = tuple[tuple[str, int], ...]

#: The version-2 fields (ABI.md §8) of both ops that the kernels below implement.
#: the kernel text the state-space families share (their fields' loads), put before each one's own
FIELDS_TEXT = ("ssm_fields.cl",)
#: the ssm program's texts before kernels/ssm.cl: the fields, and the split tensor-core operands (mma_hi) of
#: mamba2_chunk_state's variant as mamba2's backward launches it (M2_SPLIT_STATES: launches/mamba2_backward.py)
TEXTS = FIELDS_TEXT + ("mma_split.cl",)
V2_FIELDS = frozenset({
    "groups", "d", "z", "carry_state", "state", "state_dtype", "param_dtype", "cu_seqlens", "num_seqs",
    "state_slots", "num_slots",
    "delta_bias", "delta_softplus",  # selective_scan
    "dt_bias", "dt_softplus", "dt_limit",  # mamba2
})
#: the saved forward (ABI.md §9.1): selective_scan's and mamba2's kernels (forward and backward) take it
RESERVE_FIELDS = frozenset({"reserve", "reserve_bytes"})
#: per op, the chunk length of its saved forward's states (docs/abi.md 6a.1)
RESERVE_EVERY = {"selective_scan": SCAN_RESERVE_CHUNK, "mamba2": RESERVE_CHUNK}

#: kernels/ssm.cl's switches of the version-2 fields, in the order a launch's defines list them
SWITCHES = ("SSM_BIAS", "SSM_SOFTPLUS", "SSM_LIMIT", "SSM_D", "SSM_Z", "SSM_CARRY", "SSM_VARLEN", "SSM_SLOTS",
            "SSM_STATE_F32", "SSM_PARAM_F32", "SSM_RESERVE")
#: per op, the names of its delta transform's fields: (bias, softplus)
_DELTA = {"selective_scan": ("delta_bias", "delta_softplus"), "mamba2": ("dt_bias", "dt_softplus")}
_SIXTEEN_BIT = ("f16", "bf16")


def field_defines(t: Thunk) -> Defines:
    """The compile-time variant of the version-2 fields ``t`` (completed) uses: kernels/ssm.cl's SSM_*
    switches, each given as 1; none for a version-1 thunk."""
    bias, softplus = _DELTA[t["op"]]
    on = {
        "SSM_BIAS": t[bias] is not None, "SSM_SOFTPLUS": bool(t[softplus]),
        "SSM_LIMIT": t.get("dt_limit") is not None, "SSM_D": t["d"] is not None, "SSM_Z": t["z"] is not None,
        "SSM_CARRY": bool(t["carry_state"]), "SSM_VARLEN": t["cu_seqlens"] is not None,
        "SSM_SLOTS": t["state_slots"] is not None,
        # f32 state / parameters beside a 16-bit thunk (f32 is then the compute type itself)
        "SSM_STATE_F32": t["dtype"] in _SIXTEEN_BIT and t["state_dtype"] == "f32",
        "SSM_PARAM_F32": t["dtype"] in _SIXTEEN_BIT and t["param_dtype"] == "f32",
        "SSM_RESERVE": t.get("reserve") is not None,
    }
    return tuple((name, 1) for name in SWITCHES if on[name])


def rows(t: Thunk) -> int:
    """Independent sequences of ``t`` (completed): ``num_seqs`` with cu_seqlens, else ``batch``."""
    return t["num_seqs"] if t["cu_seqlens"] is not None else t["batch"]


#: field -> the kernels' tensor parameter that takes it (kernels/ssm.cl, kernels/ssm_backward.cl)
TENSOR_PARAMS = {"x": "xb", "delta": "deb", "dt": "dtb", "a": "ab", "b": "bb", "c": "cb", "dst": "db", "bias": "biasb",
                 "d": "skb", "z": "zb", "state": "stb", "cu_seqlens": "cub", "state_slots": "slb"}


def tensors(t: Thunk, fields: tuple[str, ...], params: dict[str, str] = TENSOR_PARAMS) -> dict[str, tuple]:
    """The arena arguments of ``fields`` of ``t``, by their kernel parameters in ``params`` (``bias``: the op's
    delta_bias / dt_bias); an optional tensor ``t`` has none of (``state`` without carry_state included)
    passes offset 0."""
    out = {}
    for f in fields:
        offset = t[_DELTA[t["op"]][0] if f == "bias" else f]
        out[params[f]] = (ARENA, 0 if offset is None else offset)
    return out


def saved(t: Thunk) -> dict[str, Any]:
    """The kernels' saved-forward arguments of ``t`` (completed, forward or backward): the reserve (offset 0
    without one: the variant never reads it) and its chunk length ``RQ``."""
    return {"rsb": (ARENA, t.get("reserve") or 0), "RQ": RESERVE_EVERY[t["op"].removesuffix("_backward")]}


def dt_limits(t: Thunk) -> dict[str, float]:
    """mamba2's dt clamp, ``lo`` and ``hi`` (hi null: +inf); unused without dt_limit."""
    lo, hi = t["dt_limit"] if t["dt_limit"] is not None else (0.0, None)
    return {"lo": lo, "hi": math.inf if hi is None else hi}


def state_lanes(n: int, rows: int, outer: int, lim: DeviceLimits) -> tuple[Defines, tuple[int], tuple[int]]:
    """gpu geometry for ``outer`` independent blocks of ``rows`` state rows of ``n`` values: the program
    variant (``SSM_N`` >= n, ``SSM_L`` lanes per row) and a 1-D grid of work-groups of up to SSM_WG
    lanes, each covering a power of two of rows of one block."""
    defines = state_variant(n)
    lanes = dict(defines)["SSM_L"]
    per_group = linear_local(rows, max(1, min(lim.tune("SSM_WG"), lim.max_work_group) // lanes))
    local = lanes * per_group
    return defines, (outer * -(-rows // per_group) * local,), (local,)


#: the state-space kernel choices at the gpu target (the ``ssm_kernel`` run option)
SSM_KERNELS = ("auto", "lanes", "chunked")


def takes_chunked(lim: DeviceLimits, seq: int, rule: str, ssm_kernel: str) -> bool:
    """gpu target: whether the chunked form runs (``ssm_kernel``: "auto" by the ``rule`` tuning
    constant, "lanes" or "chunked" to force one, as benchmarks/ssm_device.py does)."""
    if ssm_kernel not in SSM_KERNELS:
        raise ValueError(f"ssm_kernel={ssm_kernel!r}: expected one of {', '.join(SSM_KERNELS)}")
    return ssm_kernel == "chunked" or (ssm_kernel == "auto" and seq >= lim.tune(rule))


_SS_TENSORS = ("x", "delta", "a", "b", "c", "dst", "bias", "d", "z", "state", "cu_seqlens", "state_slots")


def _selective_scan(t: Thunk, lim: DeviceLimits, ssm_kernel: str = "auto", **_: object) -> LaunchPlan:
    t = complete(t)
    r, s, h, n, dt = rows(t), t["seq"], t["hidden"], t["state_size"], t["dtype"]
    args = dict(R=r, S=s, H=h, N=n, G=t["groups"], **tensors(t, _SS_TENSORS))
    fields, keep = field_defines(t), t["reserve"] is not None
    if lim.target == "gpu":
        # one group per (row, SSC_CB channels); a reserve's chunks must end where a lane's steps do
        if takes_chunked(lim, s, "SSC_MIN_SEQ", ssm_kernel) and not (keep and SCAN_RESERVE_CHUNK % lim.tune("SSC_T")):
            lanes = lim.tune("SSC_CB") * lim.tune("SSC_SL")
            glob, local = (r * -(-h // lim.tune("SSC_CB")) * lanes,), (lanes,)
            return LaunchPlan((kernel_launch("ssm", "selective_scan_chunked", dt, glob, local, {**args, **saved(t)},
                                             target="gpu", defines=fields),))
        defines, glob, local = state_lanes(n, h, r, lim)
        return LaunchPlan((kernel_launch("ssm", "selective_scan_lanes", dt, glob, local, {**args, **saved(t)},
                                         target="gpu", defines=defines + fields),))
    decode = s == 1 and t["cu_seqlens"] is None and not keep
    items = -(-h // lim.tune("SS_TC")) if decode else h  # decode: SS_TC channels each
    local = (linear_local(items), 1)
    return LaunchPlan((kernel_launch("ssm", "selective_scan", dt, grid((items, r), local), local, {**args, **saved(t)},
                                     target=lim.target, defines=fields),))


_M2_TENSORS = ("x", "dt", "a", "b", "c", "dst", "bias", "d", "z", "state", "cu_seqlens", "state_slots")


def _mamba2(t: Thunk, lim: DeviceLimits, ssm_kernel: str = "auto", **_: object) -> LaunchPlan:
    t = complete(t)
    r, s, heads, p, n = rows(t), t["seq"], t["heads"], t["head_dim"], t["state_size"]
    args = dict(R=r, S=s, HD=heads, P=p, N=n, G=t["groups"], **tensors(t, _M2_TENSORS), **dt_limits(t))
    fields, keep = field_defines(t), t["reserve"] is not None
    if lim.target == "gpu":
        # a reserve's chunks must be the chunked form's
        if takes_chunked(lim, s, "M2_MIN_SEQ", ssm_kernel) and t["dtype"] != "f64" and not (
                keep and lim.tune("M2_Q") != RESERVE_CHUNK):
            chunked = _mamba2_chunked(t, lim, fields)
            if not keep:
                return chunked
            return LaunchPlan(chunked.launches + (_mamba2_scores(t, lim, fields + mma_defines(lim, t["dtype"])),),
                              chunked.scratch_bytes, chunked.notes)
        defines, glob, local = state_lanes(n, p, r * heads, lim)
        walk = kernel_launch("ssm", "mamba2_lanes", t["dtype"], glob, local, {**args, **saved(t)}, target="gpu",
                             defines=defines + fields)
    else:
        defines, items = (), -(-p // lim.tune("M2_PB"))  # one work-item per M2_PB state rows
        local = (linear_local(items), 1, 1)
        walk = kernel_launch("ssm", "mamba2", t["dtype"], grid((items, heads, r), local), local, {**args, **saved(t)},
                             target=lim.target, defines=fields)
    return LaunchPlan((walk, _mamba2_scores(t, lim, defines + fields)) if keep else (walk,))


def _mamba2_scores(t: Thunk, lim: DeviceLimits, defines: Defines) -> Launch:
    """mamba2_reserve_scores: the saved forward's chunk scores (docs/abi.md 6a.1), in the forward's program."""
    every, chunks = RESERVE_EVERY["mamba2"], -(-t["seq"] // RESERVE_EVERY["mamba2"])
    local = (linear_local(every), 1, 1)
    args = dict(R=t["batch"], S=t["seq"], HD=t["heads"], P=t["head_dim"], N=t["state_size"], G=t["groups"],
                **tensors(t, ("dt", "a", "b", "c", "bias")), **saved(t), **dt_limits(t))
    size = grid((every, t["heads"], t["batch"] * chunks), local)
    return kernel_launch("ssm", "mamba2_reserve_scores", t["dtype"], size, local, args, target=lim.target,
                         defines=defines)


def chunk_slots(t: Thunk, q: int) -> int:
    """Chunks of ``q`` steps the chunked mamba2 lays out per head: ``ceil(seq/q)`` per row, or with
    cu_seqlens the most that sequences of any lengths summing to ``seq`` take (each one's last chunk
    may be partial): ``(seq + num_seqs*(q-1)) // q``."""
    if t["cu_seqlens"] is not None:
        return (t["seq"] + t["num_seqs"] * (q - 1)) // q
    return t["batch"] * -(-t["seq"] // q)


def _mamba2_chunked(t: Thunk, lim: DeviceLimits, fields: Defines) -> LaunchPlan:
    """Three launches over scratch holding one state per (head, chunk slot): each chunk's own state,
    the inter-chunk pass, the chunk outputs; with cu_seqlens a first launch lays the chunk slots out
    per sequence (f64 keeps the lanes kernel: its tiles would pass CUDA's 48 KiB of static shared
    memory). On a device with tensor cores every launch takes the chunk GEMMs' MMA variant (``mma``):
    one program holds them all."""
    r, s, heads, p, n, dt = rows(t), t["seq"], t["heads"], t["head_dim"], t["state_size"], t["dtype"]
    lanes, k = lim.tune("M2_LANES"), chunk_slots(t, lim.tune("M2_Q"))
    dec_at = ceil_to(heads * k * p * n * real_size(dt), 256)
    table_at = ceil_to(dec_at + heads * k * real_size(dt), 256)
    varlen = t["cu_seqlens"] is not None
    dims = dict(R=r, S=s, HD=heads, P=p, N=n, K=k)
    tile = ((heads * k * -(-p // lim.tune("M2_PT")) * lanes,), (lanes,))
    scratch = dict(sb=(SCRATCH, 0), eb=(SCRATCH, dec_at), tb=(SCRATCH, table_at))  # states, decays, chunk table

    def launch(kernel: str, size: tuple, local: tuple, args: dict[str, Any], *parts: str) -> Launch:
        return kernel_launch("ssm", kernel, dt, size, local, {**args, **{p: scratch[p] for p in parts}},
                             target="gpu", defines=fields + mma_defines(lim, dt))

    cu = tensors(t, ("cu_seqlens",))
    state = launch("mamba2_chunk_state", *tile, dict(**dims, G=t["groups"], **cu, **dt_limits(t),
                                                     **tensors(t, ("x", "dt", "a", "b", "bias"))), "sb", "eb", "tb")
    carry = launch("mamba2_state_pass", grid((r * heads * p * n,), (lanes,)), (lanes,),
                   dict(**dims, **tensors(t, ("state", "state_slots")), **saved(t)), "sb", "eb", "tb")
    scan = launch("mamba2_chunk_scan", *tile, dict(**dims, G=t["groups"], **cu, **dt_limits(t), **saved(t),
                                                   **tensors(t, ("x", "dt", "a", "b", "c", "dst", "bias", "d", "z"))),
                  "sb", "tb")
    launches = (state, carry, scan)
    if varlen:
        launches = (launch("mamba2_varlen_chunks", (1,), (1,), dict(R=r, K=k, **cu), "tb"),) + launches
    return LaunchPlan(launches, table_at + (k + r + 1) * 4 if varlen else dec_at + heads * k * real_size(dt),
                      (f"chunked Q={lim.tune('M2_Q')}",))


def unsupported(t: Thunk, lim: DeviceLimits) -> str | None:
    t = complete(t)
    if t["state_size"] > lim.tune("STATE_MAX"):
        return f"{t['op']} keeps a state row of state_size={t['state_size']} in private memory; the kernel holds at most {lim.tune('STATE_MAX')}"
    wider = [f"{f}={t[f]}" for f in ("state_dtype", "param_dtype") if t[f] == "f64" and t["dtype"] != "f64"]
    if wider:
        return (f"{t['op']}'s device kernels carry the recurrence in the compute type of dtype={t['dtype']} (f32); "
                f"{' and '.join(wider)} runs on the host (or give f32)")
    return None


register("selective_scan", _selective_scan, unsupported, v2_fields=V2_FIELDS | RESERVE_FIELDS, family="ssm",
         shared_texts=TEXTS)
register("mamba2", _mamba2, unsupported, v2_fields=V2_FIELDS | RESERVE_FIELDS, family="ssm", shared_texts=TEXTS)
