"""The costs of the lstm / gru / rnn kernels and of the body kernels their plans launch (``launches/rnn.py``,
``launches/body.py``; ``cost`` says how counted).

The input projection is one gemm over every step; each step's h·W_hhᵀ over the batch rows is a product of
tiles too (rnn_step: B x K times K x G·H, GEMM-shaped). The persistent kernel runs one batch row per
work-group, a matrix-vector product each step: not GEMM-shaped. A cell's gate arithmetic (activations, c and
h) is estimated at ``CELL_FLOPS`` per unit; beside the 2·K·G FLOPs of its row of the product it is small.
"""
from __future__ import annotations

from typing import Any, Mapping

from .core import Launch
from .cost import Cost, declare, defined, group_count, real, stored, tuned

#: estimated FLOPs of one cell update per hidden unit, by gate count: the activations (an exp, an add and a
#: division each), the input and bias adds, c = f·c + i·g and h = o·tanh(c) (lstm), gru's interpolation
CELL_FLOPS = {4: 28, 3: 22, 1: 6}


def _size(launch: Launch, is_real: Any) -> int:
    """Bytes of one value of an operand kept in compute-type scratch (``is_real``) or in the arena."""
    return real(launch) if is_real else stored(launch)


@declare("gemm")
def gemm(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """D[z] = A[z]·B[z] (+ bias) for every batch item z; an operand with batch stride 0 is read once."""
    m, n, k = args["m"], args["n"], args["k"]
    if launch.target == "gpu":  # one work-group per GEMM_TILE square of one batch item, all along x
        side = tuned(launch, "GEMM_TILE")
        batch = group_count(launch) // (-(-n // side) * -(-m // side))
    else:
        batch = launch.global_size[2]
    a_items, b_items = (batch if args[f"{x}_bs"] else 1 for x in "ab")
    read = m * k * a_items * _size(launch, args["a_real"]) + k * n * b_items * _size(launch, args["b_real"])
    bias = m * n * batch if args["has_bias"] else 0
    return Cost(gemm=2 * m * n * k * batch, other=bias, read=read + (n * batch * stored(launch) if bias else 0),
                written=m * n * batch * _size(launch, args["d_real"]))


@declare("transpose_real")
def transpose_real(launch: Launch, args: Mapping[str, Any]) -> Cost:
    values = args["rows"] * args["cols"] * args["batch"]
    return Cost(read=values * _size(launch, args["s_real"]), written=values * real(launch))


@declare("rnn_w_t")
def weights_transposed(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """W (ng·H rows of K) of every direction staged transposed and padded (HP units per gate)."""
    dirs = launch.global_size[2]
    return Cost(read=dirs * args["ng"] * args["H"] * args["K"] * stored(launch),
                written=dirs * args["ng"] * args["HP"] * args["K"] * real(launch))


def _phase_gates(launch: Launch, phase: int) -> int:
    """Gates a step's launch of ``phase`` sums (kernels/rnn_cell.cl's rnn_gate_count): with RNN_LBR0, r and z
    in phase 0 and n in phase 1, else all of them."""
    return (1 if phase else 2) if defined(launch, "RNN_LBR0") else defined(launch, "RNN_GATES")


@declare("rnn_step")
def step(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """One step (one phase of it) of every (batch row, direction): h·W_hhᵀ over the phase's gates, then their
    cells (the cell's arithmetic split among the phases by their gates)."""
    b, h, k, dirs, rs = args["B"], args["H"], args["K"], launch.global_size[2], real(launch)
    gates, every = _phase_gates(launch, args["phase"]), defined(launch, "RNN_GATES")
    read = (dirs * k * gates * h + dirs * b * gates * h) * rs + dirs * b * (k + h) * rs
    written = dirs * b * (k + h) * rs + b * dirs * k * _size(launch, args["o_real"])
    return Cost(gemm=2 * b * dirs * gates * h * k, other=b * dirs * h * CELL_FLOPS[every] * gates / every,
                read=read, written=written)


@declare("rnn_persist")
def persist(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """A layer's whole recurrence: per step and (batch row, direction) a matrix-vector product with W_hh (and
    at the cpu target the input projection with W_ih, over I inputs), then the cells."""
    b, s, h, gates, dirs = args["B"], args["S"], args["H"], defined(launch, "RNN_GATES"), launch.global_size[2]
    k, inputs = args.get("K", h), args.get("I", 0)
    rows = b * s * dirs
    weights = dirs * gates * h * (k + inputs) * stored(launch)
    xw = 0 if "I" in args else rows * gates * h * real(launch)
    return Cost(other=rows * h * (2 * gates * (k + inputs) + CELL_FLOPS[gates]), read=weights + xw
                + rows * inputs * stored(launch), written=rows * k * _size(launch, args["o_real"]))


@declare("rnn_proj")
def projection(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """lstm's projection of one step: (o·tanh(c))·W_hrᵀ for every (batch row, direction)."""
    b, h, p, dirs = args["B"], args["H"], args["P"], launch.global_size[2]
    rs = real(launch)
    return Cost(gemm=2 * b * dirs * p * h, read=dirs * (h * p + b * h) * rs,
                written=dirs * b * p * (rs + _size(launch, args["o_real"])))


@declare("rnn_state_in", "rnn_state_out")
def states(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """The initial states into scratch (zeros without carry), or the final ones back to the arena."""
    values = args["nh"] + args["nc"]
    return Cost(read=values * stored(launch) if args.get("carry", True) else 0, written=values * real(launch))


@declare("rnn_pad", "rnn_order")
def bookkeeping(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """seq_lens' bookkeeping: zeros past each row's length (at most every output), the rows in length order."""
    return Cost(written=args["B"] * args["S"] * args.get("W", 0) * stored(launch) + args["B"] * 4)


@declare("rnnb_step_product")
def step_product(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """The backward's per-step product of every batch row and direction (gpu target): d = a·b (+ bias)."""
    m, n, k, dirs = args["m"], args["n"], args["k"], launch.global_size[2]
    rs = real(launch)
    return Cost(gemm=2 * m * n * k * dirs, other=m * n * dirs if args["has_bias"] else 0,
                read=dirs * (m * k * rs + k * n * _size(launch, args["b_real"])), written=dirs * m * n * rs)


@declare("rnnb_forward_step", "rnnb_backward_cell")
def backward_cells(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """The cells of one step (one phase) of every (batch row, direction): the forward's (keeping what the
    gradients read), or their gradients (about twice a cell's arithmetic)."""
    b, h, gates, dirs = args["B"], args["H"], defined(launch, "RNN_GATES"), launch.global_size[2]
    share = _phase_gates(launch, args["phase"]) / gates
    times = 1 if launch.kernel == "rnnb_forward_step" else 2
    values = b * dirs * h * real(launch) * (gates + 2) * share
    return Cost(other=b * dirs * h * CELL_FLOPS[gates] * share * times, read=values, written=values)


@declare("rnnb_reverse_walk")
def reverse_walk(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """A layer's whole reverse walk, every (batch row, direction) and step: the cells' gradients (lstm's projection
    in reverse and gru's W_hn^T dz_n per unit besides), and dh = dzc·W_hh, GEMM-shaped (a work-group's rows share
    each weight read). W_hh counted once per step and direction, as rnn_step's: the work-groups read it at the
    same steps, through the cache."""
    b, s, h, k, dirs = args["B"], args["S"], args["H"], args["K"], launch.global_size[2]
    gates, lbr0, proj = defined(launch, "RNN_GATES"), defined(launch, "RNN_LBR0"), defined(launch, "RNN_PROJ")
    terms, rows, rs = (2 if lbr0 else gates) * h, b * s * dirs, real(launch)
    per_row = 2 * h * CELL_FLOPS[gates] + (2 * h * h if lbr0 else 0) + (2 * h * k if proj else 0)
    weights = dirs * (s * terms * k + (h * h if lbr0 else h * k if proj else 0)) * stored(launch)
    kept = rows * ((gates + 2) * h + k) * rs
    return Cost(gemm=2 * rows * terms * k, other=rows * per_row, read=weights + kept,
                written=rows * (gates * h * (2 if gates == 3 else 1) + (k if proj else 0)) * rs)


@declare("rnnb_forward_proj", "rnnb_backward_proj")
def backward_projection(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """lstm's projection of one step, or its gradient (d of the projected h back through W_hr): B·dirs x H·P."""
    b, h, p, dirs = args["B"], args["H"], args["P"], launch.global_size[2]
    rs = real(launch)
    return Cost(gemm=2 * b * dirs * p * h, read=dirs * (h * p * stored(launch) + b * (h + p) * rs),
                written=dirs * b * (h + p) * rs)


@declare("rnnb_colsum")
def column_sums(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Sums over ``rows`` of ``cols`` columns of ``batch`` matrices (a bias, or a peephole's products)."""
    values = args["rows"] * args["cols"] * args["batch"]
    return Cost(other=values * (2 if args["has_m"] else 1), read=values * real(launch) * (2 if args["has_m"] else 1),
                written=args["cols"] * args["batch"] * stored(launch))


@declare("rnnb_zero", "rnnb_forward_init", "rnnb_backward_init", "rnnb_backward_out")
def backward_bookkeeping(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Scratch zeroed, the initial states (and their gradients) in, the initial states' gradients out."""
    if "n" in args:  # rnnb_zero
        return Cost(written=args["n"] * real(launch))
    if "nh" in args:  # the states' gradients in, or the initial states' out
        values = args["nh"] + args["nc"] + args["nd"]
    else:  # rnnb_forward_init: h0 and c0 of every (batch row, direction)
        values = launch.global_size[2] * args["B"] * (args["K"] + args["H"])
    return Cost(read=values * stored(launch), written=values * real(launch))
