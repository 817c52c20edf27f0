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

from host_fallback.layout import regions

from .body import gemm, transpose_real
from .core import ARENA, SCRATCH, Launch, LaunchPlan, Thunk, ceil_to, grid, i32, i64, linear_local, real_size, strided_grid
from .limits import DeviceLimits, gate_variant

GATES = {"lstm": 4, "gru": 3, "rnn": 1}  # op -> gate count (ABI.md §3's G)


def persistent_fits(t: Thunk, lim: DeviceLimits) -> bool:
    """Whether the persistent kernel can run ``t``: at the gpu target one work-group of ``hidden`` items
    holds a direction's h in local memory; at the cpu target one item keeps it in scratch. One group per
    batch row (and direction)."""
    fits = lim.target == "cpu" or t["hidden"] <= min(lim.max_work_group, lim.tune("RNN_PERSIST_MAX"))
    return fits and t["batch"] <= lim.max_grid[1]


def persistent_wins(t: Thunk, lim: DeviceLimits) -> bool:
    """Above RNN_PERSIST_ROWS (batch row, direction) pairs the per-step kernel, which shares each W_hh
    row among several batch rows, beats the persistent one, which streams all of W_hh once per pair and
    step (cpu target, PoCL on 2 cores: the persistent kernel ~1.9x faster for a decode step at one pair,
    faster or even at two, slower from four)."""
    dirs = 2 if t["bidirectional"] else 1
    return persistent_fits(t, lim) and t["batch"] * dirs <= lim.tune("RNN_PERSIST_ROWS")


def _scratch(lim: DeviceLimits, dirs: int, b: int, s: int, h: int, i: int, gates: int, layers: int,
             rs: int) -> tuple[dict[str, int], int]:
    """Byte offsets of the scratch regions, and the total. Every layer stages its weights in its own
    slice of ``wt`` and ``wit`` (``wt_layer``, ``wit_layer`` bytes apart), so that the staged weights
    of all layers stay valid together between runs (``LaunchPlan.staging``). ``wit`` holds W_ih^T either
    as the gemm's [dirs][in][gates*h] or padded like W_hh^T ([dirs][in][wt_row], the fused kernel)."""
    wt_row = gates * ceil_to(h, lim.tune("RNN_JB")) + lim.tune("RNN_WPAD")
    wt_layer, wit_layer = ceil_to(dirs * h * wt_row * rs, 64), ceil_to(dirs * wt_row * max(i, dirs * h) * rs, 64)
    sizes = {"xw": dirs * b * s * gates * h * rs, "lo": b * s * dirs * h * rs if layers > 1 else 0,
             "h": 2 * dirs * b * h * rs, "c": dirs * b * h * rs, "wt": layers * wt_layer, "wit": layers * wit_layer}
    offsets, total = {"wt_layer": wt_layer, "wit_layer": wit_layer}, 0
    for name, nbytes in sizes.items():
        offsets[name] = total
        total += ceil_to(nbytes, 64)
    return offsets, total


def _plan(t: Thunk, lim: DeviceLimits, rnn_kernel: str = "auto", **_: object) -> LaunchPlan:
    gates = GATES[t["op"]]
    defines = gate_variant(gates)  # every rnn launch of the thunk: the op's program
    dt, es, rs = t["dtype"], ELEM_SIZE[t["dtype"]], real_size(t["dtype"])
    b, s, h, layers = t["batch"], t["seq"], t["hidden"], t["num_layers"]
    dirs = 2 if t["bidirectional"] else 1
    carry, relu, gh = bool(t["carry"]), bool(t.get("relu", False)), gates * h
    persistent = rnn_kernel == "persistent" or (rnn_kernel == "auto" and persistent_wins(t, lim))
    fused = persistent and lim.target == "cpu"  # the cpu persistent kernel projects the input itself
    sc, scratch_bytes = _scratch(lim, dirs, b, s, h, t["input_size"], gates, layers, rs)
    hp = ceil_to(h, lim.tune("RNN_JB"))
    bias_field = "b_ih" if t["op"] == "gru" else "bias"
    launches: list[Launch] = []
    staging: list[int] = []  # the weight-staging launches (LaunchPlan.staging)

    def stage(k: int, src: tuple, dst: tuple) -> None:
        """W (gates*h rows of k) transposed into dst, padded (rnn_w_t), as a staging launch."""
        tloc = (linear_local(gates * hp, 64), 1, 1)
        staging.append(len(launches))
        launches.append(Launch("rnn", "rnn_w_t", dt, strided_grid((gates * hp, k, dirs), tloc, lim.max_grid), tloc,
                               (i64(h), i64(hp), i64(k)) + src + dst, target=lim.target, defines=defines))

    w_ih = t["w_ih"]
    for layer in range(layers):
        in_l = t["input_size"] if layer == 0 else dirs * h
        x_buf, x_off, x_real = (ARENA, t["x"], False) if layer == 0 else (SCRATCH, sc["lo"], True)
        wit = sc["wit"] + layer * sc["wit_layer"]
        bias = t[bias_field] + es * layer * dirs * gh
        if fused:  # W_ih^T padded like W_hh^T; the recurrence projects the input itself
            stage(in_l, (ARENA, i64(w_ih)), (SCRATCH, i64(wit)))
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
        whh = (ARENA, i64(t["w_hh"] + es * layer * dirs * gh * h))
        bhh = (ARENA, i64(t["b_hh"] + es * layer * dirs * gh), i32(1)) if t["op"] == "gru" else (ARENA, i64(0), i32(0))
        state_off = es * layer * dirs * b * h
        h0 = (ARENA, i64(t["h0"] + state_off)) if carry else (ARENA, i64(0))
        c0 = (ARENA, i64(t["c0"] + state_off)) if carry and t["op"] == "lstm" else (ARENA, i64(0))
        head = (i32(relu), i64(b), i64(s), i64(h))
        tail = out + (i64(dirs * h),)
        wt = (SCRATCH, i64(sc["wt"] + layer * sc["wt_layer"]))
        if not persistent or fused:  # W_hh^T
            stage(h, whh, wt)
        n = dirs * b * h
        cs = (SCRATCH, i64(sc["c"]))
        hbuf = [(SCRATCH, i64(sc["h"])), (SCRATCH, i64(sc["h"] + n * rs))]
        if persistent:
            size, local = _persist_geometry(lim, b, h, dirs)
            if fused:
                x_in = (i64(in_l), x_buf, i64(x_off), i32(x_real), SCRATCH, i64(wit), ARENA, i64(bias))
                args = head + (i32(carry), SCRATCH, i64(sc["xw"])) + wt + bhh + h0 + c0 + hbuf[0] + hbuf[1] + cs + x_in + tail
            else:
                args = head + (i32(carry), SCRATCH, i64(sc["xw"])) + whh + bhh + h0 + c0 + tail
            launches.append(Launch("rnn", "rnn_persist", dt, size, local, args, target=lim.target, defines=defines))
            continue
        lin = (linear_local(n, 256),)
        launches.append(Launch("rnn", "rnn_state_in", dt, grid((n,), lin), lin,
                               (i32(carry), i64(n)) + h0 + c0 + hbuf[0] + cs, target=lim.target, defines=defines))
        size, local = _step_geometry(lim, gates, b, h, dirs)
        for step in range(s):
            args = head + (i64(step), SCRATCH, i64(sc["xw"])) + wt + bhh + hbuf[step % 2] + hbuf[1 - step % 2] + cs + tail
            launches.append(Launch("rnn", "rnn_step", dt, size, local, args, target=lim.target, defines=defines))
        if carry:
            launches.append(Launch("rnn", "rnn_state_out", dt, grid((n,), lin), lin,
                                   (i64(n),) + hbuf[s % 2] + cs + h0 + c0, target=lim.target, defines=defines))
    weights = tuple((r.offset, r.nbytes) for r in regions(t) if r.field in ("w_ih", "w_hh"))
    kind = ("persistent, input projected in the recurrence" if fused else "persistent") if persistent else "per-step"
    return LaunchPlan(tuple(launches), scratch_bytes, (kind,), tuple(staging), weights)


def _persist_geometry(lim: DeviceLimits, b: int, h: int, dirs: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Global and local size of the persistent kernel: at the gpu target a group of ``h`` items per batch
    row, at the cpu target a group of one item per batch row."""
    if lim.target == "gpu":
        return (h, b, dirs), (h, 1, 1)
    return (1, b, dirs), (1, 1, 1)


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


PLANNERS = {"lstm": _plan, "gru": _plan, "rnn": _plan}


#: the recurrent kernel choices (the ``rnn_kernel`` run option): by shape, or one forced
RNN_KERNELS = ("auto", "persistent", "step")
