"""Launch geometry of causal_conv1d and causal_conv1d_backward (ABI.md §10), every target, kernels/conv.cl.

The forward is one launch over (channel, chunk of T tokens), each work-item walking its tokens in order; a
decode step (seq 1, carried state, slots) is the same launch, straight on the pool. The backward: d_x and
each chunk's sums of d_weight's and d_bias's terms into scratch, then one work-item per channel adds the
chunks' sums in chunk order (no atomics: the same bytes on every run), then with a carried state the initial
state's gradient over d_state, in place. Every field of §10 runs on the device except a state kept wider than
the compute type (f64 beside an f32 or 16-bit thunk), which the host runs.
"""
from __future__ import annotations

from host_fallback.abi import complete

from .arguments import kernel_launch
from .core import ARENA, SCRATCH, Launch, LaunchPlan, Thunk, ceil_to, grid, linear_local, real_size
from .limits import DeviceLimits
from .registry import register

#: the version-2 fields of the forward its kernels implement (all of §10's), and the backward's gradients
V2_FIELDS = frozenset({"bias", "activation", "carry_state", "state", "state_dtype", "cu_seqlens", "num_seqs",
                       "state_slots", "num_slots"})
#: tokens per work-item, per target: long sequential walks where there are few cores, more items on a GPU
CHUNK_TOKENS = {"cpu": 256, "gpu": 32}
#: field -> the kernels' tensor parameter that takes it
_PARAMS = {"x": "xb", "weight": "wb", "bias": "biasb", "state": "stb", "cu_seqlens": "cub", "state_slots": "slb",
           "dst": "db", "d_dst": "ddb", "d_state": "dsb", "d_x": "dxb", "d_weight": "dwb", "d_bias": "dbb"}
_COMPUTE = {"f32": "f32", "f16": "f32", "bf16": "f32", "f64": "f64"}


def _tensors(t: Thunk, *fields: str) -> dict[str, tuple]:
    """The arena arguments of ``fields`` of ``t`` (completed): an absent tensor at offset 0 (its flag is off)."""
    return {_PARAMS[f]: (ARENA, t.get(f) or 0) for f in fields}


def _common(t: Thunk) -> dict[str, object]:
    """The shape, flags and input tensors every kernel of the op but the weight sums takes."""
    varlen = t["cu_seqlens"] is not None
    return dict(R=t["num_seqs"] if varlen else t["batch"], S=t["seq"], D=t["dim"], W=t["width"], varlen=varlen,
                slotted=t["state_slots"] is not None, state_real=t["state_dtype"] != t["dtype"],
                has_bias=t["bias"] is not None, silu=t["activation"] == "silu",
                **_tensors(t, "x", "weight", "bias", "state", "cu_seqlens", "state_slots"))


def _chunks(t: Thunk, lim: DeviceLimits) -> tuple[int, int]:
    """``(T, chunks)``: tokens per work-item and the chunks of the flat token range."""
    total = t["seq"] if t["cu_seqlens"] is not None else t["batch"] * t["seq"]
    tokens = min(total, CHUNK_TOKENS[lim.target])
    return tokens, -(-total // tokens)


def _over(t: Thunk, kernel: str, lim: DeviceLimits, rows: int, args: dict[str, object]) -> Launch:
    """A launch of ``kernel`` over (channel, ``rows``)."""
    local = (linear_local(t["dim"]), 1)
    return kernel_launch("conv", kernel, t["dtype"], grid((t["dim"], rows), local), local, args, target=lim.target)


def _forward(t: Thunk, lim: DeviceLimits, **_: object) -> LaunchPlan:
    t = complete(t)
    tokens, chunks = _chunks(t, lim)
    args = dict(_common(t), T=tokens, carry=bool(t["carry_state"]), **_tensors(t, "dst"))
    return LaunchPlan((_over(t, "causal_conv1d", lim, chunks, args),))


def _backward(t: Thunk, lim: DeviceLimits, **_: object) -> LaunchPlan:
    t = complete(t)
    tokens, chunks = _chunks(t, lim)
    common, carry, dim, width = _common(t), bool(t["carry_state"]), t["dim"], t["width"]
    part_bytes = ceil_to(chunks * dim * (width + 1) * real_size(t["dtype"]), 256)
    launches = [_over(t, "causal_conv1d_backward_dx", lim, chunks,
                      dict(common, T=tokens, carry=carry, pb=(SCRATCH, 0), **_tensors(t, "d_dst", "d_state", "d_x")))]
    local = (linear_local(dim),)
    launches.append(kernel_launch("conv", "causal_conv1d_backward_weight", t["dtype"], grid((dim,), local), local,
                                  dict(D=dim, W=width, chunks=chunks, has_bias=t["bias"] is not None,
                                       pb=(SCRATCH, 0), **_tensors(t, "d_weight", "d_bias")), target=lim.target))
    if carry:
        launches.append(_over(t, "causal_conv1d_backward_state", lim, common["R"],
                              dict(common, **_tensors(t, "d_dst", "d_state"))))
    return LaunchPlan(tuple(launches), part_bytes, (f"{chunks} chunks of {tokens} tokens",))


def unsupported(t: Thunk, lim: DeviceLimits) -> str | None:
    t = complete(t)
    if t["state_dtype"] not in (t["dtype"], _COMPUTE[t["dtype"]]):
        return (f"{t['op']} with state_dtype={t['state_dtype']!r} for a {t['dtype']} thunk: the device kernels keep "
                f"the state in the thunk's dtype or its compute type ({_COMPUTE[t['dtype']]}); the host runs it")
    return None


register("causal_conv1d", _forward, unsupported, v2_fields=V2_FIELDS, family="conv")
register("causal_conv1d_backward", _backward, unsupported, v2_fields=V2_FIELDS | {"d_bias", "d_state"},
         family="conv")
