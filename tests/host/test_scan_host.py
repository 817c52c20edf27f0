"""The scan family of ABI.md §6 on the host, on a tanh-RNN cell written by hand as body-op schedules.

References: a plain Python loop that runs the same body thunks step by step (forward and vjp),
the closed-form f64 recurrence, and central finite differences for the gradients.
"""
from __future__ import annotations

import base64
import math

import ml_dtypes
import numpy as np
import pytest

from host_fallback import execute
from host_fallback.scan import HostMemory, run_scan_backward
from rlx_gpu.conformance.scan_cell import ArenaSlots

NP = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "f64": np.float64}
B, H, I = 2, 3, 2


def matmul(a: int, b: int, dst: int, m: int, k: int, n: int, dt: str, trans_b: bool) -> dict:
    return {"op": "matmul", "dtype": dt, "a": a, "b": b, "dst": dst, "batch": 1, "m": m, "k": k, "n": n,
            "trans_a": False, "trans_b": trans_b, "a_batch_stride": 0, "b_batch_stride": 0}


def binary(fn: str, a: int, b: int, dst: int, dt: str, b_strides: list[int] = [H, 1]) -> dict:
    return {"op": "binary", "dtype": dt, "fn": fn, "a": a, "b": b, "dst": dst, "shape": [B, H],
            "a_strides": [H, 1], "b_strides": b_strides}


def unary(fn: str, x: int, dst: int, dt: str) -> dict:
    return {"op": "unary", "dtype": dt, "fn": fn, "x": x, "dst": dst, "n": B * H}


class Rnn:
    """``h' = tanh(h·W_hhᵀ + x·W_ihᵀ + b)`` as a forward body and a hand-written vjp body."""

    def __init__(self, dtype: str, seed: int = 0, bcast_bias: bool = False):
        rng = np.random.default_rng(seed)
        self.dtype, self.bcast_bias = dtype, bcast_bias
        self.w_hh, self.w_ih = rng.normal(0, 0.6, (H, H)), rng.normal(0, 0.6, (H, I))
        self.bias = rng.normal(0, 0.3, H)
        self.es = np.dtype(NP[dtype]).itemsize
        self.carry_bytes = B * H * self.es
        self.x_bytes = B * I * self.es
        self.cell, self.cell_slots = self._body(vjp=False)
        self.vjp, self.vjp_slots = self._body(vjp=True)

    def _body(self, vjp: bool) -> tuple[dict, dict]:
        dt, mem = self.dtype, ArenaSlots(self.dtype)
        w_hh, w_ih = mem.const(self.w_hh), mem.const(self.w_ih)
        bias = mem.alloc(H) if self.bcast_bias and not vjp else mem.const(self.bias)
        h, x = mem.alloc(B * H), mem.alloc(B * I)
        t1, t2, t3, t4, y = (mem.alloc(B * H) for _ in range(5))
        thunks = [
            matmul(h, w_hh, t1, B, H, H, dt, trans_b=True),
            matmul(x, w_ih, t2, B, I, H, dt, trans_b=True),
            binary("add", t1, t2, t3, dt),
            binary("add", t3, bias, t4, dt, b_strides=[0, 1]),
            unary("tanh", t4, y, dt),
        ]
        slots = {"h": h, "x": x, "out": y, "bias": bias}
        if vjp:  # dz = dy·(1 − y²); dh = dz·W_hh; dx = dz·W_ih
            d_out, ones, y2, om, dz = (mem.alloc(B * H) for _ in range(5))
            dh, dx = mem.alloc(B * H), mem.alloc(B * I)
            thunks += [
                unary("square", y, y2, dt),
                {"op": "fill", "dtype": dt, "dst": ones, "n": B * H, "value": 1.0},
                binary("sub", ones, y2, om, dt),
                binary("mul", d_out, om, dz, dt),
                matmul(dz, w_hh, dh, B, H, H, dt, trans_b=False),
                matmul(dz, w_ih, dx, B, H, I, dt, trans_b=False),
            ]
            slots = {"h": h, "x": x, "d_out": d_out, "dh": dh, "dx": dx}
        return {"arena_bytes": mem.size, "init": mem.init, "thunks": thunks}, slots

    # --- the references: the same body thunks, run step by step by a plain loop -----------------

    def _fresh(self, body: dict) -> np.ndarray:
        arena = np.zeros(body["arena_bytes"], np.uint8)
        for entry in body["init"]:
            raw = np.frombuffer(base64.b64decode(entry["b64"]), np.uint8)
            arena[entry["offset"]: entry["offset"] + raw.size] = raw
        return arena

    def _put(self, arena: np.ndarray, offset: int, values: np.ndarray) -> None:
        raw = np.asarray(values).astype(NP[self.dtype]).view(np.uint8).ravel()
        arena[offset: offset + raw.size] = raw

    def _get(self, arena: np.ndarray, offset: int, count: int) -> np.ndarray:
        return arena[offset: offset + count * self.es].view(NP[self.dtype]).copy()

    def loop_forward(self, h0: np.ndarray, xs: np.ndarray) -> np.ndarray:
        """Carry output of every step, in storage type: ``[length, B*H]``."""
        arena, s = self._fresh(self.cell), self.cell_slots
        if self.bcast_bias:
            self._put(arena, s["bias"], self.bias)
        h, out = h0.astype(NP[self.dtype]), []
        for x in xs:
            self._put(arena, s["h"], h)
            self._put(arena, s["x"], x)
            for thunk in self.cell["thunks"]:
                execute(thunk, arena)
            h = self._get(arena, s["out"], B * H)
            out.append(h)
        return np.array(out)

    def loop_backward(self, h0, xs, upstream, save_trajectory: bool) -> tuple[np.ndarray, np.ndarray]:
        """``(dinit, dxs)`` by ABI.md §6 step by step; upstream rows add in f32 for 16-bit carries."""
        carries = np.concatenate([h0.astype(NP[self.dtype])[None], self.loop_forward(h0, xs)[:-1]])
        arena, s = self._fresh(self.vjp), self.vjp_slots
        acc = np.float64 if self.dtype == "f64" else np.float32
        d = np.zeros(B * H, NP[self.dtype]) if save_trajectory else upstream.astype(NP[self.dtype])
        dxs = np.zeros((len(xs), B * I), NP[self.dtype])
        for t in range(len(xs) - 1, -1, -1):
            if save_trajectory:
                d = (d.astype(acc) + upstream[t].astype(NP[self.dtype]).astype(acc)).astype(NP[self.dtype])
            self._put(arena, s["h"], carries[t])
            self._put(arena, s["x"], xs[t])
            self._put(arena, s["d_out"], d)
            for thunk in self.vjp["thunks"]:
                execute(thunk, arena)
            d, dxs[t] = self._get(arena, s["dh"], B * H), self._get(arena, s["dx"], B * I)
        return d, dxs


class Problem:
    """An outer arena holding init, xs, a trajectory, upstream rows and the gradient outputs."""

    def __init__(self, rnn: Rnn, length: int, seed: int = 1):
        rng = np.random.default_rng(seed)
        self.rnn, self.length = rnn, length
        self.h0, self.xs = rng.normal(0, 0.5, B * H), rng.normal(0, 1.0, (length, B * I))
        self.up_rows, self.up_final = rng.normal(0, 1, (length, B * H)), rng.normal(0, 1, B * H)
        lay = ArenaSlots(rnn.dtype)
        self.init, self.xs_off, self.traj = lay.alloc(B * H), lay.alloc(length * B * I), lay.alloc(length * B * H)
        self.upstream, self.dinit, self.dxs = lay.alloc(length * B * H), lay.alloc(B * H), lay.alloc(length * B * I)
        self.bias = lay.alloc(H)
        self.arena = np.zeros(lay.size, np.uint8)
        self.put(self.init, self.h0)
        self.put(self.xs_off, self.xs)
        self.put(self.bias, rnn.bias)

    def put(self, offset: int, values: np.ndarray) -> None:
        self.rnn._put(self.arena, offset, values)

    def get(self, offset: int, count: int) -> np.ndarray:
        return self.rnn._get(self.arena, offset, count)

    def scan(self, save_trajectory: bool, k: int = 0, **extra) -> dict:
        r, s = self.rnn, self.rnn.cell_slots
        bcast = [[s["bias"], self.bias, H * r.es]] if r.bcast_bias else []
        return {"op": "scan", "dtype": r.dtype, "body": r.cell, "body_input_off": s["h"], "body_output_off": s["out"],
                "outer_init_off": self.init, "outer_final_off": self.traj, "length": self.length,
                "carry_bytes": r.carry_bytes, "save_trajectory": save_trajectory,
                "xs_inputs": [[s["x"], self.xs_off, r.x_bytes]], "bcast_inputs": bcast, "num_checkpoints": k, **extra}

    def backward(self, op: str, save_trajectory: bool, k: int, **extra) -> dict:
        """The backward thunk; also runs the checkpointed forward that fills its trajectory rows."""
        r, v, f = self.rnn, self.rnn.vjp_slots, self.rnn.cell_slots
        execute(self.scan(True, k), self.arena)
        self.put(self.upstream, self.up_rows if save_trajectory else self.up_final)
        thunk = {"op": op, "dtype": r.dtype, "body_vjp": r.vjp, "body_carry_in_off": v["h"], "body_x_offs": [v["x"]],
                 "body_d_output_off": v["d_out"], "body_dcarry_out_off": v["dh"], "outer_init_off": self.init,
                 "outer_traj_off": self.traj, "outer_upstream_off": self.upstream,
                 "outer_xs_offs": [[self.xs_off, r.x_bytes]], "length": self.length, "carry_bytes": r.carry_bytes,
                 "carry_elem_size": r.es, "save_trajectory": save_trajectory, "num_checkpoints": k,
                 "forward_body": r.cell, "forward_body_carry_in_off": f["h"], "forward_body_output_off": f["out"],
                 "forward_body_x_offs": [f["x"]]}
        if op == "scan_backward":
            thunk["outer_dinit_off"] = self.dinit
        else:
            thunk.update(xs_idx=0, body_dxs_out_off=v["dx"], outer_dxs_off=self.dxs, per_step_bytes=r.x_bytes)
        return {**thunk, **extra}

    def gradient(self, op: str, save_trajectory: bool, k: int, recompute: str = "segment") -> np.ndarray:
        execute(self.backward(op, save_trajectory, k), self.arena, recompute=recompute)
        if op == "scan_backward":
            return self.get(self.dinit, B * H)
        return self.get(self.dxs, self.length * B * I).reshape(self.length, B * I)


# --- forward -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("bcast_bias", [False, True])
def test_scan_matches_the_step_loop(dtype: str, bcast_bias: bool) -> None:
    rnn = Rnn(dtype, bcast_bias=bcast_bias)
    p = Problem(rnn, length=7)
    expected = rnn.loop_forward(p.h0, p.xs)
    execute(p.scan(save_trajectory=True), p.arena)
    np.testing.assert_array_equal(p.get(p.traj, 7 * B * H).reshape(7, -1), expected)
    p.arena[p.traj: p.traj + rnn.carry_bytes] = 0
    execute(p.scan(save_trajectory=False), p.arena)
    np.testing.assert_array_equal(p.get(p.traj, B * H), expected[-1])


def test_the_cell_is_the_tanh_rnn() -> None:
    rnn = Rnn("f64")
    p = Problem(rnn, length=4)
    execute(p.scan(save_trajectory=False), p.arena)
    h = p.h0.reshape(B, H)
    for x in p.xs:
        h = np.tanh(h @ rnn.w_hh.T + x.reshape(B, I) @ rnn.w_ih.T + rnn.bias)
    np.testing.assert_allclose(p.get(p.traj, B * H), h.ravel(), rtol=1e-13)


@pytest.mark.parametrize(("length", "k"), [(7, 3), (7, 1), (8, 4), (5, 5), (6, 0)])
def test_checkpoint_rows(length: int, k: int) -> None:
    rnn = Rnn("f32")
    p = Problem(rnn, length)
    execute(p.scan(True, k), p.arena)
    rows = k if 0 < k < length else length
    steps = [math.ceil((j + 1) * length / rows) - 1 for j in range(rows)]
    expected = rnn.loop_forward(p.h0, p.xs)[steps]
    np.testing.assert_array_equal(p.get(p.traj, rows * B * H).reshape(rows, -1), expected)


def test_length_zero_passes_init_through() -> None:
    p = Problem(Rnn("f32"), length=0)
    execute(p.scan(False), p.arena)
    np.testing.assert_array_equal(p.get(p.traj, B * H), p.h0.astype(np.float32))


def test_body_arena_restored_per_execution_not_per_step() -> None:
    # carry' = carry + n after n += 1, with n baked as 100 in init: 101+102+103+104 per execution.
    mem = ArenaSlots("f64")
    one, n = mem.const([1.0]), mem.const([100.0])
    c_in, c_out = mem.alloc(1), mem.alloc(1)
    add = {"op": "binary", "dtype": "f64", "fn": "add", "shape": [1], "a_strides": [1], "b_strides": [1]}
    thunks = [{**add, "a": n, "b": one, "dst": c_out},
              {"op": "copy", "dtype": "f64", "src": c_out, "dst": n, "nbytes": 8},
              {**add, "a": c_in, "b": n, "dst": c_out}]
    body = {"arena_bytes": mem.size, "init": mem.init, "thunks": thunks}
    outer = np.zeros(16, np.uint8)
    thunk = {"op": "scan", "dtype": "f64", "body": body, "body_input_off": c_in, "body_output_off": c_out,
             "outer_init_off": 0, "outer_final_off": 8, "length": 4, "carry_bytes": 8, "save_trajectory": False,
             "xs_inputs": [], "bcast_inputs": [], "num_checkpoints": 0}
    for _ in range(2):
        execute(thunk, outer)
        assert outer[8:16].view(np.float64)[0] == 410.0


# --- backward ----------------------------------------------------------------------------------


def loss(rnn: Rnn, h0: np.ndarray, xs: np.ndarray, p: Problem, save_trajectory: bool) -> float:
    traj = rnn.loop_forward(h0, xs).astype(np.float64)
    return float(np.sum(p.up_rows * traj)) if save_trajectory else float(p.up_final @ traj[-1])


def central_difference(f, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    grad = np.zeros_like(x)
    for i in np.ndindex(*x.shape):
        hi, lo = x.copy(), x.copy()
        hi[i] += eps
        lo[i] -= eps
        grad[i] = (f(hi) - f(lo)) / (2 * eps)
    return grad


@pytest.mark.parametrize("save_trajectory", [False, True])
@pytest.mark.parametrize("k", [0, 2])
def test_gradients_match_finite_differences(save_trajectory: bool, k: int) -> None:
    rnn = Rnn("f64", seed=3)
    p = Problem(rnn, length=5, seed=4)
    dinit = p.gradient("scan_backward", save_trajectory, k)
    fd = central_difference(lambda h0: loss(rnn, h0, p.xs, p, save_trajectory), p.h0)
    np.testing.assert_allclose(dinit, fd, rtol=1e-3, atol=1e-8)
    dxs = p.gradient("scan_backward_xs", save_trajectory, k)
    fd = central_difference(lambda xs: loss(rnn, p.h0, xs, p, save_trajectory), p.xs)
    np.testing.assert_allclose(dxs, fd, rtol=1e-3, atol=1e-8)


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32", "f64"])
@pytest.mark.parametrize("save_trajectory", [False, True])
def test_backward_matches_the_step_loop(dtype: str, save_trajectory: bool) -> None:
    rnn = Rnn(dtype, seed=5)
    p = Problem(rnn, length=6, seed=6)
    upstream = p.up_rows if save_trajectory else p.up_final
    dinit, dxs = rnn.loop_backward(p.h0, p.xs, upstream, save_trajectory)
    np.testing.assert_array_equal(p.gradient("scan_backward", save_trajectory, 3), dinit)
    np.testing.assert_array_equal(p.gradient("scan_backward_xs", save_trajectory, 3, "treeverse"), dxs)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("op", ["scan_backward", "scan_backward_xs"])
def test_bitwise_across_checkpoints_and_strategies(dtype: str, op: str) -> None:
    length = 10
    p = Problem(Rnn(dtype, seed=7), length, seed=8)
    for save_trajectory in (False, True):
        results = {(k, how): p.gradient(op, save_trajectory, k, how).tobytes()
                   for k in (0, 1, 2, math.isqrt(length), length) for how in ("segment", "treeverse")}
        assert len(set(results.values())) == 1, sorted(results)


def test_treeverse_holds_log_carries_and_segment_holds_the_segment() -> None:
    length = 32
    p = Problem(Rnn("f32"), length)
    arenas = p.rnn.vjp["arena_bytes"] + p.rnn.cell["arena_bytes"]
    peaks, runs = {}, {}
    for how in ("segment", "treeverse"):
        mem = HostMemory()
        run_scan_backward(mem, p.backward("scan_backward", False, 1), p.arena, recompute=how)
        peaks[how], runs[how] = mem.peak - arenas, mem.runs - length
    c = p.rnn.carry_bytes
    assert peaks["segment"] == (length - 1) * c and runs["segment"] == length - 1
    assert peaks["treeverse"] == math.ceil(math.log2(length)) * c
    assert length - 1 < runs["treeverse"] <= length * math.log2(length) / 2


# --- errors ------------------------------------------------------------------------------------


def test_too_many_checkpoints() -> None:
    p = Problem(Rnn("f32"), length=4)
    with pytest.raises(ValueError, match="num_checkpoints=5"):
        execute(p.scan(True, 5), p.arena)
    with pytest.raises(ValueError, match="num_checkpoints=5"):
        execute({**p.backward("scan_backward", False, 2), "num_checkpoints": 5}, p.arena)


def test_checkpoints_need_forward_body() -> None:
    p = Problem(Rnn("f32"), length=4)
    with pytest.raises(ValueError, match="forward_body"):
        execute(p.backward("scan_backward", False, 2, forward_body=None), p.arena)
    execute(p.backward("scan_backward", False, 4, forward_body=None), p.arena)  # every carry saved: fine


def test_declared_output_size_must_match_carry() -> None:
    rnn = Rnn("f32")
    p = Problem(rnn, length=3)
    out = rnn.cell_slots["out"]
    body = {**rnn.cell, "tensors": {"h": {"offset": out, "dtype": "f32", "shape": [B, H + 1]}}, "outputs": ["h"]}
    with pytest.raises(ValueError, match=r"carry_bytes=24"):
        execute(p.scan(False, body=body), p.arena)
    with pytest.raises(ValueError, match=r"carry_bytes=24"):
        execute(p.backward("scan_backward", False, 1, forward_body=body), p.arena)


def test_output_slot_outside_body_arena() -> None:
    rnn = Rnn("f32")
    p = Problem(rnn, length=3)
    with pytest.raises(ValueError, match="body_output_off"):
        execute(p.scan(False, body_output_off=rnn.cell["arena_bytes"] - 4), p.arena)


def test_overlapping_carry_slots_are_refused() -> None:
    rnn = Rnn("f32")
    p = Problem(rnn, length=3)
    with pytest.raises(ValueError, match="overlap"):
        execute(p.scan(False, body_output_off=rnn.cell_slots["h"] + 4), p.arena)


def test_bad_carry_elem_size_and_strategy() -> None:
    p = Problem(Rnn("f32"), length=3)
    with pytest.raises(ValueError, match="carry_elem_size=2"):
        execute(p.backward("scan_backward", True, 0, carry_elem_size=2), p.arena)
    with pytest.raises(ValueError, match="recompute='bisect'"):
        execute(p.backward("scan_backward", True, 0), p.arena, recompute="bisect")
