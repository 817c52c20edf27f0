"""Launch geometry of lstm_backward / gru_backward / rnn_backward (ABI.md §9), from kernels/rnn_backward.cl.

A backward thunk runs in two walks, every launch built as its forward's program variant (``rnn.variant``):

1. Forward, bottom up: per layer the input projection (W_ih staged transposed, one gemm over every timestep
   of both directions, bias folded in) and W_hh staged transposed, then per step the recurrent product of every
   row as one gemm (``h W_hh^T + b_hh``, over the compact h the previous step left) and a cell launch (two of
   each for gru without ``linear_before_reset``, and lstm's projection after) that keeps, per step, the gate
   pre-activations, the state entering the step and what the gradients read besides (lstm's cells and
   ``o * h(c)``, gru's ``W_hn h + b_hn`` or ``r * h``), and the layer's output for the layer above.
2. Reverse, top down: per layer the reverse walk from the end, as one launch (``rnnb_reverse_walk``) over every
   step: a work-group per block of RNNB_ROWS batch rows and direction (rows share nothing within a step, so no
   group waits for another) runs each step's lstm projection in reverse, pre-activations' gradients (per
   phase: gru without ``linear_before_reset`` takes two) and the gradient of the entering state, dh = dzc W_hh
   of its rows, each weight read once for the block (gpu target: dzc staged in LOCAL tiles; cpu target: one
   item, register blocks). Every field and dtype takes the walk; ``rnn_kernel="step"`` (or a batch past the
   grid) walks a launch per step instead: the cells (``rnnb_backward_cell``, the same cell function), then one
   product of every row, ``dzc W_hh``;
   then every other gradient as a sum over the whole sequence: ``d_w_ih``, the layer input's gradient (the
   layer below's output gradient, or ``d_x``), ``d_w_hh`` and ``d_w_hr`` as gemms with the ``batch*seq``
   rows as the reduction, the bias and peephole sums as ``rnnb_colsum``.

Every reduction runs in a fixed order on one work-item (no atomics), so a thunk gives the same bytes on every
run. The forward's per-step products are body.cl's gemm at the cpu target (its register blocks) and
rnnb_step_product at the gpu target: the recurrent products run at gemm speed instead of one matrix-vector
product per row. Everything kept lives in scratch in the compute type (f32 for 16-bit thunks): every layer's
forward stays until its reverse walk reads it (about ``layers * dirs * batch * seq * (gates + 4) * hidden`` reals).
"""
from __future__ import annotations

from typing import Any

from host_fallback.abi import ELEM_SIZE, complete, forward_thunk
from host_fallback.abi.rnn import layer_input_sizes, output_width

from .arguments import Partial, bind_some, kernel_launch
from .body import gemm, transpose_real
from .core import ARENA, SCRATCH, Buf, Launch, LaunchPlan, Thunk, ceil_to, linear_local, real_size, strided_grid
from .limits import DeviceLimits, add_tuning
from .registry import register
from .rnn import CELL_TEXT, GATES, V2_FIELDS as FORWARD_FIELDS, cell_args, variant
from .rnn_reserve import add_reorder, saved_args, saved_forward
from .signatures import signature

#: The version-2 fields the backward kernels implement, at both targets: the forward's, and the gradients of
#: its optional inputs.
V2_FIELDS = FORWARD_FIELDS | {"d_peepholes", "d_w_hr", "d_h0", "d_c0"}

FAMILY = "rnn_backward"
_NONE = (ARENA, 0)  # a tensor argument a variant does not read

add_tuning(
    FAMILY,
    # the persistent reverse walk (rnnb_reverse_walk): RNNB_ROWS batch rows per work-group, each weight read once
    # for them (at B32 bidirectional 8 groups: both of PoCL's cores busy; measured on PoCL, B32 H256: 8 rows 1.4x
    # faster than 4 at the gpu target, 16 no faster); gpu, RNNB_LANES items staging dzc RNNB_TQ terms at a time in
    # LOCAL memory; cpu, one item whose sums are register blocks of RNNB_ROWS rows x RNNB_JB columns (8 AVX-512
    # vectors in f32; 1.1-1.4x faster than 8 x 8 or 4 x 16)
    gpu={"RNNB_ROWS": 8, "RNNB_LANES": 256, "RNNB_TQ": 256},
    cpu={"RNNB_ROWS": 8, "RNNB_JB": 16},
)


def _scratch(t: Thunk, rs: int) -> tuple[dict[str, int], int, int]:
    """Byte offsets of the scratch regions (per-layer ones as ``name{layer}``), the offset from which they are
    zeroed when ``seq_lens`` leaves padding steps that no launch writes, and the total."""
    op, dirs, gates = t["op"], 2 if t["bidirectional"] else 1, GATES[t["op"]]
    b, s, h, layers, k = t["batch"], t["seq"], t["hidden"], t["num_layers"], output_width(t)
    n, gh = b * s, gates * h
    lstm, gru, proj = op == "lstm", op == "gru", op == "lstm" and t["proj_size"] > 0
    sizes: dict[str, int] = {f"u{l}": dirs * n * gh for l in range(layers)}
    sizes.update(wit=dirs * max(layer_input_sizes(t)) * gh, wht=dirs * k * gh, dh=dirs * b * k, dc=dirs * b * h if lstm else 0,
                 draw=dirs * b * h if proj else 0, direct=dirs * b * h if gru else 0, rec=dirs * b * gh, hs=dirs * b * k)
    zeroed = len(sizes)  # below: what seq_lens leaves unwritten (dzc, rh: the rows of no step, read by the gemms)
    for l in range(layers):
        sizes.update({f"hp{l}": dirs * n * k, f"cp{l}": dirs * n * h if lstm else 0,
                      f"cn{l}": dirs * n * h if lstm else 0, f"hn{l}": dirs * n * h if gru else 0,
                      f"raw{l}": dirs * n * h if proj else 0, f"o{l}": n * dirs * k if l < layers - 1 else 0})
    sizes.update(dz=n * dirs * gh, dzh=n * dirs * gh if gru else 0, dzht=n * dirs * gh if gru else 0, dhin=dirs * n * k if proj else 0,
                 dy=n * dirs * k if layers > 1 else 0, dzc=dirs * b * gh, rh=dirs * b * h if gru else 0)
    offsets, total, zero_from = {}, 0, 0
    for index, (name, count) in enumerate(sizes.items()):
        if index == zeroed:
            zero_from = total
        offsets[name] = total
        total += ceil_to(count * rs, 64)
    return offsets, zero_from, total


class _Backward:
    """The launches of one backward thunk (completed) as they are planned, and what its kernels share."""

    def __init__(self, t: Thunk, lim: DeviceLimits) -> None:
        self.t, self.lim, self.fwd = t, lim, forward_thunk(t)
        fwd, op = self.fwd, self.fwd["op"]
        self.es, self.rs = ELEM_SIZE[t["dtype"]], real_size(t["dtype"])
        self.dirs, self.gh = 2 if fwd["bidirectional"] else 1, GATES[op] * t["hidden"]
        self.b, self.s, self.h, self.k = t["batch"], t["seq"], t["hidden"], output_width(fwd)
        self.n, self.carry, self.layers = self.b * self.s, bool(t["carry"]), t["num_layers"]
        self.lstm, self.gru = op == "lstm", op == "gru"
        self.proj, self.lbr0 = self.lstm and fwd["proj_size"] > 0, self.gru and not fwd["linear_before_reset"]
        self.sc, self.zero_from, self.scratch_bytes = _scratch(fwd, self.rs)
        self.defines = variant(fwd, "RNN_SAVED")
        self.saved = saved_forward(fwd)
        self.lens = (ARENA, t["seq_lens"] or 0)
        self.in_sizes = layer_input_sizes(fwd)
        # per layer: W_ih's elements before it, and its input (arena x, or the layer below's output in scratch)
        self.w_ih = [sum(self.dirs * self.gh * size for size in self.in_sizes[:l]) for l in range(self.layers)]
        self.x_in = [(ARENA, t["x"], False)] + [(SCRATCH, self.sc[f"o{l}"], True) for l in range(self.layers - 1)]
        self.launches: list[Launch] = []

    def add(self, kernel: str, items: int, args: dict[str, Any], per_row: bool = True,
            shared: Partial | None = None) -> None:
        """A launch of ``items`` work-items per (batch row, direction), or of ``items`` in all."""
        local = (linear_local(items, 64), 1, 1)
        size = strided_grid((items, self.b, self.dirs) if per_row else (items, 1, 1), local, self.lim.max_grid)
        self.launches.append(kernel_launch(FAMILY, kernel, self.t["dtype"], size, local, args, target=self.lim.target,
                                           defines=self.defines, shared=shared))

    def ahead(self, kernel: str, args: dict[str, Any]) -> Partial:
        """``kernel``'s arguments that every step of a layer shares (all but the step, and the phase), bound once."""
        walk = dict(B=self.b, S=self.s, H=self.h, reverse=self.fwd["reverse"])
        return bind_some(signature(FAMILY, kernel, self.lim.target), self.t["dtype"], {**walk, **args})

    def scr(self, name: str, extra: int = 0) -> tuple[Buf, int]:
        return (SCRATCH, self.sc[name] + extra)

    def arena(self, field: str, elements: int = 0) -> tuple[Buf, int]:
        return (ARENA, self.t[field] + self.es * elements)

    def peep(self, l: int) -> int | None:
        """Arena offset of the peepholes of layer ``l``, or None."""
        t = self.t
        if not self.lstm or t["peepholes"] is None:
            return None
        return t["peepholes"] + self.es * l * self.dirs * 3 * self.h

    def phases(self) -> range:
        """The launches a cell step takes: two for gru without linear_before_reset (n needs every r * h)."""
        return range(2 if self.lbr0 else 1)


def walk_fits(t: Thunk, lim: DeviceLimits) -> bool:
    """Whether the persistent reverse walk can run ``t``: its blocks of rows within the grid, its work-group
    within the device's."""
    blocks = -(-t["batch"] // lim.tune("RNNB_ROWS"))
    return blocks <= lim.max_grid[1] and (lim.target == "cpu" or lim.tune("RNNB_LANES") <= lim.max_work_group)


def _plan(thunk: Thunk, lim: DeviceLimits, rnn_kernel: str = "auto", **_: object) -> LaunchPlan:
    c = _Backward(complete(thunk), lim)
    persistent = rnn_kernel != "step" and walk_fits(c.t, lim)
    if c.t["seq_lens"] is not None:
        c.add("rnnb_zero", 256, dict(n=(c.scratch_bytes - c.zero_from) // c.rs, zb=(SCRATCH, c.zero_from)), per_row=False)
    for l in range(c.layers):  # forward, bottom up (with a saved forward: its operands of the sums, batch-major)
        (_saved_operands if c.saved else _forward_layer)(c, l)
    for l in reversed(range(c.layers)):  # reverse, top down
        _reverse_layer(c, l, persistent)
        _weight_gradients(c, l)
        _sums(c, l)
        if c.proj:
            _projection_gradient(c, l)
    kind = "saved forward read" if c.saved else "per-step forward recompute"
    reverse = "one persistent reverse launch per layer" if persistent else "per-step reverse"
    return LaunchPlan(tuple(c.launches), c.scratch_bytes, (f"{kind}, then {reverse}",))


def _saved_operands(c: _Backward, l: int) -> None:
    """Layer ``l``'s arrays of the saved forward that the sums over the sequence read (the reverse walk reads the
    rest in place), from time-major into the backward's batch-major scratch, where the recomputing forward keeps
    them: h_prev (d_w_hh), gru's r * h without linear_before_reset, lstm's raw (d_w_hr) and its cells (d_peepholes),
    and the layer's output (the input of the layer above)."""
    ld, n, h, k, fwd = l * c.dirs, c.n, c.h, c.k, c.fwd
    block = (c.saved["y", 1][1] - c.saved["y", 0][1]) // c.rs if ("y", 1) in c.saved else 0  # ld to ld, reals
    forward_program = variant(fwd)  # rnn_reorder is the forward program's: the one its saving forward built
    arrays = [("h_prev", "hp", k)]
    arrays += [("hn", "hn", h)] if c.lbr0 else []
    arrays += [("raw", "raw", h)] if c.proj else []
    arrays += [("c_prev", "cp", h), ("c_new", "cn", h)] if c.peep(l) is not None else []
    for name, kept, width in arrays:
        add_reorder(c.launches, fwd, c.lim, forward_program, width, False, c.dirs, (c.saved[name, ld], block),
                    (c.scr(f"{kept}{l}"), n * width))
    if l < c.layers - 1:
        add_reorder(c.launches, fwd, c.lim, forward_program, c.dirs * k, False, 1, (c.saved["out", l], 0),
                    (c.scr(f"o{l}"), 0))


def _forward_layer(c: _Backward, l: int) -> None:
    """Layer ``l``'s forward: its input projection, then per step (and phase) the recurrent gemm and the cell
    launch keeping what the reverse walk reads (and lstm's projection)."""
    t, lim, dt, gh, ld, in_l, k = c.t, c.lim, c.t["dtype"], c.gh, l * c.dirs, c.in_sizes[l], c.k
    launches = c.launches
    launches.append(transpose_real(lim, dt, gh, in_l, c.dirs, (*c.arena("w_ih", c.w_ih[l]), gh * in_l, in_l, 1),
                                   (SCRATCH, c.sc["wit"])))
    launches.append(gemm(lim, dt, c.n, gh, in_l, c.dirs, (*c.x_in[l], 0, in_l, 1),
                         (SCRATCH, c.sc["wit"], True, in_l * gh, gh, 1), (SCRATCH, c.sc[f"u{l}"], True, c.n * gh, gh),
                         bias=(ARENA, t["b_ih" if c.gru else "bias"] + c.es * ld * gh, gh)))
    h0 = c.arena("h0", ld * c.b * k) if c.carry else _NONE
    c0 = c.arena("c0", ld * c.b * c.h) if c.carry and c.lstm else _NONE
    c.add("rnnb_forward_init", max(c.h, k), dict(B=c.b, S=c.s, H=c.h, K=k, carry=c.carry, reverse=c.fwd["reverse"],
                                                 h0b=h0, c0b=c0, hpb=c.scr(f"hp{l}"), cpb=c.scr(f"cp{l}"),
                                                 hsb=c.scr("hs"), lb=c.lens))
    launches.append(transpose_real(lim, dt, gh, k, c.dirs, (ARENA, t["w_hh"] + c.es * ld * gh * k, gh * k, k, 1),
                                   (SCRATCH, c.sc["wht"])))  # W_hh^T: the step's units read runs of it
    out = dict(ob=c.scr(f"o{l}"), has_out=l < c.layers - 1, o_rs=c.dirs * k)
    kept = dict(hpb=c.scr(f"hp{l}"), cpb=c.scr(f"cp{l}"), cnb=c.scr(f"cn{l}"), hnb=c.scr(f"hn{l}"),
                rwb=c.scr(f"raw{l}"))
    cell = c.ahead("rnnb_forward_step", dict(K=k, ub=c.scr(f"u{l}"), rcb=c.scr("rec"), hsb=c.scr("hs"), rhb=c.scr("rh"),
                                             **kept, **out, **cell_args(c.fwd, c.peep(l))))
    proj = c.ahead("rnnb_forward_proj", dict(P=k, rwb=c.scr(f"raw{l}"), wrb=c.arena("w_hr", ld * k * c.h),
                                             hpb=c.scr(f"hp{l}"), hsb=c.scr("hs"), **out, lb=c.lens)) if c.proj else None
    recurrent = _recurrent_gemms(c, l)
    for step in range(c.s):
        for phase in c.phases():
            launches.append(recurrent[phase])
            c.add("rnnb_forward_step", c.h, dict(t=step, phase=phase), shared=cell)
        if proj is not None:
            c.add("rnnb_forward_proj", k, dict(t=step), shared=proj)


def _step_product(c: _Backward, n: int, k: int, a: tuple[Buf, int, int, int], b: tuple[Buf, int, bool, int, int],
                  d: tuple[Buf, int, int, int], bias: tuple[Buf, int, int] | None = None) -> Launch:
    """A step's recurrent product of every batch row, ``d = a b (+ bias)``: ``n`` columns, ``k`` terms; a and d
    ``(buffer, offset, batch, row)`` element strides, b ``(buffer, offset, is_scratch_real, batch, row)``, bias
    ``(buffer, offset, batch)``. At the cpu target body.cl's gemm (its register blocks); at the gpu target
    rnnb_step_product, whose items of a column and RNN_RB rows fill a device where the gemm's 128-square tiles
    would leave three quarters of each idle at a batch of 32 (and on PoCL run 5x slower)."""
    if c.lim.target == "cpu":
        return gemm(c.lim, c.t["dtype"], c.b, n, k, c.dirs, (*a[:2], True, *a[2:], 1), (*b, 1), (*d[:2], True, *d[2:]),
                    bias=bias)
    rows = c.lim.tune("RNN_RB")
    cbuf, coff, cbs = bias if bias is not None else (*_NONE, 0)
    args = dict(m=c.b, n=n, k=k, ab=a[:2], a_bs=a[2], a_rs=a[3], bb=b[:2], b_real=b[2], b_bs=b[3], b_rs=b[4],
                cb=(cbuf, coff), has_bias=bias is not None, c_bs=cbs, db=d[:2], d_bs=d[2], d_rs=d[3])
    local = (linear_local(n, 64), 1, 1)
    size = strided_grid((n, -(-c.b // rows), c.dirs), local, c.lim.max_grid)
    return kernel_launch(FAMILY, "rnnb_step_product", c.t["dtype"], size, local, args, target=c.lim.target,
                         defines=c.defines)


def _recurrent_gemms(c: _Backward, l: int) -> list[Launch]:
    """Per phase, the product of layer ``l``'s forward step: rec = v W_hh^T + b_hh of every row over the compact v
    (h: hs; RNN_LBR0's phase 1, r * h: rh, into n's block). The same launch at every step."""
    gh, h, k, rs, b, dirs = c.gh, c.h, c.k, c.rs, c.b, c.dirs
    bias = (lambda col: (ARENA, c.t["b_hh"] + c.es * (l * dirs * gh + col), gh)) if c.gru else (lambda col: None)
    blocks = [(0, 2 * h if c.lbr0 else gh, "hs", k)] + ([(2 * h, h, "rh", h)] if c.lbr0 else [])
    return [_step_product(c, cols, width, (*c.scr(v), b * width, width), (*c.scr("wht", col * rs), True, k * gh, gh),
                          (*c.scr("rec", col * rs), b * gh, gh), bias(col)) for col, cols, v, width in blocks]


def _reverse_layer(c: _Backward, l: int, persistent: bool) -> None:
    """Layer ``l``'s reverse walk from the end: per step lstm's projection, the pre-activations' gradients (per
    phase), the entering state's gradient (dh = dzc W_hh); as one persistent launch (rnnb_reverse_walk) or a
    launch of each per step; the states' gradients in and out around it."""
    ld, k, h, b, gh = l * c.dirs, c.k, c.h, c.b, c.gh
    dy = (dict(yb=c.arena("d_dst"), dy_real=False) if l == c.layers - 1 else dict(yb=c.scr("dy"), dy_real=True))
    dy["dy_rs"] = c.dirs * k
    nh, nc = c.dirs * b * k, c.dirs * b * h if c.lstm else 0
    states = dict(h0b=c.arena("d_h0", ld * b * k) if c.carry else _NONE,
                  c0b=c.arena("d_c0", ld * b * h) if c.carry and c.lstm else _NONE)
    grads = dict(dhb=c.scr("dh"), dcb=c.scr("dc"))
    nd = c.dirs * b * h if c.gru else 0
    c.add("rnnb_backward_init", max(nh, nc), dict(nh=nh, nc=nc, nd=nd, carry=c.carry, **states, **grads,
                                                  dsb=c.scr("direct")), per_row=False)
    whh = c.arena("w_hh", ld * gh * k)
    kept = dict(ub=c.scr(f"u{l}"), hpb=c.scr(f"hp{l}"), cpb=c.scr(f"cp{l}"), cnb=c.scr(f"cn{l}"), hnb=c.scr(f"hn{l}"))
    cell = dict(K=k, **dy, **grads, drb=c.scr("draw"), dsb=c.scr("direct"), **kept, whb=whh, dzb=c.scr("dz"),
                dhzb=c.scr("dzh") if c.gru else c.scr("dz"), dz_rs=c.dirs * gh, dzcb=c.scr("dzc"),
                **saved_args(c.saved, ld), **cell_args(c.fwd, c.peep(l)))
    proj = dict(wrb=c.arena("w_hr", ld * k * h), dib=c.scr("dhin")) if c.proj else dict(wrb=_NONE, dib=_NONE)
    if persistent:
        _reverse_walk(c, dict(cell, **proj))
    else:
        _reverse_steps(c, cell, proj, whh)
    if c.carry:
        c.add("rnnb_backward_out", max(nh, nc), dict(nh=nh, nc=nc, nd=nd, B=b, S=c.s, K=k, **grads, dsb=c.scr("direct"),
                                                     **states, lb=c.lens), per_row=False)


def _reverse_walk(c: _Backward, args: dict[str, Any]) -> None:
    """The layer's reverse walk as one launch: a work-group per block of RNNB_ROWS batch rows and direction (at
    the gpu target RNNB_LANES items, at the cpu target one)."""
    local = (c.lim.tune("RNNB_LANES") if c.lim.target == "gpu" else 1, 1, 1)
    size = (local[0], -(-c.b // c.lim.tune("RNNB_ROWS")), c.dirs)
    args = dict(args, B=c.b, S=c.s, H=c.h, reverse=c.fwd["reverse"])
    c.launches.append(kernel_launch(FAMILY, "rnnb_reverse_walk", c.t["dtype"], size, local, args,
                                    target=c.lim.target, defines=c.defines))


def _reverse_steps(c: _Backward, cell: dict[str, Any], proj: dict[str, Any], whh: tuple[Buf, int]) -> None:
    """The layer's reverse walk a step at a time: per step lstm's projection, the cells (per phase), and dh = dzc
    W_hh of every row."""
    k, h, b = c.k, c.h, c.b
    shared = {n: cell[n] for n in ("yb", "dy_real", "dy_rs", "dhb", "drb", "lb")}
    projection = c.ahead("rnnb_backward_proj", dict(P=k, **shared, **proj)) if c.proj else None
    cells = c.ahead("rnnb_backward_cell", cell)
    dh = _step_product(c, k, 2 * h if c.lbr0 else c.gh, (*c.scr("dzc"), b * c.gh, c.gh), (*whh, False, c.gh * k, k),
                       (*c.scr("dh"), b * k, k))  # dh = dzc W_hh, every row
    for step in range(c.s):
        if projection is not None:
            c.add("rnnb_backward_proj", max(h, k), dict(t=step), shared=projection)
        for phase in c.phases():
            c.add("rnnb_backward_cell", h, dict(t=step, phase=phase), shared=cells)
        c.launches.append(dh)


def _weight_gradients(c: _Backward, l: int) -> None:
    """Layer ``l``'s d_w_ih, its input's gradient and d_w_hh: gemms over the batch*seq rows. The weights' take dz
    (and gru's dzh) staged transposed, [D*G*H][B*S], so that each gemm row reads a contiguous run of the
    reduction: read in place they stride over whole rows of dz per term (3-4x slower on PoCL). dz^T goes where
    the layer's u was (the reverse walk, its last reader, is done)."""
    t, lim, dt, gh, ld, in_l, k, n = c.t, c.lim, c.t["dtype"], c.gh, l * c.dirs, c.in_sizes[l], c.k, c.n
    dz_rs, sc, es = c.dirs * gh, c.sc, c.es
    x = (*c.x_in[l], 0, in_l, 1)
    dz_t, dzh_t = sc[f"u{l}"], sc["dzht"] if c.gru else sc[f"u{l}"]
    for src, dst in ((sc["dz"], dz_t),) + (((sc["dzh"], dzh_t),) if c.gru else ()):
        c.launches.append(transpose_real(lim, dt, n, dz_rs, 1, (SCRATCH, src, 0, dz_rs, 1), (SCRATCH, dst), src_real=True))
    c.launches.append(gemm(lim, dt, c.dirs * gh, in_l, n, 1, (SCRATCH, dz_t, True, 0, n, 1), x,
                           (ARENA, t["d_w_ih"] + es * c.w_ih[l], False, 0, in_l)))
    d_in = (ARENA, t["d_x"], False, 0, in_l) if l == 0 else (SCRATCH, sc["dy"], True, 0, in_l)
    c.launches.append(gemm(lim, dt, n, in_l, c.dirs * gh, 1, (SCRATCH, sc["dz"], True, 0, dz_rs, 1),
                           (ARENA, t["w_ih"] + es * c.w_ih[l], False, 0, in_l, 1), d_in))
    d_w_hh = t["d_w_hh"] + es * ld * gh * k
    c.launches.append(gemm(lim, dt, 2 * c.h if c.lbr0 else gh, k, n, c.dirs, (SCRATCH, dzh_t, True, gh * n, n, 1),
                           (SCRATCH, sc[f"hp{l}"], True, n * k, k, 1), (ARENA, d_w_hh, False, gh * k, k)))
    if c.lbr0:  # W_hn multiplies r * h
        c.launches.append(gemm(lim, dt, c.h, c.h, n, c.dirs, (SCRATCH, dzh_t + 2 * c.h * n * c.rs, True, gh * n, n, 1),
                               (SCRATCH, sc[f"hn{l}"], True, n * c.h, c.h, 1),
                               (ARENA, d_w_hh + es * 2 * c.h * k, False, gh * k, k)))


def _sums(c: _Backward, l: int) -> None:
    """Layer ``l``'s bias gradients (and peepholes'): sums over the batch*seq rows (rnnb_colsum). A bias sums dz's
    columns: at the gpu target an item per column, consecutive items reading consecutive reals; at the cpu target
    an item per row of dz^T (_weight_gradients'), a contiguous run (over dz's rows of 8 KiB, 2x the time)."""
    ld, h, gh, n, cols = l * c.dirs, c.h, c.gh, c.n, c.dirs * c.gh
    plain = dict(mb=_NONE, m_bs=0, m_rs=0, has_m=False)
    if c.lim.target == "gpu":
        whole = dict(plain, cols=cols, batch=1, a_bs=0, a_rs=cols, o_bs=0)
        src = {"b": c.scr("dz"), "h": c.scr("dzh")}
    else:
        whole = dict(plain, cols=1, batch=cols, a_bs=n, a_rs=1, o_bs=1)
        src = {"b": c.scr(f"u{l}"), "h": c.scr("dzht")}  # dz^T, dzh^T
    sums = [dict(whole, ab=src["b"], ob=c.arena(f"d_{'b_ih' if c.gru else 'bias'}", ld * gh))]
    if c.gru:
        sums.append(dict(whole, ab=src["h"], ob=c.arena("d_b_hh", ld * gh)))
    if c.peep(l) is not None:  # peepholes i, o, f: dz_i * c_prev, dz_o * c_new, dz_f * c_prev
        for slot, (gate, cell_state) in enumerate(((0, "cp"), (3, "cn"), (1, "cp"))):
            sums.append(dict(cols=h, batch=c.dirs, ab=c.scr("dz", gate * h * c.rs), a_bs=gh, a_rs=cols,
                             mb=c.scr(f"{cell_state}{l}"), m_bs=n * h, m_rs=h, has_m=True,
                             ob=c.arena("d_peepholes", ld * 3 * h + slot * h), o_bs=3 * h))
    for args in sums:
        local = (linear_local(args["cols"], 64), 1, 1)
        size = strided_grid((args["cols"], 1, args["batch"]), local, c.lim.max_grid)
        c.launches.append(kernel_launch(FAMILY, "rnnb_colsum", c.t["dtype"], size, local, dict(args, rows=n),
                                        target=c.lim.target, defines=c.defines))


def _projection_gradient(c: _Backward, l: int) -> None:
    """Layer ``l``'s d_w_hr = dhin^T . raw over the batch*seq rows (lstm with proj_size)."""
    k, h, n = c.k, c.h, c.n
    c.launches.append(gemm(c.lim, c.t["dtype"], k, h, n, c.dirs, (*c.scr("dhin"), True, n * k, 1, k),
                           (*c.scr(f"raw{l}"), True, n * h, h, 1),
                           (*c.arena("d_w_hr", l * c.dirs * k * h), False, k * h, h)))


def unsupported(t: Thunk, lim: DeviceLimits) -> str | None:
    items = lim.tune("GEMM_LX") * lim.tune("GEMM_LY")
    if lim.max_work_group < items:
        return f"{t['op']} needs work-groups of {items} items at the {lim.target} target; the device allows {lim.max_work_group}"
    return None


register(("lstm_backward", "gru_backward", "rnn_backward"), _plan, unsupported, v2_fields=V2_FIELDS, family=FAMILY,
         shared_texts=CELL_TEXT)
