"""The hand-picked conformance shapes of every op: the thunk cases (``THUNKS``: op, params, options, whether
the quick run keeps it) and the causality cases (``CAUSAL``: one NaN or Inf that must reach exactly the outputs
the recurrence says). :mod:`.catalog` turns them into cases in every dtype."""
from __future__ import annotations

from typing import Any

from .references import BINARY, UNARY


def _recurrent(op: str, b: int, s: int, i: int, h: int, layers: int, bidir: bool, carry: bool, relu: bool = False) -> dict:
    params = dict(batch=b, seq=s, input_size=i, hidden=h, num_layers=layers, bidirectional=bidir, carry=carry)
    return dict(params, relu=relu) if op == "rnn" else params


def _ssm(b: int, s: int, h: int, n: int) -> dict:
    return dict(batch=b, seq=s, hidden=h, state_size=n)


def _mamba2(b: int, s: int, heads: int, p: int, n: int) -> dict:
    return dict(batch=b, seq=s, heads=heads, head_dim=p, state_size=n)


def _gdn(b: int, s: int, heads: int, n: int, per_channel: bool, carry: bool, **v2: Any) -> dict:
    """A gated_delta_net case; ``v2`` adds ABI.md §8 fields (``state=True`` is implied by ``carry``)."""
    return dict(batch=b, seq=s, heads=heads, state_size=n, gate_per_channel=per_channel, carry_state=carry, **v2)


def _conv(b: int, s: int, dim: int, width: int, carry_state: bool = True, **v2: Any) -> dict:
    """A causal_conv1d case, its state carried unless told (a backward op's case adds ``d_state``)."""
    carried = dict(carry_state=True, state=True) if carry_state else {}
    return dict(batch=b, seq=s, dim=dim, width=width, **carried, **v2)


def _mamba3(b: int, s: int, heads: int, p: int, n: int, angles: int, carry_state: bool = False, **v2: Any) -> dict:
    """A mamba3 case (ABI.md §11); ``carry_state`` places its four states (a backward op's case adds their
    gradients with ``grads``)."""
    carried = dict(carry_state=True, angle_state=True, state=True, k_state=True, v_state=True) if carry_state else {}
    return dict(batch=b, seq=s, heads=heads, head_dim=p, state_size=n, num_angles=angles, **carried, **v2)


_M3_GRADS = dict(d_angle_state=True, d_state=True, d_k_state=True, d_v_state=True)
_M3_EVERY = dict(groups=2, q_bias=True, k_bias=True, d=True, z=True)


def _matmul(batch: int, m: int, k: int, n: int, ta: bool, tb: bool, sa: int, sb: int) -> dict:
    return dict(batch=batch, m=m, k=k, n=n, trans_a=ta, trans_b=tb, a_batch_stride=sa, b_batch_stride=sb)


THUNKS: list[tuple[str, dict, dict, bool]] = [
    # each recurrent op through both kernels (persistent: layers > 0 read their input from scratch)
    ("lstm", _recurrent("lstm", 2, 5, 3, 4, 2, True, True), {"rnn_kernel": "persistent"}, False),
    ("lstm", _recurrent("lstm", 2, 5, 3, 4, 2, True, True), {"rnn_kernel": "step"}, False),
    ("gru", _recurrent("gru", 2, 4, 3, 5, 2, True, True), {"rnn_kernel": "persistent"}, False),
    ("gru", _recurrent("gru", 1, 3, 2, 6, 1, False, False), {"rnn_kernel": "step"}, False),
    ("rnn", _recurrent("rnn", 2, 4, 3, 5, 1, True, True, relu=True), {"rnn_kernel": "persistent"}, False),
    ("rnn", _recurrent("rnn", 2, 4, 3, 5, 2, False, False), {"rnn_kernel": "step"}, False),
    # a decode step (seq 1, state carried) as the kernel choice of each target makes it
    ("lstm", _recurrent("lstm", 1, 1, 7, 20, 1, False, True), {}, False),
    ("gru", _recurrent("gru", 2, 1, 7, 20, 1, False, True), {}, False),
    # version 2 (ABI.md §8): every field of each op at once, seq 20 (past the host's decode path), a row that
    # never runs and one that runs to the end; decode (seq 1) with a row of length 0
    ("lstm", dict(_recurrent("lstm", 3, 20, 3, 5, 2, True, True), seq_lens=[20, 0, 7], peepholes=True,
                  input_forget=True, clip=0.5, proj_size=3, w_hr=True,
                  activations=[["hard_sigmoid", 0.2, 0.5], ["tanh", 0.0, 0.0], ["softsign", 0.0, 0.0]] * 2), {}, False),
    ("gru", dict(_recurrent("gru", 3, 20, 3, 5, 2, True, True), seq_lens=[3, 20, 0], linear_before_reset=False,
                 clip=0.5, activations=[["sigmoid", 0.0, 0.0], ["elu", 1.0, 0.0], ["hard_sigmoid", 0.2, 0.5],
                                        ["tanh", 0.0, 0.0]]), {}, False),
    ("rnn", dict(_recurrent("rnn", 2, 20, 3, 5, 2, False, True), reverse=True, seq_lens=[20, 4],
                 activations=[["scaled_tanh", 1.5, 0.7]]), {}, False),
    ("lstm", dict(_recurrent("lstm", 2, 1, 7, 20, 1, False, True), seq_lens=[1, 0], clip=1.0), {}, False),
    ("selective_scan", _ssm(2, 5, 5, 4), {}, False),
    ("selective_scan", _ssm(2, 9, 7, 16), {}, False),  # state_size 16: the fixed-width register path of ssm.cl
    ("mamba2", _mamba2(2, 4, 3, 4, 6), {}, False),
    ("gated_delta_net", _gdn(2, 4, 2, 8, False, True), {}, False),
    ("gated_delta_net", _gdn(1, 3, 2, 5, True, False), {}, False),
    # the gpu target's state-size variants 32..256 (16 is above) and decode (seq 1)
    ("selective_scan", _ssm(1, 3, 3, 32), {}, False),
    ("selective_scan", _ssm(1, 2, 2, 200), {}, False),
    ("mamba2", _mamba2(1, 3, 2, 3, 64), {}, False),
    # seq >= 64 runs selective_scan chunked on the gpu target (chunks of 256 steps: 300 takes two)
    ("selective_scan", _ssm(2, 300, 5, 3), {}, False),
    ("mamba2", _mamba2(1, 70, 1, 3, 4), {}, False),  # and mamba2 chunked (chunks of 64: 70 takes two, one partial)
    # every version-2 field at once: packed sequences (one empty, one starting inside the second chunk of
    # either target) through state slots, grouped b/c, the delta/dt knobs, d and z
    ("selective_scan", dict(_ssm(1, 300, 4, 3), groups=2, cu_seqlens=[0, 40, 40, 270, 300], state_slots=[3, 0, 4, 1],
                            num_slots=5, carry_state=True, state=True, delta_bias=True, delta_softplus=True, d=True,
                            z=True), {}, False),
    ("mamba2", dict(_mamba2(1, 150, 4, 3, 4), groups=2, cu_seqlens=[0, 20, 20, 100, 150], state_slots=[3, 0, 4, 1],
                    num_slots=5, carry_state=True, state=True, dt_bias=True, dt_softplus=True, dt_limit=[0.0, None],
                    d=True, z=True), {}, False),
    # a decode step of each through slots (rows 2 of a pool of 3) with d and z
    ("selective_scan", dict(_ssm(2, 1, 5, 16), state_slots=[2, 0], num_slots=3, carry_state=True, state=True,
                            d=True, z=True, delta_bias=True, delta_softplus=True), {}, False),
    ("mamba2", dict(_mamba2(2, 1, 3, 4, 16), state_slots=[2, 0], num_slots=3, carry_state=True, state=True,
                    d=True, z=True, dt_bias=True, dt_softplus=True), {}, False),
    ("gated_delta_net", _gdn(1, 70, 2, 16, True, True), {}, False),  # and gated_delta_net chunked, both gate kinds
    ("gated_delta_net", _gdn(2, 130, 1, 20, False, False), {}, False),  # three chunks; 20 is no multiple of a tile
    ("gated_delta_net", _gdn(1, 2, 1, 128, True, True), {}, False),
    ("gated_delta_net", _gdn(3, 1, 2, 8, False, True), {}, False),
    # cpu target's decode step kernel: one work-item per 32 value columns, the last one partial
    ("gated_delta_net", _gdn(2, 1, 3, 40, True, True), {}, False),
    ("gated_delta_net", _gdn(1, 1, 2, 70, False, False), {}, False),
    # version 2: grouped value heads with K != V, L2-norm and a scale over packed sequences whose starts fall
    # inside chunks (host L=32, gpu 64; one empty), per-channel gates; then a decode step of three rows into slots
    ("gated_delta_net", _gdn(1, 70, 2, 16, True, True, value_heads=4, value_size=12, qk_l2norm=True, scale=0.3,
                             cu_seqlens=[0, 20, 20, 45, 70]), {}, False),
    ("gated_delta_net", _gdn(1, 9, 1, 8, False, False, value_heads=3, cu_seqlens=[0, 4, 9]), {}, False),
    ("gated_delta_net", _gdn(3, 1, 2, 8, False, True, value_heads=4, value_size=6, state_slots=[4, 0, 2],
                             num_slots=5), {}, False),
    ("matmul", _matmul(2, 5, 7, 3, False, False, 35, 0), {}, False),
    ("matmul", _matmul(2, 17, 18, 19, True, True, 306, 342), {}, False),
    ("reduce_sum", dict(outer=3, r=5, inner=7), {}, False),
    ("binary", dict(fn="add", shape=[2, 3, 4], a_strides=[12, 4, 1], b_strides=[0, 1, 0]), {}, False),
    ("copy", dict(nbytes=37), {}, False),
    ("fill", dict(n=9, value=1.5), {}, False),
    *[("unary", dict(fn=fn, n=67), {}, False) for fn in UNARY],
    *[("binary", dict(fn=fn, shape=[3, 1, 5], a_strides=[5, 0, 1], b_strides=[0, 0, 1]), {}, False) for fn in BINARY],
    ("lstm", _recurrent("lstm", 3, 16, 24, 40, 2, True, True), {"rnn_kernel": "persistent"}, True),
    ("gru", _recurrent("gru", 2, 12, 16, 33, 1, True, False), {"rnn_kernel": "step"}, True),
    ("selective_scan", _ssm(2, 24, 16, 256), {}, True),
    ("mamba2", _mamba2(1, 20, 2, 16, 64), {}, True),
    ("gated_delta_net", _gdn(1, 16, 2, 256, True, True), {}, True),
    ("gated_delta_net", _gdn(2, 24, 3, 64, False, False), {}, True),
    ("matmul", _matmul(3, 70, 65, 33, False, True, 70 * 65, 0), {}, True),
    ("mamba2", _mamba2(2, 150, 2, 17, 20), {}, True),  # gpu target: three chunks, two tiles of 16 rows
    ("gated_delta_net", _gdn(1, 100, 1, 256, True, True), {}, True),  # gpu target: chunked, the largest state
    # the recurrences' backward ops: layers and directions, with and without the carried state's gradient
    ("lstm_backward", _recurrent("lstm", 2, 4, 3, 5, 2, True, True), {}, False),
    ("gru_backward", _recurrent("gru", 2, 4, 3, 5, 2, True, False), {}, False),
    ("rnn_backward", _recurrent("rnn", 2, 4, 3, 5, 1, False, True, relu=True), {}, False),
    ("lstm_backward", _recurrent("lstm", 3, 16, 24, 40, 2, True, True), {}, True),
    # mamba2's backward: the host's step path (seq <= 10); then chunked (chunks of 64, the last partial) with every
    # version-2 field at once, packed sequences (one empty, one starting inside the second chunk) through slots
    ("mamba2_backward", _mamba2(2, 9, 2, 3, 8), {}, False),
    ("mamba2_backward", dict(_mamba2(1, 150, 4, 3, 4), groups=2, cu_seqlens=[0, 20, 20, 100, 150],
                             state_slots=[3, 0, 4, 1], num_slots=5, carry_state=True, state=True, d_state=True,
                             dt_bias=True, d_dt_bias=True, dt_softplus=True, dt_limit=[0.0, None], d=True, d_d=True,
                             z=True, d_z=True), {}, False),
    ("mamba2_backward", _mamba2(2, 150, 2, 17, 20), {}, True),
    # the selective scan's backward: one host chunk (32 steps), then three (the last partial); every version-2
    # field at once over packed sequences (one empty, two starting inside a chunk) through state slots
    ("selective_scan_backward", _ssm(2, 5, 5, 4), {}, False),
    ("selective_scan_backward", _ssm(2, 70, 5, 3), {}, False),
    ("selective_scan_backward", dict(_ssm(1, 70, 4, 3), groups=2, cu_seqlens=[0, 20, 20, 45, 70],
                                     state_slots=[3, 0, 4, 1], num_slots=5, carry_state=True, state=True, d_state=True,
                                     delta_bias=True, d_delta_bias=True, delta_softplus=True, d=True, d_d=True, z=True,
                                     d_z=True), {}, False),
    ("selective_scan_backward", _ssm(2, 130, 8, 16), {}, True),
    # gated_delta_net_backward: both gate kinds on the host's step path (decode) and in one partial chunk, then
    # three chunks of 32 (the last partial) with grouped value heads, K != V and L2-norm, and a packed row
    # through slots
    ("gated_delta_net_backward", _gdn(2, 2, 2, 8, False, True), {}, False),
    ("gated_delta_net_backward", _gdn(1, 1, 2, 5, True, False), {}, False),
    ("gated_delta_net_backward", _gdn(2, 5, 2, 8, True, True), {}, False),
    ("gated_delta_net_backward", _gdn(1, 70, 2, 16, True, True, value_heads=4, value_size=12, qk_l2norm=True),
     {}, False),
    ("gated_delta_net_backward", _gdn(1, 40, 1, 8, False, True, cu_seqlens=[0, 15, 15, 40], state_slots=[1, 2, 0],
                                      num_slots=3, scale=0.4), {}, False),
    # causal_conv1d (ABI.md §10): widths 2..8 sampled; packed sequences with empty ones and ones shorter than
    # width-1 through slots (the carried values then stay in the window); a decode step into slots; two chunks
    # of the cpu target's 256 tokens; the backward likewise (d_weight summed over chunks, rows and sequences)
    ("causal_conv1d", _conv(2, 5, 3, 2), {}, False),
    ("causal_conv1d", _conv(1, 12, 5, 3, cu_seqlens=[0, 1, 1, 9, 12], state_slots=[3, 0, 4, 1], num_slots=5,
                            bias=True, activation="silu"), {}, False),
    ("causal_conv1d", _conv(1, 10, 4, 8, cu_seqlens=[0, 2, 2, 10], state_slots=[1, 2, 0], num_slots=3), {}, False),
    ("causal_conv1d", _conv(3, 1, 6, 4, state_slots=[2, 0, 4], num_slots=5, bias=True), {}, False),
    ("causal_conv1d", _conv(2, 300, 3, 5, bias=True, activation="silu", carry_state=False), {}, False),
    ("causal_conv1d_backward", _conv(2, 9, 3, 7, bias=True, d_bias=True, carry_state=False), {}, False),
    ("causal_conv1d_backward", _conv(1, 12, 5, 4, cu_seqlens=[0, 2, 2, 9, 12], state_slots=[3, 0, 4, 1],
                                     num_slots=5, bias=True, d_bias=True, activation="silu", d_state=True), {}, False),
    ("causal_conv1d_backward", _conv(2, 1, 4, 3, state_slots=[1, 0], num_slots=2, d_state=True), {}, False),
    ("causal_conv1d_backward", _conv(1, 300, 3, 6, activation="silu", d_state=True), {}, False),
    # mamba3 (ABI.md §11): an odd num_angles = N/2; a single angle with q/k shared by two heads each; every field
    # at once over packed sequences (one empty, one starting inside the second chunk of 64) through slots; a
    # decode step into slots; three chunks (the last partial) carried; the backward likewise
    ("mamba3", _mamba3(2, 5, 2, 3, 6, 3), {}, False),
    ("mamba3", _mamba3(2, 9, 4, 3, 8, 1, groups=2), {}, False),
    ("mamba3", _mamba3(1, 150, 4, 3, 8, 2, True, cu_seqlens=[0, 20, 20, 100, 150], state_slots=[3, 0, 4, 1],
                       num_slots=5, **_M3_EVERY), {}, False),
    ("mamba3", _mamba3(3, 1, 2, 4, 6, 3, True, state_slots=[2, 0, 4], num_slots=5, d=True, z=True), {}, False),
    ("mamba3", _mamba3(2, 150, 2, 5, 10, 4, True, d=True), {}, False),
    ("mamba3_backward", _mamba3(2, 5, 2, 3, 6, 3), {}, False),
    ("mamba3_backward", _mamba3(1, 40, 4, 3, 8, 2, True, cu_seqlens=[0, 15, 15, 40], state_slots=[1, 2, 0],
                                num_slots=3, **_M3_EVERY, **_M3_GRADS, d_q_bias=True, d_k_bias=True, d_d=True,
                                d_z=True), {}, False),
    ("mamba3_backward", _mamba3(2, 1, 2, 4, 6, 1, True, state_slots=[1, 0], num_slots=2, **_M3_GRADS), {}, False),
    ("mamba3_backward", _mamba3(1, 150, 2, 4, 8, 4, True, **_M3_GRADS), {}, False),
]

NAN, INF = float("nan"), float("inf")
#: (op, params, field, step, value) of the causality cases: one NaN or Inf at ``step`` of batch row 0 must reach
#: that row's outputs from that step on and nothing else (NaN and signed Inf positions compared with the float64
#: reference and the host)
CAUSAL: list[tuple[str, dict, str, int, float]] = [
    ("selective_scan", _ssm(2, 9, 3, 16), "x", 5, NAN),
    ("selective_scan", _ssm(2, 300, 3, 4), "x", 270, NAN),  # in the second chunk of 256 steps (gpu target)
    ("mamba2", _mamba2(2, 9, 2, 3, 8), "x", 5, NAN),
    ("mamba3", _mamba3(2, 9, 2, 3, 6, 2), "v", 5, NAN),
    ("mamba3", _mamba3(1, 80, 2, 3, 6, 2, cu_seqlens=[0, 30, 68, 80]), "q", 40, NAN),  # reaches no other sequence
    ("mamba2", _mamba2(2, 80, 1, 2, 4), "x", 70, NAN),  # in the second chunk of 64 steps (gpu target)
    # version 2: the gate reaches only its own step; a packed sequence after a poisoned one starts clean, in
    # the chunk they share too (mamba2: 68 starts inside the second chunk of 64, selective_scan: 260 inside
    # the second of 256)
    ("selective_scan", dict(_ssm(2, 10, 3, 16), z=True, d=True), "z", 5, NAN),  # seq 10: an id of its own
    ("selective_scan", dict(_ssm(1, 300, 3, 4), cu_seqlens=[0, 100, 260, 300], carry_state=True, state=True),
     "x", 150, NAN),
    ("mamba2", dict(_mamba2(2, 10, 2, 3, 8), z=True), "z", 5, -INF),
    # (a NaN: past an Inf in dt the gpu target's chunked sums may give NaN where the step order gives ±Inf)
    ("mamba2", dict(_mamba2(1, 80, 1, 2, 4), cu_seqlens=[0, 30, 68, 80], dt_bias=True, dt_softplus=True), "dt", 40,
     NAN),
    ("gated_delta_net", _gdn(2, 9, 2, 8, False, True), "v", 5, NAN),
    ("gated_delta_net", _gdn(2, 9, 2, 8, True, False), "v", 5, NAN),
    # in the second chunk of 64 steps (gpu target): one value column, every column from a key or a gate
    ("gated_delta_net", _gdn(2, 80, 2, 8, False, True), "v", 70, NAN),
    ("gated_delta_net", _gdn(2, 80, 1, 8, True, True), "k", 70, NAN),
    ("gated_delta_net", _gdn(1, 140, 2, 8, False, False), "g", 100, NAN),
    # an Inf: every device keeps the ABI's operation order on the step forms, so NaN and each signed Inf
    # land alike (the gpu target's chunked forms may differ in the class, see the ABI's non-finite rule)
    ("selective_scan", _ssm(2, 9, 3, 16), "x", 5, INF),
    ("selective_scan", _ssm(2, 300, 3, 4), "delta", 270, -INF),
    ("mamba2", _mamba2(2, 9, 2, 3, 8), "x", 5, -INF),
    ("gated_delta_net", _gdn(2, 9, 2, 8, False, True), "v", 5, INF),
    ("gated_delta_net", _gdn(2, 9, 2, 8, True, False), "beta", 5, -INF),
    ("gated_delta_net", _gdn(2, 1, 3, 40, True, True), "k", 0, INF),  # the cpu target's decode step kernel
    # packed sequences: a NaN in one sequence reaches no other (in the first, and mid-chunk in the last)
    ("gated_delta_net", _gdn(1, 80, 1, 8, False, True, value_heads=2, cu_seqlens=[0, 30, 30, 80]), "v", 5, NAN),
    ("gated_delta_net", _gdn(1, 80, 2, 8, True, True, value_heads=4, value_size=5, cu_seqlens=[0, 30, 30, 80]),
     "k", 70, NAN),
    ("lstm", _recurrent("lstm", 2, 5, 3, 4, 1, True, True), "x", 2, INF),
    ("gru", _recurrent("gru", 2, 5, 3, 4, 1, True, False), "x", 2, -INF),
    ("rnn", _recurrent("rnn", 2, 5, 3, 4, 1, False, True, relu=True), "x", 2, INF),
    # with lengths: a NaN inside row 0's length reaches its steps; one in its padding reaches nothing
    ("lstm", dict(_recurrent("lstm", 2, 5, 3, 4, 1, True, True), seq_lens=[4, 5]), "x", 2, NAN),
    ("gru", dict(_recurrent("gru", 2, 5, 3, 4, 1, True, True), seq_lens=[2, 5]), "x", 3, NAN),
    # a backward op walks back: a NaN gradient at one step reaches only that row's earlier steps' inputs
    # (and every weight gradient, which sums over rows and steps)
    ("lstm_backward", _recurrent("lstm", 2, 5, 3, 4, 1, False, True), "d_dst", 2, NAN),
    ("gru_backward", _recurrent("gru", 2, 5, 3, 4, 2, False, False), "d_dst", 2, NAN),
    ("rnn_backward", _recurrent("rnn", 2, 5, 3, 4, 1, False, True), "d_dst", 2, NAN),
    ("mamba2_backward", _mamba2(2, 9, 2, 3, 8), "d_dst", 5, NAN),
    ("mamba2_backward", _mamba2(2, 80, 1, 2, 4), "d_dst", 70, NAN),  # in the host's second chunk of 64 steps
    ("selective_scan_backward", _ssm(2, 40, 3, 4), "d_dst", 35, NAN),  # in the second host chunk of 32 steps
    # the gated delta rule's: in one short chunk, and in the second of two chunks (both gate kinds)
    ("gated_delta_net_backward", _gdn(2, 9, 2, 8, False, True), "d_dst", 5, NAN),
    ("gated_delta_net_backward", _gdn(2, 40, 1, 8, True, True, value_heads=2), "d_dst", 35, NAN),
]

#: (op, save_trajectory, num_checkpoints) of the scan-family cases (length 5, tanh-RNN cell)
