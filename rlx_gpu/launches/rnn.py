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

from dataclasses import dataclass
from typing import Any

from host_fallback.abi import ELEM_SIZE, complete, regions
from host_fallback.abi.rnn import ACTIVATION_SLOTS, output_width

from .activation_codes import ACTIVATION_CODES
from .arguments import Partial, bind_some, kernel_launch
from .body import gemm, transpose_real
from .core import ARENA, SCRATCH, Buf, Launch, LaunchPlan, Thunk, ceil_to, grid, linear_local, real_size, strided_grid
from .limits import DeviceLimits, gate_variant
from .registry import register
from .rnn_reserve import add_reorder, saved_args, saved_forward
from .signatures import signature

GATES = {"lstm": 4, "gru": 3, "rnn": 1}  # op -> gate count (ABI.md §3's G)

#: The version-2 fields (ABI.md §8) the recurrent kernels implement, at both targets.
#: the recurrent cell's kernel text, which the forward runs and the backward differentiates
CELL_TEXT = ("rnn_cell.cl",)
V2_FIELDS = frozenset({"seq_lens", "reverse", "clip", "activations", "linear_before_reset", "peepholes",
                       "input_forget", "proj_size", "w_hr", "reserve", "reserve_bytes"})

_SLOT_NAMES = "FGH"  # the activation slots f, g, h (RNN_ACT_<slot><dir>)
_V1_ACTIVATIONS = {"lstm": ("sigmoid", "tanh", "tanh"), "gru": ("sigmoid", "tanh"), "rnn": ("tanh",)}


def variant(t: Thunk, reserve_flag: str = "RNN_SAVE") -> tuple[tuple[str, int], ...]:
    """The program variant of every recurrent launch of the completed thunk ``t``: ``RNN_GATES``, then only what
    differs from ABI.md §3 — each slot's activation code (``RNN_ACT_F0``.., direction 1's only where it differs
    from direction 0's) and a flag per optional field in use (kernels/rnn_cell.cl's RNN_LENS, RNN_CLIP, RNN_PEEP,
    RNN_IFG, RNN_PROJ, RNN_LBR0, and ``reserve_flag`` with a reserve: RNN_SAVE where the forward writes it,
    RNN_SAVED where the backward reads it). A version-1 thunk gets ``gate_variant`` (and rnn's relu as
    ``RNN_ACT_F0``)."""
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
             "RNN_PROJ": op == "lstm" and t["proj_size"] > 0, "RNN_LBR0": op == "gru" and not t["linear_before_reset"],
             reserve_flag: t.get("reserve") is not None}
    return tuple(defines) + tuple((name, 1) for name, on in flags.items() if on)


def cell_args(t: Thunk, peep_off: int | None) -> dict[str, Any]:
    """The cell arguments of the recurrent kernels (rnn_step, rnn_persist and the backward's): seq_lens (``lb``), the
    layer's peepholes (``pb``), clip, and alpha, beta of the slots f, g, h of direction 0 then 1 (``a_f0``, ``b_f0``,
    ..., unused slots and directions 0)."""
    slots, acts = ACTIVATION_SLOTS[t["op"]], list(t["activations"])
    args: dict[str, Any] = {"lb": (ARENA, t["seq_lens"] or 0), "pb": (ARENA, 0 if peep_off is None else peep_off),
                            "clip": t["clip"]}
    for d in range(2):
        mine = acts[d * slots:(d + 1) * slots] if d * slots < len(acts) else [("", 0.0, 0.0)] * slots
        mine += [("", 0.0, 0.0)] * (3 - slots)
        for slot, (_, alpha, beta) in zip(_SLOT_NAMES.lower(), mine):
            args[f"a_{slot}{d}"], args[f"b_{slot}{d}"] = alpha, beta
    return args


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


@dataclass(frozen=True)
class _Layer:
    """One layer of a forward thunk as its kernels see it: arena offsets of its weights and states, its input
    (arena x, or the layer below's output in scratch) and output, and its staged weights in scratch."""

    index: int
    in_size: int
    x: tuple[Buf, int]
    x_real: bool  # x is compute-type scratch
    w_ih: int
    wit: int  # scratch: W_ih^T
    bias: int
    out: tuple[Buf, int]
    out_real: bool
    w_hh: int
    bhh: dict[str, Any]  # bhb, has_bhh
    h0: tuple[Buf, int]
    c0: tuple[Buf, int]
    peep: int | None
    wt: tuple[Buf, int]  # scratch: W_hh^T
    w_hr: int
    whr: tuple[Buf, int]  # scratch: W_hr^T


def _layers(t: Thunk, sc: dict[str, int]) -> list[_Layer]:
    """Every layer of the completed forward thunk ``t`` with the scratch layout ``sc``."""
    op, es, dirs, h, k = t["op"], ELEM_SIZE[t["dtype"]], 2 if t["bidirectional"] else 1, t["hidden"], output_width(t)
    gh, carry, layers = GATES[op] * h, bool(t["carry"]), t["num_layers"]
    out, w_ih = [], t["w_ih"]
    for l in range(layers):
        in_l = t["input_size"] if l == 0 else dirs * k
        last, lstm = l == layers - 1, op == "lstm"
        out.append(_Layer(
            index=l, in_size=in_l, x=(ARENA, t["x"]) if l == 0 else (SCRATCH, sc["lo"]), x_real=l > 0, w_ih=w_ih,
            wit=sc["wit"] + l * sc["wit_layer"], bias=t["b_ih" if op == "gru" else "bias"] + es * l * dirs * gh,
            out=(ARENA, t["dst"]) if last else (SCRATCH, sc["lo"]), out_real=not last,
            w_hh=t["w_hh"] + es * l * dirs * gh * k,
            bhh={"bhb": (ARENA, t["b_hh"] + es * l * dirs * gh), "has_bhh": True} if op == "gru"
            else {"bhb": (ARENA, 0), "has_bhh": False},
            h0=(ARENA, t["h0"] + es * l * dirs * t["batch"] * k if carry else 0),
            c0=(ARENA, t["c0"] + es * l * dirs * t["batch"] * h if carry and lstm else 0),
            peep=None if not lstm or t["peepholes"] is None else t["peepholes"] + es * l * dirs * 3 * h,
            wt=(SCRATCH, sc["wt"] + l * sc["wt_layer"]), w_hr=t["w_hr"] + es * l * dirs * k * h if _proj(t) else 0,
            whr=(SCRATCH, sc["whr"] + l * sc["whr_layer"])))
        w_ih += es * dirs * gh * in_l
    return out


def _proj(t: Thunk) -> bool:
    return t["op"] == "lstm" and t["proj_size"] > 0


class _Forward:
    """The launches of one forward thunk (completed) as they are planned, and what its kernels share."""

    def __init__(self, t: Thunk, lim: DeviceLimits, persistent: bool) -> None:
        self.t, self.lim = t, lim
        self.fused = persistent and lim.target == "cpu"  # the cpu persistent kernel projects the input itself
        self.sc, self.scratch_bytes = _scratch(lim, t, real_size(t["dtype"]))
        self.defines = variant(t)  # every rnn launch of the thunk: the op's program
        self.dirs, self.k = 2 if t["bidirectional"] else 1, output_width(t)
        self.lens = (ARENA, t["seq_lens"] or 0)
        self.saved = saved_forward(t)
        self.launches: list[Launch] = []
        self.staging: list[int] = []  # the weight-staging launches (LaunchPlan.staging)

    def add(self, kernel: str, size: tuple, local: tuple, args: dict[str, Any], shared: Partial | None = None) -> None:
        self.launches.append(kernel_launch("rnn", kernel, self.t["dtype"], size, local, args, target=self.lim.target,
                                           defines=self.defines, shared=shared))

    def ahead(self, kernel: str, args: dict[str, Any]) -> Partial:
        """``kernel``'s arguments that every step of a layer shares, bound once."""
        return bind_some(signature("rnn", kernel, self.lim.target), self.t["dtype"], args)

    def stage(self, ng: int, units: int, units_p: int, rows: int, src: tuple[Buf, int], dst: tuple[Buf, int]) -> None:
        """W (ng*units rows of ``rows``) transposed into dst, padded (rnn_w_t), as a staging launch."""
        tloc = (linear_local(ng * units_p, 64), 1, 1)
        self.staging.append(len(self.launches))
        self.add("rnn_w_t", strided_grid((ng * units_p, rows, self.dirs), tloc, self.lim.max_grid), tloc,
                 dict(ng=ng, H=units, HP=units_p, K=rows, wb=src, tb=dst))

    def h_buffers(self) -> tuple[tuple[Buf, int], tuple[Buf, int]]:
        """The two scratch buffers h ping-pongs between, step by step."""
        nh = self.dirs * self.t["batch"] * self.k
        return (SCRATCH, self.sc["h"]), (SCRATCH, self.sc["h"] + nh * real_size(self.t["dtype"]))

    def reorder(self, width: int, to_time: bool, batch: int, src: tuple[tuple[Buf, int], int],
                dst: tuple[tuple[Buf, int], int]) -> None:
        """Rows of ``width`` reals between batch-major and time-major order (rnn_reorder), zeros past each row's
        length, for ``batch`` blocks; ``src``, ``dst``: ``((buffer, offset), block stride in reals)``."""
        add_reorder(self.launches, self.t, self.lim, self.defines, width, to_time, batch, src, dst)

    def output(self, layer: _Layer) -> dict[str, Any]:
        """The layer's output arguments: where, whether compute-type scratch, and its row stride."""
        return {"ob": layer.out, "o_real": layer.out_real, "o_rs": self.dirs * self.k}


def _plan(t: Thunk, lim: DeviceLimits, rnn_kernel: str = "auto", **_: object) -> LaunchPlan:
    t = complete(t)
    persistent = persistent_fits(t, lim) and (rnn_kernel == "persistent" or (rnn_kernel == "auto" and persistent_wins(t, lim)))
    f = _Forward(t, lim, persistent)
    if t["seq_lens"] is not None:  # the rows longest first, for every layer's steps
        f.add("rnn_order", (1,), (1,), dict(B=t["batch"], S=t["seq"], lb=f.lens, ob=(SCRATCH, f.sc["ord"]),
                                            cb=(SCRATCH, f.sc["cnt"])))
    for layer in _layers(t, f.sc):
        _project(f, layer)
        if t["seq_lens"] is not None:  # zeros past each row's length, written once; the steps never touch them
            ploc = (linear_local(f.dirs * f.k, 256), 1, 1)  # an item walks its column's padding steps
            f.add("rnn_pad", strided_grid((f.dirs * f.k, 1, t["batch"]), ploc, lim.max_grid), ploc,
                  dict(B=t["batch"], S=t["seq"], W=f.dirs * f.k, ob=layer.out, o_real=layer.out_real, lb=f.lens))
        jb, gates, h = lim.tune("RNN_JB"), GATES[t["op"]], t["hidden"]
        if not persistent or f.fused:  # W_hh^T
            f.stage(gates, h, ceil_to(h, jb), f.k, (ARENA, layer.w_hh), layer.wt)
        if _proj(t):  # W_hr^T [dirs][h][kp + wpad]
            f.stage(1, f.k, ceil_to(f.k, jb), h, (ARENA, layer.w_hr), layer.whr)
        (_persist if persistent else _steps)(f, layer)
        if f.saved:
            _saved_rest(f, layer)
    weights = tuple((r.offset, r.nbytes) for r in regions(t) if r.field in ("w_ih", "w_hh", "w_hr"))
    kind = ("persistent, input projected in the recurrence" if f.fused else "persistent") if persistent else "per-step"
    return LaunchPlan(tuple(f.launches), f.scratch_bytes, (kind,), tuple(f.staging), weights)


def _saved_rest(f: _Forward, layer: _Layer) -> None:
    """What the step kernels leave of the layer's saved forward: zeros past each row's length (rnn_saved_pad), and
    the layer's output (the next layer's input) time-major."""
    t = f.t
    if t["seq_lens"] is not None:
        gh = GATES[t["op"]] * t["hidden"]
        local = (linear_local(gh, 64), 1, 1)
        f.add("rnn_saved_pad", strided_grid((gh, t["batch"], f.dirs), local, f.lim.max_grid), local,
              dict(B=t["batch"], S=t["seq"], H=t["hidden"], K=f.k, lb=f.lens,
                   **saved_args(f.saved, layer.index * f.dirs)))
    if layer.index < t["num_layers"] - 1:
        f.reorder(f.dirs * f.k, True, 1, (layer.out, 0), (f.saved["out", layer.index], 0))


def _project(f: _Forward, layer: _Layer) -> None:
    """The layer's input projection: staged for the fused cpu persistent kernel, else one gemm of every step."""
    t, lim, dt = f.t, f.lim, f.t["dtype"]
    gh, in_l = GATES[t["op"]] * t["hidden"], layer.in_size
    if f.fused:  # W_ih^T padded like W_hh^T; the recurrence projects the input itself
        f.stage(GATES[t["op"]], t["hidden"], ceil_to(t["hidden"], lim.tune("RNN_JB")), in_l, (ARENA, layer.w_ih),
                (SCRATCH, layer.wit))
        return
    # B(kk, col) = W_ih[col, kk], staged as [dirs][in_l][gh] so the gemm reads B's columns contiguously
    f.staging.append(len(f.launches))
    f.launches.append(transpose_real(lim, dt, gh, in_l, f.dirs, (ARENA, layer.w_ih, gh * in_l, in_l, 1),
                                     (SCRATCH, layer.wit)))
    f.launches.append(gemm(lim, dt, t["batch"] * t["seq"], gh, in_l, f.dirs, (*layer.x, layer.x_real, 0, in_l, 1),
                           (SCRATCH, layer.wit, True, in_l * gh, gh, 1),
                           (SCRATCH, f.sc["xw"], True, t["batch"] * t["seq"] * gh, gh),
                           bias=(ARENA, layer.bias, gh)))


def _persist(f: _Forward, layer: _Layer) -> None:
    """The layer's recurrence as one launch (rnn_persist): at the cpu target it projects the input too."""
    t, sc = f.t, f.sc
    size, local = _persist_geometry(f.lim, t["batch"], t["hidden"], f.dirs)
    args = dict(B=t["batch"], S=t["seq"], H=t["hidden"], carry=t["carry"], reverse=t["reverse"],
                xwb=(SCRATCH, sc["xw"]), **layer.bhh, h0b=layer.h0, c0b=layer.c0, **f.output(layer),
                **saved_args(f.saved, layer.index * f.dirs), **cell_args(t, layer.peep))
    if f.fused:
        h = f.h_buffers()
        args.update(K=f.k, wtb=layer.wt, hb0=h[0], hb1=h[1], cb=(SCRATCH, sc["c"]), ab=(SCRATCH, sc["aux"]),
                    I=layer.in_size, xb=layer.x, x_real=layer.x_real, wib=(SCRATCH, layer.wit), bib=(ARENA, layer.bias),
                    wrb=layer.whr)
    else:
        args.update(whb=(ARENA, layer.w_hh))
    f.add("rnn_persist", size, local, args)


def _steps(f: _Forward, layer: _Layer) -> None:
    """The layer's recurrence a launch per step (rnn_step; two phases for gru without linear_before_reset,
    lstm's projection rnn_proj after each), between the states' entry (rnn_state_in) and exit (rnn_state_out)."""
    t, sc, lim = f.t, f.sc, f.lim
    b, s, h, k, dirs = t["batch"], t["seq"], t["hidden"], f.k, f.dirs
    nh, nc = dirs * b * k, dirs * b * h
    hbuf = f.h_buffers()
    cs, aux, order = (SCRATCH, sc["c"]), (SCRATCH, sc["aux"]), (SCRATCH, sc["ord"])
    lin = (linear_local(max(nh, nc), 256),)
    f.add("rnn_state_in", grid((max(nh, nc),), lin), lin,
          dict(carry=t["carry"], nh=nh, nc=nc, h0b=layer.h0, c0b=layer.c0, hb=hbuf[0], cb=cs))
    size, local = _step_geometry(lim, GATES[t["op"]], b, h, dirs)
    psize, ploc = _proj_geometry(lim, b, k, dirs)
    walk = dict(B=b, S=s, H=h, reverse=t["reverse"], **f.output(layer), rb_=order)
    each_step = f.ahead("rnn_step", dict(walk, K=k, xwb=(SCRATCH, sc["xw"]), wtb=layer.wt, **layer.bhh, cb=cs,
                                         ab=aux, **saved_args(f.saved, layer.index * dirs), **cell_args(t, layer.peep)))
    proj = f.ahead("rnn_proj", dict(walk, P=k, mb=aux, wb=layer.whr, lb=f.lens)) if _proj(t) else None
    for step in range(s):
        hin, hout = hbuf[step % 2], hbuf[1 - step % 2]
        for phase in range(2 if t["op"] == "gru" and not t["linear_before_reset"] else 1):
            f.add("rnn_step", size, local, dict(t=step, phase=phase, hib=hin, hob=hout), each_step)
        if proj is not None:
            f.add("rnn_proj", psize, ploc, dict(t=step, hob=hout), proj)
    if t["carry"]:
        f.add("rnn_state_out", grid((max(nh, nc),), lin), lin,
              dict(nh=nh, nc=nc, B=b, S=s, K=k, hb0=hbuf[0], hb1=hbuf[1], cb=cs, h0b=layer.h0, c0b=layer.c0, lb=f.lens))


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


register(("lstm", "gru", "rnn"), _plan, unsupported, v2_fields=V2_FIELDS, family="rnn", shared_texts=CELL_TEXT)


#: the recurrent kernel choices (the ``rnn_kernel`` run option): by shape, or one forced
RNN_KERNELS = ("auto", "persistent", "step")
