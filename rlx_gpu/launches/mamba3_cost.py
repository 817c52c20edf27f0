"""The costs of the mamba3 forward kernels (``launches/mamba3.py`` plans them; ``cost`` says how counted).

Per (token, head) every form computes the trapezoid's coefficients (λ = σ(trap), α, β, γ), advances the A angles
(π·tanh(angles)·dt, reduced mod 2π, their cos and sin) and turns the biased q and k (§11 steps 1-3). The step
kernels (mamba3, mamba3_lanes) then update the state row by row: a recurrence, no matrix product. The chunked
prefill (§11's informative chunk form) is GEMM-shaped, per (head, chunk of M3C_Q steps, tile of M3C_PT state rows):
in ``mamba3_chunk_state`` the chunk's own state (w·decay·V)ᵀ·K̃; in ``mamba3_chunk_scan`` Q̃·K̃ᵀ over the whole
M3C_Q x M3C_Q tile (recomputed by each tile of rows), Q̃·S_inᵀ and the masked (Q̃·K̃ᵀ ∘ decays ∘ weights)·V.
"""
from __future__ import annotations

from typing import Any, Mapping

from .core import Launch
from .cost import Cost, chunk_steps, declare, defined, real, stored, tokens, tuned

#: FLOPs of σ (exp, add, division); of α = exp(adt), β = (1 - λ)·dt·α, γ = λ·dt with σ; of β' = (1 - λ)·dt with σ
SIGMOID = 3
COEFFS = SIGMOID + 5
BPRIME = SIGMOID + 2
#: FLOPs of one angle's advance: tanh (a multiply, exp, add, division, subtraction), θ + π·tanh·dt, the reduction
#: θ - 2π·floor(θ/2π); of its cos and sin; of turning one pair of q and of k (4 multiplies, 2 adds each)
ADVANCE, SINCOS, TURN = 5 + 3 + 3, 2, 12
_SILU = 4



def turn_flops(args: Mapping[str, Any]) -> int:
    """FLOPs of one token's angles and turned, biased q and k at one head."""
    a = args["A"]
    return a * (ADVANCE + SINCOS + TURN) + args["N"] * (args["has_q_bias"] + args["has_k_bias"])


def finish_flops(args: Mapping[str, Any]) -> int:
    """FLOPs per output of y += d·v and y *= silu(z)."""
    return 2 * args["has_d"] + (_SILU + 1) * args["has_z"]


def inputs(launch: Launch, args: Mapping[str, Any], *fields: str) -> float:
    """Bytes of the thunk's token-major inputs ``fields`` (and the parameters they bring), each read once; adt, dt,
    trap and angles in the compute type where dt_real says so."""
    t, h, n, p, es = tokens(args), args["H"], args["N"], args["P"], stored(launch)
    coeff = real(launch) if args["dt_real"] else es
    width = {"qk": 2 * t * args["G"] * n * es + h * n * (args["has_q_bias"] + args["has_k_bias"]) * es,
             "v": t * h * p * es, "z": t * h * p * es * args["has_z"], "coeffs": 3 * t * h * coeff,
             "angles": t * h * (args["A"] * coeff + coeff), "d": h * es * args["has_d"], "dst": t * h * p * es}
    return sum(width[f] for f in fields)


def carried(launch: Launch, args: Mapping[str, Any], *parts: str) -> float:
    """Bytes of the carried state tensors ``parts`` of every row (the compute type), or 0 without carry."""
    per_row = {"angle": args["A"], "state": args["P"] * args["N"], "k": args["N"], "v": args["P"]}
    return args["R"] * args["H"] * sum(per_row[p] for p in parts) * real(launch) if args["carry"] else 0


def _step_bytes(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Every input read once, dst written, the four carried states read and written."""
    state = carried(launch, args, "angle", "state", "k", "v")
    return Cost(read=inputs(launch, args, "qk", "v", "z", "coeffs", "angles", "d") + state,
                written=inputs(launch, args, "dst") + state)


def _step_flops(args: Mapping[str, Any], coeffs: int, turns: int, rows: int, per_row: int) -> int:
    """FLOPs of the step recurrence per (token, head): the coefficients ``coeffs`` times and q and k turned ``turns``
    times, then per state row of ``rows`` (zeros past P count) S = α·S + (β·v̄)·k̄ + (γ·v)·k̃ and y += S·q̃ per entry
    and ``per_row`` more (β·v̄, γ·v, joining partial sums), and the finish on the P rows."""
    per_head = (coeffs * COEFFS + turns * turn_flops(args) + rows * (7 * args["N"] + per_row)
                + args["P"] * finish_flops(args))
    return tokens(args) * args["H"] * per_head


@declare("mamba3")
def mamba3(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """cpu: each work-item takes the coefficients, turns q and k itself and walks M3_PB state rows (padded; a
    decode step the P rows), β·v̄ and γ·v per row, y in two partial sums."""
    items, pb = -(-args["P"] // tuned(launch, "M3_PB")), tuned(launch, "M3_PB")
    rows = args["P"] if args["S"] == 1 and not args["varlen"] else items * pb
    return Cost(other=_step_flops(args, items, items, rows, 3)) + _step_bytes(launch, args)


@declare("mamba3_lanes")
def mamba3_lanes(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """gpu: a state row over SSM_L lanes, a block of LSIZE/SSM_L rows walking the sequence together; every lane
    takes the coefficients and β·v̄, γ·v of its row, the lanes turn q and k once per block walk together, a row's
    partial sums of y are joined by SSM_L - 1 adds."""
    lanes, local = defined(launch, "SSM_L"), launch.local_size[0]
    walks = -(-args["P"] // (local // lanes))
    flops = _step_flops(args, walks * local, walks, walks * (local // lanes), 3 * lanes - 1)
    return Cost(other=flops) + _step_bytes(launch, args)


@declare("mamba3_lanes_final")
def mamba3_lanes_final(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (row, head): each angle walked over the row's tokens, the last token's pairs turned; the final angle and
    key written."""
    a, rh = args["A"], args["R"] * args["H"]
    other = tokens(args) * args["H"] * a * ADVANCE + rh * (a * (SINCOS + TURN)
                                                               + args["N"] * (args["has_q_bias"] + args["has_k_bias"]))
    last_qk = 2 * args["R"] * args["G"] * args["N"] * stored(launch)
    read = inputs(launch, args, "angles") + last_qk + carried(launch, args, "angle")
    return Cost(other=other, read=read, written=carried(launch, args, "angle", "k"))


def chunk_lengths(launch: Launch, args: Mapping[str, Any]) -> list[int]:
    return chunk_steps(args["S"], args["R"], tuned(launch, "M3C_Q"), bool(args["varlen"]))


def row_tiles(launch: Launch, args: Mapping[str, Any]) -> int:
    """Tiles of M3C_PT state rows per (head, chunk): P rounded up (a tile's padding rows are zeros)."""
    return -(-args["P"] // tuned(launch, "M3C_PT"))


def stage_flops(launch: Launch, args: Mapping[str, Any], weighted: bool) -> int:
    """Per head, what every tile stages (m3c_stage_barrier) over the chunks' steps: γ with its coefficients, the
    weight γ + β' of the next token (none after a row's last), the running sum of adt; ``weighted``: each weight
    times its decay to the chunk's end and each value of P times its weight."""
    steps = sum(chunk_lengths(launch, args))
    per_tile = steps * (COEFFS + BPRIME + 2 + 3 * weighted) - args["R"] * BPRIME
    return row_tiles(launch, args) * per_tile + weighted * steps * args["P"]


@declare("mamba3_chunk_turn")
def chunk_turn(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (token, head): its angles advanced and its q and k turned into scratch (q̃, k̃); with carry the initial key
    kept in scratch, the final angle and key written."""
    t, h, n = tokens(args), args["H"], args["N"]
    read = inputs(launch, args, "qk", "angles") + carried(launch, args, "angle", "k")
    kept_key = carried(launch, args, "k")  # the initial key's copy in scratch
    written = 2 * t * h * n * real(launch) + kept_key + carried(launch, args, "angle", "k")
    return Cost(other=t * h * turn_flops(args), read=read, written=written)


def _slot_states(launch: Launch, args: Mapping[str, Any]) -> float:
    """Bytes of the chunk slots' states in scratch: M3C_PT-padded rows of N per (head, slot)."""
    return args["H"] * args["K"] * row_tiles(launch, args) * tuned(launch, "M3C_PT") * args["N"] * real(launch)


@declare("mamba3_chunk_state")
def chunk_state(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (head, chunk, tile of rows): the staged weights and values, the chunk's decay exp(c_last), and its own
    state from zero, (w·decay·V)ᵀ·K̃ over the tile's padded rows."""
    h, n, chunks = args["H"], args["N"], chunk_lengths(launch, args)
    rows = row_tiles(launch, args) * tuned(launch, "M3C_PT")
    gemm = h * 2 * sum(chunks) * rows * n
    other = h * (stage_flops(launch, args, True) + len(chunks))
    read = inputs(launch, args, "v", "coeffs") + tokens(args) * h * n * real(launch)
    return Cost(gemm=gemm, other=other, read=read,
                written=_slot_states(launch, args) + h * args["K"] * real(launch))


@declare("mamba3_state_pass")
def state_pass(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per state element (rows in blocks of M3C_PP) and chunk, S = decay·S + own, each slot left with the state
    entering it; with carry S0 = S_init + β'·v̄⊗k̄ (β'·k̄ once per item) and the final state written."""
    h, n, p, pp = args["H"], args["N"], args["P"], tuned(launch, "M3C_PP")
    blocks = -(-p // pp)
    other = h * len(chunk_lengths(launch, args)) * 2 * n * blocks * pp
    if args["carry"]:
        other += args["R"] * h * (n * blocks * (BPRIME + 1) + 2 * p * n)
    slots = _slot_states(launch, args)
    state = carried(launch, args, "state")
    read = slots + h * args["K"] * real(launch) + state + carried(launch, args, "v", "k")
    return Cost(other=other, read=read, written=slots + state)


def _scan_gemm(launch: Launch, args: Mapping[str, Any]) -> int:
    """Per head, the scan's products: gpu Q̃·K̃ᵀ and Q̃·S_inᵀ over whole tiles (state columns in tiles of M3C_NT)
    and the masked product over the lower triangle with its diagonal; cpu each step's row of Q̃·K̃ᵀ and Q̃·S_inᵀ
    and the masked product strictly below the diagonal (the diagonal's term with the decayed S_in's)."""
    q, pt, n, chunks, tiles = tuned(launch, "M3C_Q"), tuned(launch, "M3C_PT"), args["N"], chunk_lengths(launch, args), \
        row_tiles(launch, args)
    if launch.target == "cpu":
        strict = sum(s * (s - 1) // 2 for s in chunks)
        return tiles * (2 * sum(chunks) * (q + pt) * n + 2 * pt * strict)
    nt = tuned(launch, "M3C_NT")
    columns = -(-n // nt) * nt
    triangle = sum(s * (s + 1) // 2 for s in chunks)
    return len(chunks) * tiles * 2 * q * (q + pt) * columns + 2 * args["P"] * triangle


def _scan_other(launch: Launch, args: Mapping[str, Any]) -> int:
    """Per head, the scan's other FLOPs: the stage, the mask exp(c_t - c_s)·w_s·(q̃_t·k̃_s) below the diagonal and
    γ_t·(q̃_t·k̃_t) on it, exp(c_t)·(q̃_t·S_in) (cpu: over the tile's padded rows, with the diagonal's term)
    and the finish."""
    chunks, tiles, pt = chunk_lengths(launch, args), row_tiles(launch, args), tuned(launch, "M3C_PT")
    steps, strict = sum(chunks), sum(s * (s - 1) // 2 for s in chunks)
    mask = tiles * (4 * strict + (2 if launch.target == "cpu" else 1) * steps)
    outputs = tiles * steps * 3 * pt if launch.target == "cpu" else steps * args["P"] * 2
    return stage_flops(launch, args, False) + mask + outputs + steps * args["P"] * finish_flops(args)


@declare("mamba3_chunk_scan")
def chunk_scan(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (head, chunk, tile of rows): y = exp(c_t)·q̃_t·S_in + Σ_{s<t} exp(c_t - c_s)·w_s·(q̃_t·k̃_s)·v_s
    + γ_t·(q̃_t·k̃_t)·v_t, then d and z; with carry the row's last value written as v̄."""
    h = args["H"]
    scratch = 2 * tokens(args) * h * args["N"] * real(launch) + _slot_states(launch, args)
    read = inputs(launch, args, "v", "z", "coeffs", "d") + scratch
    return Cost(gemm=h * _scan_gemm(launch, args), other=h * _scan_other(launch, args), read=read,
                written=inputs(launch, args, "dst") + carried(launch, args, "v"))
