"""Launch geometry of lstm / gru / rnn (ABI.md §3).

Per layer the recurrence runs either as one persistent launch (chosen for up to RNN_PERSIST_ROWS
(batch row, direction) pairs) or as one launch per timestep (chosen otherwise). Both first project
every timestep of both directions at once (but for the cpu persistent kernel): W_ih is staged
transposed (compute type) and one gemm writes ``xw`` (compute type, bias folded in except GRU's
``b_hh``); each step of the per-step kernel then reads W_hh staged transposed. The persistent kernel's shape is per target: gpu, a work-group of ``hidden`` items
per batch row keeps h in local memory (never chosen by default: it cannot fill a GPU); cpu, one
work-item per (batch row, direction) runs every step over W_ih and W_hh staged transposed, projecting
the input itself, so a layer is one launch (a decode step: one launch per layer and no gemm). The
per-step kernel's shape is per target too: cpu, each item computes RNN_JB_G<gates> units for
RNN_RB_G<gates> batch rows (a register block); gpu, a work-group of RNN_GU consecutive units x RNN_GK
slices of the reduction for RNN_RB batch rows, the slices summed through LOCAL memory, so that B64
H1024 exposes over a thousand work-groups. Layers below the last write their output to scratch in
the compute type. Every recurrent launch of a thunk is built as its op's program variant
(``RNN_GATES``, ``limits.gate_variant``), so the kernels take no op or gate count at run time.
"""
from __future__ import annotations

from host_fallback.arena import ELEM_SIZE
from host_fallback.fields import ACTIVATION_SLOTS, complete
from host_fallback.layout import output_width, regions

from .activation_codes import ACTIVATION_CODES
from .body import gemm, transpose_real
from .core import (ARENA, SCRATCH, Launch, LaunchPlan, Thunk, ceil_to, grid, i32, i64, linear_local, real,
                   real_size, strided_grid)
from .limits import DeviceLimits, gate_variant
from .registry import register

GATES = {"lstm": 4, "gru": 3, "rnn": 1}  # op -> gate count (ABI.md §3's G)

#: The version-2 fields (ABI.md §8) the recurrent kernels implement, at both targets.
V2_FIELDS = frozenset({"seq_lens", "reverse", "clip", "activations", "linear_before_reset", "peepholes",
                       "input_forget", "proj_size", "w_hr"})

_SLOT_NAMES = "FGH"  # the activation slots f, g, h (RNN_ACT_<slot><dir>)
_V1_ACTIVATIONS = {"lstm": ("sigmoid", "tanh", "tanh"), "gru": ("sigmoid", "tanh"), "rnn": ("tanh",)}


def variant(t: Thunk) -> tuple[tuple[str, int], ...]:
    """The program variant of every recurrent launch of the completed thunk ``t``: ``RNN_GATES``, then only what
    differs from ABI.md §3 — each slot's activation code (``RNN_ACT_F0``.., direction 1's only where it differs
    from direction 0's) and a flag per optional field in use (kernels/rnn_cell.cl's RNN_LENS, RNN_CLIP, RNN_PEEP,
    RNN_IFG, RNN_PROJ, RNN_LBR0). A version-1 thunk gets ``gate_variant`` (and rnn's relu as ``RNN_ACT_F0``)."""
    op, dirs = t["op"], 2 if t["bidirectional"] else 1
    slots = ACTIVATION_SLOTS[op]
    codes = [ACTIVATION_CODES[a[0]] for a in t["activations"]]
    defines = list(gate_variant(GATES[op]))
    for k in range(slots):
        if codes[k] != ACTIVATION_CODES[_V1_ACTIVATIONS[op][k]]:
            defines.append((f"RNN_ACT_{_SLOT_NAMES[k]}0", codes[k]))
        if dirs == 2 and codes[slots + k] != codes[k]:
            defines.append((f"RNN_ACT_{_SLOT_NAMES[k]}1", codes[slots + k]))
    flags = {"RNN_LENS": t["seq_lens"] is not None, "RNN_CLIP": t["clip"] > 0,
             "RNN_PEEP": op == "lstm" and t["peepholes"] is not None, "RNN_IFG": op == "lstm" and t["input_forget"],
             "RNN_PROJ": op == "lstm" and t["proj_size"] > 0, "RNN_LBR0": op == "gru" and not t["linear_before_reset"]}
    return tuple(defines) + tuple((name, 1) for name, on in flags.items() if on)


def cell_args(t: Thunk, lens: tuple, peep_off: int | None) -> tuple:
    """The trailing arguments of rnn_step and rnn_persist: seq_lens, the layer's peepholes, clip, and alpha, beta
    of the slots f, g, h of direction 0 then 1 (unused slots and directions 0)."""
    dt, slots = t["dtype"], ACTIVATION_SLOTS[t["op"]]
    acts = list(t["activations"])
    ab: list[float] = []
    for d in range(2):
        mine = acts[d * slots:(d + 1) * slots] if d * slots < len(acts) else [("", 0.0, 0.0)] * slots
        mine += [("", 0.0, 0.0)] * (3 - slots)
        ab += [v for _, a, b in mine for v in (a, b)]
    peep = (ARENA, i64(0)) if peep_off is None else (ARENA, i64(peep_off))
    return lens + peep + (real(dt, t["clip"]),) + tuple(real(dt, v) for v in ab)


def persistent_fits(t: Thunk, lim: DeviceLimits) -> bool:
    """Whether the persistent kernel can run ``t``: at the gpu target one work-group of ``hidden`` items
    holds a direction's h in local memory, for the fields that need no other unit's value within a step (no
    proj_size, gru's linear_before_reset kept); at the cpu target one item keeps it in scratch. One group per
    batch row (and direction)."""
    if lim.target == "cpu":
        fits = True
    else:
        t = complete(t)
        per_unit = not t.get("proj_size") and t.get("linear_before_reset", True)
        fits = per_unit and t["hidden"] <= min(lim.max_work_group, lim.tune("RNN_PERSIST_MAX"))
    return fits and t["batch"] <= lim.max_grid[1]


def persistent_wins(t: Thunk, lim: DeviceLimits) -> bool:
    """Above RNN_PERSIST_ROWS (batch row, direction) pairs the per-step kernel, which shares each W_hh
    row among several batch rows, beats the persistent one, which streams all of W_hh once per pair and
    step (cpu target, PoCL on 2 cores: the persistent kernel ~1.9x faster for a decode step at one pair,
    faster or even at two, slower from four)."""
    dirs = 2 if t["bidirectional"] else 1
    return persistent_fits(t, lim) and t["batch"] * dirs <= lim.tune("RNN_PERSIST_ROWS")


def _scratch(lim: DeviceLimits, t: Thunk, rs: int) -> tuple[dict[str, int], int]:
    """Byte offsets of the scratch regions, and the total. Every layer stages its weights in its own
    slice of ``wt``, ``wit`` and ``whr`` (``wt_layer``, ``wit_layer``, ``whr_layer`` bytes apart), so that the
    staged weights of all layers stay valid together between runs (``LaunchPlan.staging``). ``wit`` holds W_ih^T
    either as the gemm's [dirs][in][gates*h] or padded like W_hh^T ([dirs][in][wt_row], the fused kernel).
    ``aux`` holds lstm's o * h(c) before its projection, or gru's r * h between the phases of a step; ``ord``
    and ``cnt`` the rows in order of their lengths (int32, with seq_lens)."""
    dirs, gates = 2 if t["bidirectional"] else 1, GATES[t["op"]]
    b, s, h, i, layers, k = t["batch"], t["seq"], t["hidden"], t["input_size"], t["num_layers"], output_width(t)
    jb, wpad = lim.tune("RNN_JB"), lim.tune("RNN_WPAD")
    wt_row = gates * ceil_to(h, jb) + wpad
    proj = t["op"] == "lstm" and t["proj_size"] > 0
    lbr0 = t["op"] == "gru" and not t["linear_before_reset"]
    wt_layer, wit_layer = ceil_to(dirs * k * wt_row * rs, 64), ceil_to(dirs * wt_row * max(i, dirs * k) * rs, 64)
    whr_layer = ceil_to(dirs * h * (ceil_to(k, jb) + wpad) * rs, 64) if proj else 0
    lens = t["seq_lens"] is not None
    sizes = {"xw": dirs * b * s * gates * h * rs, "lo": b * s * dirs * k * rs if layers > 1 else 0,
             "h": 2 * dirs * b * k * rs, "c": dirs * b * h * rs, "aux": dirs * b * h * rs if proj or lbr0 else 0,
             "wt": layers * wt_layer, "wit": layers * wit_layer, "whr": layers * whr_layer,
             "ord": 4 * b if lens else 0, "cnt": 4 * (s + 1) if lens else 0}
    offsets, total = {"wt_layer": wt_layer, "wit_layer": wit_layer, "whr_layer": whr_layer}, 0
    for name, nbytes in sizes.items():
        offsets[name] = total
        total += ceil_to(nbytes, 64)
    return offsets, total


def _plan(t: Thunk, lim: DeviceLimits, rnn_kernel: str = "auto", **_: object) -> LaunchPlan:
    t = complete(t)
    gates = GATES[t["op"]]
    defines = variant(t)  # every rnn launch of the thunk: the op's program
    dt, es, rs = t["dtype"], ELEM_SIZE[t["dtype"]], real_size(t["dtype"])
    b, s, h, layers, k = t["batch"], t["seq"], t["hidden"], t["num_layers"], output_width(t)
    dirs = 2 if t["bidirectional"] else 1
    carry, gh = bool(t["carry"]), gates * h
    proj = t["op"] == "lstm" and t["proj_size"] > 0
    lbr0 = t["op"] == "gru" and not t["linear_before_reset"]
    persistent = persistent_fits(t, lim) and (rnn_kernel == "persistent" or (rnn_kernel == "auto" and persistent_wins(t, lim)))
    fused = persistent and lim.target == "cpu"  # the cpu persistent kernel projects the input itself
    sc, scratch_bytes = _scratch(lim, t, rs)
    jb, wpad = lim.tune("RNN_JB"), lim.tune("RNN_WPAD")
    hp, kp = ceil_to(h, jb), ceil_to(k, jb)
    bias_field = "b_ih" if t["op"] == "gru" else "bias"
    lens = (ARENA, i64(t["seq_lens"] or 0))
    launches: list[Launch] = []
    staging: list[int] = []  # the weight-staging launches (LaunchPlan.staging)

    def add(kernel: str, size: tuple, local: tuple, args: tuple) -> None:
        launches.append(Launch("rnn", kernel, dt, size, local, args, target=lim.target, defines=defines))

    def stage(ng: int, units: int, units_p: int, rows: int, src: tuple, dst: tuple) -> None:
        """W (ng*units rows of ``rows``) transposed into dst, padded (rnn_w_t), as a staging launch."""
        tloc = (linear_local(ng * units_p, 64), 1, 1)
        staging.append(len(launches))
        add("rnn_w_t", strided_grid((ng * units_p, rows, dirs), tloc, lim.max_grid), tloc,
            (i32(ng), i64(units), i64(units_p), i64(rows)) + src + dst)

    order = (SCRATCH, i64(sc["ord"]))
    if t["seq_lens"] is not None:  # the rows longest first, for every layer's steps
        add("rnn_order", (1,), (1,), (i64(b), i64(s)) + lens + order + (SCRATCH, i64(sc["cnt"])))
    w_ih = t["w_ih"]
    for layer in range(layers):
        in_l = t["input_size"] if layer == 0 else dirs * k
        x_buf, x_off, x_real = (ARENA, t["x"], False) if layer == 0 else (SCRATCH, sc["lo"], True)
        wit = sc["wit"] + layer * sc["wit_layer"]
        bias = t[bias_field] + es * layer * dirs * gh
        if fused:  # W_ih^T padded like W_hh^T; the recurrence projects the input itself
            stage(gates, h, hp, in_l, (ARENA, i64(w_ih)), (SCRATCH, i64(wit)))
        else:  # B(kk, col) = W_ih[col, kk], staged as [dirs][in_l][gh] so the gemm reads B's columns contiguously
            staging.append(len(launches))
            launches.append(transpose_real(lim, dt, gh, in_l, dirs, (ARENA, w_ih, gh * in_l, in_l, 1), (SCRATCH, wit)))
            launches.append(gemm(
                lim, dt, b * s, gh, in_l, dirs, (x_buf, x_off, x_real, 0, in_l, 1),
                (SCRATCH, wit, True, in_l * gh, gh, 1),
                (SCRATCH, sc["xw"], True, b * s * gh, gh),
                bias=(ARENA, bias, gh),
            ))
        w_ih += es * dirs * gh * in_l
        last = layer == layers - 1
        out = (ARENA, i64(t["dst"]), i32(0)) if last else (SCRATCH, i64(sc["lo"]), i32(1))
        if t["seq_lens"] is not None:  # zeros past each row's length, written once; the steps never touch them
            ploc = (linear_local(dirs * k, 256), 1, 1)  # an item walks its column's padding steps
            add("rnn_pad", strided_grid((dirs * k, 1, b), ploc, lim.max_grid), ploc,
                (i64(b), i64(s), i64(dirs * k)) + out + lens)
        whh = (ARENA, i64(t["w_hh"] + es * layer * dirs * gh * k))
        bhh = (ARENA, i64(t["b_hh"] + es * layer * dirs * gh), i32(1)) if t["op"] == "gru" else (ARENA, i64(0), i32(0))
        h0 = (ARENA, i64(t["h0"] + es * layer * dirs * b * k)) if carry else (ARENA, i64(0))
        c0 = (ARENA, i64(t["c0"] + es * layer * dirs * b * h)) if carry and t["op"] == "lstm" else (ARENA, i64(0))
        peep = None if t["op"] != "lstm" or t["peepholes"] is None else t["peepholes"] + es * layer * dirs * 3 * h
        cell = cell_args(t, lens, peep)
        tail = out + (i64(dirs * k),)
        wt = (SCRATCH, i64(sc["wt"] + layer * sc["wt_layer"]))
        whr = (SCRATCH, i64(sc["whr"] + layer * sc["whr_layer"]))
        if not persistent or fused:  # W_hh^T
            stage(gates, h, hp, k, whh, wt)
        if proj:  # W_hr^T [dirs][h][kp + wpad]
            stage(1, k, kp, h, (ARENA, i64(t["w_hr"] + es * layer * dirs * k * h)), whr)
        nh, nc = dirs * b * k, dirs * b * h
        cs, aux = (SCRATCH, i64(sc["c"])), (SCRATCH, i64(sc["aux"]))
        hbuf = [(SCRATCH, i64(sc["h"])), (SCRATCH, i64(sc["h"] + nh * rs))]
        if persistent:
            size, local = _persist_geometry(lim, b, h, dirs)
            if fused:
                x_in = (i64(in_l), x_buf, i64(x_off), i32(x_real), SCRATCH, i64(wit), ARENA, i64(bias)) + whr
                args = ((i64(b), i64(s), i64(h), i64(k), i32(carry), i32(t["reverse"]), SCRATCH, i64(sc["xw"])) + wt
                        + bhh + h0 + c0 + hbuf[0] + hbuf[1] + cs + aux + x_in + tail + cell)
            else:
                args = ((i64(b), i64(s), i64(h), i32(carry), i32(t["reverse"]), SCRATCH, i64(sc["xw"])) + whh + bhh
                        + h0 + c0 + tail + cell)
            add("rnn_persist", size, local, args)
            continue
        lin = (linear_local(max(nh, nc), 256),)
        add("rnn_state_in", grid((max(nh, nc),), lin), lin, (i32(carry), i64(nh), i64(nc)) + h0 + c0 + hbuf[0] + cs)
        size, local = _step_geometry(lim, gates, b, h, dirs)
        psize, ploc = _proj_geometry(lim, b, k, dirs)
        for step in range(s):
            hin, hout = hbuf[step % 2], hbuf[1 - step % 2]
            for phase in range(2 if lbr0 else 1):
                args = ((i64(b), i64(s), i64(h), i64(k), i64(step), i32(t["reverse"]), i32(phase), SCRATCH, i64(sc["xw"]))
                        + wt + bhh + hin + hout + cs + aux + tail + order + cell)
                add("rnn_step", size, local, args)
            if proj:
                add("rnn_proj", psize, ploc, (i64(b), i64(s), i64(h), i64(k), i64(step), i32(t["reverse"])) + aux + whr
                    + hout + tail + order + lens)
        if carry:
            add("rnn_state_out", grid((max(nh, nc),), lin), lin,
                (i64(nh), i64(nc), i64(b), i64(s), i64(k)) + hbuf[0] + hbuf[1] + cs + h0 + c0 + lens)
    weights = tuple((r.offset, r.nbytes) for r in regions(t) if r.field in ("w_ih", "w_hh", "w_hr"))
    kind = ("persistent, input projected in the recurrence" if fused else "persistent") if persistent else "per-step"
    return LaunchPlan(tuple(launches), scratch_bytes, (kind,), tuple(staging), weights)


def _persist_geometry(lim: DeviceLimits, b: int, h: int, dirs: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Global and local size of the persistent kernel: at the gpu target a group of ``h`` items per batch
    row, at the cpu target a group of one item per batch row."""
    if lim.target == "gpu":
        return (h, b, dirs), (h, 1, 1)
    return (1, b, dirs), (1, 1, 1)


def _proj_geometry(lim: DeviceLimits, b: int, p: int, dirs: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Global and local size of lstm's projection (rnn_proj): at the gpu target an item per (p, batch row), at the
    cpu target a register block of RNN_JB_G1 values of p for RNN_RB_G1 rows per item."""
    if lim.target == "gpu":
        local = (linear_local(p, 64), 1, 1)
        return strided_grid((p, b, dirs), local, lim.max_grid), local
    units = -(-p // lim.tune("RNN_JB_G1"))
    local = (linear_local(units), 1, 1)
    return grid((units, -(-b // lim.tune("RNN_RB_G1")), dirs), local), local


def _step_geometry(lim: DeviceLimits, gates: int, b: int, h: int, dirs: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Global and local size of the per-step kernel at the device's target."""
    if lim.target == "gpu":  # row blocks past grid y are strided over by whole work-groups
        gu, gk = lim.tune("RNN_GU"), lim.tune("RNN_GK")
        row_blocks = min(-(-b // lim.tune("RNN_RB")), lim.max_grid[1])
        return (ceil_to(h, gu), row_blocks * gk, dirs), (gu, gk, 1)
    units = -(-h // lim.tune(f"RNN_JB_G{gates}"))
    local = (linear_local(units), 1, 1)
    return grid((units, -(-b // lim.tune(f"RNN_RB_G{gates}")), dirs), local), local


def unsupported(t: Thunk, lim: DeviceLimits) -> str | None:
    # the per-step kernel has no shape limit; the persistent one is chosen only when it fits
    items = lim.tune("GEMM_LX") * lim.tune("GEMM_LY")
    if lim.target == "gpu":
        items = max(items, lim.tune("RNN_GU") * lim.tune("RNN_GK"))
    if lim.max_work_group < items:
        return f"{t['op']} needs work-groups of {items} items at the {lim.target} target; the device allows {lim.max_work_group}"
    return None


register(("lstm", "gru", "rnn"), _plan, unsupported, v2_fields=V2_FIELDS, family="rnn")


#: the recurrent kernel choices (the ``rnn_kernel`` run option): by shape, or one forced
RNN_KERNELS = ("auto", "persistent", "step")
