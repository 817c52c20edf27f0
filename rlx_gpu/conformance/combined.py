"""The combined-field cases: many version-2 fields (ABI.md §8) of one op at once — one compile-time
variant of its kernels each — in every kernel form of both targets (the cpu recurrence and decode step,
the gpu lanes and chunked forms, packed sequences ending inside a chunk), at the dtypes that stress them.

The catalog's other cases switch one optional field at a time on small shapes; these are the
combinations, run by every backend through the one harness (``catalog.cases`` adds them).
"""
from __future__ import annotations

from typing import Any

#: (label, op, dtype, params, options) of one combined case
Combined = tuple[str, str, str, dict[str, Any], dict[str, Any]]

# ------------------------------------------------------------------ selective_scan and mamba2
_CARRIED = dict(carry_state=True, state=True)
_PACKED = dict(batch=1, cu_seqlens=[0, 5, 5, 70], num_seqs=3, state_slots=[2, 0, 3], num_slots=4)  # one empty
#: (label, op, dtype, params); each runs in both of the gpu target's forms (``SSM_FORMS``)
_SSM: list[tuple[str, str, str, dict[str, Any]]] = [
    # every field of the op at once: varlen into slots, 16-bit thunk with f32 state and parameters
    ("every_field", "selective_scan", "bf16",
     dict(seq=70, hidden=6, state_size=4, groups=2, delta_bias=True, delta_softplus=True, d=True, z=True,
          state_dtype="f32", param_dtype="f32", **_CARRIED, **_PACKED)),
    ("every_field", "mamba2", "bf16",
     dict(seq=70, heads=4, head_dim=3, state_size=5, groups=2, dt_bias=True, dt_softplus=True, dt_limit=[0.05, None],
          d=True, z=True, state_dtype="f32", param_dtype="f32", **_CARRIED, **_PACKED)),
    # batch rows, state_size 16 (selective_scan's fixed-width path at the cpu target: a block of 8 steps, then
    # 3 single steps), slots without varlen
    ("slots_fixed_width", "selective_scan", "f32",
     dict(batch=2, seq=11, hidden=4, state_size=16, groups=4, delta_bias=True, z=True, state_slots=[1, 0],
          num_slots=2, **_CARRIED)),
    ("partial_rows", "mamba2", "f16",
     dict(batch=2, seq=6, heads=2, head_dim=17, state_size=4, groups=1, dt_limit=[0.1, 0.3], d=True, **_CARRIED)),
    # one token per row (mamba2's decode form at the cpu target): batch rows; packed sequences of 1, 0 and 3
    # tokens into slots; head_dim 17 (an item with a partial block of rows), odd state_size
    ("decode", "mamba2", "f32",
     dict(batch=2, seq=1, heads=2, head_dim=17, state_size=5, groups=2, dt_bias=True, dt_softplus=True, d=True,
          z=True, **_CARRIED)),
    ("short_packed", "mamba2", "f32",
     dict(batch=1, seq=4, heads=2, head_dim=17, state_size=5, groups=1, dt_limit=[0.1, 0.3], z=True,
          cu_seqlens=[0, 1, 1, 4], num_seqs=3, state_slots=[2, 0, 3], num_slots=4, **_CARRIED)),
    ("decode_no_state", "mamba2", "f32", dict(batch=2, seq=1, heads=2, head_dim=4, state_size=6, d=True)),
    ("state_only", "mamba2", "f64", dict(batch=2, seq=4, heads=2, head_dim=3, state_size=6, **_CARRIED)),
    # the host suites' every-field cases (five packed sequences of 37 tokens, one empty, into a pool of 7)
    ("host_every_field", "selective_scan", "f32",
     dict(batch=1, seq=37, hidden=4, state_size=4, groups=2, cu_seqlens=[0, 5, 5, 18, 19, 37], num_seqs=5,
          state_slots=[6, 0, 3, 5, 1], num_slots=7, delta_bias=True, delta_softplus=True, d=True, z=True, **_CARRIED)),
    ("host_every_field", "mamba2", "f32",
     dict(batch=1, seq=37, heads=4, head_dim=3, state_size=4, groups=2, cu_seqlens=[0, 5, 5, 18, 19, 37], num_seqs=5,
          state_slots=[6, 0, 3, 5, 1], num_slots=7, dt_bias=True, dt_softplus=True, dt_limit=[0.0, None], d=True,
          z=True, **_CARRIED)),
]
#: the gpu target's two state-space forms, each forced (the cpu target and the host run both alike; mamba2 in
#: f64 keeps the lanes form)
SSM_FORMS = ({"ssm_kernel": "lanes"}, {"ssm_kernel": "chunked"})


# ------------------------------------------------------------------ gated_delta_net
def gdn_params(**params: Any) -> dict[str, Any]:
    """A gated_delta_net case of batch 2, seq 7, 2 heads of 8, scalar gates, state carried, with ``params``."""
    return {**dict(batch=2, seq=7, heads=2, state_size=8, gate_per_channel=False, carry_state=True), **params}


_GDN_V2 = dict(value_heads=4, value_size=12, scale=0.3, qk_l2norm=True)
#: (label, dtype, params): every field, in the cpu recurrence (seq > 1), the cpu decode step (seq 1), the gpu
#: lanes (short) and chunked (seq >= GDN_MIN_SEQ) forms
GDN: list[tuple[str, str, dict[str, Any]]] = [
    ("gva_kv_scale_norm", "f32", gdn_params(**_GDN_V2)),
    ("gva_kv_scale_norm_channel_chunked", "f32", gdn_params(seq=70, gate_per_channel=True, **_GDN_V2)),
    ("gva_kv_nocarry_chunked", "f32",
     gdn_params(seq=66, carry_state=False, value_heads=4, value_size=20, state_size=16)),
    ("decode_slots_gva_norm_tail", "f32",
     gdn_params(batch=3, seq=1, gate_per_channel=True, state_slots=[1, 3, 0], num_slots=4,
                **{**_GDN_V2, "value_size": 40})),
    ("varlen_slots_channel", "f32",
     gdn_params(batch=1, seq=9, cu_seqlens=[0, 4, 4, 9], state_slots=[2, 0, 3], num_slots=4, gate_per_channel=True,
                value_heads=4)),
    ("varlen_nocarry", "f32", gdn_params(batch=1, seq=9, cu_seqlens=[0, 4, 4, 9], carry_state=False, qk_l2norm=True)),
    ("varlen_chunked_boundaries", "f32",
     gdn_params(batch=1, seq=150, cu_seqlens=[0, 50, 52, 130, 150], state_slots=[4, 1, 0, 2], num_slots=5,
                value_heads=4, value_size=12)),
    ("varlen_decode", "f32", gdn_params(batch=1, seq=1, cu_seqlens=[0, 0, 1], state_slots=[1, 0], num_slots=2)),
    ("state_f32", "bf16", gdn_params(seq=70, state_dtype="f32", value_size=20, state_size=16)),
    ("state_f32_decode", "bf16",
     gdn_params(batch=3, seq=1, state_dtype="f32", gate_per_channel=True, value_size=40)),
    ("state_f32_varlen_channel", "f16",
     gdn_params(batch=1, seq=9, cu_seqlens=[0, 5, 9], state_dtype="f32", gate_per_channel=True, qk_l2norm=True,
                state_slots=[1, 0], num_slots=2)),
    ("wide_value", "f32", gdn_params(batch=1, seq=3, heads=1, state_size=40, value_size=256, scale=0.1)),
    ("wide_key", "f32", gdn_params(batch=1, seq=2, heads=1, state_size=256, value_size=24, gate_per_channel=True)),
    # the host suite's every-field case: packed sequences (one empty) into a pool of 5
    ("host_every_field", "f32",
     gdn_params(batch=1, seq=14, heads=2, value_heads=4, state_size=8, value_size=6, cu_seqlens=[0, 5, 5, 7, 14],
                state_slots=[1, 3, 0, 4], num_slots=5, qk_l2norm=True, scale=0.4)),
]

# ------------------------------------------------------------------ lstm, gru, rnn
RNN_BASE = dict(batch=5, seq=6, input_size=3, hidden=5, num_layers=2, bidirectional=True, carry=True)
#: one case per op, every optional field on at once (the variants of launches.limits.RNN_FIELD_VARIANTS)
RNN_FIELDS: dict[str, dict[str, Any]] = {
    "lstm": dict(RNN_BASE, seq_lens=[6, 2, 0, 5, 1], clip=0.9, peepholes=True, input_forget=True, proj_size=3,
                 w_hr=True, activations=[["hard_sigmoid", 0.3, 0.6], ["elu", 0.8, 0.0], ["scaled_tanh", 1.2, 0.7],
                                         ["hard_sigmoid", 0.3, 0.4], ["elu", 1.1, 0.0], ["softsign", 0.0, 0.0]]),
    "gru": dict(RNN_BASE, seq_lens=[3, 6, 1, 0, 4], clip=1.1, linear_before_reset=False,
                activations=[["leaky_relu", 0.05, 0.0], ["affine", 0.7, 0.1],
                             ["leaky_relu", 0.2, 0.0], ["softplus", 0.0, 0.0]]),
    "rnn": dict(RNN_BASE, relu=False, seq_lens=[2, 6, 6, 0, 3], clip=0.8,
                activations=[["thresholded_relu", 0.1, 0.0], ["sigmoid", 0.0, 0.0]]),
}
#: single fields beside those: reverse (one direction), seq_lens with the default activations, peepholes
#: (the forget gate's, which input_forget drops)
_RNN_SINGLE: list[tuple[str, str, dict[str, Any]]] = [
    ("reverse", "lstm", dict(RNN_BASE, bidirectional=False, reverse=True, num_layers=1)),
    ("lens", "gru", dict(RNN_BASE, seq_lens=[6, 0, 3, 3, 1], num_layers=1)),
    ("peepholes", "lstm", dict(RNN_BASE, peepholes=True, num_layers=1)),
]
#: both recurrent kernels, each forced
RNN_FORMS = ({"rnn_kernel": "persistent"}, {"rnn_kernel": "step"})


def combined() -> list[Combined]:
    """Every combined case, in a stable order (state-space, gated delta rule, recurrences)."""
    out: list[Combined] = [(label, op, dtype, params, form) for label, op, dtype, params in _SSM for form in SSM_FORMS
                           if not (op == "mamba2" and dtype == "f64" and form["ssm_kernel"] == "chunked")]
    out += [(label, "gated_delta_net", dtype, params, {}) for label, dtype, params in GDN]
    recurrent = [("every_field", op, params) for op, params in RNN_FIELDS.items()] + _RNN_SINGLE
    out += [(label, op, "f32", params, form) for label, op, params in recurrent for form in RNN_FORMS]
    return out
