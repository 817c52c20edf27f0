"""Float64 references of every non-scan op, written from ABI.md (no ``host_fallback`` code).

The forward ops' are here; every ``reference_*`` module registers its own (``registry``), and importing
this module imports them all. ``copy`` and the scan family have none, each for the reason it is exempt.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from host_fallback.abi import SCAN_OPS
from host_fallback.registry import import_all

from . import reference_rnn, reference_ssm
from .reference_rnn import sigmoid
from .registry import CASES, REFERENCES, V2_FIELDS, Load, declare_cases, reference

UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "exp": np.exp, "log": np.log, "tanh": np.tanh, "sigmoid": sigmoid, "relu": lambda x: np.maximum(x, 0),
    "neg": np.negative, "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x), "square": np.square, "abs": np.abs,
    "recip": lambda x: 1 / x, "softplus": lambda x: np.logaddexp(x, 0), "step": lambda x: np.where(x > 0, 1.0, 0.0),
}
BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "max": np.maximum, "min": np.minimum,
}


@reference("lstm", "gru", "rnn", v2_fields=reference_rnn.V2_FIELDS)
def recurrent(t: Mapping[str, Any], load: Load) -> dict[str, np.ndarray]:
    op = t["op"]
    names = ("b_ih", "b_hh") if op == "gru" else ("bias",)
    tensors = {f: load(f) for f in ("seq_lens", "peepholes", "w_hr") if t.get(f) is not None}
    flags = {f: t[f] for f in ("reverse", "clip", "activations", "linear_before_reset", "input_forget", "proj_size")
             if f in t}
    dst, h, c = reference_rnn.reference(
        op, load("x"), load("w_ih"), load("w_hh"), {n: load(n) for n in names}, hidden=t["hidden"],
        num_layers=t["num_layers"], bidirectional=t["bidirectional"], relu=bool(t.get("relu")),
        h0=load("h0") if t["carry"] else None, c0=load("c0") if t["carry"] and op == "lstm" else None,
        **tensors, **flags)
    out = {"dst": dst}
    if t["carry"]:
        out["h0"] = h
        if op == "lstm":
            out["c0"] = c
    return out


def _state_space(t: Mapping[str, Any], load: Load, reference: Callable, inputs: tuple[str, ...],
                 optional: tuple[str, ...], flags: tuple[str, ...]) -> dict[str, np.ndarray]:
    """A selective_scan or mamba2 reference on the thunk's tensors and §8 fields (``t`` is completed)."""
    fields = {f: load(f) for f in optional + ("cu_seqlens", "state_slots") if t[f] is not None}
    fields.update({f: t[f] for f in flags})
    if t["carry_state"]:
        y, final = reference(*(load(f) for f in inputs), state=load("state"), **fields)
        return {"dst": y, "state": final}
    return {"dst": reference(*(load(f) for f in inputs), **fields)}


@reference("selective_scan", v2_fields=reference_ssm.V2_FIELDS)
def selective_scan(t: Mapping[str, Any], load: Load) -> dict[str, np.ndarray]:
    return _state_space(t, load, reference_ssm.selective_scan, ("x", "delta", "a", "b", "c"), ("delta_bias", "d", "z"),
                        ("delta_softplus",))


@reference("mamba2", v2_fields=reference_ssm.V2_FIELDS)
def mamba2(t: Mapping[str, Any], load: Load) -> dict[str, np.ndarray]:
    return _state_space(t, load, reference_ssm.mamba2, ("x", "dt", "a", "b", "c"), ("dt_bias", "d", "z"),
                        ("dt_softplus", "dt_limit"))


@reference("gated_delta_net", v2_fields=reference_ssm.V2_FIELDS)
def gated_delta_net(t: Mapping[str, Any], load: Load) -> dict[str, np.ndarray]:
    ints = {f: load(f) for f in ("cu_seqlens", "state_slots") if t[f] is not None}
    out, final = reference_ssm.gated_delta_net(
        *(load(f) for f in ("q", "k", "v", "g", "beta")), state=load("state") if t["carry_state"] else None,
        scale=t["scale"], qk_l2norm=t["qk_l2norm"], **ints)
    return {"dst": out, "state": final} if t["carry_state"] else {"dst": out}


@reference("unary")
def unary(t: Mapping[str, Any], load: Load) -> dict[str, np.ndarray]:
    return {"dst": UNARY[t["fn"]](load("x"))}


@reference("binary")
def binary(t: Mapping[str, Any], load: Load) -> dict[str, np.ndarray]:
    a, b = (np.lib.stride_tricks.as_strided(load(f), t["shape"], [s * 8 for s in t[f + "_strides"]]) for f in "ab")
    return {"dst": BINARY[t["fn"]](a, b)}


@reference("matmul")
def matmul(t: Mapping[str, Any], load: Load) -> dict[str, np.ndarray]:
    m, k, n = t["m"], t["k"], t["n"]
    a, b = load("a").ravel(), load("b").ravel()
    out = []
    for i in range(t["batch"]):
        lhs = a[i * t["a_batch_stride"]:][: m * k].reshape((k, m) if t["trans_a"] else (m, k))
        rhs = b[i * t["b_batch_stride"]:][: k * n].reshape((n, k) if t["trans_b"] else (k, n))
        out.append((lhs.T if t["trans_a"] else lhs) @ (rhs.T if t["trans_b"] else rhs))
    return {"dst": np.array(out)}


@reference("reduce_sum")
def reduce_sum(t: Mapping[str, Any], load: Load) -> dict[str, np.ndarray]:
    return {"dst": load("x").sum(axis=1)}


@reference("fill")
def fill(t: Mapping[str, Any], load: Load) -> dict[str, np.ndarray]:
    return {"dst": np.full(t["n"], t["value"])}


@reference("cast")
def cast(t: Mapping[str, Any], load: Load) -> dict[str, np.ndarray]:
    return {"dst": load("src")}


def _matmul(batch: int, m: int, k: int, n: int, ta: bool, tb: bool, sa: int, sb: int) -> dict:
    return dict(batch=batch, m=m, k=k, n=n, trans_a=ta, trans_b=tb, a_batch_stride=sa, b_batch_stride=sb)


# the body ops' shapes (every unary and binary function too; the catalog adds their NaN/Inf cases and the cast
# matrix)
declare_cases("unary", small=dict(n=37, fn="tanh"), thunks=[(dict(fn=fn, n=67), {}, False) for fn in UNARY])
declare_cases("binary", small=dict(fn="add", shape=[3, 5], a_strides=[5, 1], b_strides=[0, 1]), thunks=[
    (dict(fn="add", shape=[2, 3, 4], a_strides=[12, 4, 1], b_strides=[0, 1, 0]), {}, False),
    *[(dict(fn=fn, shape=[3, 1, 5], a_strides=[5, 0, 1], b_strides=[0, 0, 1]), {}, False) for fn in BINARY]])
declare_cases("matmul", small=_matmul(2, 3, 5, 4, False, True, 15, 0), thunks=[
    (_matmul(2, 5, 7, 3, False, False, 35, 0), {}, False),
    (_matmul(2, 17, 18, 19, True, True, 306, 342), {}, False),
    (_matmul(3, 70, 65, 33, False, True, 70 * 65, 0), {}, True)])
declare_cases("reduce_sum", small=dict(outer=3, r=4, inner=5), thunks=[(dict(outer=3, r=5, inner=7), {}, False)])
declare_cases("copy", small=dict(nbytes=64), thunks=[(dict(nbytes=37), {}, False)])
declare_cases("fill", small=dict(n=17, value=1.5), thunks=[(dict(n=9, value=1.5), {}, False)])
declare_cases("cast", small=dict(n=17, src_dtype="f32"))

import_all(__package__, "reference_")  # the other ops' references register themselves on import
REFERENCES.exempt("copy", "it moves bytes, which the runner compares exactly")
REFERENCES.exempt(SCAN_OPS, "the runner checks the scan family against scan_cell's float64 recurrence of its body")

__all__ = ["CASES", "REFERENCES", "V2_FIELDS", "UNARY", "BINARY", "Load"]
