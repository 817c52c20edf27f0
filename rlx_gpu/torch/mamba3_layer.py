"""``Mamba3``: mamba_ssm's Mamba-3 block (SISO) in torch around rlx_gpu's ``mamba3`` op (ABI.md §11).

The constructor takes mamba_ssm's ``Mamba3`` keywords and builds its parameters under its names and shapes
(``in_proj.weight``, ``dt_bias``, ``B_bias``, ``C_bias``, ``B_norm.weight``, ``C_norm.weight``, ``D``,
``norm.weight`` with ``is_outproj_norm``, ``out_proj.weight``), so a mamba_ssm SISO state_dict loads unchanged.
What stays outside the op is written here with torch operations (§11, "What stays outside the op"): the input
projection split ``[z, x, B, C, dd_dt, dd_A, trap, angles]``, the RMSNorm of B and C, ``dt = softplus(dd_dt +
dt_bias)``, the decay ``a = min(−f(dd_A), −A_floor)``, one angle vector per token for every head, the gated
RMSNorm of ``is_outproj_norm`` and the output projection. The recurrence runs in ``mamba3_siso_combined``
(prefill) and ``mamba3_siso_step`` (decode), both differentiable.

MIMO (``is_mimo=True``, where mamba_ssm's ``mimo_rank`` takes effect) is refused: the op is SISO (ABI.md §11
describes what a ``mamba3_mimo`` op would add). Where this differs from mamba_ssm: the decay, ``dt`` and the
angles are computed in f32, or f64 for an f64 module (mamba_ssm casts them to f32 always); the four cached
states are the op's ``state_dtype`` (f32, f64 for an f64 module), where mamba_ssm keeps ``k`` and ``v`` in the
weights' dtype; ``chunk_size`` changes nothing (§11).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .mamba3 import mamba3_siso_combined, mamba3_siso_step

__all__ = ["Mamba3", "RMSNormGated"]

#: The cached states, in mamba_ssm's order: ``(angle, ssm, k, v)``.
States = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class RMSNormGated(nn.Module):
    """mamba_ssm's gated RMSNorm (``ops.triton.layernorm_gated.RMSNorm``): ``x / sqrt(mean(x²) + eps) · weight``
    over groups of ``group_size`` (default the whole last dimension), times ``silu(z)`` after the norm
    (``norm_before_gate``) or on ``x`` before it; computed in f32 (or wider) and returned in ``x``'s dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = True, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)
        h = x.to(wide)
        if z is not None and not self.norm_before_gate:
            h = h * F.silu(z.to(wide))
        size = self.group_size or h.shape[-1]
        groups = h.unflatten(-1, (h.shape[-1] // size, size))
        h = (groups * torch.rsqrt(groups.square().mean(-1, keepdim=True) + self.eps)).flatten(-2)
        h = h * self.weight.to(wide)
        if z is not None and self.norm_before_gate:
            h = h * F.silu(z.to(wide))
        return h.to(x.dtype)


def heavy_tail(u: torch.Tensor) -> torch.Tensor:
    """``1 + u`` for ``u >= 0``, ``1 / (1 − u)`` below: positive, continuous and smooth at 0 (§11's ``f``)."""
    return u.clamp_min(0) + torch.reciprocal(1 - u.clamp_max(0))


class Mamba3(nn.Module):
    """mamba_ssm's ``Mamba3`` block, SISO: ``forward(u [batch, seqlen, d_model]) -> [batch, seqlen, d_model]``
    through ``mamba3_siso_combined``; ``step(u [batch, d_model], angle, ssm, k, v)`` one decode token through
    ``mamba3_siso_step``, the four states updated in place (``allocate_inference_cache`` makes them)."""

    def __init__(self, d_model: int, d_state: int = 128, expand: int = 2, headdim: int = 64, ngroups: int = 1,
                 rope_fraction: float = 0.5, dt_min: float = 0.001, dt_max: float = 0.1,
                 dt_init_floor: float = 1e-4, A_floor: float = 1e-4, is_outproj_norm: bool = False,
                 is_mimo: bool = False, mimo_rank: int = 4, fuse_pregate_headwise_norm: bool = True,
                 chunk_size: int = 64, dropout: float = 0.0, layer_idx: int | None = None,
                 n_layer: int | None = None, device: Any = None, dtype: Any = None, **kwargs: Any) -> None:
        super().__init__()
        if is_mimo:
            raise NotImplementedError(
                f"Mamba3(is_mimo=True, mimo_rank={mimo_rank}): rlx_gpu's mamba3 op is SISO (ABI.md §11); MIMO "
                "needs a mamba3_mimo op (rank-R projections of x, z and the output inside the recurrence), which "
                "the ABI does not define yet. Use is_mimo=False (mimo_rank is then unused, as in mamba_ssm)")
        d_inner = int(expand * d_model)
        if d_inner % headdim:
            raise ValueError(f"Mamba3: d_inner = expand·d_model = {d_inner} is not a multiple of headdim={headdim}")
        if rope_fraction not in (0.5, 1.0):
            raise ValueError(f"Mamba3: rope_fraction={rope_fraction}; expected 0.5 or 1.0 (as mamba_ssm)")
        rotated = int(d_state * rope_fraction) // 2 * 2
        if rotated < 2:
            raise ValueError(f"Mamba3: d_state={d_state} with rope_fraction={rope_fraction} rotates no pair")
        self.d_model, self.d_state, self.expand, self.headdim = d_model, d_state, expand, headdim
        self.d_inner, self.nheads, self.num_bc_heads = d_inner, d_inner // headdim, ngroups
        self.chunk_size, self.layer_idx, self.A_floor = chunk_size, layer_idx, A_floor
        self.is_outproj_norm, self.is_mimo, self.mimo_rank = is_outproj_norm, False, 1
        self.num_rope_angles = rotated // 2
        self._init_parameters(dt_min, dt_max, dt_init_floor, device, dtype)

    def _init_parameters(self, dt_min: float, dt_max: float, dt_init_floor: float, device: Any, dtype: Any) -> None:
        """mamba_ssm's parameters, names, shapes and initialisation (dt_bias: softplus⁻¹ of a log-uniform dt)."""
        made = {"device": device, "dtype": dtype}
        heads, n = self.nheads, self.d_state
        width = 2 * self.d_inner + 2 * n * self.num_bc_heads + 3 * heads + self.num_rope_angles
        self.in_proj = nn.Linear(self.d_model, width, bias=False, **made)
        f32 = {"device": device, "dtype": torch.float32}  # dt_bias and the B/C biases stay f32 (mamba_ssm)
        dt = torch.exp(torch.rand(heads, **f32) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp_min(dt_init_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.dt_bias._no_weight_decay = True  # type: ignore[attr-defined]
        self.B_bias = nn.Parameter(torch.ones(heads, 1, n, **f32))
        self.C_bias = nn.Parameter(torch.ones(heads, 1, n, **f32))
        self.B_norm = RMSNormGated(n, eps=1e-5, **made)
        self.C_norm = RMSNormGated(n, eps=1e-5, **made)
        self.D = nn.Parameter(torch.ones(heads, device=device))
        self.D._no_weight_decay = True  # type: ignore[attr-defined]
        if self.is_outproj_norm:
            self.norm = RMSNormGated(self.d_inner, eps=1e-5, norm_before_gate=True, group_size=self.headdim, **made)
        self.out_proj = nn.Linear(self.d_inner, self.d_model, bias=False, **made)

    def _project(self, u: torch.Tensor) -> dict[str, torch.Tensor]:
        """The op's inputs for tokens ``u [..., d_model]``, each led by ``u``'s leading dimensions: ``z, x [..., H,
        P]``, ``B, C [..., G, N]`` (normed), ``adt, dt, trap [..., H]``, ``angles [..., H, A]`` (a broadcast view)."""
        lead = u.shape[:-1]
        heads, groups, n = self.nheads, self.num_bc_heads, self.d_state
        z, x, B, C, dd_dt, dd_A, trap, angles = torch.split(
            self.in_proj(u), [self.d_inner, self.d_inner, groups * n, groups * n, heads, heads, heads,
                              self.num_rope_angles], dim=-1)
        wide = torch.promote_types(u.dtype, torch.float32)
        a = torch.clamp(-heavy_tail(dd_A.to(wide)), max=-self.A_floor)
        dt = F.softplus(dd_dt.to(wide) + self.dt_bias.to(wide))
        return {"z": z.unflatten(-1, (heads, self.headdim)), "x": x.unflatten(-1, (heads, self.headdim)),
                "B": self.B_norm(B.unflatten(-1, (groups, n))), "C": self.C_norm(C.unflatten(-1, (groups, n))),
                "adt": a * dt, "dt": dt, "trap": trap,
                "angles": angles.to(wide).unsqueeze(-2).expand(*lead, heads, self.num_rope_angles)}

    def _out(self, y: torch.Tensor, z: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The output projection of ``y [..., H, P]`` (through the gated norm with ``is_outproj_norm``)."""
        y = y.flatten(-2)
        if self.is_outproj_norm:
            y = self.norm(y, z.flatten(-2))
        return self.out_proj(y.to(like.dtype))

    def forward(self, u: torch.Tensor, seq_idx: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                inference_params: Any = None) -> torch.Tensor:
        """``u [batch, seqlen, d_model]`` -> the same shape. ``cu_seqlens`` (batch 1) packs sequences, each
        starting from zero state. With ``inference_params`` (mamba_ssm's: ``key_value_memory_dict``,
        ``seqlen_offset``; needs ``layer_idx``) the final states go to its cache at offset 0, and a later call
        (one token) is a decode ``step`` on them."""
        if seq_idx is not None:
            raise NotImplementedError("Mamba3.forward: seq_idx is not used by mamba_ssm's SISO path either; pack "
                                      "sequences with cu_seqlens")
        states = None
        if inference_params is not None:
            rows = u.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
            states = self._get_states_from_cache(inference_params, rows)
            if inference_params.seqlen_offset > 0:
                return self.step(u, *states)[0]
        p = self._project(u)
        y = mamba3_siso_combined(p["C"], p["B"], p["x"], *(p[f].transpose(1, 2) for f in ("adt", "dt", "trap")),
                                 self.C_bias.squeeze(1), self.B_bias.squeeze(1), p["angles"], self.D,
                                 None if self.is_outproj_norm else p["z"], return_final_states=states is not None,
                                 cu_seqlens=cu_seqlens)
        if states is not None:
            y, *finals = y
            self._keep(states, finals)
        return self._out(y, p["z"], u)

    def step(self, u: torch.Tensor, angle_state: torch.Tensor, ssm_state: torch.Tensor, k_state: torch.Tensor,
             v_state: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        """One decode token ``u [batch, d_model]`` (or ``[batch, 1, d_model]``) from the states ``angle [batch, H,
        A]``, ``ssm [batch, H, P, N]``, ``k [batch, 1, H, N]``, ``v [batch, H, P]``, which it updates in place.
        Returns ``(out, angle, ssm, k, v)``: ``out`` shaped as ``u``, then the four (updated) states."""
        token = u.squeeze(1) if u.dim() == 3 else u
        if token.dim() != 2:
            raise ValueError(f"Mamba3.step: u has shape {list(u.shape)}; expected (batch, d_model) or "
                             "(batch, 1, d_model)")
        p = self._project(token)
        states = (angle_state, ssm_state, k_state, v_state)
        y, finals = mamba3_siso_step(p["C"], p["B"], p["x"], p["adt"], p["dt"], p["trap"], self.C_bias.squeeze(1),
                                     self.B_bias.squeeze(1), p["angles"], self.D,
                                     None if self.is_outproj_norm else p["z"],
                                     Input_States=(angle_state, ssm_state, k_state.squeeze(1), v_state))
        self._keep(states, finals)
        out = self._out(y, p["z"], token)
        return (out.unsqueeze(1) if u.dim() == 3 else out, *states)

    @staticmethod
    def _keep(states: Sequence[torch.Tensor], finals: Sequence[torch.Tensor]) -> None:
        """Write the op's final ``(angle, ssm, k, v)`` into the cache ``states`` (``k`` is ``[R, 1, H, N]`` there)."""
        with torch.no_grad():
            for into, final in zip(states, finals):
                into.copy_(final.reshape(into.shape))

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int = 0, device: Any = None, dtype: Any = None,
                                 **kwargs: Any) -> States:
        """Zero states ``(angle [batch, H, A], ssm [batch, H, P, N], k [batch, 1, H, N], v [batch, H, P])`` in the
        op's state dtype: f32, or f64 where the weights (or ``dtype``) are f64."""
        device = self.in_proj.weight.device if device is None else device
        dtype = self.in_proj.weight.dtype if dtype is None else dtype
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        heads, p, n = self.nheads, self.headdim, self.d_state
        shapes = ((heads, self.num_rope_angles), (heads, p, n), (1, heads, n), (heads, p))
        return tuple(torch.zeros(batch_size, *s, device=device, dtype=state_dtype) for s in shapes)  # type: ignore

    def _get_states_from_cache(self, inference_params: Any, batch_size: int,
                               initialize_states: bool = False) -> States:
        """This layer's states in ``inference_params.key_value_memory_dict[layer_idx]``, made there if absent."""
        if self.layer_idx is None:
            raise ValueError("Mamba3: a call with inference_params needs the layer's layer_idx (its cache key)")
        memory = inference_params.key_value_memory_dict
        if self.layer_idx not in memory:
            memory[self.layer_idx] = self.allocate_inference_cache(batch_size)
        elif initialize_states:
            for state in memory[self.layer_idx]:
                state.zero_()
        return memory[self.layer_idx]
