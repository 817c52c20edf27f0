"""The costs of the mamba3_backward kernels (``launches/mamba3.py`` plans them; ``cost`` says how counted).

The backward is §11's step recurrence reversed: no matrix product. Per (token, head) the turn launch turns q and
k as the forward does; the walk recomputes each block of M3B_PB state rows forward twice (the checkpoints, then a
chunk's states) and undoes the step per state entry; the per-token launch sums the blocks' partials and undoes
the turns, the angle launch sums each angle's gradient from the last token back; the reductions add partials.
"""
from __future__ import annotations

from typing import Any, Mapping

from .core import Launch
from .cost import Cost, declare, real, stored, tokens, tuned
from .mamba3_cost import COEFFS, SIGMOID, SINCOS, turn_flops

#: FLOPs per (token, state row) of one forward step (β·v̄, γ·v) and per entry (S = α·S + (β·v̄)·k̄ + (γ·v)·k̃); of
#: its reverse per entry (dS, the shares of q̃, k̃, α, β, γ, v, the carried dS and k̄'s share) and per row (d_v,
#: the three coefficient shares, v̄'s carried share)
_STEP_ROW, _STEP_ENTRY, _BACK_ENTRY, _BACK_ROW = 2, 5, 17, 10
#: FLOPs per (token, head) of the coefficients' gradients (d_adt, d_trap, dt's share) beside σ(trap) and α; per
#: turned pair of undoing the turn (the angle's share, the turned-back gradients of q and k)
_COEFF_GRADS, _UNTURN = SIGMOID + 15, 19
#: FLOPs per (token, angle) of the angle launch: the sum, tanh, d_angles and dt's share
_ANGLE_GRADS = 1 + 5 + 5 + 3


def _coeffs_bytes(launch: Launch, args: Mapping[str, Any], count: int) -> float:
    """Bytes of ``count`` of adt, dt, trap and angles per (token, head), in the compute type where dt_real says so."""
    return args["T"] * args["H"] * count * (real(launch) if args["dt_real"] else stored(launch))


def _reals(launch: Launch, count: float) -> float:
    return count * real(launch)


@declare("mamba3_backward_turn")
def backward_turn(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """The forward's angles and turns of every (token, head); q̃, k̃ and the angles into scratch."""
    t, h, n, a = tokens(args), args["H"], args["N"], args["A"]
    es = stored(launch)
    coeff = real(launch) if args["dt_real"] else es
    read = 2 * t * args["G"] * n * es + t * h * (a + 1) * coeff + (args["R"] * h * a * real(launch) if args["carry"]
                                                                    else 0)
    return Cost(other=t * h * turn_flops(args), read=read, written=_reals(launch, t * h * (2 * n + a)))


@declare("mamba3_backward_walk")
def backward_walk(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (token, head, block of M3B_PB rows) the coefficients three times (two forward steps, the reverse one);
    per state row the two forward steps, the reverse step and the finish's gradient (with z, y recomputed)."""
    t, h, n, p = args["T"], args["H"], args["N"], args["P"]
    row_blocks = args["blocks"] * -(-args["per"] // tuned(launch, "M3B_PB"))
    gy = 3 * args["has_d"] + args["has_z"] * (2 * n + SIGMOID + 9)
    per_row = 2 * (_STEP_ROW + _STEP_ENTRY * n) + _BACK_ENTRY * n + _BACK_ROW + gy
    other = t * h * (3 * COEFFS * row_blocks + p * per_row) + args["R"] * h * p * n
    es, part = stored(launch), args["blocks"] * t * h * (2 * n + 3)
    items = args["R"] * h * args["blocks"]
    workspace = items * (-(-args["S"] // tuned(launch, "SSMB_Q")) + tuned(launch, "SSMB_Q") + 2) \
        * tuned(launch, "M3B_PB") * n
    carried = args["R"] * h * (p * n + p + n) if args["carry"] else 0
    read = t * h * p * (2 + args["has_z"]) * es + _coeffs_bytes(launch, args, 3) \
        + _reals(launch, 2 * t * h * n + workspace + 2 * carried)
    written = t * h * p * (1 + args["has_z"]) * es + _reals(launch, part + workspace + items * (n + 1) + carried)
    return Cost(other=other, read=read, written=written)


@declare("mamba3_backward_tokens")
def backward_tokens(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (token, head): the blocks' partials summed, the coefficients' gradients, the turns undone."""
    t, h, n, a, blocks = args["T"], args["H"], args["N"], args["A"], args["blocks"]
    other = t * h * ((blocks - 1) * (2 * n + 3) + COEFFS + _COEFF_GRADS + a * (SINCOS + _UNTURN))
    read = _coeffs_bytes(launch, args, 3) + _reals(launch, t * h * (blocks * (2 * n + 3) + 2 * n + a))
    written = _coeffs_bytes(launch, args, 2) + _reals(launch, t * h * (1 + 2 * n + a))
    return Cost(other=other, read=read, written=written)


@declare("mamba3_backward_angles")
def backward_angles(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (token, head, angle) the gradient summed from the last token back, d_angles and dt's share; d_dt stored;
    with carry d_angle_state and d_k_state (the blocks' key shares summed)."""
    t, h, n, a, rh = tokens(args), args["H"], args["N"], args["A"], args["R"] * args["H"]
    key_sums = rh * n * args["blocks"] if args["carry"] else 0
    other = t * h * a * _ANGLE_GRADS + key_sums
    coeff = real(launch) if args["dt_real"] else stored(launch)
    read = t * h * (a + 1) * coeff + _reals(launch, t * h * (a + 1) + key_sums + (rh * a if args["carry"] else 0))
    written = t * h * (a + 1) * coeff + _reals(launch, t * h + (rh * (a + n) if args["carry"] else 0))
    return Cost(other=other, read=read, written=written)


@declare("mamba3_backward_reduce")
def backward_reduce(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Each of M outputs the sum of its K partials."""
    m, k = args["M"], args["K"]
    return Cost(other=m * (k - 1), read=_reals(launch, m * k),
                written=m * (real(launch) if args["is_real"] else stored(launch)))
