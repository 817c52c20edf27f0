"""The argument checks of ``rlx_gpu.torch``, in the caller's terms: each public function's arguments
named as the function takes them, in the anchor's layout (mamba_ssm's ``(batch, dim, seqlen)``,
fla's ``(B, T, H, K)``), with what was expected, written in ``argument_rules``' vocabulary.

Two kinds of check, called from two places:

- ``check_<function>`` (one per public function, ``check_rnn_forward`` for the modules) reads shapes,
  dtypes, devices and Python scalars only, never tensor data, so it runs unchanged under
  ``torch.compile`` tracing (fake tensors) and raises before anything runs. Each size is named as the
  anchor's docstring names it and fixed by the first argument that shows it, in a fixed order that
  starts at the anchor (``u``, ``x``, ``q``), so a mismatch blames the argument that disagrees with
  what came before, and says where each size came from.
- ``check_state_batch_indices``, ``check_seq_idx`` and ``check_cu_seqlens`` read index tensors'
  values: they run where those values are read (eagerly, inside the op), before anything is written.

Shape and rank mismatches raise ``ValueError``; a dtype the function cannot take, mixed activation
dtypes and a floating index tensor ``TypeError``; complex tensors ``NotImplementedError`` (the scans
are real, ABI.md §4); index values out of their pool ``IndexError``.
"""
from __future__ import annotations

from typing import Any

import torch

from .argument_rules import (FLOATS, Form, Sizes, dtypes, indices, is_tensor, once_per_signature, parameter_dtypes,
                             real, same_device, spelled)


@once_per_signature
def check_selective_scan_fn(u: Any, delta: Any, A: Any, B: Any, C: Any, D: Any = None, z: Any = None,
                            delta_bias: Any = None) -> None:
    """mamba_ssm's layout: ``u, delta, z (batch, dim, seqlen)``, ``A (dim, dstate)``, ``B, C (batch,
    dstate, seqlen)``, ``(batch, ngroups, dstate, seqlen)`` or ``(dim, dstate)`` (both the same form),
    ``D, delta_bias (dim,)``; dtypes as ``dtypes`` and ``parameters`` say (a fixed ``(dim, dstate)``
    B or C is a parameter, as in mamba_ssm)."""
    fn = "selective_scan_fn"
    sizes = Sizes(fn)
    sizes.take("u", u, ("batch", "dim", "seqlen"))
    sizes.take("delta", delta, ("batch", "dim", "seqlen"))
    sizes.take("A", A, ("dim", "dstate"))
    forms = (("batch", "dstate", "seqlen"), ("batch", "ngroups", "dstate", "seqlen"), ("dim", "dstate"))
    b_form = sizes.take("B", B, *forms)
    if isinstance(C, torch.Tensor) and C.dim() != B.dim():
        raise NotImplementedError(f"{fn}: C has shape {list(C.shape)} and B {list(B.shape)}; rlx_gpu's op reads B "
                                  f"and C in one of mamba_ssm's layouts: pass C as {spelled(b_form)} like B")
    sizes.take("C", C, b_form)
    if "ngroups" in b_form:
        sizes.divides("ngroups", "dim", "B", "channel d reads group d // (dim / ngroups)")
    sizes.maybe("D", D, ("dim",))
    sizes.maybe("z", z, ("batch", "dim", "seqlen"))
    sizes.maybe("delta_bias", delta_bias, ("dim",))
    tensors = {"u": u, "delta": delta, "A": A, "B": B, "C": C, "D": D, "z": z, "delta_bias": delta_bias}
    fixed = b_form == ("dim", "dstate")
    params = parameter_dtypes(u.dtype, A, "D", "delta_bias", *(("B", "C") if fixed else ()))
    dtypes(fn, "mamba_ssm", tensors, "u", ("delta", "z") if fixed else ("delta", "B", "C", "z"), params)
    same_device(fn, "u", tensors)


@once_per_signature
def check_mamba_chunk_scan_combined(x: Any, dt: Any, A: Any, B: Any, C: Any, D: Any = None, z: Any = None,
                                    dt_bias: Any = None, initial_states: Any = None, seq_idx: Any = None,
                                    cu_seqlens: Any = None, state_dtype: torch.dtype | None = None) -> None:
    """mamba_ssm's layout: ``x, z (batch, seqlen, nheads, headdim)``, ``dt (batch, seqlen, nheads)``,
    ``A, dt_bias (nheads,)``, ``B, C (batch, seqlen, ngroups, dstate)``, ``D (nheads,)`` or ``(nheads,
    headdim)``, ``initial_states (batch, nheads, headdim, dstate)`` (x's dtype, f32, or ``state_dtype``),
    ``seq_idx (batch, seqlen)`` and ``cu_seqlens (num_sequences + 1,)`` integers."""
    fn = "mamba_chunk_scan_combined"
    sizes = Sizes(fn)
    sizes.take("x", x, ("batch", "seqlen", "nheads", "headdim"))
    sizes.take("dt", dt, ("batch", "seqlen", "nheads"))
    sizes.take("A", A, ("nheads",))
    sizes.take("B", B, ("batch", "seqlen", "ngroups", "dstate"))
    sizes.take("C", C, ("batch", "seqlen", "ngroups", "dstate"))
    sizes.divides("ngroups", "nheads", "B", "head h reads group h // (nheads / ngroups)")
    sizes.maybe("D", D, ("nheads",), ("nheads", "headdim"))
    sizes.maybe("z", z, ("batch", "seqlen", "nheads", "headdim"))
    sizes.maybe("dt_bias", dt_bias, ("nheads",))
    sizes.maybe("initial_states", initial_states, ("batch", "nheads", "headdim", "dstate"))
    if indices(fn, "seq_idx", seq_idx, "sequence indices"):
        sizes.take("seq_idx", seq_idx, ("batch", "seqlen"))
    if indices(fn, "cu_seqlens", cu_seqlens, "sequence boundaries"):
        sizes.take("cu_seqlens", cu_seqlens, ("num_sequences + 1",))
    tensors = {"x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z, "dt_bias": dt_bias,
               "initial_states": initial_states}
    params = parameter_dtypes(x.dtype, A, "D", "dt_bias")
    params["initial_states"] = ((torch.float32,), "x's dtype or f32 (the carried state)") if state_dtype is None else (
        (torch.float32, state_dtype), f"x's dtype, f32 (the carried state) or state_dtype ({state_dtype})")
    dtypes(fn, "mamba_ssm", tensors, "x", ("dt", "B", "C", "z"), params)
    same_device(fn, "x", {**tensors, "seq_idx": seq_idx, "cu_seqlens": cu_seqlens})


@once_per_signature
def check_selective_state_update(state: Any, x: Any, dt: Any, A: Any, B: Any, C: Any, D: Any = None, z: Any = None,
                                 dt_bias: Any = None, state_batch_indices: Any = None) -> None:
    """mamba_ssm's layout, in x's form: ``x, dt, z (batch, dim)`` with ``state (batch, dim, dstate)``,
    or ``(batch, nheads, dim)`` with ``state (batch, nheads, dim, dstate)``; with
    ``state_batch_indices (batch,)`` the state's first size is its pool's. ``A (nheads, dim, dstate)``
    or ``(dim, dstate)``, ``D, dt_bias (nheads, dim)`` or ``(dim,)``, ``B, C (batch, dstate)`` or
    ``(batch, ngroups, dstate)``. The state may be any floating dtype (it is carried at f32 or wider)."""
    fn = "selective_state_update"
    sizes = Sizes(fn)
    heads_form = is_tensor(fn, "x", x) and x.dim() == 3
    form = ("batch", "nheads", "dim") if heads_form else ("batch", "dim")
    if not heads_form:
        sizes.fix("nheads", 1, lambda: "x (batch, dim): one head")
    sizes.take("x", x, ("batch", "dim"), ("batch", "nheads", "dim"))
    pool = "pool" if state_batch_indices is not None else "batch"
    sizes.take("state", state, (pool, *form[1:], "dstate"))
    sizes.take("dt", dt, form)
    sizes.take("A", A, ("nheads", "dim", "dstate"), ("dim", "dstate"))
    sizes.take("B", B, ("batch", "dstate"), ("batch", "ngroups", "dstate"))
    sizes.take("C", C, ("batch", "dstate"), ("batch", "ngroups", "dstate"))
    if "ngroups" in sizes.known:
        sizes.divides("ngroups", "nheads", "B", "head h reads group h // (nheads / ngroups)")
    sizes.maybe("D", D, ("nheads", "dim"), ("dim",))
    sizes.maybe("z", z, form)
    sizes.maybe("dt_bias", dt_bias, ("nheads", "dim"), ("dim",))
    if indices(fn, "state_batch_indices", state_batch_indices, "state pool entries"):
        sizes.take("state_batch_indices", state_batch_indices, ("batch",))
    tensors = {"x": x, "state": state, "dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z, "dt_bias": dt_bias}
    params = parameter_dtypes(x.dtype, A, "D", "dt_bias")
    params["state"] = (FLOATS, "a floating dtype")
    dtypes(fn, "mamba_ssm", tensors, "x", ("dt", "B", "C", "z"), params)
    same_device(fn, "x", {**tensors, "state_batch_indices": state_batch_indices})


def _check_delta_rule(fn: str, q: Any, k: Any, v: Any, gates: dict[str, tuple[Any, Form]], beta: Any,
                      initial_state: Any, state_v_first: bool, cu_seqlens: Any,
                      parameters: dict[str, tuple[Any, Form]]) -> None:
    """fla's layout: ``q, k (B, T, H, K)``, ``v (B, T, HV, V)`` (HV a multiple of H), the ``gates`` and
    ``beta (B, T, HV)``, ``cu_seqlens (N + 1,)`` integers with B = 1, ``initial_state (N, HV, K, V)``
    (``(N, HV, V, K)`` with ``state_v_first``; N = B without cu_seqlens), and the gate's ``parameters``.
    k and v share q's dtype; the gates, beta, the state and the parameters may be f32 beside it (fla
    computes its gates and carries its state in f32)."""
    sizes = Sizes(fn)
    sizes.take("q", q, ("B", "T", "H", "K"))
    sizes.take("k", k, ("B", "T", "H", "K"))
    sizes.take("v", v, ("B", "T", "HV", "V"))
    sizes.divides("H", "HV", "q", "value head j reads key head j // (HV / H)")
    for arg, (t, form) in gates.items():
        sizes.maybe(arg, t, form)
    sizes.maybe("beta", beta, ("B", "T", "HV"))
    if indices(fn, "cu_seqlens", cu_seqlens, "sequence boundaries"):
        sizes.take("cu_seqlens", cu_seqlens, ("N + 1",))
        if sizes.size("B") != 1:
            raise ValueError(f"{fn}: the batch size must be 1 rather than {sizes.size('B')} with cu_seqlens "
                             f"(q {list(q.shape)}); flatten variable-length inputs first")
        sizes.fix("N", cu_seqlens.shape[0] - 1,
                  lambda: f"cu_seqlens {list(cu_seqlens.shape)}: one state per sequence")
    else:
        sizes.fix("N", sizes.size("B"), lambda: f"q {list(q.shape)}: one state per row")
    sizes.maybe("initial_state", initial_state, ("N", "HV", "V", "K") if state_v_first else ("N", "HV", "K", "V"))
    sizes.fix("HV·K", sizes.size("HV") * sizes.size("K"),
              lambda: f"HV={sizes.size('HV')} from {sizes.source('HV')} times K={sizes.size('K')} from "
                      f"{sizes.source('K')}")
    for arg, (t, form) in parameters.items():
        sizes.maybe(arg, t, form)
    beside = ((torch.float32,), "q's dtype or f32")
    tensors = {"q": q, "k": k, "v": v, **{arg: t for arg, (t, _) in gates.items()}, "beta": beta,
               "initial_state": initial_state, **{arg: t for arg, (t, _) in parameters.items()}}
    dtypes(fn, "fla", tensors, "q", ("k", "v"), {arg: beside for arg in tensors if arg not in ("q", "k", "v")})
    same_device(fn, "q", {**tensors, "cu_seqlens": cu_seqlens})


@once_per_signature
def check_chunk_gated_delta_rule(q: Any, k: Any, v: Any, g: Any, beta: Any, initial_state: Any = None,
                                 state_v_first: bool = False, cu_seqlens: Any = None, A_log: Any = None,
                                 dt_bias: Any = None) -> None:
    """fla's layout (``_check_delta_rule``) with ``g (B, T, HV)`` and, for the gate fused in the kernel,
    ``A_log, dt_bias (HV,)``."""
    _check_delta_rule("chunk_gated_delta_rule", q, k, v, {"g": (g, ("B", "T", "HV"))}, beta, initial_state,
                      state_v_first, cu_seqlens, {"A_log": (A_log, ("HV",)), "dt_bias": (dt_bias, ("HV",))})


@once_per_signature
def check_fused_recurrent_gated_delta_rule(q: Any, k: Any, v: Any, g: Any = None, gk: Any = None, beta: Any = None,
                                           initial_state: Any = None, state_v_first: bool = False,
                                           cu_seqlens: Any = None, A_log: Any = None, dt_bias: Any = None) -> None:
    """fla's layout (``_check_delta_rule``) with ``g (B, T, HV)``, ``gk (B, T, HV, K)`` and ``beta`` optional,
    and ``A_log, dt_bias (HV,)`` for the gate fused in the kernel."""
    _check_delta_rule("fused_recurrent_gated_delta_rule", q, k, v,
                      {"g": (g, ("B", "T", "HV")), "gk": (gk, ("B", "T", "HV", "K"))}, beta, initial_state,
                      state_v_first, cu_seqlens, {"A_log": (A_log, ("HV",)), "dt_bias": (dt_bias, ("HV",))})


@once_per_signature
def check_chunk_kda(q: Any, k: Any, v: Any, g: Any, beta: Any, initial_state: Any = None, state_v_first: bool = False,
                    cu_seqlens: Any = None, A_log: Any = None, dt_bias: Any = None) -> None:
    """fla's layout (``_check_delta_rule``) with a gate per key channel ``g (B, T, HV, K)``, and for the gate
    fused in the kernel ``A_log (HV,)`` and ``dt_bias (HV·K,)``."""
    _check_delta_rule("chunk_kda", q, k, v, {"g": (g, ("B", "T", "HV", "K"))}, beta, initial_state, state_v_first,
                      cu_seqlens, {"A_log": (A_log, ("HV",)), "dt_bias": (dt_bias, ("HV·K",))})


#: The narrowest and widest causal_conv1d filters (ABI.md §10).
CONV_WIDTHS = (2, 8)


def _conv_width(sizes: Sizes, weight: torch.Tensor) -> None:
    """``weight (dim, width)``'s width is one the op takes; fixes ``width - 1``, the carried columns."""
    width, (narrowest, widest) = sizes.size("width"), CONV_WIDTHS
    if not narrowest <= width <= widest:  # comparisons, which trace on symbolic sizes
        raise ValueError(f"{sizes.fn}: weight has shape {list(weight.shape)}: width={width}; rlx_gpu's "
                         f"causal_conv1d takes {narrowest} <= width <= {widest} (ABI.md §10)")
    sizes.fix("width - 1", width - 1, lambda: f"width={width} from weight {list(weight.shape)}")


def _floats(fn: str, anchor: str, tensors: dict[str, Any], index_tensors: dict[str, Any]) -> None:
    """Each of ``tensors`` real and floating (their dtypes may differ: the call casts them to the anchor's), all
    of them and the ``index_tensors`` on the anchor's device."""
    for arg, t in tensors.items():
        if t is not None:
            real(fn, arg, t)
    same_device(fn, anchor, {**tensors, **index_tensors})


@once_per_signature
def check_causal_conv1d_fn(x: Any, weight: Any, bias: Any = None, seq_idx: Any = None, initial_states: Any = None,
                           final_states_out: Any = None) -> None:
    """causal-conv1d's layout: ``x (batch, dim, seqlen)``, ``weight (dim, width)`` with a width the op takes,
    ``bias (dim,)``, ``seq_idx (batch, seqlen)`` integers, ``initial_states`` and ``final_states_out (batch,
    dim, width - 1)``; any floating dtypes (weight, bias and states are cast to x's)."""
    fn = "causal_conv1d_fn"
    sizes = Sizes(fn)
    sizes.take("x", x, ("batch", "dim", "seqlen"))
    sizes.take("weight", weight, ("dim", "width"))
    _conv_width(sizes, weight)
    sizes.maybe("bias", bias, ("dim",))
    if indices(fn, "seq_idx", seq_idx, "sequence indices"):
        sizes.take("seq_idx", seq_idx, ("batch", "seqlen"))
    sizes.maybe("initial_states", initial_states, ("batch", "dim", "width - 1"))
    sizes.maybe("final_states_out", final_states_out, ("batch", "dim", "width - 1"))
    _floats(fn, "x", {"x": x, "weight": weight, "bias": bias, "initial_states": initial_states,
                      "final_states_out": final_states_out}, {"seq_idx": seq_idx})


@once_per_signature
def check_causal_conv1d_update(x: Any, conv_state: Any, weight: Any, bias: Any = None,
                               conv_state_indices: Any = None) -> None:
    """causal-conv1d's layout: ``x (batch, dim)`` or ``(batch, dim, seqlen)``, ``conv_state (batch, dim,
    state_len)`` (its first size the pool's with ``conv_state_indices (batch,)`` integers) holding at least
    ``width - 1`` columns, ``weight (dim, width)``, ``bias (dim,)``; any floating dtypes."""
    fn = "causal_conv1d_update"
    sizes = Sizes(fn)
    sizes.take("x", x, ("batch", "dim"), ("batch", "dim", "seqlen"))
    pool = "pool" if conv_state_indices is not None else "batch"
    sizes.take("conv_state", conv_state, (pool, "dim", "state_len"))
    sizes.take("weight", weight, ("dim", "width"))
    _conv_width(sizes, weight)
    if sizes.size("state_len") < sizes.size("width - 1"):
        raise ValueError(f"{fn}: conv_state has shape {list(conv_state.shape)}: {sizes.size('state_len')} columns; "
                         f"width {sizes.size('width')} (weight {list(weight.shape)}) needs at least "
                         f"{sizes.size('width - 1')}")
    sizes.maybe("bias", bias, ("dim",))
    if indices(fn, "conv_state_indices", conv_state_indices, "state pool entries"):
        sizes.take("conv_state_indices", conv_state_indices, ("batch",))
    _floats(fn, "x", {"x": x, "conv_state": conv_state, "weight": weight, "bias": bias},
            {"conv_state_indices": conv_state_indices})


#: mamba_ssm's Mamba-3 SISO layout (``mamba3_siso_combined``'s; its step's without ``seqlen``), argument by argument.
MAMBA3_FORMS: dict[str, Form] = {
    "Q": ("batch", "seqlen", "nheads_qk", "headdim_qk"), "K": ("batch", "seqlen", "nheads_qk", "headdim_qk"),
    "V": ("batch", "seqlen", "nheads", "headdim_v"), "ADT": ("batch", "nheads", "seqlen"),
    "DT": ("batch", "nheads", "seqlen"), "Trap": ("batch", "nheads", "seqlen"), "Q_bias": ("nheads", "headdim_qk"),
    "K_bias": ("nheads", "headdim_qk"), "Angles": ("batch", "seqlen", "nheads", "headdim_angles"), "D": ("nheads",),
    "Z": ("batch", "seqlen", "nheads", "headdim_v")}
#: ``Input_States``' four, in the anchor's order.
MAMBA3_STATES: tuple[tuple[str, Form], ...] = (
    ("angle", ("R", "nheads", "headdim_angles")), ("ssm", ("R", "nheads", "headdim_v", "headdim_qk")),
    ("k", ("R", "nheads", "headdim_qk")), ("v", ("R", "nheads", "headdim_v")))


@once_per_signature
def check_mamba3_siso_combined(Q: Any, K: Any, V: Any, ADT: Any, DT: Any, Trap: Any, Q_bias: Any, K_bias: Any,
                               Angles: Any, D: Any = None, Z: Any = None, Input_States: Any = None,
                               cu_seqlens: Any = None) -> None:
    """``_check_mamba3`` over sequences."""
    tensors = dict(zip(MAMBA3_FORMS, (Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z)))
    _check_mamba3("mamba3_siso_combined", False, tensors, Input_States, cu_seqlens)


@once_per_signature
def check_mamba3_siso_step(Q: Any, K: Any, V: Any, ADT: Any, DT: Any, Trap: Any, Q_bias: Any, K_bias: Any,
                           Angles: Any, D: Any = None, Z: Any = None, Input_States: Any = None) -> None:
    """``_check_mamba3`` of one token."""
    tensors = dict(zip(MAMBA3_FORMS, (Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z)))
    _check_mamba3("mamba3_siso_step", True, tensors, Input_States, None)


def _check_mamba3(fn: str, step: bool, tensors: dict[str, Any], states: Any, cu_seqlens: Any) -> None:
    """``MAMBA3_FORMS`` (``step``: without ``seqlen``) for ``tensors`` by the anchor's names, ``Input_States``
    (``states``: four tensors, R = batch or the sequences of ``cu_seqlens (num_sequences + 1,)``, integers with
    batch 1), ``headdim_qk`` even with ``1 <= headdim_angles <= headdim_qk / 2`` (ABI.md §11); real floating
    dtypes (the call casts K, V, Z to Q's), one device."""
    sizes = Sizes(fn)
    for arg, form in MAMBA3_FORMS.items():
        form = tuple(n for n in form if not (step and n == "seqlen"))
        (sizes.take if arg in ("Q", "K", "V", "ADT", "DT", "Trap", "Angles") else sizes.maybe)(arg, tensors[arg], form)
        if arg == "V":
            sizes.divides("nheads_qk", "nheads", "Q", "head h reads group h // (nheads / nheads_qk)")
    n, angles = sizes.size("headdim_qk"), sizes.size("headdim_angles")
    if n % 2 or not 1 <= angles <= n // 2:
        raise ValueError(f"{fn}: Angles has headdim_angles={angles} (Angles {list(tensors['Angles'].shape)}) beside "
                         f"headdim_qk={n} (from {sizes.source('headdim_qk')}); rotary pairs need an even headdim_qk "
                         f"and 1 <= headdim_angles <= headdim_qk / 2")
    if indices(fn, "cu_seqlens", cu_seqlens, "sequence boundaries"):
        sizes.take("cu_seqlens", cu_seqlens, ("num_sequences + 1",))
        if sizes.size("batch") != 1:
            raise ValueError(f"{fn}: the batch size must be 1 rather than {sizes.size('batch')} with cu_seqlens "
                             f"(Q {list(tensors['Q'].shape)}); flatten variable-length inputs first")
        sizes.fix("R", cu_seqlens.shape[0] - 1, lambda: f"cu_seqlens {list(cu_seqlens.shape)}: one per sequence")
    else:
        sizes.fix("R", sizes.size("batch"), lambda: f"Q {list(tensors['Q'].shape)}: one per row")
    given = dict(tensors)
    if states is not None and len(states) != len(MAMBA3_STATES):
        raise ValueError(f"{fn}: Input_States holds {len(states)} tensors; expected the 4-tuple (angle, ssm, k, v)")
    for i, (what, form) in enumerate(MAMBA3_STATES if states is not None else ()):
        given[f"Input_States[{i}]"] = states[i]
        sizes.take(f"Input_States[{i}] ({what})", states[i], form)
    _floats(fn, "Q", given, {"cu_seqlens": cu_seqlens})


def check_rnn_forward(module: torch.nn.RNNBase, input: Any, hx: Any) -> None:
    """What torch.nn's ``forward`` checks before ``check_forward_args``, with torch's messages: the input is 2-D
    or 3-D with at least one step and the initial states have its rank; and, beyond torch, that the initial
    states have the input's dtype (torch fails inside its kernel there)."""
    name = "RNN" if module.mode.startswith("RNN") else module.mode  # as torch.nn's messages name the module
    packed = isinstance(input, torch.nn.utils.rnn.PackedSequence)
    data = input.data if packed else input
    if not packed:
        if input.dim() not in (2, 3):
            tensor = " tensor" if name == "RNN" else ""  # torch.nn's RNN says so
            raise ValueError(f"{name}: Expected input to be 2D or 3D, got {input.dim()}D{tensor} instead")
        if input.shape[1 if module.batch_first and input.dim() == 3 else 0] == 0:
            raise RuntimeError("Expected sequence length to be larger than 0 in RNN")
    lstm = module.mode == "LSTM"
    if hx is None or (lstm and not isinstance(hx, (tuple, list))):
        return  # no states, or not a pair (forward's own TypeError says what an LSTM takes)
    states = dict(zip(("hx", "cx") if lstm else ("hx",), hx if lstm else (hx,)))
    if not all(isinstance(t, torch.Tensor) for t in states.values()):
        return
    rank = 3 if packed or input.dim() == 3 else 2
    if any(t.dim() != rank for t in states.values()):
        kind = "batched 3-D" if rank == 3 else "unbatched 2-D"
        if lstm:
            got = ", ".join(f"{t.dim()}-D" for t in states.values())
            raise RuntimeError(f"For {kind} input, hx and cx should also be {rank}-D but got ({got}) tensors")
        raise RuntimeError(f"For {kind} input, hx should also be {rank}-D but got {states['hx'].dim()}-D tensor")
    for i, (arg, t) in enumerate(states.items()):
        if t.dtype != data.dtype:
            which = f"hx[{i}] ({'h_0' if arg == 'hx' else 'c_0'})" if lstm else "hx (h_0)"
            raise TypeError(f"{name}: {which} is {t.dtype} beside input {data.dtype}; the initial states take the "
                            f"input's dtype: pass {which.split(' ')[0]}.to({data.dtype})")


def check_state_batch_indices(fn: str, indices: torch.Tensor, pool: int, argument: str = "state_batch_indices",
                              pool_argument: str = "state") -> None:
    """Each entry of the indices (``argument``) names an entry of the state pool (``pool_argument.shape[0]`` =
    ``pool``) and no entry is named twice; reads the indices' values."""
    values = indices.reshape(-1).tolist()
    for position, value in enumerate(values):
        if not 0 <= value < pool:
            raise IndexError(f"{fn}: {argument}[{position}] = {value} is outside the state pool of "
                             f"{pool} entries ({pool_argument}.shape[0]); expected 0 <= index < {pool}")
    first: dict[int, int] = {}
    for position, value in enumerate(values):
        if value in first:
            raise ValueError(f"{fn}: {argument}[{first[value]}] and [{position}] both name state entry "
                             f"{value}; each row of x updates an entry of its own")
        first[value] = position


def check_seq_idx(fn: str, seq_idx: torch.Tensor) -> None:
    """``seq_idx`` does not decrease along a row (rlx_gpu packs sequences as runs of tokens); reads its values."""
    idx = seq_idx.detach().cpu().to(torch.int64)
    falls = (idx[:, 1:] < idx[:, :-1]).nonzero()
    if len(falls):
        row, t = (int(v) for v in falls[0])
        raise NotImplementedError(f"{fn}: seq_idx falls from {int(idx[row, t])} to {int(idx[row, t + 1])} at "
                                  f"[{row}, {t + 1}]; rlx_gpu packs sequences as runs of tokens (cu_seqlens), so "
                                  f"seq_idx must not decrease along a row")


def check_cu_seqlens(fn: str, cu_seqlens: torch.Tensor, tokens: int) -> None:
    """``cu_seqlens`` starts at 0, does not decrease and ends at ``tokens`` (ABI.md §8's rule); reads its values."""
    cu = cu_seqlens.reshape(-1).tolist()
    if not cu or cu[0] != 0:
        raise ValueError(f"{fn}: cu_seqlens {cu} must start at 0 (the first sequence's first token)")
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            raise ValueError(f"{fn}: cu_seqlens[{i}] = {cu[i]} is below cu_seqlens[{i - 1}] = {cu[i - 1]}; the "
                             f"sequence boundaries must not decrease")
    if cu[-1] != tokens:
        raise ValueError(f"{fn}: cu_seqlens ends at {cu[-1]}, expected the token count {tokens} (the packed "
                         f"sequences cover every token)")
