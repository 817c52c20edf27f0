"""The costs of the selective_scan and mamba2 kernels (``launches/ssm.py`` plans them; ``cost`` says how counted).

selective_scan's state is diagonal: nothing of it is a matrix product, at any target (its chunked form composes
each lane's steps and reruns them: about twice the recurrence's FLOPs). mamba2's walk and lanes
kernels are a recurrence too; its chunked form (SSD) is GEMM-shaped: per (head, chunk of M2_Q steps, M2_PT rows
of P) the chunk's own state (Xwᵀ·B), then in the scan C·Bᵀ (the whole tile, recomputed by each group of
M2_PT rows), C·S_inᵀ and the masked (C·Bᵀ ∘ decays)·X.
"""
from __future__ import annotations

from typing import Any, Mapping

from .core import Launch
from .cost import Cost, chunk_steps, declare, defined, real, stored, tuned
from .mma import MMA_TF32

_SOFTPLUS, _SILU = 3, 4  # FLOPs of softplus (exp, add, log) and of silu (exp, add, division, multiply)


def delta_flops(launch: Launch) -> int:
    """FLOPs of the §8 transform of one delta (dt): its bias and softplus."""
    return defined(launch, "SSM_BIAS") + _SOFTPLUS * defined(launch, "SSM_SOFTPLUS")


def finish_flops(launch: Launch) -> int:
    """FLOPs per output of y += d x and y *= silu(z)."""
    return 2 * defined(launch, "SSM_D") + (_SILU + 1) * defined(launch, "SSM_Z")


def tokens(launch: Launch, args: Mapping[str, Any]) -> int:
    """Tokens of the thunk: R rows of S steps, or S packed tokens with varlen."""
    return args["S"] if defined(launch, "SSM_VARLEN") else args["R"] * args["S"]


def carried_state(launch: Launch, rows: int, values: int) -> Cost:
    """With SSM_CARRY, the state read and written once: ``rows`` entries of ``values`` values."""
    size = 4 if defined(launch, "SSM_STATE_F32") else stored(launch)
    nbytes = rows * values * size if defined(launch, "SSM_CARRY") else 0
    return Cost(read=nbytes, written=nbytes)


def _selective_scan_bytes(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """x, delta (and z), b, c and a read once, y written once, the carried state."""
    t, h, n, g, es = tokens(launch, args), args["H"], args["N"], args["G"], stored(launch)
    streams = 2 + defined(launch, "SSM_Z")  # x, delta (and z), one value per (token, channel)
    read = t * h * streams * es + 2 * t * g * n * es + h * n * es
    return Cost(read=read, written=t * h * es) + carried_state(launch, args["R"], h * n)


@declare("selective_scan", "selective_scan_lanes")
def selective_scan(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (token, channel) and state entry: exp(Δ·a), h = decay·h + (Δ·x)·b, y += c·h."""
    per_channel = 7 * args["N"] + 1 + delta_flops(launch) + finish_flops(launch)
    return Cost(other=tokens(launch, args) * args["H"] * per_channel) + _selective_scan_bytes(launch, args)


@declare("selective_scan_chunked")
def selective_scan_chunked(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (token, channel) and state entry: exp(Δ·a), Δ·x·b, the lane's composition (A, B), then its steps rerun
    from the entering state with y += c·h (10 FLOPs); per chunk of SSC_SL·SSC_T steps, channel and entry, lane l
    composes the (A, B) of the l lanes before it (SSC_SL·(SSC_SL-1) FLOPs in all)."""
    lanes, steps = tuned(launch, "SSC_SL"), tuned(launch, "SSC_T")
    n, h = args["N"], args["H"]
    chunks = len(chunk_steps(args["S"], args["R"], lanes * steps, bool(defined(launch, "SSM_VARLEN"))))
    per_channel = 10 * n + 1 + delta_flops(launch) + finish_flops(launch)
    other = tokens(launch, args) * h * per_channel + chunks * h * n * lanes * (lanes - 1)
    return Cost(other=other) + _selective_scan_bytes(launch, args)


def _mamba2_inputs(launch: Launch, args: Mapping[str, Any]) -> float:
    """Bytes of x, dt, b, c (and z) read once."""
    t, hd, p, n, g, es = tokens(launch, args), args["HD"], args["P"], args["N"], args["G"], stored(launch)
    return t * hd * (p * (1 + defined(launch, "SSM_Z")) + 1) * es + 2 * t * g * n * es


@declare("mamba2", "mamba2_lanes")
def mamba2(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (token, head): exp(dt·a), dt·x, then per state entry S = decay·S + (dt·x)⊗b and y += S·c."""
    t, hd, p, n = tokens(launch, args), args["HD"], args["P"], args["N"]
    per_head = 5 * p * n + p + 2 + delta_flops(launch) + p * finish_flops(launch)
    return Cost(other=t * hd * per_head, read=_mamba2_inputs(launch, args),
                written=t * hd * p * stored(launch)) + carried_state(launch, args["R"], hd * p * n)


def _chunks(launch: Launch, args: Mapping[str, Any]) -> list[int]:
    return chunk_steps(args["S"], args["R"], tuned(launch, "M2_Q"), bool(defined(launch, "SSM_VARLEN")))


def _p_rows(launch: Launch, args: Mapping[str, Any]) -> int:
    """Rows of P the tiles compute: P rounded up to whole tiles of M2_PT (a tile's padding rows are zeros)."""
    pt = tuned(launch, "M2_PT")
    return -(-args["P"] // pt) * pt


@declare("mamba2_chunk_state")
def mamba2_chunk_state(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (head, chunk, tile of P): dt and its running sum, the weights exp(L_last - L_s)·dt_s·x_s, and the
    chunk's own state Xwᵀ·B; writes every slot's state [P, N] and decay. With RLX_MMA and M2_SPLIT_STATES (as
    mamba2's backward launches it) Xwᵀ·B from split operands: hi·hi + lo·hi, and hi·lo at TF32, where b splits too
    (a 16-bit thunk's own b is exact); a subtraction per staged value of a split operand."""
    hd, n, rows, tiles = args["HD"], args["N"], _p_rows(launch, args), -(-args["P"] // tuned(launch, "M2_PT"))
    steps = sum(_chunks(launch, args))
    mma, split = defined(launch, "RLX_MMA"), defined(launch, "M2_SPLIT_STATES")
    tf32 = int(bool(split) and mma == MMA_TF32)
    gemm = hd * 2 * steps * rows * n * (1 + split + tf32)
    other = hd * (tiles * steps * (2 + delta_flops(launch)) + 4 * steps * rows)
    other += split * hd * (steps * rows + tf32 * tiles * steps * n)
    slots = args["HD"] * args["K"]
    t, es = tokens(launch, args), stored(launch)
    read = t * hd * (args["P"] + 1) * es + t * args["G"] * n * es
    return Cost(gemm=gemm, other=other, read=read, written=slots * (args["P"] * n + 1) * real(launch))


@declare("mamba2_state_pass")
def mamba2_state_pass(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per state entry and chunk, S = decay·S + own: the states entering each chunk, in place."""
    hd, pn = args["HD"], args["P"] * args["N"]
    chunks = len(_chunks(launch, args))
    states = hd * args["K"] * (pn + 1) * real(launch)
    return Cost(other=2 * hd * chunks * pn, read=states, written=hd * args["K"] * pn * real(launch)) + \
        carried_state(launch, args["R"], hd * pn)


@declare("mamba2_chunk_scan")
def mamba2_chunk_scan(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (head, chunk, tile of P): C·Bᵀ over the whole M2_Q x M2_Q tile, C·S_inᵀ, the decayed mask on the lower
    triangle, then y = exp(L)·(C·S_inᵀ) + (masked C·Bᵀ)·X and the §8 finish."""
    hd, n, q, pt = args["HD"], args["N"], tuned(launch, "M2_Q"), tuned(launch, "M2_PT")
    rows, tiles, chunks = _p_rows(launch, args), -(-args["P"] // pt), _chunks(launch, args)
    triangle = sum(s * (s + 1) // 2 for s in chunks)
    steps = sum(chunks)
    gemm = hd * (tiles * len(chunks) * 2 * q * q * n + 2 * q * rows * n * len(chunks) + 2 * rows * triangle)
    other = hd * (tiles * (steps * (2 + delta_flops(launch)) + 4 * triangle)
                  + steps * rows * (2 + finish_flops(launch)))
    t, es = tokens(launch, args), stored(launch)
    states = hd * args["K"] * args["P"] * n * real(launch)
    return Cost(gemm=gemm, other=other, read=_mamba2_inputs(launch, args) + states,
                written=t * hd * args["P"] * es)


@declare("mamba2_varlen_chunks")
def mamba2_varlen_chunks(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """One work-item lays the chunk table out: no arithmetic, the table written."""
    return Cost(read=(args["R"] + 1) * 4, written=(args["K"] + args["R"] + 1) * 4)
