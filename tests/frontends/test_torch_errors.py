"""rlx_gpu.torch's errors speak the caller's terms: each bad call raises before anything runs, naming the
caller's argument and the anchor's layout (mamba_ssm's ``(batch, dim, seqlen)``, fla's ``(B, T, H, K)``) with
what was expected; the shape and dtype checks read no tensor data (they run on fake tensors and inside a
``torch.compile`` graph without a break); the modules' errors are torch.nn's; and no NumPy warning reaches
the caller, whatever the values.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from support.torch_devices import host  # noqa: F401  (fixture)

import rlx_gpu.torch as rt
from rlx_gpu.torch import arguments

F16, F32, F64 = torch.float16, torch.float32, torch.float64


def r(*shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype)


def scan_args() -> dict[str, Any]:
    """selective_scan_fn: batch 2, dim 4, seqlen 6, dstate 3, ngroups 2."""
    return {"u": r(2, 4, 6), "delta": r(2, 4, 6).abs(), "A": -r(4, 3).abs(), "B": r(2, 2, 3, 6), "C": r(2, 2, 3, 6),
            "D": r(4), "z": r(2, 4, 6), "delta_bias": r(4)}


def ssd_args() -> dict[str, Any]:
    """mamba_chunk_scan_combined: batch 2, seqlen 6, nheads 4, headdim 3, ngroups 2, dstate 5."""
    return {"x": r(2, 6, 4, 3), "dt": r(2, 6, 4), "A": -r(4).abs(), "B": r(2, 6, 2, 5), "C": r(2, 6, 2, 5),
            "chunk_size": 4, "D": r(4), "z": r(2, 6, 4, 3), "dt_bias": r(4), "initial_states": r(2, 4, 3, 5)}


def varlen_args() -> dict[str, Any]:
    """mamba_chunk_scan_combined over one row of three packed sequences, with their varlen states."""
    args = {k: v[:1] if k in ("x", "dt", "B", "C", "z", "initial_states") else v for k, v in ssd_args().items()}
    return {**args, "seq_idx": torch.tensor([[0, 0, 1, 1, 1, 2]]), "cu_seqlens": torch.tensor([0, 2, 5, 6]),
            "return_varlen_states": True}


def step_args() -> dict[str, Any]:
    """selective_state_update, heads form, into entries 3 and 1 of a pool of 5: batch 2, nheads 4, dim 3,
    ngroups 2, dstate 5."""
    return {"state": r(5, 4, 3, 5), "x": r(2, 4, 3), "dt": r(2, 4, 3), "A": -r(4, 3, 5).abs(), "B": r(2, 2, 5),
            "C": r(2, 2, 5), "D": r(4, 3), "z": r(2, 4, 3), "dt_bias": r(4, 3),
            "state_batch_indices": torch.tensor([3, 1], dtype=torch.int32)}


def mamba1_step_args() -> dict[str, Any]:
    """selective_state_update, Mamba-1 form: batch 2, dim 4, dstate 3."""
    return {"state": r(2, 4, 3), "x": r(2, 4), "dt": r(2, 4), "A": -r(4, 3).abs(), "B": r(2, 3), "C": r(2, 3)}


def gdn_args(per_channel: bool = False) -> dict[str, Any]:
    """fla's functions: B 2, T 5, H 2, K 3, HV 4, V 2 (per_channel: a gate per key channel)."""
    gate = (2, 5, 4, 3) if per_channel else (2, 5, 4)
    return {"q": r(2, 5, 2, 3), "k": r(2, 5, 2, 3), "v": r(2, 5, 4, 2), "g": -r(*gate).abs(), "beta": r(2, 5, 4).sigmoid(),
            "initial_state": r(2, 4, 3, 2)}


def packed_gdn_args() -> dict[str, Any]:
    """fla's functions over one row of three packed sequences."""
    args = {k: v[:1] for k, v in gdn_args().items()}
    return {**args, "initial_state": r(3, 4, 3, 2), "cu_seqlens": torch.tensor([0, 2, 2, 5])}


def conv_args() -> dict[str, Any]:
    """causal_conv1d_fn: batch 2, dim 4, seqlen 6, width 3, from initial states, returning the final ones."""
    return {"x": r(2, 4, 6), "weight": r(4, 3), "bias": r(4), "initial_states": r(2, 4, 2), "return_final_states": True}


def conv_update_args() -> dict[str, Any]:
    """causal_conv1d_update into entries 3 and 1 of a pool of 5: batch 2, dim 4, width 3, state_len 3."""
    return {"x": r(2, 4), "conv_state": r(5, 4, 3), "weight": r(4, 3), "bias": r(4),
            "conv_state_indices": torch.tensor([3, 1], dtype=torch.int32)}


def mamba3_args(step: bool = False) -> dict[str, Any]:
    """mamba3_siso_combined (``step``: mamba3_siso_step, no seqlen): batch 2, seqlen 5, nheads_qk 2,
    headdim_qk 4, nheads 4, headdim_v 3, headdim_angles 2, from initial states."""
    t = () if step else (5,)
    args = {"Q": r(2, *t, 2, 4), "K": r(2, *t, 2, 4), "V": r(2, *t, 4, 3), "ADT": -r(2, 4, *t).abs(),
            "DT": r(2, 4, *t).abs(), "Trap": r(2, 4, *t), "Q_bias": r(4, 4), "K_bias": r(4, 4),
            "Angles": r(2, *t, 4, 2), "D": r(4), "Z": r(2, *t, 4, 3),
            "Input_States": [r(2, 4, 2), r(2, 4, 3, 4), r(2, 4, 4), r(2, 4, 3)]}
    return args if step else {**args, "return_final_states": True}


def in_bf16(args: dict[str, Any], *activations: str) -> dict[str, Any]:
    """``args`` with the ``activations`` in bf16 and the rest as they were (f32 parameters, gates and states:
    what mamba_ssm's and fla's models pass)."""
    return {k: v.bfloat16() if k in activations else v for k, v in args.items()}


GOOD: dict[str, tuple[Callable, Callable[[], dict[str, Any]]]] = {
    "scan": (rt.selective_scan_fn, scan_args),
    "ssd": (rt.mamba_chunk_scan_combined, ssd_args),
    "varlen": (rt.mamba_chunk_scan_combined, varlen_args),
    "step": (rt.selective_state_update, step_args),
    "mamba1_step": (rt.selective_state_update, mamba1_step_args),
    "gdn": (rt.chunk_gated_delta_rule, gdn_args),
    "packed_gdn": (rt.chunk_gated_delta_rule, packed_gdn_args),
    "recurrent": (rt.fused_recurrent_gated_delta_rule, gdn_args),
    "kda": (rt.chunk_kda, lambda: gdn_args(per_channel=True)),
    "scan_bf16": (rt.selective_scan_fn, lambda: in_bf16(scan_args(), "u", "delta", "B", "C", "z")),
    "ssd_bf16": (rt.mamba_chunk_scan_combined, lambda: in_bf16(ssd_args(), "x", "dt", "B", "C", "z", "D", "dt_bias")),
    "step_bf16": (rt.selective_state_update, lambda: in_bf16(step_args(), "x", "dt", "B", "C", "z", "D", "dt_bias")),
    "gdn_bf16": (rt.chunk_gated_delta_rule, lambda: in_bf16(gdn_args(), "q", "k", "v", "beta")),
    "conv": (rt.causal_conv1d_fn, conv_args),
    "conv_update": (rt.causal_conv1d_update, conv_update_args),
    "mamba3": (rt.mamba3_siso_combined, mamba3_args),
    "mamba3_step": (rt.mamba3_siso_step, lambda: mamba3_args(step=True)),
    "conv_bf16": (rt.causal_conv1d_fn, lambda: in_bf16(conv_args(), "x")),
    "mamba3_bf16": (rt.mamba3_siso_combined, lambda: in_bf16(mamba3_args(), "Q", "K", "V", "Z")),
}

#: (good call, change to its arguments, exception, message regex): each message names the argument and the
#: layout expected, in the anchor's terms.
TABLE = [
    # selective_scan_fn: mamba_ssm's (batch, dim, seqlen)
    ("scan", lambda a: {**a, "B": r(2, 3, 5), "C": r(2, 3, 5)}, ValueError,
     r"^selective_scan_fn: B has shape \[2, 3, 5\]; expected \(batch, dstate, seqlen\) = \[2, 3, 6\] "
     r"\(seqlen=6 from u \[2, 4, 6\]\)$"),
    ("scan", lambda a: {**a, "u": a["u"].transpose(1, 2), "delta": a["delta"].transpose(1, 2),
                        "z": a["z"].transpose(1, 2), "A": a["A"].T}, ValueError,
     r"^selective_scan_fn: A has shape \[3, 4\]; expected \(dim, dstate\) = \[6, dstate\] \(dim=6 from u \[2, 6, 4\]\)"),
    ("scan", lambda a: {**a, "u": a["u"].transpose(1, 2)}, ValueError,
     r"^selective_scan_fn: delta has shape \[2, 4, 6\]; expected \(batch, dim, seqlen\) = \[2, 6, 4\] "
     r"\(dim=6 from u \[2, 6, 4\], seqlen=4 from u \[2, 6, 4\]\)$"),
    ("scan", lambda a: {**a, "u": a["u"][0]}, ValueError,
     r"^selective_scan_fn: u has shape \[4, 6\] \(2 dimensions\); expected \(batch, dim, seqlen\)$"),
    ("scan", lambda a: {**a, "B": a["B"][None]}, ValueError,
     r"^selective_scan_fn: B has shape \[1, 2, 2, 3, 6\] \(5 dimensions\); expected \(batch, dstate, seqlen\), "
     r"\(batch, ngroups, dstate, seqlen\) or \(dim, dstate\)$"),
    ("scan", lambda a: {**a, "B": r(2, 3, 3, 6), "C": r(2, 3, 3, 6)}, ValueError,
     r"^selective_scan_fn: B has ngroups=3, which does not divide dim=4 \(from u \[2, 4, 6\]\)"),
    ("scan", lambda a: {**a, "C": r(2, 3, 6)}, NotImplementedError,
     r"^selective_scan_fn: C has shape \[2, 3, 6\] and B \[2, 2, 3, 6\]; .* pass C as "
     r"\(batch, ngroups, dstate, seqlen\) like B$"),
    ("scan", lambda a: {**a, "D": r(5)}, ValueError,
     r"^selective_scan_fn: D has shape \[5\]; expected \(dim,\) = \[4\] \(dim=4 from u \[2, 4, 6\]\)$"),
    ("scan", lambda a: {**a, "D": [1.0] * 4}, TypeError, r"^selective_scan_fn: D must be a torch.Tensor, got list$"),
    ("scan", lambda a: {**a, "C": None}, TypeError, r"^selective_scan_fn: C must be a torch.Tensor, got None$"),
    ("scan", lambda a: {**a, "u": a["u"].half(), "delta": a["delta"].half(), "B": a["B"].half(), "C": a["C"].half()},
     TypeError, r"^selective_scan_fn: z is torch.float32 beside u torch.float16; the activations \(u, delta, B, C, z\) "
                r"share one dtype, as mamba_ssm's kernels require: pass z.to\(torch.float16\)$"),
    ("scan", lambda a: {**a, "A": a["A"].bfloat16()}, TypeError,
     r"^selective_scan_fn: A is torch.bfloat16 beside u torch.float32; A takes u's dtype or a wider float"),
    ("scan", lambda a: {**a, "D": a["D"].double()}, TypeError,
     r"^selective_scan_fn: D is torch.float64 beside u torch.float32; D takes u's or A's dtype \(torch.float32\)$"),
    ("scan", lambda a: {**a, "u": a["u"].long()}, TypeError, r"^selective_scan_fn: u is torch.int64; expected a floating"),
    ("scan", lambda a: {**a, "A": a["A"].to(torch.complex64)}, NotImplementedError,
     r"^selective_scan_fn: A is complex \(torch.complex64\); rlx_gpu's scans are real"),
    ("scan", lambda a: {**a, "delta_bias": a["delta_bias"].to("meta")}, ValueError,
     r"^selective_scan_fn: delta_bias lies on meta, u on cpu; the tensors of one call lie on one device"),
    # mamba_chunk_scan_combined: mamba_ssm's (batch, seqlen, nheads, headdim)
    ("ssd", lambda a: {**a, "x": a["x"].flatten(2)}, ValueError,
     r"^mamba_chunk_scan_combined: x has shape \[2, 6, 12\] \(3 dimensions\); "
     r"expected \(batch, seqlen, nheads, headdim\)$"),
    ("ssd", lambda a: {**a, "dt": r(2, 6, 3)}, ValueError,
     r"^mamba_chunk_scan_combined: dt has shape \[2, 6, 3\]; expected \(batch, seqlen, nheads\) = \[2, 6, 4\] "
     r"\(nheads=4 from x \[2, 6, 4, 3\]\)$"),
    ("ssd", lambda a: {**a, "B": r(2, 6, 3, 5), "C": r(2, 6, 3, 5)}, ValueError,
     r"^mamba_chunk_scan_combined: B has ngroups=3, which does not divide nheads=4"),
    ("ssd", lambda a: {**a, "C": r(2, 6, 2, 4)}, ValueError,
     r"^mamba_chunk_scan_combined: C has shape \[2, 6, 2, 4\]; expected \(batch, seqlen, ngroups, dstate\) = "
     r"\[2, 6, 2, 5\] \(dstate=5 from B \[2, 6, 2, 5\]\)$"),
    ("ssd", lambda a: {**a, "D": r(4, 2)}, ValueError,
     r"^mamba_chunk_scan_combined: D has shape \[4, 2\]; expected \(nheads, headdim\) = \[4, 3\]"),
    ("ssd", lambda a: {**a, "initial_states": r(2, 4, 5, 3)}, ValueError,
     r"^mamba_chunk_scan_combined: initial_states has shape \[2, 4, 5, 3\]; expected "
     r"\(batch, nheads, headdim, dstate\) = \[2, 4, 3, 5\]"),
    ("ssd", lambda a: {**a, "x": a["x"].half(), "dt": a["dt"].half(), "B": a["B"].half(), "C": a["C"].half()},
     TypeError, r"^mamba_chunk_scan_combined: z is torch.float32 beside x torch.float16; the activations"),
    ("ssd", lambda a: {**a, "initial_states": a["initial_states"].double()}, TypeError,
     r"^mamba_chunk_scan_combined: initial_states is torch.float64 beside x torch.float32; initial_states takes "
     r"x's dtype or f32 \(the carried state\)$"),
    ("ssd", lambda a: {**a, "seq_idx": torch.zeros(2, 6)}, TypeError,
     r"^mamba_chunk_scan_combined: seq_idx is torch.float32; expected an integer tensor"),
    ("ssd", lambda a: {**a, "seq_idx": torch.zeros(2, 5, dtype=torch.int32)}, ValueError,
     r"^mamba_chunk_scan_combined: seq_idx has shape \[2, 5\]; expected \(batch, seqlen\) = \[2, 6\]"),
    ("ssd", lambda a: {**a, "seq_idx": torch.tensor([[0, 0, 1, 0, 0, 0]] * 2)}, NotImplementedError,
     r"^mamba_chunk_scan_combined: seq_idx falls from 1 to 0 at \[0, 3\]"),
    ("varlen", lambda a: {**a, "cu_seqlens": a["cu_seqlens"].float()}, TypeError,
     r"^mamba_chunk_scan_combined: cu_seqlens is torch.float32; expected an integer tensor"),
    ("varlen", lambda a: {**a, "cu_seqlens": torch.tensor([1, 2, 5, 6])}, ValueError,
     r"^mamba_chunk_scan_combined: cu_seqlens \[1, 2, 5, 6\] must start at 0"),
    ("varlen", lambda a: {**a, "cu_seqlens": torch.tensor([0, 2, 5, 7])}, ValueError,
     r"^mamba_chunk_scan_combined: cu_seqlens ends at 7, expected the token count 6"),
    # selective_state_update: mamba_ssm's (batch, nheads, dim) / (batch, dim)
    ("step", lambda a: {**a, "state": a["state"][:, 0]}, ValueError,
     r"^selective_state_update: state has shape \[5, 3, 5\] \(3 dimensions\); "
     r"expected \(pool, nheads, dim, dstate\)$"),
    ("step", lambda a: {**a, "B": r(2, 2, 4), "C": r(2, 2, 4)}, ValueError,
     r"^selective_state_update: B has shape \[2, 2, 4\]; expected \(batch, ngroups, dstate\) = \[2, ngroups, 5\] "
     r"\(dstate=5 from state \[5, 4, 3, 5\]\)$"),
    ("step", lambda a: {**a, "dt": a["dt"][:, :, 0]}, ValueError,
     r"^selective_state_update: dt has shape \[2, 4\] \(2 dimensions\); expected \(batch, nheads, dim\)$"),
    ("step", lambda a: {**a, "dt": a["dt"].double()}, TypeError,
     r"^selective_state_update: dt is torch.float64 beside x torch.float32; the activations"),
    ("step", lambda a: {**a, "state_batch_indices": torch.tensor([3, 7])}, IndexError,
     r"^selective_state_update: state_batch_indices\[1\] = 7 is outside the state pool of 5 entries "
     r"\(state.shape\[0\]\)"),
    ("step", lambda a: {**a, "state_batch_indices": torch.tensor([-1, 1])}, IndexError,
     r"^selective_state_update: state_batch_indices\[0\] = -1 is outside the state pool of 5 entries"),
    ("step", lambda a: {**a, "state_batch_indices": torch.tensor([1, 1])}, ValueError,
     r"^selective_state_update: state_batch_indices\[0\] and \[1\] both name state entry 1"),
    ("step", lambda a: {**a, "state_batch_indices": torch.tensor([3.0, 1.0])}, TypeError,
     r"^selective_state_update: state_batch_indices is torch.float32; expected an integer tensor"),
    ("step", lambda a: {**a, "state_batch_indices": torch.tensor([3, 1, 0])}, ValueError,
     r"^selective_state_update: state_batch_indices has shape \[3\]; expected \(batch,\) = \[2\] "
     r"\(batch=2 from x \[2, 4, 3\]\)$"),
    ("mamba1_step", lambda a: {**a, "B": r(2, 2, 3), "C": r(2, 2, 3)}, ValueError,
     r"^selective_state_update: B has ngroups=2, which does not divide nheads=1 \(from x \(batch, dim\): one head\)"),
    ("mamba1_step", lambda a: {**a, "state": r(3, 4, 3)}, ValueError,
     r"^selective_state_update: state has shape \[3, 4, 3\]; expected \(batch, dim, dstate\) = \[2, 4, dstate\] "
     r"\(batch=2 from x \[2, 4\]\)$"),
    # fla: q, k (B, T, H, K), v (B, T, HV, V)
    ("gdn", lambda a: {**a, "k": a["k"].double()}, TypeError,
     r"^chunk_gated_delta_rule: k is torch.float64 beside q torch.float32; the activations \(q, k, v\) share one "
     r"dtype, as fla's kernels require"),
    ("gdn", lambda a: {**a, "q": a["q"][0]}, ValueError,
     r"^chunk_gated_delta_rule: q has shape \[5, 2, 3\] \(3 dimensions\); expected \(B, T, H, K\)$"),
    ("gdn", lambda a: {**a, "k": r(2, 5, 1, 3)}, ValueError,
     r"^chunk_gated_delta_rule: k has shape \[2, 5, 1, 3\]; expected \(B, T, H, K\) = \[2, 5, 2, 3\] "
     r"\(H=2 from q \[2, 5, 2, 3\]\)$"),
    ("gdn", lambda a: {**a, "v": r(2, 5, 3, 2), "g": r(2, 5, 3), "beta": r(2, 5, 3)}, ValueError,
     r"^chunk_gated_delta_rule: q has H=2, which does not divide HV=3 \(from v \[2, 5, 3, 2\]\); "
     r"value head j reads key head j // \(HV / H\)$"),
    ("gdn", lambda a: {**a, "g": r(2, 5, 4, 3)}, ValueError,
     r"^chunk_gated_delta_rule: g has shape \[2, 5, 4, 3\] \(4 dimensions\); expected \(B, T, HV\)$"),
    ("gdn", lambda a: {**a, "beta": r(2, 5, 2)}, ValueError,
     r"^chunk_gated_delta_rule: beta has shape \[2, 5, 2\]; expected \(B, T, HV\) = \[2, 5, 4\] "
     r"\(HV=4 from v \[2, 5, 4, 2\]\)$"),
    ("gdn", lambda a: {**a, "g": a["g"].double()}, TypeError,
     r"^chunk_gated_delta_rule: g is torch.float64 beside q torch.float32; g takes q's dtype or f32$"),
    ("gdn", lambda a: {**a, "initial_state": r(2, 4, 2, 3)}, ValueError,
     r"^chunk_gated_delta_rule: initial_state has shape \[2, 4, 2, 3\]; expected \(N, HV, K, V\) = \[2, 4, 3, 2\]"),
    ("gdn", lambda a: {**a, "initial_state": r(2, 4, 3, 2), "state_v_first": True}, ValueError,
     r"^chunk_gated_delta_rule: initial_state has shape \[2, 4, 3, 2\]; expected \(N, HV, V, K\) = \[2, 4, 2, 3\]"),
    ("gdn", lambda a: {**a, "cu_seqlens": torch.tensor([0, 2, 5])}, ValueError,
     r"^chunk_gated_delta_rule: the batch size must be 1 rather than 2 with cu_seqlens"),
    ("packed_gdn", lambda a: {**a, "cu_seqlens": a["cu_seqlens"].float()}, TypeError,
     r"^chunk_gated_delta_rule: cu_seqlens is torch.float32; expected an integer tensor"),
    ("packed_gdn", lambda a: {**a, "initial_state": a["initial_state"][:2]}, ValueError,
     r"^chunk_gated_delta_rule: initial_state has shape \[2, 4, 3, 2\]; expected \(N, HV, K, V\) = \[3, 4, 3, 2\] "
     r"\(N=3 from cu_seqlens \[4\]: one state per sequence\)$"),
    ("packed_gdn", lambda a: {**a, "cu_seqlens": torch.tensor([0, 3, 2, 5])}, ValueError,
     r"^chunk_gated_delta_rule: cu_seqlens\[2\] = 2 is below cu_seqlens\[1\] = 3"),
    ("packed_gdn", lambda a: {**a, "cu_seqlens": torch.tensor([0, 2, 2, 4])}, ValueError,
     r"^chunk_gated_delta_rule: cu_seqlens ends at 4, expected the token count 5"),
    ("recurrent", lambda a: {**a, "gk": r(2, 5, 4, 2)}, ValueError,
     r"^fused_recurrent_gated_delta_rule: gk has shape \[2, 5, 4, 2\]; expected \(B, T, HV, K\) = \[2, 5, 4, 3\] "
     r"\(K=3 from q \[2, 5, 2, 3\]\)$"),
    ("recurrent", lambda a: {**a, "q": a["q"].half(), "k": a["k"].half()}, TypeError,
     r"^fused_recurrent_gated_delta_rule: v is torch.float32 beside q torch.float16"),
    ("kda", lambda a: {**a, "g": r(2, 5, 4)}, ValueError,
     r"^chunk_kda: g has shape \[2, 5, 4\] \(3 dimensions\); expected \(B, T, HV, K\)$"),
    ("kda", lambda a: {**a, "use_gate_in_kernel": True, "A_log": r(4), "dt_bias": r(8)}, ValueError,
     r"^chunk_kda: dt_bias has shape \[8\]; expected \(HV·K,\) = \[12\] \(HV·K=12 from HV=4 from v \[2, 5, 4, 2\] "
     r"times K=3 from q \[2, 5, 2, 3\]\)$"),
    # causal-conv1d: x (batch, dim, seqlen), weight (dim, width)
    ("conv", lambda a: {**a, "x": a["x"][0]}, ValueError,
     r"^causal_conv1d_fn: x has shape \[4, 6\] \(2 dimensions\); expected \(batch, dim, seqlen\)$"),
    ("conv", lambda a: {**a, "weight": r(5, 3)}, ValueError,
     r"^causal_conv1d_fn: weight has shape \[5, 3\]; expected \(dim, width\) = \[4, width\] \(dim=4 from x \[2, 4, 6\]\)$"),
    ("conv", lambda a: {**a, "weight": r(4, 9), "initial_states": None}, ValueError,
     r"^causal_conv1d_fn: weight has shape \[4, 9\]: width=9; rlx_gpu's causal_conv1d takes 2 <= width <= 8"),
    ("conv", lambda a: {**a, "initial_states": r(2, 4, 3)}, ValueError,
     r"^causal_conv1d_fn: initial_states has shape \[2, 4, 3\]; expected \(batch, dim, width - 1\) = \[2, 4, 2\] "
     r"\(width - 1=2 from width=3 from weight \[4, 3\]\)$"),
    ("conv", lambda a: {**a, "final_states_out": r(1, 4, 2)}, ValueError,
     r"^causal_conv1d_fn: final_states_out has shape \[1, 4, 2\]; expected \(batch, dim, width - 1\) = \[2, 4, 2\] "
     r"\(batch=2 from x \[2, 4, 6\]\)$"),
    ("conv", lambda a: {**a, "seq_idx": torch.zeros(2, 5, dtype=torch.int32)}, ValueError,
     r"^causal_conv1d_fn: seq_idx has shape \[2, 5\]; expected \(batch, seqlen\) = \[2, 6\]"),
    ("conv", lambda a: {**a, "seq_idx": torch.zeros(2, 6)}, TypeError,
     r"^causal_conv1d_fn: seq_idx is torch.float32; expected an integer tensor"),
    ("conv", lambda a: {**a, "seq_idx": torch.tensor([[0, 0, 1, 0, 0, 0]] * 2)}, NotImplementedError,
     r"^causal_conv1d_fn: seq_idx falls from 1 to 0 at \[0, 3\]"),
    ("conv", lambda a: {**a, "x": a["x"].long()}, TypeError, r"^causal_conv1d_fn: x is torch.int64; expected a floating"),
    ("conv", lambda a: {**a, "weight": a["weight"].to(torch.complex64)}, NotImplementedError,
     r"^causal_conv1d_fn: weight is complex \(torch.complex64\)"),
    ("conv", lambda a: {**a, "bias": a["bias"].to("meta")}, ValueError,
     r"^causal_conv1d_fn: bias lies on meta, x on cpu; the tensors of one call lie on one device"),
    ("conv_update", lambda a: {**a, "conv_state": r(5, 4, 1)}, ValueError,
     r"^causal_conv1d_update: conv_state has shape \[5, 4, 1\]: 1 columns; width 3 \(weight \[4, 3\]\) needs at "
     r"least 2$"),
    ("conv_update", lambda a: {**a, "conv_state": r(5, 3, 3)}, ValueError,
     r"^causal_conv1d_update: conv_state has shape \[5, 3, 3\]; expected \(pool, dim, state_len\) = "
     r"\[pool, 4, state_len\] \(dim=4 from x \[2, 4\]\)$"),
    ("conv_update", lambda a: {**a, "conv_state_indices": None}, ValueError,
     r"^causal_conv1d_update: conv_state has shape \[5, 4, 3\]; expected \(batch, dim, state_len\) = "
     r"\[2, 4, state_len\] \(batch=2 from x \[2, 4\]\)$"),
    ("conv_update", lambda a: {**a, "x": r(2, 4, 1, 1)}, ValueError,
     r"^causal_conv1d_update: x has shape \[2, 4, 1, 1\] \(4 dimensions\); expected \(batch, dim\) or "
     r"\(batch, dim, seqlen\)$"),
    ("conv_update", lambda a: {**a, "conv_state_indices": torch.tensor([3, 1, 0])}, ValueError,
     r"^causal_conv1d_update: conv_state_indices has shape \[3\]; expected \(batch,\) = \[2\]"),
    ("conv_update", lambda a: {**a, "conv_state_indices": torch.tensor([3.0, 1.0])}, TypeError,
     r"^causal_conv1d_update: conv_state_indices is torch.float32; expected an integer tensor"),
    ("conv_update", lambda a: {**a, "conv_state_indices": torch.tensor([3, 5])}, IndexError,
     r"^causal_conv1d_update: conv_state_indices\[1\] = 5 is outside the state pool of 5 entries"),
    # mamba_ssm's Mamba-3 SISO: Q, K (batch, seqlen, nheads_qk, headdim_qk), ADT, DT, Trap (batch, nheads, seqlen)
    ("mamba3", lambda a: {**a, "ADT": a["ADT"].transpose(1, 2)}, ValueError,
     r"^mamba3_siso_combined: ADT has shape \[2, 5, 4\]; expected \(batch, nheads, seqlen\) = \[2, 4, 5\] "
     r"\(nheads=4 from V \[2, 5, 4, 3\], seqlen=5 from Q \[2, 5, 2, 4\]\)$"),
    ("mamba3", lambda a: {**a, "V": r(2, 5, 3, 3), "Z": None}, ValueError,
     r"^mamba3_siso_combined: Q has nheads_qk=2, which does not divide nheads=3 \(from V \[2, 5, 3, 3\]\)"),
    ("mamba3", lambda a: {**a, "Angles": r(2, 5, 4, 3)}, ValueError,
     r"^mamba3_siso_combined: Angles has headdim_angles=3 \(Angles \[2, 5, 4, 3\]\) beside headdim_qk=4 \(from "
     r"Q \[2, 5, 2, 4\]\); rotary pairs need an even headdim_qk and 1 <= headdim_angles <= headdim_qk / 2$"),
    ("mamba3", lambda a: {**a, "Input_States": a["Input_States"][:3]}, ValueError,
     r"^mamba3_siso_combined: Input_States holds 3 tensors; expected the 4-tuple \(angle, ssm, k, v\)$"),
    ("mamba3", lambda a: {**a, "Input_States": [a["Input_States"][0], r(2, 4, 4, 3), *a["Input_States"][2:]]},
     ValueError, r"^mamba3_siso_combined: Input_States\[1\] \(ssm\) has shape \[2, 4, 4, 3\]; expected "
                 r"\(R, nheads, headdim_v, headdim_qk\) = \[2, 4, 3, 4\]"),
    ("mamba3", lambda a: {**a, "cu_seqlens": torch.tensor([0, 2, 5])}, ValueError,
     r"^mamba3_siso_combined: the batch size must be 1 rather than 2 with cu_seqlens"),
    ("mamba3", lambda a: {**a, "Q": a["Q"].long()}, TypeError,
     r"^mamba3_siso_combined: Q is torch.int64; expected a floating"),
    ("mamba3_step", lambda a: {**a, "Q": a["Q"][:, None]}, ValueError,
     r"^mamba3_siso_step: Q has shape \[2, 1, 2, 4\] \(4 dimensions\); expected \(batch, nheads_qk, headdim_qk\)$"),
    ("mamba3_step", lambda a: {**a, "DT": r(2, 3)}, ValueError,
     r"^mamba3_siso_step: DT has shape \[2, 3\]; expected \(batch, nheads\) = \[2, 4\] "
     r"\(nheads=4 from V \[2, 4, 3\]\)$"),
]


def _label(entry: tuple) -> str:
    return f"{entry[0]}-{entry[2].__name__}"


@pytest.mark.parametrize("good,change,error,message", TABLE, ids=[_label(e) for e in TABLE])
def test_a_bad_call_raises_before_anything_runs_naming_the_argument_and_its_layout(good, change, error, message,
                                                                                     host):
    fn, args = GOOD[good]
    given = args()
    bad = change(given)
    before = {k: v.clone() for k, v in bad.items() if isinstance(v, torch.Tensor) and v.device.type == "cpu"}
    with pytest.raises(error, match=message):
        fn(**bad)
    for k, v in before.items():  # nothing ran: the state updated in place is as it was
        assert torch.equal(bad[k], v), k


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors a call returned: one, or those of a tuple or list (nested once: mamba3_siso_step's states)."""
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for item in out if item is not None for t in _tensors(item)]


@pytest.mark.parametrize("good", GOOD)
def test_the_good_calls_run(good, host):
    fn, args = GOOD[good]
    outs = _tensors(fn(**args()))
    assert outs and all(torch.isfinite(t).all() for t in outs)


#: (check, its arguments from a good call's): the checks the lead calls inside the custom ops.
CHECKS = {
    "scan": (arguments.check_selective_scan_fn, lambda a: a),
    "ssd": (arguments.check_mamba_chunk_scan_combined,
            lambda a: {k: v for k, v in a.items() if k not in ("chunk_size", "return_varlen_states")}),
    "varlen": (arguments.check_mamba_chunk_scan_combined,
               lambda a: {k: v for k, v in a.items() if k not in ("chunk_size", "return_varlen_states")}),
    "step": (arguments.check_selective_state_update, lambda a: a),
    "gdn": (arguments.check_chunk_gated_delta_rule, lambda a: a),
    "packed_gdn": (arguments.check_chunk_gated_delta_rule, lambda a: a),
    "recurrent": (arguments.check_fused_recurrent_gated_delta_rule, lambda a: a),
    "kda": (arguments.check_chunk_kda, lambda a: a),
    "conv": (arguments.check_causal_conv1d_fn, lambda a: {k: v for k, v in a.items() if k != "return_final_states"}),
    "conv_update": (arguments.check_causal_conv1d_update, lambda a: a),
    "mamba3": (arguments.check_mamba3_siso_combined,
               lambda a: {k: v for k, v in a.items() if k != "return_final_states"}),
    "mamba3_step": (arguments.check_mamba3_siso_step, lambda a: a),
}


def _static(entry: tuple) -> bool:
    """Whether a table entry is a shape/dtype/device error (not one of the index values')."""
    return entry[0] in CHECKS and entry[2] is not IndexError and not any(
        word in entry[3] for word in ("falls from", "must start at 0", "ends at", "is below", "both name"))


STATIC = [e for e in TABLE if _static(e)]


@pytest.mark.parametrize("good,change,error,message", STATIC, ids=[_label(e) for e in STATIC])
def test_the_shape_and_dtype_checks_read_no_data_they_run_on_fake_tensors(good, change, error, message):
    check, picked = CHECKS[good]
    given = picked(change(GOOD[good][1]()))
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        def faked(v: Any) -> Any:
            if isinstance(v, list):
                return [faked(t) for t in v]
            return mode.from_tensor(v) if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v

        fake = {k: faked(v) for k, v in given.items()}
        with pytest.raises(error, match=message):
            check(**{k: v for k, v in fake.items() if k != "use_gate_in_kernel"})


@pytest.mark.parametrize("good", CHECKS)
def test_the_checks_trace_into_a_compiled_graph_without_a_break(good):
    check, picked = CHECKS[good]
    given = {k: v for k, v in picked(GOOD[good][1]()).items() if isinstance(v, torch.Tensor)}
    names = tuple(given)

    def step(*tensors: torch.Tensor) -> torch.Tensor:
        check(**dict(zip(names, tensors)))
        return tensors[0] * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager", dynamic=True)
    torch.testing.assert_close(compiled(*given.values()), next(iter(given.values())) * 2)


# torch.nn's modules: the errors are torch.nn's own, bad call for bad call
def _states(mode: str, *shape: int, dtype: torch.dtype = F32) -> Any:
    h = torch.zeros(*shape, dtype=dtype)
    return (h, torch.zeros(*shape)) if mode == "LSTM" else h


MODULE_CALLS = {
    "4-D input": lambda m: m(r(2, 3, 5, 4)),
    "input size": lambda m: m(r(5, 3, 6)),
    "input dtype": lambda m: m(r(5, 3, 4, dtype=F64)),
    "state batch": lambda m: m(r(5, 3, 4), _states(m.mode, 1, 2, 8)),
    "2-D states for 3-D input": lambda m: m(r(5, 3, 4), _states(m.mode, 1, 8)),
    "3-D states for 2-D input": lambda m: m(r(5, 4), _states(m.mode, 1, 1, 8)),
    "no step": lambda m: m(r(0, 3, 4)),
}


@pytest.mark.parametrize("call", MODULE_CALLS)
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_the_modules_errors_are_torch_nn_s(kind, call, host):
    torch.manual_seed(0)
    theirs, ours = getattr(torch.nn, kind)(4, 8), getattr(rt, kind)(4, 8)
    with pytest.raises(Exception) as expected:
        MODULE_CALLS[call](theirs)
    with pytest.raises(type(expected.value), match=f"^{__import__('re').escape(str(expected.value))}$"):
        MODULE_CALLS[call](ours)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_initial_states_of_another_dtype_are_refused_naming_them(kind, host):
    """torch.nn fails inside its kernel (``mat1 and mat2 must have the same dtype``); ours names the state."""
    which = r"hx\[0\] \(h_0\)" if kind == "LSTM" else r"hx \(h_0\)"
    with pytest.raises(TypeError, match=rf"^{kind}: {which} is torch.float64 beside input torch.float32; the initial "
                                        rf"states take the input's dtype"):
        getattr(rt, kind)(4, 8)(r(5, 3, 4), _states(kind, 1, 3, 8, dtype=F64))


# no NumPy warning reaches the caller: saturated and non-finite values are data
EXTREMES = [1e30, float("inf"), -float("inf"), float("nan")]


@pytest.mark.parametrize("value", EXTREMES)
@pytest.mark.parametrize("good", ["scan", "ssd", "step", "mamba1_step", "gdn", "recurrent", "kda", "conv", "mamba3"])
def test_no_numpy_warning_reaches_the_caller_on_saturated_or_non_finite_inputs(good, value, host):
    fn, args = GOOD[good]
    given = args()
    if good in ("step", "mamba1_step"):
        given.pop("state_batch_indices", None)
        given["state"] = given["state"][:2].clone()
    leaves = {k: v.requires_grad_() if good not in ("step", "mamba1_step") and v.is_floating_point() else v
              for k, v in given.items() if isinstance(v, torch.Tensor)}
    for name, t in leaves.items():  # every tensor argument saturated in every other element
        if t.is_floating_point():
            with torch.no_grad():
                t.view(-1)[::2] = value
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = fn(**{**given, **leaves})
        outs = _tensors(out)
        if good not in ("step", "mamba1_step"):
            sum(t.sum() for t in outs).backward()


@pytest.mark.parametrize("value", EXTREMES)
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_no_numpy_warning_reaches_the_caller_from_the_modules(kind, value, host):
    x = r(70, 2, 4)
    x.view(-1)[::3] = value
    x.requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y, _ = getattr(rt, kind)(4, 8)(x)
        y.sum().backward()
