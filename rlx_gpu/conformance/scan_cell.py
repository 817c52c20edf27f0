"""The scan family's cases: a tanh-RNN cell written as body-op schedules, and its float64 reference.

``h' = tanh(h·W_hhᵀ + x·W_ihᵀ + b)`` is the forward body (matmul, matmul, add, add of a broadcast
bias, tanh); its vjp body is written by hand (``dz = dh'·(1 − h'²)``, ``dh = dz·W_hh``,
``dx = dz·W_ih``). The reference runs the same recurrence and its gradient in float64 from the
weights as the body stores them (rounded to the dtype), so it shares nothing with ``host_fallback``.
"""
from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from host_fallback.abi import ELEM_SIZE
from host_fallback.arena import STORAGE

B, H, I = 2, 3, 2  # batch rows, carry width, input width of the cell


def _stored(values: np.ndarray, dtype: str) -> np.ndarray:
    """``values`` as ``dtype`` storage would hold them, back in float64."""
    return np.asarray(values, np.float64).astype(STORAGE[dtype]).astype(np.float64)


class ArenaSlots:
    """Bump allocator of one arena (a body's, or the schedule's around it), with the constants it bakes into
    ``init``."""

    def __init__(self, dtype: str):
        self.dtype, self.size, self.init = dtype, 0, []

    def alloc(self, count: int) -> int:
        offset, self.size = self.size, self.size + count * ELEM_SIZE[self.dtype]
        return offset

    def const(self, values: np.ndarray) -> int:
        offset = self.alloc(np.size(values))
        raw = np.asarray(values, np.float64).astype(STORAGE[self.dtype]).tobytes()
        self.init.append({"offset": offset, "b64": base64.b64encode(raw).decode()})
        return offset

    def body(self, thunks: list[dict]) -> dict[str, Any]:
        return {"arena_bytes": self.size, "init": self.init, "thunks": thunks}


def _matmul(a: int, b: int, dst: int, m: int, k: int, n: int, dt: str, trans_b: bool) -> dict:
    return {"op": "matmul", "dtype": dt, "a": a, "b": b, "dst": dst, "batch": 1, "m": m, "k": k, "n": n,
            "trans_a": False, "trans_b": trans_b, "a_batch_stride": 0, "b_batch_stride": 0}


def _binary(fn: str, a: int, b: int, dst: int, dt: str, b_strides: tuple[int, int] = (H, 1)) -> dict:
    return {"op": "binary", "dtype": dt, "fn": fn, "a": a, "b": b, "dst": dst, "shape": [B, H],
            "a_strides": [H, 1], "b_strides": list(b_strides)}


def _unary(fn: str, x: int, dst: int, dt: str) -> dict:
    return {"op": "unary", "dtype": dt, "fn": fn, "x": x, "dst": dst, "n": B * H}


@dataclass(frozen=True)
class Cell:
    """The cell's weights (float64, as stored), its forward and vjp bodies and their slot offsets."""

    dtype: str
    bcast_bias: bool
    w_hh: np.ndarray
    w_ih: np.ndarray
    bias: np.ndarray
    forward: dict
    forward_slots: dict
    vjp: dict
    vjp_slots: dict

    @property
    def carry_bytes(self) -> int:
        return B * H * ELEM_SIZE[self.dtype]

    @property
    def x_bytes(self) -> int:
        return B * I * ELEM_SIZE[self.dtype]


def cell(dtype: str, bcast_bias: bool, seed: int = 0) -> Cell:
    """The cell in ``dtype``; with ``bcast_bias`` the forward body's bias is a broadcast input
    (``bcast_inputs``, which only ``scan`` has), else a constant of its ``init``."""
    rng = np.random.default_rng(seed)
    w_hh, w_ih, bias = rng.normal(0, 0.6, (H, H)), rng.normal(0, 0.6, (H, I)), rng.normal(0, 0.3, H)
    bodies = []
    for vjp in (False, True):
        mem, dt = ArenaSlots(dtype), dtype
        w_hh_at, w_ih_at = mem.const(w_hh), mem.const(w_ih)
        bias_at = mem.alloc(H) if bcast_bias and not vjp else mem.const(bias)
        h, x = mem.alloc(B * H), mem.alloc(B * I)
        t1, t2, t3, t4, y = (mem.alloc(B * H) for _ in range(5))
        thunks = [_matmul(h, w_hh_at, t1, B, H, H, dt, trans_b=True), _matmul(x, w_ih_at, t2, B, I, H, dt, trans_b=True),
                  _binary("add", t1, t2, t3, dt), _binary("add", t3, bias_at, t4, dt, b_strides=(0, 1)),
                  _unary("tanh", t4, y, dt)]
        slots = {"h": h, "x": x, "out": y, "bias": bias_at}
        if vjp:
            d_out, ones, y2, om, dz = (mem.alloc(B * H) for _ in range(5))
            dh, dx = mem.alloc(B * H), mem.alloc(B * I)
            thunks += [_unary("square", y, y2, dt), {"op": "fill", "dtype": dt, "dst": ones, "n": B * H, "value": 1.0},
                       _binary("sub", ones, y2, om, dt), _binary("mul", d_out, om, dz, dt),
                       _matmul(dz, w_hh_at, dh, B, H, H, dt, trans_b=False),
                       _matmul(dz, w_ih_at, dx, B, H, I, dt, trans_b=False)]
            slots = {"h": h, "x": x, "d_out": d_out, "dh": dh, "dx": dx}
        bodies.append((mem.body(thunks), slots))
    (fwd, fwd_slots), (vjp_body, vjp_slots) = bodies
    return Cell(dtype, bcast_bias, _stored(w_hh, dtype), _stored(w_ih, dtype), _stored(bias, dtype), fwd, fwd_slots,
                vjp_body, vjp_slots)


def checkpoint_steps(length: int, num_checkpoints: int) -> list[int]:
    """The steps whose carries a trajectory of ``num_checkpoints`` rows holds (ABI.md §6)."""
    rows = num_checkpoints if 0 < num_checkpoints < length else length
    return [math.ceil((j + 1) * length / rows) - 1 for j in range(rows)]


def fields(op: str, c: Cell, length: int, save_trajectory: bool, num_checkpoints: int) -> dict[str, Any]:
    """The thunk fields of ``op`` over cell ``c`` (outer offsets 0, placed by ``cases.lay_out``)."""
    f, v = c.forward_slots, c.vjp_slots
    if op == "scan":
        return {"body": c.forward, "body_input_off": f["h"], "body_output_off": f["out"], "outer_init_off": 0,
                "outer_final_off": 0, "length": length, "carry_bytes": c.carry_bytes,
                "save_trajectory": save_trajectory, "xs_inputs": [[f["x"], 0, c.x_bytes]],
                "bcast_inputs": [[f["bias"], 0, H * ELEM_SIZE[c.dtype]]] if c.bcast_bias else [],
                "num_checkpoints": num_checkpoints}
    out = {"body_vjp": c.vjp, "body_carry_in_off": v["h"], "body_x_offs": [v["x"]], "body_d_output_off": v["d_out"],
           "body_dcarry_out_off": v["dh"], "outer_init_off": 0, "outer_traj_off": 0, "outer_upstream_off": 0,
           "outer_xs_offs": [[0, c.x_bytes]], "length": length, "carry_bytes": c.carry_bytes,
           "carry_elem_size": ELEM_SIZE[c.dtype], "save_trajectory": save_trajectory,
           "num_checkpoints": num_checkpoints, "forward_body": c.forward, "forward_body_carry_in_off": f["h"],
           "forward_body_output_off": f["out"], "forward_body_x_offs": [f["x"]]}
    if op == "scan_backward":
        out["outer_dinit_off"] = 0
    else:
        out.update(xs_idx=0, body_dxs_out_off=v["dx"], outer_dxs_off=0, per_step_bytes=c.x_bytes)
    return out


@dataclass(frozen=True)
class Problem:
    """The outer inputs of one case (float64, as stored) and where each lives in the thunk."""

    h0: np.ndarray        # [B*H]
    xs: np.ndarray        # [length, B*I]
    upstream: np.ndarray  # [length, B*H] with a trajectory, else [B*H]


def problem(op: str, c: Cell, length: int, save_trajectory: bool, seed: int) -> Problem:
    rng = np.random.default_rng(seed)
    h0, xs = rng.normal(0, 0.5, B * H), rng.normal(0, 1.0, (length, B * I))
    upstream = rng.normal(0, 1, (length, B * H) if save_trajectory else B * H)
    return Problem(_stored(h0, c.dtype), _stored(xs, c.dtype), _stored(upstream, c.dtype))


def forward(c: Cell, p: Problem) -> np.ndarray:
    """Every step's carry in float64: ``[length, B*H]``."""
    h, out = p.h0.reshape(B, H), []
    for x in p.xs:
        h = np.tanh(h @ c.w_hh.T + x.reshape(B, I) @ c.w_ih.T + c.bias)
        out.append(h.ravel())
    return np.array(out).reshape(len(p.xs), B * H)


def gradients(c: Cell, p: Problem, save_trajectory: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(dinit [B*H], dxs [length, B*I])`` of ``sum(upstream · carries)`` (every step's carry with a
    trajectory, the final one without), by the chain rule in float64."""
    carries = forward(c, p).reshape(-1, B, H)
    d = np.zeros((B, H)) if save_trajectory else p.upstream.reshape(B, H)
    dxs = np.zeros((len(p.xs), B * I))
    for t in range(len(p.xs) - 1, -1, -1):
        if save_trajectory:
            d = d + p.upstream[t].reshape(B, H)
        dz = d * (1 - carries[t] ** 2)
        dxs[t] = (dz @ c.w_ih).ravel()
        d = dz @ c.w_hh
    return d.ravel(), dxs


def inputs(op: str, c: Cell, p: Problem, num_checkpoints: int) -> dict[str, np.ndarray]:
    """The outer input tensors by region label (``host_fallback.abi.regions``)."""
    if op == "scan":
        bias = {"bcast_inputs[0]": c.bias} if c.bcast_bias else {}
        return {"outer_init_off": p.h0, "xs_inputs[0]": p.xs, **bias}
    rows = forward(c, p)[checkpoint_steps(len(p.xs), num_checkpoints)]
    return {"outer_init_off": p.h0, "outer_xs_offs[0]": p.xs, "outer_traj_off": rows, "outer_upstream_off": p.upstream}


def reference(op: str, c: Cell, p: Problem, save_trajectory: bool, num_checkpoints: int) -> dict[str, np.ndarray]:
    """The float64 value of every output, by region label."""
    if op == "scan":
        carries = forward(c, p)
        rows = carries[checkpoint_steps(len(p.xs), num_checkpoints)] if save_trajectory else carries[-1]
        return {"outer_final_off": rows}
    dinit, dxs = gradients(c, p, save_trajectory)
    return {"outer_dinit_off": dinit} if op == "scan_backward" else {"outer_dxs_off": dxs}
