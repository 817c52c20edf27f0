"""flash-linear-attention's gated delta rule functions with its signatures and conventions, on rlx_gpu's op.

``chunk_gated_delta_rule`` and ``fused_recurrent_gated_delta_rule`` (a gate per value head) and
``chunk_kda`` (a gate per key channel) map onto the ``gated_delta_net`` op of ABI.md §4/§8: fla's
``[N, HV, K, V]`` state (f32), ``scale``, ``initial_state``, ``output_final_state``,
``use_qk_l2norm_in_kernel`` and ``cu_seqlens`` are the op's own; the gate and beta activations fla
can fuse (``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``) are applied here before the op, and
``state_v_first`` transposes the state around it. Every function is differentiable
(``fused.FusedFunction``) and runs where its tensors lie.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from .arguments import (check_chunk_gated_delta_rule, check_chunk_kda, check_cu_seqlens,
                        check_fused_recurrent_gated_delta_rule)
from ..schedule.reserve import reserve_bytes
from .bridge import DTYPES, UNBUILT, call_key, hot_path, keep_hot_path
from .fused import FusedOp, bound_forward, cast, define_fused, saves
from .library import PLAIN, runs_directly

from .registry import FUNCTIONS
from .written import bound_written



def _reserve(given: dict[str, torch.Tensor]) -> int | None:
    """The elements of ``q``'s type a call's saved forward takes (``rlx_gpu.reserve_bytes``), ``None`` for packed
    sequences (none yet)."""
    if "cu_seqlens" in given:
        return None
    q, v = given["q"], given["v"]
    fields = dict(op="gated_delta_net", dtype=DTYPES[q.dtype], batch=q.shape[0], seq=q.shape[1], heads=q.shape[2],
                  state_size=q.shape[3], value_heads=v.shape[2], value_size=v.shape[3])
    if "state" in given:
        fields["state_dtype"] = DTYPES[given["state"].dtype]
    return reserve_bytes(fields) // q.element_size()


_GATED_DELTA_NET = define_fused(FusedOp(
    "gated_delta_net", ("q", "k", "v", "g", "beta"), ("state", "cu_seqlens"),
    (("gate_per_channel", "bool"), ("scale", "float?"), ("use_qk_l2norm", "bool")), "v", _reserve))

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda"]


def _refuse(name: str, **given: Any) -> None:
    """fla arguments the op cannot express, refused when given a value other than fla's default."""
    for arg, value in given.items():
        if value is not None and value is not False:
            shown = f"a tensor {list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
            raise NotImplementedError(f"{name}: {arg}={shown} is not supported by rlx_gpu's gated_delta_net "
                                      f"(ABI.md §8); leave {arg} at its default")


def _beta(name: str, beta: torch.Tensor, sigmoid: bool, allow_neg_eigval: bool) -> torch.Tensor:
    """fla's ``use_beta_sigmoid_in_kernel`` (``sigmoid(beta)``, doubled with ``allow_neg_eigval``)."""
    if allow_neg_eigval and not sigmoid:
        raise ValueError(f"{name}: allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    if not sigmoid:
        return beta
    return (2.0 if allow_neg_eigval else 1.0) * torch.sigmoid(beta)


def _delta_rule(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                per_channel: bool, scale: float | None, initial_state: torch.Tensor | None, output_final_state: bool,
                use_qk_l2norm_in_kernel: bool, state_v_first: bool, cu_seqlens: torch.Tensor | None,
                recompute: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The shared body: the op's call on arguments ``arguments.check_*`` passed, fla's return value
    ``(o, final_state or None)``; the forward saved for the backward where ``fused.saves`` says so, unless
    ``recompute``."""
    value_heads = v.shape[2]
    rows = q.shape[0]
    cu = None
    if cu_seqlens is not None:
        if not torch.compiler.is_compiling():  # reads the values; traced, the op's run-time data check stands
            check_cu_seqlens(name, cu_seqlens, q.shape[1])
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        rows = cu.numel() - 1
    act = q.dtype
    carried = torch.float64 if act == torch.float64 else torch.float32  # fla's state is f32
    state = None
    if initial_state is not None or output_final_state:
        key_size, value_size = k.shape[-1], v.shape[-1]
        if initial_state is None:
            state = q.new_zeros((rows, value_heads, key_size, value_size), dtype=carried)
        else:
            state = cast(initial_state.transpose(-1, -2) if state_v_first else initial_state, carried)
    tensors = (q, cast(k, act), cast(v, act), cast(g, act), cast(beta, act), state)
    save = not recompute and saves(q, [t for t in tensors[1:] if t is not None])
    # the op's schema: q, k, v, g, beta, state, cu_seqlens, gate_per_channel, scale, use_qk_l2norm, save
    o, final, _ = _GATED_DELTA_NET(*tensors, cu, per_channel, None if scale is None else float(scale),
                                   bool(use_qk_l2norm_in_kernel), save)
    if not output_final_state:
        return o, None
    return o, final.transpose(-1, -2) if state_v_first else final


def _gdn_gate(g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """fla's gate fused in the kernel: ``-exp(A_log)·softplus(g + dt_bias)`` per value head."""
    u = g.float() if dt_bias is None else g.float() + dt_bias.float()
    return (-A_log.float().exp() * F.softplus(u)).to(g.dtype)


@FUNCTIONS.register("gated_delta_net")
def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: float | None = None, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
                           state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None,
                           cu_seqlens_cpu: torch.Tensor | None = None, chunk_indices: torch.Tensor | None = None,
                           cp_context: Any = None, recompute: bool = False,
                           **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule, fla's ``chunk_gated_delta_rule``: per value head ``S ← exp(g)·S``,
    ``S ← S + k⊗(beta·(v - Sᵀk))``, ``o = scale·Sᵀq``.

    Parameters
    ----------
    q, k : torch.Tensor
        ``[B, T, H, K]``.
    v : torch.Tensor
        ``[B, T, HV, V]``; value head ``j`` reads key head ``j // (HV/H)``.
    g, beta : torch.Tensor
        ``[B, T, HV]``: the log decay and the write strength. With ``use_gate_in_kernel=True`` (a
        keyword, with ``A_log`` and ``dt_bias`` ``[HV]``) ``g`` is raw: ``-exp(A_log)·softplus(g + dt_bias)``.
    scale : float, optional
        Default ``1/sqrt(K)``.
    initial_state : torch.Tensor, optional
        ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), one per sequence.
    cu_seqlens : torch.Tensor, optional
        ``[N + 1]`` boundaries of ``N`` sequences packed along ``T`` (batch 1).
    use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval : bool
        As fla: L2-normalise q and k; ``beta = sigmoid(beta)`` (``2·sigmoid`` with ``allow_neg_eigval``).
    recompute : bool
        False: a forward autograd records on the host saves what its backward reads (ABI.md §9.1's
        reserve: per chunk of 32 tokens the state, the decayed products, their inverse and u; not for
        packed sequences); True: the backward recomputes the forward (less memory, slower).

    Returns
    -------
    (torch.Tensor, torch.Tensor or None)
        ``o [B, T, HV, V]`` in q's dtype and, with ``output_final_state``, the final state (f32; f64 for
        f64 inputs). Differentiable in q, k, v, g, beta, the initial state and the gate's parameters.
    """
    check_chunk_gated_delta_rule(q, k, v, g, beta, initial_state, state_v_first, cu_seqlens, kwargs.get("A_log"),
                                 kwargs.get("dt_bias"))
    name = "chunk_gated_delta_rule"
    _refuse(name, cp_context=cp_context)
    if kwargs.pop("chunk_size", 64) not in (16, 32, 64):
        raise ValueError(f"{name}: chunk_size must be 16, 32 or 64, as fla's")
    if kwargs.pop("use_gate_in_kernel", False):
        A_log = kwargs.pop("A_log", None)
        if A_log is None:
            raise ValueError(f"{name}: A_log must be provided when use_gate_in_kernel=True")
        g = _gdn_gate(g, A_log, kwargs.pop("dt_bias", None))
    _refuse(name, **kwargs)
    beta = _beta(name, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return _delta_rule(name, q, k, v, g, beta, False, scale, initial_state, output_final_state,
                       use_qk_l2norm_in_kernel, state_v_first, cu_seqlens, recompute)


@FUNCTIONS.register("gated_delta_net")
def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None,
                                     gk: torch.Tensor | None = None, gv: torch.Tensor | None = None,
                                     beta: torch.Tensor | None = None, scale: float | None = None,
                                     initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                                     use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                                     A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                                     use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
                                     state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None,
                                     recompute: bool = False,
                                     **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule step by step, fla's ``fused_recurrent_gated_delta_rule`` (same result as
    ``chunk_gated_delta_rule``; the decode-time spelling).

    ``g [B, T, HV]`` (a decay per value head) and ``gk [B, T, HV, K]`` (per key channel) may be given
    alone or together (their sum is the log decay); neither: no decay. ``beta`` defaults to ones.
    ``gv`` (a decay per value channel) has no counterpart in the op. Otherwise as
    ``chunk_gated_delta_rule`` (``recompute`` too); with ``use_gate_in_kernel`` the raw ``g`` goes through
    ``-exp(A_log)·softplus(g + dt_bias)``.
    """
    key = None
    if not kwargs and runs_directly(q, k, v, g, gk, gv, beta, initial_state, A_log, dt_bias, cu_seqlens):
        key = call_key(q, k, v, g, gk, gv, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                       use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                       state_v_first, cu_seqlens, recompute)
        path = hot_path(key)
        if path is not None and path is not UNBUILT:
            return path(q, k, v, g, beta, initial_state)
    out = _fused_recurrent(q, k, v, g, gk, gv, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                           use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                           state_v_first, cu_seqlens, recompute, kwargs)
    if key is not None and path is UNBUILT:
        plain = (gk is gv is cu_seqlens is None and g is not None and beta is not None and not use_gate_in_kernel
                 and not use_beta_sigmoid_in_kernel and not state_v_first)
        keep_hot_path(key, lambda: _hot_recurrent(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                  use_qk_l2norm_in_kernel) if plain else None)
    return out


def _hot_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   scale: float | None, initial_state: torch.Tensor | None, output_final_state: bool,
                   use_qk_l2norm_in_kernel: bool) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None:
    """The hot path (``bridge.hot_path``) of a plain ``fused_recurrent_gated_delta_rule`` signature whose
    call just passed its checks: a gate per value head, ``beta`` as it is, the state in fla's layout as
    the op carries it or none at all, tensors of q's dtype: the op's bound forward call on the tensors
    themselves; None for any other."""
    carried = torch.float64 if q.dtype == torch.float64 else torch.float32
    state_given = initial_state is not None and initial_state.dtype == carried
    if not (state_given or not output_final_state) or any(t.dtype != q.dtype for t in (k, v, g, beta)) or not all(
            type(t) in PLAIN for t in (q, k, v, g, beta, initial_state) if t is not None):
        return None
    bound = bound_forward("gated_delta_net", (q, k, v, g, beta, initial_state, None, False,
                                              None if scale is None else float(scale), bool(use_qk_l2norm_in_kernel),
                                              False))  # (save: the general path's key for a call saving nothing)
    if bound is None:
        return None
    tensors = (q, k, v, g, beta, initial_state)
    written = bound_written(bound, tensors) if bound.plain else None
    run = written if written is not None else bound

    def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        o, *final = run((q, k, v, g, beta, initial_state))  # by the op's fields: q, k, v, g, beta, state
        return o, final[0] if output_final_state else None
    return recurrent


def _fused_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
                     gk: torch.Tensor | None, gv: torch.Tensor | None, beta: torch.Tensor | None, scale: float | None,
                     initial_state: torch.Tensor | None, output_final_state: bool, use_qk_l2norm_in_kernel: bool,
                     use_gate_in_kernel: bool, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                     use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, state_v_first: bool,
                     cu_seqlens: torch.Tensor | None, recompute: bool,
                     kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fused_recurrent_gated_delta_rule`` the whole way: its checks, fla's options, the op."""
    check_fused_recurrent_gated_delta_rule(q, k, v, g, gk, beta, initial_state, state_v_first, cu_seqlens, A_log,
                                           dt_bias)
    name = "fused_recurrent_gated_delta_rule"
    _refuse(name, gv=gv, **kwargs)
    if use_gate_in_kernel:
        if A_log is None or g is None:
            raise ValueError(f"{name}: use_gate_in_kernel=True needs A_log and the raw g")
        g = _gdn_gate(g, A_log, dt_bias)
    beta = torch.ones_like(q[..., 0]).expand(*v.shape[:3]) if beta is None else beta
    beta = _beta(name, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if gk is not None:
        gate, per_channel = gk if g is None else gk + g.unsqueeze(-1), True
    else:
        gate, per_channel = (v.new_zeros(v.shape[:3]) if g is None else g), False
    return _delta_rule(name, q, k, v, gate, beta, per_channel, scale, initial_state, output_final_state,
                       use_qk_l2norm_in_kernel, state_v_first, cu_seqlens, recompute)


@FUNCTIONS.register("gated_delta_net")
def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
              use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
              use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False, safe_gate: bool = False,
              lower_bound: float | None = None, disable_recompute: bool = False,
              return_intermediate_states: bool = False, state_v_first: bool = False,
              cu_seqlens: torch.Tensor | None = None, cu_seqlens_cpu: torch.Tensor | None = None,
              cp_context: Any = None, recompute: bool = False,
              **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention, fla's ``chunk_kda``: the gated delta rule with a decay per key channel,
    ``S[i, :] ← exp(g[i])·S[i, :]``; ``g [B, T, HV, K]``, otherwise as ``chunk_gated_delta_rule``.

    With ``use_gate_in_kernel`` the raw ``g`` becomes ``-exp(A_log)·softplus(g + dt_bias)`` (``A_log
    [HV]``, ``dt_bias [HV·K]``, keywords as in fla). ``safe_gate``/``lower_bound`` and
    ``return_intermediate_states`` (fla's kernel-specific modes) are refused. A forward autograd records saves
    what its backward reads unless ``recompute`` (as ``chunk_gated_delta_rule``); fla's ``disable_recompute``,
    which saves where fla would recompute, is accepted and changes nothing.
    """
    check_chunk_kda(q, k, v, g, beta, initial_state, state_v_first, cu_seqlens, kwargs.get("A_log"),
                    kwargs.get("dt_bias"))
    name = "chunk_kda"
    _refuse(name, safe_gate=safe_gate, lower_bound=lower_bound, return_intermediate_states=return_intermediate_states,
            cp_context=cp_context)
    if kwargs.pop("chunk_size", 64) not in (32, 64):
        raise ValueError(f"{name}: chunk_size must be 32 or 64, as fla's")
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    _refuse(name, **kwargs)
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError(f"{name}: A_log must be provided when use_gate_in_kernel=True")
        heads, width = g.shape[-2:]
        g = _gdn_gate(g, A_log.reshape(heads, 1), None if dt_bias is None else dt_bias.reshape(heads, width))
    beta = _beta(name, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return _delta_rule(name, q, k, v, g, beta, True, scale, initial_state, output_final_state,
                       use_qk_l2norm_in_kernel, state_v_first, cu_seqlens, recompute)
