"""The costs of the chunked gated_delta_net_backward kernels (``launches/gdn_backward.py`` plans them; ``cost`` says
how counted; ``gdn_backward_qk`` after them is ``ssm_backward_cost``'s).

Per chunk of L = 32 tokens of a (batch row, value head), read off kernels/gdn_chunk_backward.cl's loops, a partial
chunk counted whole. The reverse pass, per state column: qkᵀ·dO on the lower triangle (tri = L(L+1)/2 pairs),
K·dS_L (L x K), the triangular inverseᵀ·dU (L(L-1)/2 pairs) and the two products of dS0 ((γQ)ᵀ·dO, (γK)ᵀ·dV);
the gradient products, per token of the chunk: dO·Uᵀ and Y·Uᵀ on the triangle, Y·S0ᵀ, dO·S0ᵀ and U·dS_Lᵀ (over
V for each of K), the decayed pair products into d_q and d_k (three per key channel and token pair), and per chunk
S0·dS_L. Those are GEMM-shaped; the decays, the rows' scalars and the log-decays' sums are the rest. Per-channel
gates (GDNB_GATE_K): g read per key channel, the cumulative log-decays per (token, key channel) written to scratch
and read back, a decay per (token, key channel) where per head one per token, a pair ratio per (token, token, key
channel), and d_g's per-channel sums (through scratch) in place of the per-token ones. The RLX_MMA variant of
``gdn_chunk_back_pass`` runs dU's diag(end) K·dS_L and dS0's two products as one,
[scale γQ | -γβK]ᵀ·[dO; Y] (16 x 16 output tiles, sums in blocks of 2L, split operands at 16 bits), on the tensor
cores, that of ``gdn_chunk_back_grads`` Y·S0ᵀ, dO·S0ᵀ and U·dS_Lᵀ (16-row tiles padded to 16 key channels and
columns; at 16 bits U·dS_Lᵀ as three products of split operands): those alone are their launches' GEMM FLOPs there.
"""
from __future__ import annotations

from typing import Any, Mapping

from host_fallback.abi.gdn import RESERVE_CHUNK

from .core import Launch
from .cost import Cost, declare, defined, real, stored
from .mma import MMA_16BIT, MMA_TILE

L = RESERVE_CHUNK
_TRI, _STRICT = L * (L + 1) // 2, L * (L - 1) // 2


def _slots(launch: Launch, args: Mapping[str, Any], per_group: int) -> tuple[int, int, int]:
    """(batch rows, chunks per row, tokens) of a launch of ``per_group`` work-groups per (batch row, value head)
    or per (batch row, chunk, value head)."""
    chunks = -(-args["S"] // L)
    groups = launch.global_size[0] // launch.local_size[0]
    rows = groups // (args["HV"] * per_group)
    return rows, chunks, rows * args["S"]


@declare("gdn_chunk_back_pass")
def reverse_pass(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (batch row, value head, chunk, state column): dU = scale qkᵀ dO + diag(end) K dS_L, Y = inverseᵀ dU,
    dV = beta Y, dS0 = D dS_L + (γQ)ᵀ dO scale - (γK)ᵀ dV; per chunk and work-item the rows' scalars (cumulative
    log-decays: L(L+1)/2 adds, their exps). The states' gradients written once a chunk and read once. With RLX_MMA
    K·dS_L's and dS0's products are the launch's GEMM FLOPs (on tiles, split in three at 16 bits), the triangular
    qkᵀ·dO and inverseᵀ·dU ``other``."""
    h, hv, k, v, es, rs = args["H"], args["HV"], args["K"], args["V"], stored(launch), real(launch)
    b, chunks, t = _slots(launch, args, 1)
    columns, mma = b * hv * chunks * v, defined(launch, "RLX_MMA")
    gemm = columns * (2 * _TRI + 2 * L * k + 2 * _STRICT + 4 * L * k)
    lanes, gk = launch.local_size[0], k if defined(launch, "GDNB_GATE_K") else 1
    other = columns * (3 * L + k) + b * hv * chunks * lanes * (_TRI + 4 * L)
    if mma:  # dU's diag(end) K·dS_L = [L][K] x [K][V] and dS0 = [K][2L] x [2L][V] on the tensor cores, by 16 x 16
        # tiles summing over blocks of 2L (padded; three products at 16 bits: split operands, a subtraction per
        # staged value of each); the triangular qkᵀ·dO and Y = inverseᵀ dU FMA loops
        split, kp, vp = mma == MMA_16BIT, -(-k // MMA_TILE) * MMA_TILE, -(-v // MMA_TILE) * MMA_TILE
        sums = -(-k // (2 * L)) * 2 * L  # K·dS_L's sum over the key channels, in blocks
        other += columns * (2 * _TRI + 2 * _STRICT)
        gemm = b * hv * chunks * 2 * (L * sums + kp * 2 * L) * vp * (3 if split else 1)
        blocks = b * hv * chunks * (vp // MMA_TILE) * (L // MMA_TILE * sums // (2 * L) + kp // MMA_TILE)
        other += blocks * 2 * MMA_TILE * 2 * L if split else 0
    if gk > 1:  # a decay per (token, key channel) at every work-item, the channels' cumulative sums
        other += b * hv * chunks * (lanes * 2 * L * k * 4 + L * k)
    read = t * hv * (2 * h // hv * k + v + 1 + gk) * es + b * chunks * hv * 2 * L * L * rs  # q, k, d_dst, beta, g; ..
    states = b * hv * (chunks + 1) * k * v * rs
    written = t * hv * v * es + b * chunks * hv * L * v * rs + b * hv * k * v * rs  # d_v, Y, the first entering state
    channels = b * chunks * hv * L * k * rs if gk > 1 else 0  # the cumulative log-decays through scratch
    return Cost(gemm=gemm, other=other, read=read + states + lanes * channels, written=written + states + channels)


@declare("gdn_chunk_back_grads")
def chunk_grads(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (batch row, chunk, value head): dO·Uᵀ, Y·Uᵀ and Y·V per token, Y·S0ᵀ, dO·S0ᵀ, U·dS_Lᵀ per (token, key
    channel), the pair products into d_q, d_k per (token, token, key channel), S0·dS_L; the decay ratios, the rows'
    scalars and the log-decays' sums of E; d_q, d_k partials, d_beta and d_g written. With RLX_MMA the state
    products (U·dS_Lᵀ split in three at 16 bits) are the launch's GEMM FLOPs, the other products ``other``."""
    h, hv, k, v, es, rs = args["H"], args["HV"], args["K"], args["V"], stored(launch), real(launch)
    b, chunks, t = _slots(launch, args, -(-args["S"] // L))
    slots, gk = b * chunks * hv, k if defined(launch, "GDNB_GATE_K") else 1
    products = slots * (2 * v * (_TRI + _STRICT + L) + 6 * L * L * k + 2 * k * v)
    other = slots * (L * (_TRI + 4 * L) + 8 * L * L + 10 * L * k)
    mma = defined(launch, "RLX_MMA")
    # Y·S0ᵀ, dO·S0ᵀ, U·dS_Lᵀ: with 16-bit operands the third as three products of split ones (hi·hi + hi·lo + lo·hi,
    # each lo the rest of a value of U or dS_L as staged: a subtraction per value, every 16 key channels)
    split, kp, vp = mma == MMA_16BIT, -(-k // MMA_TILE) * MMA_TILE, -(-v // MMA_TILE) * MMA_TILE
    state = slots * 2 * L * (kp * vp if mma else k * v) * (5 if split else 3)  # the MMA tiles padded to 16
    if split:
        other += slots * kp // MMA_TILE * (L + MMA_TILE) * vp
    # the RLX_MMA variant runs the state products alone on the tensor cores: the other products stay FMA loops
    gemm, other = (state, other + products) if mma else (state + products, other)
    if gk > 1:  # a pair ratio (an exp) and two more sums per (token, token, key channel); the channels' sums
        other += slots * (L * L * k * 8 + 4 * L * k)
    read = t * hv * (2 * h // hv * k + 2 * v + 1 + gk) * es  # q, k, v, d_dst, beta, g
    read += slots * (2 * k * v + 2 * L * L + 2 * L * v) * rs  # S0, dS_L, qk, kk, U, Y
    written = 2 * t * hv * k * rs + t * hv * (1 + gk) * es
    if gk > 1:  # the cumulative log-decays and the rows of their gradients through scratch, read per row and channel
        read += slots * (L * L * k + 4 * L * k) * rs
        written += slots * 3 * L * k * rs
    return Cost(gemm=gemm, other=other, read=read, written=written)
