"""mamba_ssm's selective-scan functions with its signatures and conventions, on rlx_gpu's ops.

``selective_scan_fn`` (Mamba-1, channel-major ``[B, D, L]`` like mamba_ssm) and ``mamba_chunk_scan_combined``
(Mamba-2 SSD, ``seq_idx`` as mamba_ssm's spelling of packed sequences) map onto the ``selective_scan`` and
``mamba2`` ops of ABI.md §4/§8, differentiable (``fused.FusedFunction``); ``selective_state_update`` (one
decode step, updating ``state`` in place) is ``state_update``'s. Every function runs where its tensors lie
(``bridge.device_for``).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ..schedule.reserve import reserve_bytes
from .arguments import check_cu_seqlens, check_mamba_chunk_scan_combined, check_selective_scan_fn, check_seq_idx
from .bridge import DTYPES
from .fused import FusedOp, cast, define_fused, fused
from .library import define
from .registry import FUNCTIONS



def _reserve_of(op: str, shape: Any) -> Any:
    """The ``FusedOp.reserve`` of ``op``: the elements of ``x``'s type a call's saved forward takes
    (``rlx_gpu.reserve_bytes``; ``shape(given)``: its shape fields), ``None`` for packed sequences (none yet)."""
    def elements(given: dict[str, torch.Tensor]) -> int | None:
        if "cu_seqlens" in given:
            return None
        x = given["x"]
        fields = dict(op=op, dtype=DTYPES[x.dtype], param_dtype=DTYPES[given["a"].dtype], **shape(given))
        if "state" in given:
            fields["state_dtype"] = DTYPES[given["state"].dtype]
        return reserve_bytes(fields) // x.element_size()
    return elements


define_fused(FusedOp("selective_scan", ("x", "delta", "a", "b", "c"), ("d", "z", "delta_bias", "state", "cu_seqlens"),
                     (("delta_softplus", "bool"),), "x",
                     _reserve_of("selective_scan", lambda g: dict(batch=g["x"].shape[0], seq=g["x"].shape[1],
                                                                  hidden=g["x"].shape[2], state_size=g["a"].shape[-1]))))
_mamba2_reserve = _reserve_of("mamba2", lambda g: dict(batch=g["x"].shape[0], seq=g["x"].shape[1],
                                                       heads=g["x"].shape[2], head_dim=g["x"].shape[3],
                                                       state_size=g["b"].shape[-1]))


define_fused(FusedOp("mamba2", ("x", "dt", "a", "b", "c"), ("d", "z", "dt_bias", "state", "cu_seqlens"),
                     (("dt_softplus", "bool"), ("dt_limit", "float[]?")), "x", _mamba2_reserve))

__all__ = ["selective_scan_fn", "mamba_chunk_scan_combined"]


def _param_dtype(a: torch.Tensor, x: torch.Tensor) -> torch.dtype:
    """The element type of the per-channel parameters: ``a``'s (mamba_ssm keeps A, D and the dt bias
    in f32 beside 16-bit activations), widened to ``x``'s where ``x`` is wider (ABI.md §8's rule)."""
    return a.dtype if a.dtype.itemsize >= x.dtype.itemsize and a.is_floating_point() else x.dtype


def _state_dtype(x: torch.Tensor) -> torch.dtype:
    """The precision states are carried at: f32, or f64 for f64 activations."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _channel_bc(name: str, arg: str, t: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """mamba_ssm's B or C (``[D,N]`` fixed, ``[B,N,L]`` or ``[B,G,N,L]``) as the op's ``[B,L,N]`` / ``[B,L,G,N]``."""
    if t.dim() == 2:  # one B per channel for every step: D groups of one channel, broadcast over time
        return t.expand(batch, length, *t.shape)
    if t.dim() == 3:
        return t.permute(0, 2, 1)
    if t.dim() == 4:
        return t.permute(0, 3, 1, 2)
    raise ValueError(f"{name}: {arg} has shape {list(t.shape)}; mamba_ssm takes [D, N], [B, N, L] or [B, G, N, L]")


@FUNCTIONS.register("selective_scan")
def selective_scan_fn(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                      D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                      delta_bias: torch.Tensor | None = None, delta_softplus: bool = False,
                      return_last_state: bool = False, recompute: bool = False) -> Any:
    """Mamba-1's selective scan, mamba_ssm's ``selective_scan_fn``: per channel ``h = exp(Δ·A)⊙h + Δ·B·u``,
    ``y = C·h``, ``out = (y + D·u)⊙silu(z)``, ``Δ = softplus(delta + delta_bias)``.

    Parameters
    ----------
    u, delta, z : torch.Tensor
        ``[B, D, L]`` (channel-major, like mamba_ssm).
    A : torch.Tensor
        ``[D, N]``, real. ``A``, ``D`` and ``delta_bias`` (``[D]``) share ``A``'s element type (f32
        beside 16-bit activations, as mamba_ssm keeps them).
    B, C : torch.Tensor
        ``[B, N, L]``, ``[B, G, N, L]`` (channel ``d`` reads group ``d // (D/G)``) or ``[D, N]`` (fixed).
    delta_softplus : bool
        Apply softplus to the biased ``delta``.
    return_last_state : bool
        Also return the state after the last step, ``[B, D, N]`` (f32; f64 for f64 ``u``).
    recompute : bool
        False: a forward autograd records on the host saves what its backward reads (ABI.md §9.1's
        reserve: the state every 32 steps); True: the backward recomputes the forward.

    Returns
    -------
    torch.Tensor or (torch.Tensor, torch.Tensor)
        ``out [B, D, L]`` in ``u``'s dtype, and the last state with ``return_last_state``. Differentiable
        in every tensor argument, the last state included (mamba_ssm leaves its gradient out).
    """
    check_selective_scan_fn(u, delta, A, B, C, D, z, delta_bias)
    name = "selective_scan_fn"
    batch, _, length = u.shape
    act, param = u.dtype, _param_dtype(A, u)
    tensors = {"x": u.transpose(1, 2), "delta": cast(delta, act).transpose(1, 2), "a": cast(A, param),
               "b": _channel_bc(name, "B", cast(B, act), batch, length),
               "c": _channel_bc(name, "C", cast(C, act), batch, length),
               "d": cast(D, param), "delta_bias": cast(delta_bias, param),
               "z": None if z is None else cast(z, act).transpose(1, 2)}
    if return_last_state:  # the op returns a final state only when it is given an initial one
        tensors["state"] = u.new_zeros((batch, *A.shape), dtype=_state_dtype(u))
    y, last = fused("selective_scan", tensors, recompute, delta_softplus=bool(delta_softplus))
    out = y.transpose(1, 2).contiguous()
    return (out, last) if return_last_state else out


def _packed_rows(seq_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rlx_gpu::packed_rows``: mamba_ssm's ``seq_idx [B, L]`` as packed sequences of the ``B·L`` tokens
    laid end to end: ``(cu_seqlens, first, last)``, the int32 boundaries and each row's first and last
    sequence (int64), on ``seq_idx``'s device.

    The state restarts wherever ``seq_idx`` changes along a row, and at every row start; a row's
    indices must not decrease (a sequence is one run of tokens). An op of its own, since it reads the
    indices: traced, the number of sequences is a size known only when it runs.
    """
    check_seq_idx("mamba_chunk_scan_combined", seq_idx)
    batch, length = seq_idx.shape
    idx = seq_idx.detach().cpu().to(torch.int64)
    steps = idx[:, 1:] - idx[:, :-1]
    starts = torch.ones(batch, length, dtype=torch.bool)
    starts[:, 1:] = steps != 0
    flat = starts.reshape(-1).nonzero().reshape(-1)
    cu = torch.cat([flat, torch.tensor([batch * length])]).to(torch.int32)
    counts = starts.sum(1)
    last = counts.cumsum(0) - 1
    return tuple(t.to(seq_idx.device) for t in (cu, last - counts + 1, last))


def _packed_rows_fake(seq_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    boundaries = torch.library.get_ctx().new_dynamic_size(min=2)  # one past each sequence, and 0
    rows = seq_idx.new_empty((seq_idx.shape[0],), dtype=torch.int64)
    return seq_idx.new_empty((boundaries,), dtype=torch.int32), rows, torch.empty_like(rows)


_PACKED_ROWS = define("packed_rows", "(Tensor seq_idx) -> (Tensor, Tensor, Tensor)", _packed_rows, _packed_rows_fake)


@FUNCTIONS.register("mamba2")
def mamba_chunk_scan_combined(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                              chunk_size: int, D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                              dt_bias: torch.Tensor | None = None, initial_states: torch.Tensor | None = None,
                              seq_idx: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                              dt_softplus: bool = False, dt_limit: Sequence[float] = (0.0, float("inf")),
                              return_final_states: bool = False, return_varlen_states: bool = False,
                              state_dtype: torch.dtype | None = None, recompute: bool = False) -> Any:
    """Mamba-2's SSD, mamba_ssm's ``mamba_chunk_scan_combined``: per head ``S = exp(dt·A)·S + (dt·x)⊗B``,
    ``y = S·C``, ``out = (y + D·x)⊙silu(z)``, ``dt = clamp(softplus(dt + dt_bias), *dt_limit)``.

    Parameters
    ----------
    x, z : torch.Tensor
        ``[B, L, H, P]``.
    dt : torch.Tensor
        ``[B, L, H]``.
    A, dt_bias : torch.Tensor
        ``[H]``; with ``D`` (``[H]`` or ``[H, P]``) in ``A``'s element type (see ``selective_scan_fn``).
    B, C : torch.Tensor
        ``[B, L, G, N]``; head ``h`` reads group ``h // (H/G)``.
    chunk_size : int
        mamba_ssm's blocking; the result does not depend on it here.
    initial_states : torch.Tensor, optional
        ``[B, H, P, N]``. With ``seq_idx`` each row's state feeds its first sequence only, as in mamba_ssm.
    seq_idx : torch.Tensor, optional
        ``[B, L]`` integers: the state restarts where the index changes along a row (packed sequences).
    cu_seqlens : torch.Tensor, optional
        ``[num_seqs + 1]``, read only for ``return_varlen_states`` (batch 1, with ``seq_idx``), as mamba_ssm.
    dt_limit : (float, float)
        The clamp of ``dt``; the default ``(0, inf)`` clamps negative values to 0, as mamba_ssm.
    return_final_states, return_varlen_states : bool
        Also return the state after each row's last step ``[B, H, P, N]``, and after each packed
        sequence ``[num_seqs, H, P, N]``, in ``state_dtype`` (default ``C``'s dtype).
    recompute : bool
        False: a forward autograd records on the host (without ``seq_idx``) saves what its backward reads
        (ABI.md §9.1's reserve); True: the backward recomputes the forward (less memory, slower).

    Returns
    -------
    torch.Tensor or tuple
        ``out [B, L, H, P]`` in ``x``'s dtype, then the final states and the varlen states as asked, in
        mamba_ssm's order. Differentiable in every tensor argument, the initial states included.
    """
    check_mamba_chunk_scan_combined(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, state_dtype)
    name = "mamba_chunk_scan_combined"
    if not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError(f"{name}: chunk_size={chunk_size!r} must be a positive int")
    batch, length, heads, head_dim = x.shape
    act, param, carried = x.dtype, _param_dtype(A, x), _state_dtype(x)
    statics = {"dt_softplus": bool(dt_softplus), "dt_limit": _dt_limit(name, dt_limit), "recompute": recompute}
    # D per (head, channel) is outside the op's [H]: it and the gate z are applied here, around the scan
    per_channel_d = D is not None and D.dim() == 2
    inner_d, inner_z = (None, None) if per_channel_d else (D, z)
    tensors = {"x": x, "dt": cast(dt, act), "a": cast(A, param), "b": cast(B, act), "c": cast(C, act),
               "d": cast(inner_d, param), "dt_bias": cast(dt_bias, param), "z": cast(inner_z, act)}
    state_shape = (heads, head_dim, B.shape[-1])
    if return_varlen_states and (cu_seqlens is None or seq_idx is None):
        raise NotImplementedError(f"{name}: return_varlen_states needs cu_seqlens and seq_idx (mamba_ssm "
                                  f"restarts the state where seq_idx changes; cu_seqlens names the sequences)")
    wants_state = initial_states is not None or return_final_states or return_varlen_states
    if seq_idx is None:
        if wants_state:
            tensors["state"] = (x.new_zeros((batch, *state_shape), dtype=carried) if initial_states is None
                                else cast(initial_states, carried))
        out, final = fused("mamba2", tensors, **statics)
        varlen = None
    else:
        initial = None if initial_states is None else cast(initial_states, carried)
        out, final, varlen = _packed_scan(name, x, tensors, statics, seq_idx, cu_seqlens, return_varlen_states,
                                          (carried, state_shape) if wants_state else None, initial)
    if per_channel_d:
        out = out + x * cast(D, act)
        out = out if z is None else out * F.silu(cast(z, act))
    result = [out]
    as_dtype = state_dtype or C.dtype
    if return_final_states:
        result.append(final.to(as_dtype))
    if return_varlen_states:
        result.append(varlen.to(as_dtype))
    return result[0] if len(result) == 1 else tuple(result)


def _dt_limit(name: str, dt_limit: Sequence[float]) -> tuple[float, float | None] | None:
    """mamba_ssm's ``dt_limit`` as the op's: ``(lo, hi or None)``, or None for no clamp at all."""
    lo, hi = (float(v) for v in dt_limit)
    if lo == -math.inf and hi == math.inf:
        return None
    if math.isfinite(lo) and lo >= 0:
        return lo, None if hi == math.inf else hi
    raise NotImplementedError(f"{name}: dt_limit={tuple(dt_limit)!r}: the op clamps dt to [lo, hi] with a finite "
                              f"lo >= 0 (ABI.md §8), or not at all (-inf, inf)")


def _packed_scan(name: str, x: torch.Tensor, tensors: dict[str, torch.Tensor | None], statics: dict[str, Any],
                 seq_idx: torch.Tensor, cu_seqlens: torch.Tensor | None, return_varlen_states: bool,
                 state: tuple[torch.dtype, tuple[int, ...]] | None, initial: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``mamba_chunk_scan_combined`` with ``seq_idx``: the ``B·L`` tokens as packed sequences of one row, each
    row's initial state feeding its first sequence (``state``: the carried dtype and ``(H, P, N)``, None
    without states). Returns ``out [B, L, H, P]``, each row's final state and each sequence's (None without)."""
    batch, length = x.shape[:2]
    cu, first, last = _PACKED_ROWS(seq_idx)
    if return_varlen_states and not torch.compiler.is_compiling():  # reads values; traced, they are trusted
        check_cu_seqlens(name, cu_seqlens, batch * length)
        if not torch.equal(cu_seqlens.detach().cpu().to(torch.int32), cu):
            raise ValueError(f"{name}: cu_seqlens {cu_seqlens.tolist()} and the sequences of seq_idx "
                             f"{cu.tolist()} disagree")
    packed = {f: None if t is None else t.reshape(1, batch * length, *t.shape[2:]) if f not in ("a", "d", "dt_bias")
              else t for f, t in tensors.items()}
    packed["cu_seqlens"] = cu.to(x.device)
    if state is not None:
        carried, state_shape = state
        pool = x.new_zeros((cu.shape[0] - 1, *state_shape), dtype=carried)
        if initial is not None:
            pool = pool.index_copy(0, first.to(x.device), initial)
        packed["state"] = pool
    out, varlen = fused("mamba2", packed, **statics)
    final = None if varlen is None else varlen.index_select(0, last.to(x.device))
    return out.reshape(x.shape), final, varlen
