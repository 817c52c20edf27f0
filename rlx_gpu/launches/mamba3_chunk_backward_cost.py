"""The costs of the chunked mamba3_backward kernels (``launches/mamba3_chunk_backward.py`` plans them; ``cost`` says how
counted; the turn, per-token, angle and reduce launches around them are ``mamba3_backward_cost``'s).

Per (head, chunk of s steps), read off kernels/mamba3_chunk_backward.cl's loops (batch rows only): in
``mamba3_cb_states`` two [P x N] products over the chunk, its own state (w·decay·V)ᵀ·K̃ and its share of the
entering gradient (exp(c)·Gy)ᵀ·Q̃ (FMA on every path); in ``mamba3_cb_chunk`` the scores
Q̃·K̃ᵀ over N and Gy·Vᵀ over P on the lower triangle (tri = s(s+1)/2 pairs; their RLX_MMA variant on the tensor
cores), then per step and state row dv (Aᵀ·Gy, D·k̃) and y (A·V, S_in·q̃), per step and column dq̃ (B·K̃, S_inᵀ·gy)
and dk̃ (Bᵀ·Q̃, Dᵀ·v): GEMM-shaped too; the four state products D·k̃, S_in·q̃, S_inᵀ·gy and Dᵀ·v run on the tensor
cores in the RLX_MMA variant (``_state_products_mma``: tiles, split operands, their results through scratch), the
products with the LOCAL scores are FMA loops in both variants, so counted as ``other`` here (what a tensor-core
path for them would still win). The pass is a recurrence over chunks.
"""
from __future__ import annotations

from typing import Any, Mapping

from .core import Launch
from .cost import Cost, declare, defined, real, stored, tuned
from .mma import MMA_TF32, MMA_TILE
from .mamba3_cost import BPRIME, SIGMOID, carried, chunk_lengths, finish_flops, inputs, stage_flops

_SILU = SIGMOID + 1


def _rows(args: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments as the forward's cost helpers read them: batch rows (the chunked backward takes no others)."""
    return {**args, "varlen": 0, "has_q_bias": 0, "has_k_bias": 0}


@declare("mamba3_cb_states")
def cb_states(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (head, chunk, tile of M3C_PT rows): the stage (weights, decays, weighted values), gy = d_dst·silu(z) and
    its weight exp(c) per (step, row), the chunk's decay; the two products over the tile's padded rows."""
    a = _rows(args)
    h, n, p, t = args["H"], args["N"], args["P"], args["R"] * args["S"]
    rows = -(-p // tuned(launch, "M3C_PT")) * tuned(launch, "M3C_PT")
    other = h * (stage_flops(launch, a, True) + t * p * (1 + 2 + _SILU * args["has_z"]) + args["K"])
    read = inputs(launch, a, "v", "z", "coeffs") + t * h * p * stored(launch) + 2 * t * h * n * real(launch)
    written = (t * h * p + 2 * h * args["K"] * p * n + h * args["K"]) * real(launch)
    return Cost(gemm=h * 2 * 2 * t * rows * n, other=other, read=read, written=written)


@declare("mamba3_cb_pass")
def cb_pass(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (row, head, state row, column) and chunk: S = decay·S + own forward, then <D, S_leaving> and
    D = decay·D + share in reverse; with carry S0 = S_init + β'·v̄·k̄ and D0·k̄ (β' once per item)."""
    a = _rows(args)
    h, n, p = args["H"], args["N"], args["P"]
    items, per_row = args["R"] * h * p, len(chunk_lengths(launch, a)) // args["R"]
    other = items * n * 6 * per_row + args["carry"] * items * (BPRIME + 5 * n + 1)
    slots = 2 * h * args["K"] * p * n * real(launch)
    read = slots + h * args["K"] * real(launch) + 2 * carried(launch, a, "state") + carried(launch, a, "k", "v", "v")
    written = slots + h * args["K"] * p * real(launch) + carried(launch, a, "state", "v", "v")
    return Cost(other=other, read=read, written=written)


@declare("mamba3_cb_chunk")
def cb_chunk(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (head, chunk): the scores (gemm), their decays and weights, the per-pair sums of dw, the per-row products
    and finish (d_v, d_z), the per-column products, the per-step sums, d_adt's reverse sums; the row's first chunk
    with carry D0ᵀ·v̄ and <D0, v̄⊗k̄>."""
    a = _rows(args)
    h, n, p, chunks = args["H"], args["N"], args["P"], chunk_lengths(launch, a)
    tri, t = sum(s * (s + 1) // 2 for s in chunks), sum(chunks)
    gemm = h * tri * 2 * (n + p)
    products = 4 * p * tri + 4 * n * p * t + 4 * n * tri + 4 * p * n * t
    per_row = 12 + finish_flops(a) + args["has_z"] * (_SILU + 5)
    elementwise = 8 * tri + t * p * per_row + t * (4 * tuned(launch, "M3C_LANES") // tuned(launch, "M3C_Q") + 6) \
        + tri + len(chunks) * p
    other = h * (products + elementwise + stage_flops(launch, a, False)) + args["carry"] * args["R"] * h * 4 * p * n
    es, rs = stored(launch), real(launch)
    read = (inputs(launch, a, "v", "z", "coeffs", "d") + t * h * p * es + t * h * (2 * n + p) * rs
            + h * args["K"] * p * (2 * n + 1) * rs + carried(launch, a, "state", "k", "v") + args["carry"] * (
                args["R"] * h * (p + n) * rs))
    written = t * h * p * (1 + args["has_z"]) * es + (t * h * args["W"] + args["K"] * h
                                                      + args["carry"] * args["R"] * h * n) * rs
    mma = defined(launch, "RLX_MMA")
    if mma:  # the state products on the tensor cores, their FMA loops gone; results through scratch and the partials
        tensor, split = _state_products_mma(mma, tuned(launch, "M3C_Q"), h, p, n, len(chunks))
        gemm, other = gemm + tensor, other - h * 8 * n * p * t + split
        through = h * t * 2 * (p + n) * rs  # D·k̃, S_in·q̃ per (step, row); S_inᵀ·gy, Dᵀ·v per (step, column)
        read, written = read + through, written + through
    return Cost(gemm=gemm, other=other, read=read, written=written)


def _state_products_mma(mma: int, q: int, h: int, p: int, n: int, chunks: int) -> tuple[int, int]:
    """(tensor-core FLOPs, the split's subtractions) of mamba3_cb_chunk's RLX_MMA state products: per (head, chunk)
    one pass of its q steps (M3C_Q, 64: four 16-step tiles) per 32 output columns, the sum in slices of 16: D·k̃ and S_in·q̃ ([Q] x [N] x
    [P]), S_inᵀ·gy and Dᵀ·v ([Q] x [P] x [N]); each hi·hi + hi·lo, and lo·hi where the row operand is split too (q̃,
    k̃, gy; v at TF32 only: a 16-bit thunk's own v is exact); a subtraction per staged value of a split operand."""
    tile = MMA_TILE
    p16, n16 = -(-p // tile) * tile, -(-n // tile) * tile
    p32, n32 = -(-p // (2 * tile)) * 2 * tile, -(-n // (2 * tile)) * 2 * tile
    split_v = mma == MMA_TF32
    tensor = h * chunks * 2 * q * (p32 * n16 * 2 * 3 + n32 * p16 * (3 + 2 + split_v))
    slices = h * chunks * (2 * (p32 // 32) * (n16 // tile) + 2 * (n32 // 32) * (p16 // tile))  # (product, pass, slice)
    lo_slices = h * chunks * (2 * (p32 // 32) * (n16 // tile) + (1 + split_v) * (n32 // 32) * (p16 // tile))
    return tensor, slices * tile * 2 * tile + lo_slices * q * tile
