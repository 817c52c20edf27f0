"""The costs of the selective_scan, mamba2 and gated_delta_net backward kernels (``launches/ssm_backward.py``
plans them; ``cost`` says how counted).

Each walk runs its state rows (gated_delta_net: state columns) step by step, nothing GEMM-shaped: a forward
pass storing checkpoints, then per chunk of SSMB_Q steps the states recomputed and the reverse step. The
FLOPs per (token, state row) are read off kernels/ssm_backward.cl's and kernels/gdn_backward.cl's loops; the
workspace of checkpoints and recomputed states is a scratch region, counted once written and once read like
every other.
"""
from __future__ import annotations

from typing import Any, Mapping

from .core import Launch
from .cost import Cost, declare, defined, real, stored, tuned
from .ssm_cost import delta_flops, finish_flops


def _workspace(launch: Launch, args: Mapping[str, Any], items: int, width: int, decays: bool = False,
               rows: int = 1) -> float:
    """Bytes of the items' workspaces: per item SSMB_Q states of ``width`` reals (and with ``decays`` SSMB_Q steps'
    decays), and per state row walked together (``rows``) ceil(S / SSMB_Q) + 1 states."""
    q = tuned(launch, "SSMB_Q")
    return items * ((2 if decays else 1) * q + rows * (-(-args["S"] // q) + 1)) * width * real(launch)


@declare("selective_scan_backward", "mamba2_backward")
def state_rows(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (token, state row of N entries): the step twice (checkpoint pass, recompute: 3 FLOPs an entry, with
    selective_scan's exp(Δ·a_n) 2 more), y = c·h again (2N), the reverse step (15 an entry: d_c, d_b, the carried
    gradient, d_Δ's and d_a's shares; selective_scan's decays at the gpu target 2 more, at the cpu target kept by
    the recompute), and the token's delta, dx and finish; then the delta gradients."""
    mamba2 = launch.kernel == "mamba2_backward"
    t, n, g, es, rs = args["T"], args["N"], args["G"], stored(launch), real(launch)
    width = args["HD"] if mamba2 else args["H"]  # heads or channels per token
    rows = width * (args["P"] if mamba2 else 1)  # state rows per token
    decay = 0 if mamba2 else 2  # exp(Δ·a_n) per entry (mamba2: one per token, in the 3 below)
    step = (3 + decay) * n + 3 + delta_flops(launch)
    kept = launch.target == "cpu"  # selective_scan's decays kept by the recompute (SSMB_KEEP_DECAYS)
    reverse = 2 * n + (15 + (0 if kept else decay)) * n + 3 + delta_flops(launch) + 6 + finish_flops(launch)
    per_row = 2 * step + reverse
    per_token = rows * per_row + width * (delta_flops(launch) + 2)
    x = t * rows * es  # x, d_dst, d_x (and z, d_z) per state row's channel
    blocks = args["blocks"]
    partials = (2 * blocks * t * g * n + t * width) * rs
    read = x * (2 + 2 * defined(launch, "SSM_Z")) + 2 * t * g * n * es + t * width * es
    written = x * (1 + defined(launch, "SSM_Z")) + t * width * es + partials
    items = args["R"] * g * blocks
    scratch = _workspace(launch, args, items, n, decays=kept and not mamba2, rows=(args["P"] if mamba2 else args["per"]) if kept else 1)
    return Cost(other=t * per_token, read=read + scratch, written=written + scratch)


@declare("ssm_backward_reduce")
def reduce(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """out[m] = the sum of K x J partials of each of M outputs."""
    m, k, j = args["M"], args["K"], args["J"]
    return Cost(other=m * k * j, read=m * k * j * real(launch), written=m * stored(launch))


@declare("gated_delta_net_backward")
def gdn_columns(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (token, value head, state column of K): the step twice (checkpoint pass, recompute; once with the
    checkpoints read from a saved forward), the reverse step (k·(e s0) again, d_q, d_u, d_k, the carried gradient,
    d_g: 23K + 8), the decays taken per use."""
    t, h, hv, k, v = args["T"], args["H"], args["HV"], args["K"], args["V"]
    per_channel = bool(defined(launch, "GDNB_GATE_K"))
    twice = (1 if args["saved"] else 2) * (6 * k + 2)  # the step of one column: k·(e s0), u, s2 = e s0 + k u
    exps = 6 * k if per_channel else 4
    other = t * hv * v * (twice + 23 * k + 8 + exps)
    es, rs, blocks = stored(launch), real(launch), args["blocks"]
    gk = k if per_channel else 1
    read = t * (2 * h * k + 2 * hv * v + hv * (gk + 1)) * es  # q, k, v, d_dst, g, beta
    written = t * hv * v * es + (2 * blocks * t * h * k + t * hv * (1 + gk)) * rs  # d_v, partials, sums
    scratch = _workspace(launch, args, args["R"] * h * blocks, k)
    saved = -(-args["S"] // tuned(launch, "SSMB_Q")) * args["R"] * hv * k * v * rs if args["saved"] else 0
    return Cost(other=other, read=read + scratch + saved, written=written + scratch)


@declare("gdn_backward_saved")
def gdn_saved(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (token, value head, state column of KP): the state rebuilt from the reserve's u (d s + k u: 3), the
    reverse step (gs, d_q, d_u, k·(d s0), d_k, d_g, the carried gradient: 17); per token and item the key rows
    (normalised, decays taken per use); the workspace of the chunk's states written once and read twice."""
    b, t, h, hv, kp, v = args["B"], args["B"] * args["S"], args["H"], args["HV"], args["KP"], args["V"]
    k, nb, per_channel = args["K"], args["NB"], bool(defined(launch, "GDNB_GATE_K"))
    es, rs = stored(launch), real(launch)
    rows = 2 * (2 * kp + (4 if per_channel else 0) * kp) + 2 * k * defined(launch, "GDNB_NORM")
    other = t * hv * (v * 20 * kp + nb * rows)
    gk = k if per_channel else 1
    read = t * hv * nb * (2 * h // hv * k + gk + 1) * es * 2 + t * hv * 2 * v * es  # q, k, g, beta per item; v, d_dst
    saved = (t * hv * v + -(-args["S"] // tuned(launch, "SSMB_Q")) * b * hv * k * v) * rs  # u, states
    workspace = t * hv * v * kp * rs
    written = t * hv * v * es + (2 * nb * t * hv * k + nb * t * hv * (1 + gk)) * rs  # d_v, partials
    return Cost(other=other, read=read + saved + 2 * workspace, written=written + workspace)


@declare("gdn_backward_sums")
def gdn_sums(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """out[m] = the sum of NB partials of each of M outputs."""
    m, nb = args["M"], args["NB"]
    return Cost(other=m * nb, read=m * nb * real(launch), written=m * stored(launch))


@declare("gdn_backward_qk")
def gdn_qk(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """d_q and d_k of every (token, key head): the blocks' partials summed (and the norm's derivative)."""
    e, k, blocks = args["E"], args["K"], args["blocks"]
    return Cost(other=2 * e * k * (blocks + 4), read=2 * e * k * (blocks * real(launch) + stored(launch)),
                written=2 * e * k * stored(launch))
