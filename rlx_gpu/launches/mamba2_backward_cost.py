"""The costs of the chunked mamba2_backward kernels (``launches/mamba2_backward.py`` plans them; ``cost`` says how
counted; the forward's ``mamba2_chunk_state`` it launches first is ``ssm_cost``'s).

Per (head, chunk of s steps), read off kernels/mamba2_backward.cl's loops: the chunk's share of the entering state's
gradient ((exp(L) Gy)ᵀ·C, P x N over s; its RLX_MMA variant runs it on the tensor cores), the scores A = C·Bᵀ and
B = Gy·Xᵀ on the lower triangle (tri = s(s+1)/2 pairs), then per step Aᵀ·Gy, A·(dt X) (per row of P), Bᵀ·C, B·B
(per state column), each over the triangle, and the state products D·b, S_in·c, Dᵀ·x, S_inᵀ·gy.
Those are GEMM-shaped; the decays, the per-step sums and the §8 transforms are the rest. The chunk kernel's RLX_MMA
variant runs the four state products on the tensor cores (tiles of 32 steps by 16 columns, the sums in slices of
16, split operands: three products, two where a 16-bit thunk's own x, b or c is exact) and the scores C·Bᵀ (16 x 16
tiles on and below the diagonal; split at TF32): those alone are its GEMM FLOPs there, Gy·Xᵀ and the triangular
products FMA loops.
"""
from __future__ import annotations

from typing import Any, Mapping

from .core import Launch
from .cost import Cost, chunk_steps, declare, defined, real, stored, tuned
from .mma import MMA_TF32, MMA_TILE
from .ssm_cost import carried_state, delta_flops, finish_flops

_SILU = 4  # FLOPs of silu (exp, add, division, multiply)


def _rows(launch: Launch, args: Mapping[str, Any]) -> int:
    """Batch rows: the K chunk slots of a head over ceil(S / M2_Q) chunks a row."""
    return args["K"] // -(-args["S"] // tuned(launch, "M2_Q"))


def _chunks(launch: Launch, args: Mapping[str, Any]) -> list[int]:
    return chunk_steps(args["S"], _rows(launch, args), tuned(launch, "M2_Q"), False)


def _decays(launch: Launch, steps: int) -> int:
    """dt, its running sum, exp(L) and exp(L_last - L) per step."""
    return steps * (4 + delta_flops(launch))


@declare("mamba2_backward_dstate")
def dstate(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (head, chunk, tile of M2_PT rows of P), as mamba2_chunk_state: dt and its running sum, gy = d_dst·silu(z)
    and its weight exp(L_i) per (step, p), then the chunk's [P, N] = (exp(L) Gy)ᵀ·C over its steps; writes gy and
    the chunk's [P, N] (with SSM_RESERVE the chunk's decay too)."""
    hd, p, n, es, rs = args["HD"], args["P"], args["N"], stored(launch), real(launch)
    pt, t = tuned(launch, "M2_PT"), sum(_chunks(launch, args))
    rows, z = -(-p // pt) * pt, defined(launch, "SSM_Z")
    other = hd * (-(-p // pt) * t * (2 + delta_flops(launch)) + t * p * (2 + (_SILU + 1) * z))
    read = t * hd * (p * (1 + z) + 1) * es + t * args["G"] * n * es
    written = t * hd * p * rs + hd * args["K"] * (p * n + defined(launch, "SSM_RESERVE")) * rs
    return Cost(gemm=hd * 2 * t * rows * n, other=other, read=read, written=written)


@declare("mamba2_backward_pass")
def state_pass(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per state entry and chunk: S = decay·S + own forward (with SSM_RESERVE the saved state read instead, as many
    reads), D = decay·D + own backward; the states entering each chunk, the leaving ones' gradients and the final
    states written; d_state read and rewritten with SSM_CARRY."""
    hd, pn, rs = args["HD"], args["P"] * args["N"], real(launch)
    chunks = len(_chunks(launch, args))
    slots = hd * args["K"] * pn
    rows = args["R"] * hd * pn
    return Cost(other=(4 - 2 * defined(launch, "SSM_RESERVE")) * hd * chunks * pn, read=(2 * slots + hd * args["K"]) * rs,
                written=(2 * slots + rows) * rs) + carried_state(launch, args["R"], 2 * hd * pn)


@declare("mamba2_backward_chunk")
def chunk(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (head, chunk): the scores on the lower triangle (C·Bᵀ over N, Gy·Xᵀ over P, decayed); per step and p
    du (Aᵀ·Gy, D·b) and y (A·(dt X), S_in·c), d_x, d_z; per step and n d_b (Bᵀ·C, Dᵀ·x) and d_c (B·B, S_inᵀ·gy);
    <D, S_end>; the log-decay's reverse sums and d_dt; the chunk's sums of d_a, d_d, d_dt_bias. With SSM_RESERVE A
    and y are the saved forward's: no C·Bᵀ, A·(dt X) or S_in·c, the saved scores and y read instead. With RLX_MMA
    the state products D·b, S_in·c, Dᵀ·x and S_inᵀ·gy (on tiles, split operands: ``_state_products_mma``) and,
    not with SSM_RESERVE, the scores C·Bᵀ (``_scores_mma``) are the launch's GEMM FLOPs, the other products
    ``other``; the state products' results go through scratch (D·b and S_in·c per (step, row), Dᵀ·x and S_inᵀ·gy in
    d_b's and d_c's partials, written and read back)."""
    hd, p, n, es, rs = args["HD"], args["P"], args["N"], stored(launch), real(launch)
    chunks = _chunks(launch, args)
    tri, t = sum(s * (s + 1) // 2 for s in chunks), sum(chunks)
    saved = defined(launch, "SSM_RESERVE")
    gemm = hd * (tri * (2 * n + 2 * p) + p * (4 * tri + 4 * n * t) + n * (4 * tri + 4 * p * t) + 2 * p * n * len(chunks))
    gemm -= saved * hd * (tri * 2 * n + p * (2 * tri + 2 * n * t))
    other = hd * (_decays(launch, t) + 3 * tri + p * (tri + t * (12 + finish_flops(launch))) + 5 * n * t + 2 * tri
                  + t * (8 + delta_flops(launch)))
    z = defined(launch, "SSM_Z")
    states = (2 * hd * args["K"] + _rows(launch, args) * hd) * p * n * rs  # entering, the leaving ones' gradients, finals
    read = t * hd * (p * (2 + z) + 1) * es + 2 * t * args["G"] * n * es + t * hd * p * rs + states
    read += saved * hd * (t * p + len(chunks) * tuned(launch, "M2_Q") ** 2) * rs
    written = t * hd * (p * (1 + z) + 1) * es + (2 * t * hd * n + 3 * args["K"] * hd) * rs
    mma = defined(launch, "RLX_MMA")
    if mma:  # the state products and C·Bᵀ on the tensor cores, the rest FMA; the products' results through scratch
        tensor, split = _state_products_mma(mma, saved, hd, p, n, chunks)
        scores, scores_split = (0, 0) if saved else _scores_mma(mma, hd, n, chunks)
        gemm, other = tensor + scores, other + gemm - hd * t * p * n * (8 - 2 * saved) + split
        other += scores_split - (1 - saved) * hd * tri * 2 * n
        through = hd * t * ((2 - saved) * p + 2 * n) * rs  # D·b, S_in·c per (step, row); x·D, gy·S_in per column
        read, written = read + through, written + through
    return Cost(gemm=gemm, other=other, read=read, written=written)


def _state_products_mma(mma: int, saved: int, hd: int, p: int, n: int, chunks: list[int]) -> tuple[int, int]:
    """(tensor-core FLOPs, the split's subtractions) of mamba2_backward_chunk's RLX_MMA state products: per chunk of s
    steps, ceil(s / 32) passes of 32 steps, each over P and N padded to 16: D·b ([N] x [P]), S_in·c (not with
    SSM_RESERVE), x·D ([P] x [N]) and gy·S_in; each hi·hi + hi·lo, and lo·hi where the row operand is split too (gy,
    and at TF32 every one: a 16-bit thunk's own x, b and c are exact); a subtraction per staged value of a split
    operand (a slice's 16 x 16 of the state, its 32 x 16 rows)."""
    pp, np_, tile = -(-p // MMA_TILE) * MMA_TILE, -(-n // MMA_TILE) * MMA_TILE, MMA_TILE
    rows = sum(-(-s // 32) * 32 for s in chunks)
    products = 4 - saved
    split_rows = products if mma == MMA_TF32 else 1
    tensor = hd * 2 * rows * pp * np_ * (2 * products + split_rows)
    slices = hd * rows // 32 * (pp // tile) * (np_ // tile)  # (pass, column slice, sum slice) of each product
    return tensor, slices * (tile * tile * products + 32 * tile * split_rows)


def _scores_mma(mma: int, hd: int, n: int, chunks: list[int]) -> tuple[int, int]:
    """(tensor-core FLOPs, the split's subtractions) of mamba2_backward_chunk's RLX_MMA scores C·Bᵀ: per chunk of s
    steps the m(m+1)/2 16 x 16 tiles on and below the diagonal of its m = ceil(s / 16) row tiles, each over N padded
    to 16; at TF32 three products of split operands (hi·hi + lo·hi + hi·lo) and a subtraction per staged value of
    c and of b (a 16-bit thunk's own are exact: one product)."""
    np_, tile, tf32 = -(-n // MMA_TILE) * MMA_TILE, MMA_TILE, mma == MMA_TF32
    tiles = sum(-(-s // tile) * (-(-s // tile) + 1) // 2 for s in chunks)
    return hd * tiles * 2 * tile * tile * np_ * (3 if tf32 else 1), hd * tiles * 2 * tile * np_ if tf32 else 0
