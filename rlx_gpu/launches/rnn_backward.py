"""Launch geometry of lstm_backward / gru_backward / rnn_backward (ABI.md §9), from kernels/rnn_backward.cl.

A backward thunk runs in two walks, every launch built as its forward's program variant (``rnn.variant``):

1. Forward, bottom up: per layer the input projection (W_ih staged transposed, one gemm over every timestep
   of both directions, bias folded in) and W_hh staged transposed, then one launch per step (two for gru without
   ``linear_before_reset``, and lstm's projection after each) that keeps, per step, the gate
   pre-activations, the state entering the step and what the gradients read besides (lstm's cells and
   ``o * h(c)``, gru's ``W_hn h + b_hn`` or ``r * h``), and the layer's output for the layer above.
2. Reverse, top down: per layer, per step from the end, the pre-activations' gradients (``rnnb_backward_cell``)
   and the gradient of the entering state (``rnnb_backward_dh``: one matrix-vector product by W_hh per row);
   then every other gradient as a sum over the whole sequence: ``d_w_ih``, the layer input's gradient (the
   layer below's output gradient, or ``d_x``), ``d_w_hh`` and ``d_w_hr`` as gemms with the ``batch*seq``
   rows as the reduction, the bias and peephole sums as ``rnnb_colsum``.

Every reduction runs in a fixed order on one work-item (no atomics), so a thunk gives the same bytes on every
run. Everything kept lives in scratch in the compute type (f32 for 16-bit thunks): every layer's forward stays
until its reverse walk reads it (about ``layers * dirs * batch * seq * (gates + 4) * hidden`` reals).
"""
from __future__ import annotations

from host_fallback.arena import ELEM_SIZE
from host_fallback.fields import complete
from host_fallback.layout import forward_thunk, layer_input_sizes, output_width

from .body import gemm, transpose_real
from .core import ARENA, SCRATCH, Launch, LaunchPlan, Thunk, ceil_to, i32, i64, linear_local, real_size, strided_grid
from .limits import DeviceLimits
from .registry import register
from .rnn import GATES, V2_FIELDS as FORWARD_FIELDS, cell_args, variant

#: The version-2 fields the backward kernels implement, at both targets: the forward's, and the gradients of
#: its optional inputs.
V2_FIELDS = FORWARD_FIELDS | {"d_peepholes", "d_w_hr", "d_h0", "d_c0"}

FAMILY = "rnn_backward"
_NONE = (ARENA, i64(0))  # a tensor argument a variant does not read


def _scratch(t: Thunk, rs: int) -> tuple[dict[str, int], int, int]:
    """Byte offsets of the scratch regions (per-layer ones as ``name{layer}``), the offset from which they are
    zeroed when ``seq_lens`` leaves padding steps that no launch writes, and the total."""
    op, dirs, gates = t["op"], 2 if t["bidirectional"] else 1, GATES[t["op"]]
    b, s, h, layers, k = t["batch"], t["seq"], t["hidden"], t["num_layers"], output_width(t)
    n, gh = b * s, gates * h
    lstm, gru, proj = op == "lstm", op == "gru", op == "lstm" and t["proj_size"] > 0
    sizes: dict[str, int] = {f"u{l}": dirs * n * gh for l in range(layers)}
    sizes.update(wit=dirs * max(layer_input_sizes(t)) * gh, wht=dirs * k * gh, dh=dirs * b * k, dc=dirs * b * h if lstm else 0,
                 draw=dirs * b * h if proj else 0, direct=dirs * b * h if gru else 0)
    zeroed = len(sizes)
    for l in range(layers):
        sizes.update({f"hp{l}": dirs * n * k, f"cp{l}": dirs * n * h if lstm else 0,
                      f"cn{l}": dirs * n * h if lstm else 0, f"hn{l}": dirs * n * h if gru else 0,
                      f"raw{l}": dirs * n * h if proj else 0, f"o{l}": n * dirs * k if l < layers - 1 else 0})
    sizes.update(dz=n * dirs * gh, dzh=n * dirs * gh if gru else 0, dhin=dirs * n * k if proj else 0,
                 dy=n * dirs * k if layers > 1 else 0)
    offsets, total, zero_from = {}, 0, 0
    for index, (name, count) in enumerate(sizes.items()):
        if index == zeroed:
            zero_from = total
        offsets[name] = total
        total += ceil_to(count * rs, 64)
    return offsets, zero_from, total


def _plan(thunk: Thunk, lim: DeviceLimits, **_: object) -> LaunchPlan:
    t = complete(thunk)
    fwd = forward_thunk(t)
    op, dt = fwd["op"], t["dtype"]
    es, rs = ELEM_SIZE[dt], real_size(dt)
    gates, dirs = GATES[op], 2 if fwd["bidirectional"] else 1
    b, s, h, layers, k = t["batch"], t["seq"], t["hidden"], t["num_layers"], output_width(fwd)
    n, gh, carry = b * s, gates * h, bool(t["carry"])
    lstm, gru = op == "lstm", op == "gru"
    proj, lbr0 = lstm and fwd["proj_size"] > 0, gru and not fwd["linear_before_reset"]
    sc, zero_from, scratch_bytes = _scratch(fwd, rs)
    defines = variant(fwd)
    lens = (ARENA, i64(t["seq_lens"] or 0))
    walk = (i64(b), i64(s), i64(h))
    launches: list[Launch] = []

    def add(kernel: str, items: int, args: tuple, rows: int = b, depth: int = dirs) -> None:
        local = (linear_local(items, 64), 1, 1)
        launches.append(Launch(FAMILY, kernel, dt, strided_grid((items, rows, depth), local, lim.max_grid), local,
                               args, target=lim.target, defines=defines))

    def scr(name: str, extra: int = 0) -> tuple:
        return (SCRATCH, i64(sc[name] + extra))

    def arena(field: str, elements: int = 0) -> tuple:
        return (ARENA, i64(t[field] + es * elements))

    if t["seq_lens"] is not None:
        add("rnnb_zero", 256, (i64((scratch_bytes - zero_from) // rs), SCRATCH, i64(zero_from)), rows=1, depth=1)
    bias_field = "b_ih" if gru else "bias"
    w_ih, in_sizes = [], layer_input_sizes(fwd)
    for l, in_l in enumerate(in_sizes):
        w_ih.append(sum(dirs * gh * size for size in in_sizes[:l]))
    x_in = [(ARENA, t["x"], False)] + [(SCRATCH, sc[f"o{l}"], True) for l in range(layers - 1)]

    # forward, bottom up
    for l, in_l in enumerate(in_sizes):
        ld = l * dirs
        launches.append(transpose_real(lim, dt, gh, in_l, dirs, (ARENA, t["w_ih"] + es * w_ih[l], gh * in_l, in_l, 1),
                                       (SCRATCH, sc["wit"])))
        xb, xo, xr = x_in[l]
        launches.append(gemm(lim, dt, n, gh, in_l, dirs, (xb, xo, xr, 0, in_l, 1), (SCRATCH, sc["wit"], True, in_l * gh, gh, 1),
                             (SCRATCH, sc[f"u{l}"], True, n * gh, gh), bias=(ARENA, t[bias_field] + es * ld * gh, gh)))
        h0 = arena("h0", ld * b * k) if carry else _NONE
        c0 = arena("c0", ld * b * h) if carry and lstm else _NONE
        add("rnnb_forward_init", max(h, k), walk + (i64(k), i32(carry), i32(fwd["reverse"])) + h0 + c0
            + scr(f"hp{l}") + scr(f"cp{l}") + lens)
        launches.append(transpose_real(lim, dt, gh, k, dirs, (ARENA, t["w_hh"] + es * ld * gh * k, gh * k, k, 1),
                                       (SCRATCH, sc["wht"])))  # W_hh^T: the step's units read runs of it
        bhh = arena("b_hh", ld * gh) + (i32(1),) if gru else _NONE + (i32(0),)
        peep = t["peepholes"] + es * ld * 3 * h if lstm and t["peepholes"] is not None else None
        cell = cell_args(fwd, lens, peep)
        out = scr(f"o{l}") + (i32(l < layers - 1), i64(dirs * k))
        kept = scr(f"hp{l}") + scr(f"cp{l}") + scr(f"cn{l}") + scr(f"hn{l}") + scr(f"raw{l}")
        for step in range(s):
            for phase in range(2 if lbr0 else 1):
                add("rnnb_forward_step", h, walk + (i64(k), i64(step), i32(fwd["reverse"]), i32(phase)) + scr(f"u{l}")
                    + scr("wht") + bhh + kept + out + cell)
            if proj:
                add("rnnb_forward_proj", k, walk + (i64(k), i64(step), i32(fwd["reverse"])) + scr(f"raw{l}")
                    + arena("w_hr", ld * k * h) + scr(f"hp{l}") + out + lens)

    # reverse, top down
    dz_rs = dirs * gh
    for l in reversed(range(layers)):
        ld, in_l = l * dirs, in_sizes[l]
        dy = (arena("d_dst") + (i32(0),) if l == layers - 1 else scr("dy") + (i32(1),)) + (i64(dirs * k),)
        nh, nc = dirs * b * k, dirs * b * h if lstm else 0
        d_h0 = arena("d_h0", ld * b * k) if carry else _NONE
        d_c0 = arena("d_c0", ld * b * h) if carry and lstm else _NONE
        add("rnnb_backward_init", max(nh, nc), (i64(nh), i64(nc), i32(carry)) + d_h0 + d_c0 + scr("dh") + scr("dc"),
            rows=1, depth=1)
        whh = arena("w_hh", ld * gh * k)
        peep = t["peepholes"] + es * ld * 3 * h if lstm and t["peepholes"] is not None else None
        cell = cell_args(fwd, lens, peep)
        dzh = scr("dzh") if gru else scr("dz")
        for step in range(s):
            head = walk + (i64(k), i64(step), i32(fwd["reverse"]))
            if proj:
                add("rnnb_backward_proj", max(h, k), head + dy + scr("dh") + arena("w_hr", ld * k * h) + scr("dhin")
                    + scr("draw") + lens)
            for phase in range(2 if lbr0 else 1):
                add("rnnb_backward_cell", h, head + (i32(phase),) + dy + scr("dh") + scr("dc") + scr("draw")
                    + scr("direct") + scr(f"u{l}") + scr(f"hp{l}") + scr(f"cp{l}") + scr(f"cn{l}") + scr(f"hn{l}")
                    + whh + scr("dz") + dzh + (i64(dz_rs),) + cell)
            add("rnnb_backward_dh", k, head + (i64(2 * h if lbr0 else gh),) + dzh + (i64(dz_rs),) + whh
                + scr("direct") + (i32(gru),) + scr("dh") + lens)
        if carry:
            add("rnnb_backward_out", max(nh, nc), (i64(nh), i64(nc)) + scr("dh") + scr("dc") + d_h0 + d_c0,
                rows=1, depth=1)
        xb, xo, xr = x_in[l]
        w_ih_l = t["w_ih"] + es * w_ih[l]
        launches.append(gemm(lim, dt, dirs * gh, in_l, n, 1, (SCRATCH, sc["dz"], True, 0, 1, dz_rs), (xb, xo, xr, 0, in_l, 1),
                             (ARENA, t["d_w_ih"] + es * w_ih[l], False, 0, in_l)))
        d_in = (ARENA, t["d_x"], False, 0, in_l) if l == 0 else (SCRATCH, sc["dy"], True, 0, in_l)
        launches.append(gemm(lim, dt, n, in_l, dirs * gh, 1, (SCRATCH, sc["dz"], True, 0, dz_rs, 1),
                             (ARENA, w_ih_l, False, 0, in_l, 1), d_in))
        d_w_hh = t["d_w_hh"] + es * ld * gh * k
        hidden_rows = 2 * h if lbr0 else gh
        launches.append(gemm(lim, dt, hidden_rows, k, n, dirs, (dzh[0], int(dzh[1]), True, gh, 1, dz_rs),
                             (SCRATCH, sc[f"hp{l}"], True, n * k, k, 1), (ARENA, d_w_hh, False, gh * k, k)))
        if lbr0:  # W_hn multiplies r * h
            launches.append(gemm(lim, dt, h, h, n, dirs, (SCRATCH, sc["dzh"] + 2 * h * rs, True, gh, 1, dz_rs),
                                 (SCRATCH, sc[f"hn{l}"], True, n * h, h, 1), (ARENA, d_w_hh + es * 2 * h * k, False, gh * k, k)))
        sums = [(scr("dz"), dirs * gh, 1, 0, _NONE + (i64(0), i64(0), i32(0)), arena(f"d_{bias_field}", ld * gh), 0)]
        if gru:
            sums.append((scr("dzh"), dirs * gh, 1, 0, _NONE + (i64(0), i64(0), i32(0)), arena("d_b_hh", ld * gh), 0))
        if peep is not None:  # peepholes i, o, f: dz_i * c_prev, dz_o * c_new, dz_f * c_prev
            for slot, (gate, cell_state) in enumerate(((0, "cp"), (3, "cn"), (1, "cp"))):
                sums.append((scr("dz", gate * h * rs), h, dirs, gh, scr(f"{cell_state}{l}") + (i64(n * h), i64(h), i32(1)),
                             arena("d_peepholes", ld * 3 * h + slot * h), 3 * h))
        for a, cols, batch, a_bs, m, o, o_bs in sums:
            add("rnnb_colsum", cols, (i64(n), i64(cols), i64(batch)) + a + (i64(a_bs), i64(dz_rs)) + m + o + (i64(o_bs),),
                rows=1, depth=1)
        if proj:
            launches.append(gemm(lim, dt, k, h, n, dirs, (SCRATCH, sc["dhin"], True, n * k, 1, k),
                                 (SCRATCH, sc[f"raw{l}"], True, n * h, h, 1),
                                 (ARENA, t["d_w_hr"] + es * ld * k * h, False, k * h, h)))
    return LaunchPlan(tuple(launches), scratch_bytes, ("per-step forward recompute, then per-step reverse",))


def unsupported(t: Thunk, lim: DeviceLimits) -> str | None:
    items = lim.tune("GEMM_LX") * lim.tune("GEMM_LY")
    if lim.max_work_group < items:
        return f"{t['op']} needs work-groups of {items} items at the {lim.target} target; the device allows {lim.max_work_group}"
    return None


register(("lstm_backward", "gru_backward", "rnn_backward"), _plan, unsupported, v2_fields=V2_FIELDS, family=FAMILY)
