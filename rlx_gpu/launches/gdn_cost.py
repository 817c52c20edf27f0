"""The costs of the gated_delta_net kernels (``launches/gdn.py`` plans them; ``cost`` says how counted).

The walk, step and lanes kernels run the delta rule step by step: no matrix product. The chunked WY form is
GEMM-shaped, per (value head, chunk of GDN_Q steps): in ``chunk_prep`` the Gram products K·Kᵀ and Q·Kᵀ (per-head
gates; with per-channel gates the portable kernel weighs each key channel by its own decay inside the sum, which
is not a product of tiles, where the MMA variant splits the decay so that the tiles below the diagonal are) and
T·(βK), T·(βV) (the triangular solve for T itself runs row by row); in the state pass W·S0 and the state update
(K∘decay)ᵀ·U; in ``chunk_out`` (exp(G)∘Q)·S0 and P·U. The saved forward's decayed products (``gdn_reserve_grams``)
are GEMM-shaped too (per-channel decays split at the chunk's middle token); its walk and inverse step by step.
"""
from __future__ import annotations

from typing import Any, Mapping

from host_fallback.abi.gdn import RESERVE_CHUNK

from .core import Launch
from .cost import Cost, chunk_steps, declare, defined, group_count, real, stored, tuned
from .mma import MMA_TILE


def _tokens(args: Mapping[str, Any], steps: int) -> int:
    """Tokens of ``steps`` steps of every row (the packed tokens themselves with varlen)."""
    return steps if args["varlen"] else args["R"] * steps


def _inputs(launch: Launch, args: Mapping[str, Any], tokens: int, *fields: str) -> float:
    """Bytes of the thunk's token-major inputs ``fields`` over ``tokens`` tokens, each read once."""
    h, hv, k, v = args["H"], args["HV"], args["K"], args["V"]
    width = {"q": h * k, "k": h * k, "v": hv * v, "g": hv * (k if args["per_channel"] else 1), "beta": hv,
             "dst": hv * v}
    return tokens * sum(width[f] for f in fields) * stored(launch)


def _state(launch: Launch, args: Mapping[str, Any]) -> float:
    """Bytes of the carried states of every row, as the arena keeps them (the compute type with state_real)."""
    size = real(launch) if args.get("state_real") else stored(launch)
    return args["R"] * args["HV"] * args["K"] * args["V"] * size if args["carry"] else 0


def step_flops(k: int, v: int, per_channel: bool, decays: bool = True) -> int:
    """FLOPs of one step of one value head: S = decay·S, u = (v - k·S)·β, S += k⊗u, out = scale·(q·S); the
    decay's exps (one, or one per key channel) unless another launch takes them."""
    exps = (k if per_channel else 1) if decays else 0
    return 7 * k * v + 3 * v + exps


@declare("gated_delta_net", "gated_delta_net_lanes", "gated_delta_net_step")
def recurrent(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """The step recurrence over the launch's tokens: a block of T steps (the walk), the whole sequence (lanes),
    or one token per row (step). The walk with per-channel gates reads the decays gdn_decay wrote."""
    steps = args.get("T", args.get("S", 1))
    tokens = args["R"] if launch.kernel == "gated_delta_net_step" else _tokens(args, steps)
    walk_decays = launch.kernel == "gated_delta_net" and args["per_channel"]
    flops = tokens * args["HV"] * step_flops(args["K"], args["V"], args["per_channel"], not walk_decays)
    read = _inputs(launch, args, tokens, "q", "k", "v", "beta", *(() if walk_decays else ("g",)))
    if walk_decays:
        read += tokens * args["HV"] * args["K"] * real(launch)
    parked = real(launch) * args["R"] * args["HV"] * args["K"] * args["V"] if steps < args.get("S", steps) else 0
    state = _state(launch, args) + parked
    recorded = _recorded(launch, args, tokens) if defined(launch, "GDN_RESERVE") else 0
    return Cost(other=flops, read=read + state, written=_inputs(launch, args, tokens, "dst") + state + recorded)


def _recorded(launch: Launch, args: Mapping[str, Any], tokens: int) -> float:
    """Bytes of the saved forward's u and states that a walk over ``tokens`` tokens records (a state per chunk)."""
    hv, k, v = args["HV"], args["K"], args["V"]
    return hv * (tokens * v + -(-tokens // RESERVE_CHUNK) * k * v) * real(launch)


@declare("gdn_reserve_walk")
def reserve_walk(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """The step recurrence of every column, in place in the reserve's states (each chunk's column copied from the
    one before, read and written twice a step from cache), recording u: the decay's exps taken per use."""
    b, s, hv, k, v, pc = args["B"], args["S"], args["HV"], args["K"], args["V"], bool(args["per_channel"])
    tokens = b * s
    flops = tokens * hv * (v * (4 * k + 4 + (2 * k if pc else 1)))
    read = _inputs(launch, {**args, "R": b, "varlen": 0}, tokens, "q", "k", "v", "g", "beta") + _state(
        launch, {**args, "R": b})
    return Cost(other=flops, read=read, written=_recorded(launch, args, tokens))


#: the log-decays gdn_reserve_grams sums per channel of a chunk: each token's from the middle token (its 15th)
_RESERVE_REACH = sum(abs(t - (RESERVE_CHUNK // 2 - 1)) for t in range(RESERVE_CHUNK))


@declare("gdn_reserve_grams")
def reserve_grams(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (row, chunk, value head): the chunk's q, k (and per-channel log-decays) read once; q_r·k_s and k_r·k_s
    for s <= r, K terms each, GEMM-shaped (32 entries of each written). Per-channel gates: each (token, channel)
    first weighs its row and column by its decay to the chunk's middle token (the log-decays summed from there:
    256 adds per channel over the chunk; two exps, three products), the cost of channels that factor so (one
    past ``GDN_RC_SPREAD`` is summed pair by pair, an exp per term); one gate per head: each entry decayed (an
    exp, two products, the log-decays summed walking down the row)."""
    b, hv, k, pc = args["B"], args["HV"], args["K"], bool(args["per_channel"])
    slots = b * -(-args["S"] // RESERVE_CHUNK) * hv
    pairs = slots * RESERVE_CHUNK * (RESERVE_CHUNK + 1) // 2
    weigh = slots * k * (_RESERVE_REACH + 5 * RESERVE_CHUNK) if pc else 4 * pairs
    read = slots * RESERVE_CHUNK * (2 * k + (k if pc else 1)) * stored(launch)
    return Cost(gemm=pairs * 4 * k, other=weigh, read=read, written=2 * slots * RESERVE_CHUNK ** 2 * real(launch))


@declare("gdn_reserve_inverse")
def reserve_inverse(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (row, chunk, value head, column s): forward substitution down the column, sum_{s <= m < r} per row r."""
    slots = args["B"] * -(-args["S"] // RESERVE_CHUNK) * args["HV"]
    terms = slots * sum(r - s for s in range(RESERVE_CHUNK) for r in range(s, RESERVE_CHUNK))
    return Cost(other=2 * terms + slots * RESERVE_CHUNK ** 2, read=2 * terms * real(launch),
                written=slots * RESERVE_CHUNK ** 2 * real(launch))


@declare("gdn_decay")
def decay(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """exp(g) of a block of T steps of every (batch row, value head, key channel)."""
    count = args["B"] * args["T"] * args["W"]
    return Cost(other=count, read=count * stored(launch), written=count * real(launch))


@declare("gdn_qk_norm")
def qk_norm(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """1/|q| and 1/|k| of every (token, key head): two sums of squares, two square roots and divisions."""
    e, k = args["E"], args["K"]
    return Cost(other=e * (4 * k + 4), read=2 * e * k * stored(launch), written=2 * e * real(launch))


def _chunks(launch: Launch, args: Mapping[str, Any]) -> list[int]:
    return chunk_steps(args["S"], args["R"], tuned(launch, "GDN_Q"), bool(args["varlen"]))


def _triangle(chunks: list[int], strict: bool = False) -> int:
    """Entries of the chunks' lower triangles, with the diagonal or (``strict``) without."""
    return sum(s * (s - 1) // 2 if strict else s * (s + 1) // 2 for s in chunks)


def _diagonal(chunks: list[int]) -> int:
    """Entries s <= t of the chunks' diagonal MMA tiles (the steps of each chunk only)."""
    t = MMA_TILE
    return sum(s // t * (t * (t + 1) // 2) + s % t * (s % t + 1) // 2 for s in chunks)


def _gram(launch: Launch, chunks: list[int], k: int, pc: bool) -> tuple[int, int]:
    """FLOPs of the Gram products K·Kᵀ and Q·Kᵀ over each chunk's GDN_Q x GDN_Q lower triangle (the rows past a
    partial chunk on zeros) and of storing P and M (the chunk's steps), GEMM-shaped and other. One gate per head:
    two products on the triangle, each entry decayed as stored. Per-channel gates, portable: every entry sums
    k_s·exp(G_t - G_s) per channel. Per-channel gates, MMA variant: the tiles below the diagonal are tile products
    of operands weighed per channel (the rows β k_t and q_t from their block's first step m: a difference, an exp
    and three products; the tiles' k_s to m: three), the diagonal tiles sum as the portable path does."""
    q, t = tuned(launch, "GDN_Q"), MMA_TILE
    triangle = q * (q + 1) // 2
    if not pc:
        return len(chunks) * 2 * 2 * k * triangle, 5 * _triangle(chunks)
    if defined(launch, "RLX_MMA") == 0:
        return 0, len(chunks) * (2 * 2 + 3) * k * triangle + 3 * _triangle(chunks)
    below = (q // t) * (q // t - 1) // 2 * t * t
    weigh = (2 * 2 + 3) * (triangle - below) + 5 * q + 3 * below // t
    return len(chunks) * 2 * 2 * k * below, len(chunks) * k * weigh + 3 * _diagonal(chunks)


@declare("gated_delta_net_chunk_prep")
def chunk_prep(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (value head, chunk): G, the Gram products (``_gram``), P and M, T = (I + M)^-1 row by row, then
    W = T·(β exp(G) K), U0 = T·(βV)."""
    hv, k, v, pc = args["HV"], args["K"], args["V"], bool(args["per_channel"])
    chunks = _chunks(launch, args)
    steps, gw = sum(chunks), k if pc else 1
    gram, gram_other = _gram(launch, chunks, k, pc)
    solve = sum(t * (t - 1) for s in chunks for t in range(1, s))
    other = gw * steps + gram_other + solve + (3 + args["qk_norm"]) * steps * k + steps * v
    wy = 2 * _triangle(chunks, strict=True) * (k + v)
    gemm = hv * (wy + gram)
    other = hv * other
    tokens = _tokens(args, args["S"])
    written = hv * (steps * (gw + k + v) + _triangle(chunks)) * real(launch)
    return Cost(gemm=gemm, other=other, read=_inputs(launch, args, tokens, "q", "k", "v", "g", "beta"),
                written=written)


@declare("gated_delta_net_state_pass")
def state_pass(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (row, value head, block of value columns), in chunk order: the state entering each chunk stored,
    U = U0 - W·S0, S = exp(G_last)·S + (K∘exp(G_last - G))ᵀ·U; each lane of a column strip takes its key row's
    decayed k itself (``blocks * strips`` times per chunk)."""
    hv, k, v, pc = args["HV"], args["K"], args["V"], bool(args["per_channel"])
    chunks = _chunks(launch, args)
    steps = sum(chunks)
    strips = min(tuned(launch, "GDN_LANES") // k, tuned(launch, "GDN_SPMAX"))
    blocks = group_count(launch) // (args["R"] * hv)
    gemm = hv * 4 * steps * k * v
    other = hv * (len(chunks) * (k * v + k) + (4 + args["qk_norm"]) * steps * k * strips * blocks)
    scratch = hv * steps * ((k if pc else 1) + k + v) * real(launch)
    read = _inputs(launch, args, _tokens(args, args["S"]), "k") + scratch + _state(launch, args)
    written = hv * (steps * v + len(chunks) * k * v) * real(launch) + _state(launch, args)
    return Cost(gemm=gemm, other=other, read=read, written=written)


@declare("gated_delta_net_chunk_out")
def chunk_out(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (value head, chunk, tile of GDN_OT value columns): exp(G)·q staged, (exp(G)∘Q)·S0 over the whole tile,
    P·U over the lower triangle, the scale."""
    hv, k, v, q, ot = args["HV"], args["K"], args["V"], tuned(launch, "GDN_Q"), tuned(launch, "GDN_OT")
    chunks = _chunks(launch, args)
    steps, tiles = sum(chunks), -(-v // ot)
    gemm = hv * (len(chunks) * 2 * q * k * tiles * ot + 2 * _triangle(chunks) * v)
    other = hv * (tiles * (3 + args["qk_norm"]) * steps * k + steps * v)
    scratch = hv * (steps * ((k if args["per_channel"] else 1) + v) + _triangle(chunks)
                    + len(chunks) * k * v) * real(launch)
    tokens = _tokens(args, args["S"])
    return Cost(gemm=gemm, other=other, read=_inputs(launch, args, tokens, "q") + scratch,
                written=_inputs(launch, args, tokens, "dst"))
