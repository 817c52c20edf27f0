"""Version-2 gated_delta_net cases (ABI.md §8): grouped value heads, K != V, scale, q/k L2-norm, packed
sequences, state slots; a case's thunk laid out and run on the host beside the float64 reference."""
from __future__ import annotations

import numpy as np

import host_fallback
from rlx_gpu.conformance.reference_ssm import gated_delta_net, lay_out, read


def v2_case(rng, *, batch=2, seq=11, heads=2, value_heads=2, k=8, v=8, per_channel=False, carry=True,
             cu=None, slots=None, num_slots=0, scale=None, l2norm=False, state_dtype=None):
    """``(params, tensors)`` of a version-2 thunk; ``cu`` packs ``seq`` tokens into the one batch row."""
    if cu is not None:
        batch, seq = 1, cu[-1]
    rows = (len(cu) - 1 if cu is not None else batch)
    params = dict(batch=batch, seq=seq, heads=heads, state_size=k, gate_per_channel=per_channel,
                  carry_state=carry, value_heads=value_heads, value_size=v, qk_l2norm=l2norm)
    keys = rng.standard_normal((batch, seq, heads, k))
    tensors = {"q": rng.standard_normal((batch, seq, heads, k)),
               # unnormalized keys when the kernel normalizes them (so the norm is what keeps the state bounded)
               "k": keys * 3 if l2norm else keys / np.linalg.norm(keys, axis=-1, keepdims=True),
               "v": rng.standard_normal((batch, seq, value_heads, v)),
               "g": rng.uniform(-2.0, 0.0, (batch, seq, value_heads, k) if per_channel else (batch, seq, value_heads)),
               "beta": rng.uniform(0.0, 1.0, (batch, seq, value_heads))}
    if scale is not None:
        params["scale"] = scale
    if state_dtype is not None:
        params["state_dtype"] = state_dtype
    if cu is not None:
        params["cu_seqlens"] = tensors["cu_seqlens"] = list(cu)
    if slots is not None:
        params.update(state_slots=list(slots), num_slots=num_slots)
        tensors["state_slots"] = list(slots)
    if carry:
        tensors["state"] = rng.standard_normal((num_slots if slots is not None else rows, value_heads, k, v))
    return params, tensors


def v2_run(dtype, params, tensors, **options):
    """Run a version-2 thunk; return ``(dst, state or None, want dst, want state or None)``."""
    thunk, arena = lay_out("gated_delta_net", dtype, params, tensors)
    ins = {f: read(thunk, arena, f) for f in ("q", "k", "v", "g", "beta")}
    state = read(thunk, arena, "state") if params["carry_state"] else None
    ints = {f: tensors[f] for f in ("cu_seqlens", "state_slots") if f in tensors}
    want, want_state = gated_delta_net(*ins.values(), state, scale=params.get("scale"),
                                       qk_l2norm=params["qk_l2norm"], **ints)
    host_fallback.execute(thunk, arena, **options)
    got_state = read(thunk, arena, "state") if params["carry_state"] else None
    return read(thunk, arena, "dst"), got_state, want, want_state if params["carry_state"] else None


#: name -> the version-2 fields of a case (``v2_case`` keywords); sequence starts fall inside chunks of 4
V2_CASES = {
    "gva": dict(heads=2, value_heads=6),
    "k_ne_v": dict(k=8, v=5),
    "k_lt_v": dict(k=4, v=12, carry=False),
    "scale": dict(scale=0.3),
    "l2norm": dict(l2norm=True),
    "varlen": dict(cu=[0, 3, 3, 10, 11]),  # one sequence empty, one inside a chunk, one a single token
    "varlen_from_zero": dict(cu=[0, 6, 13], carry=False),
    "varlen_at_chunk_edges": dict(cu=[0, 4, 8, 8, 12]),
    "slots": dict(slots=[2, 0], num_slots=4),
    "all": dict(heads=2, value_heads=4, k=8, v=6, cu=[0, 5, 5, 7, 14], slots=[1, 3, 0, 4], num_slots=5, l2norm=True,
                scale=0.4),
}
