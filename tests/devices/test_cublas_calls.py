"""The cuBLAS mapping of row-major gemms, executed here by an independent column-major interpreter.

``execute`` below implements the BLAS definition of ``gemmStridedBatchedEx`` (column-major, ``ld``,
``op``, element strides, stride 0 shares a matrix, ``C = alpha·op(A)·op(B) + beta·C``) on NumPy byte
buffers, and rejects what cuBLAS rejects (``ld < max(1, rows)``, out-of-range reads). Whatever the
mapping emits must reproduce NumPy's row-major products through it.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from host_fallback.arena import STORAGE
from rlx_gpu import launches
from rlx_gpu.backends import cublas_calls
from rlx_gpu.backends.cublas_calls import GemmCall, NotMappable, RowMajor, gemm_launch_calls, matmul_call, with_cublas
from rlx_gpu.launches import ARENA, SCRATCH
from rlx_gpu.launches.body import gemm

DTYPES = ("f32", "f16", "bf16", "f64")
TOL = {"f32": 1e-5, "f64": 1e-12, "f16": 2e-3, "bf16": 1.6e-2}


def _matrix(buf: np.ndarray, dtype: str, start: int, rows: int, cols: int, ld: int) -> np.ndarray:
    """The column-major ``rows×cols`` matrix at element ``start`` of ``buf`` (in float64)."""
    assert ld >= max(1, rows), f"ld {ld} < max(1, {rows}): cuBLAS returns CUBLAS_STATUS_INVALID_VALUE"
    elems = buf.view(STORAGE[dtype])
    idx = start + np.arange(rows)[:, None] + ld * np.arange(cols)[None, :]
    assert start >= 0 and idx.max() < elems.size, f"reads past the buffer ({idx.max()} >= {elems.size})"
    return elems[idx].astype(np.float64)


def execute(call: GemmCall, buffers: dict) -> None:
    """Run ``call`` with the BLAS semantics on ``buffers`` (``Buf -> numpy.uint8``), in place."""
    for arg in (call.m, call.n, call.k, call.batch):
        assert 0 <= arg <= cublas_calls.INT_MAX
    es = {name: np.dtype(STORAGE[name]).itemsize for name in STORAGE}
    for z in range(call.batch):
        shape_a = (call.m, call.k) if call.op_a == "N" else (call.k, call.m)
        shape_b = (call.k, call.n) if call.op_b == "N" else (call.n, call.k)
        a = _matrix(buffers[call.a.buf], call.a.dtype, call.a.offset // es[call.a.dtype] + z * call.stride_a, *shape_a, call.lda)
        b = _matrix(buffers[call.b.buf], call.b.dtype, call.b.offset // es[call.b.dtype] + z * call.stride_b, *shape_b, call.ldb)
        op_a = a if call.op_a == "N" else a.T
        op_b = b if call.op_b == "N" else b.T
        c_start = call.c.offset // es[call.c.dtype] + z * call.stride_c
        old = _matrix(buffers[call.c.buf], call.c.dtype, c_start, call.m, call.n, call.ldc)
        new = call.alpha * (op_a @ op_b) + (call.beta * old if call.beta else 0)
        elems = buffers[call.c.buf].view(STORAGE[call.c.dtype])
        idx = c_start + np.arange(call.m)[:, None] + call.ldc * np.arange(call.n)[None, :]
        elems[idx] = new.astype(STORAGE[call.c.dtype])


def _store(values: np.ndarray, dtype: str) -> np.ndarray:
    return np.ascontiguousarray(values.astype(STORAGE[dtype])).reshape(-1).view(np.uint8)


def _close(got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    scale = max(np.abs(want).max(), 1.0)
    assert np.abs(got - want).max() <= TOL[dtype] * scale * 4, f"max error {np.abs(got - want).max():.3g}"


SIZES = [(1, 1, 1), (3, 5, 2), (7, 1, 4), (2, 9, 1), (1, 6, 5)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product((False, True), repeat=2)))
def test_matmul_thunks_through_the_interpreter(dtype, trans_a, trans_b):
    rng = np.random.default_rng(11)
    for (m, k, n), batch, share_a, share_b in itertools.product(SIZES, (1, 2, 3), (False, True), (False, True)):
        a = rng.standard_normal((1 if share_a else batch, m * k))
        b = rng.standard_normal((1 if share_b else batch, k * n))
        a_bytes, b_bytes = _store(a, dtype), _store(b, dtype)
        pad = 64  # operands sit at offsets, as in an arena
        arena = np.zeros(pad + a_bytes.size + pad + b_bytes.size + pad + batch * m * n * 8, np.uint8)
        a_off, b_off = pad, 2 * pad + a_bytes.size
        dst = b_off + b_bytes.size + pad
        arena[a_off: a_off + a_bytes.size], arena[b_off: b_off + b_bytes.size] = a_bytes, b_bytes
        t = dict(op="matmul", dtype=dtype, a=a_off, b=b_off, dst=dst, batch=batch, m=m, k=k, n=n,
                 trans_a=trans_a, trans_b=trans_b, a_batch_stride=0 if share_a else m * k,
                 b_batch_stride=0 if share_b else k * n)
        call = matmul_call(t)
        assert call.compute == ("64F" if dtype == "f64" else "32F")
        execute(call, {ARENA: arena})
        av, bv = a.astype(STORAGE[dtype]).astype(np.float64), b.astype(STORAGE[dtype]).astype(np.float64)
        for z in range(batch):
            A = av[0 if share_a else z].reshape((k, m) if trans_a else (m, k))
            B = bv[0 if share_b else z].reshape((n, k) if trans_b else (k, n))
            want = (A.T if trans_a else A) @ (B.T if trans_b else B)
            got = arena[dst:].view(STORAGE[dtype])[z * m * n: (z + 1) * m * n].astype(np.float64).reshape(m, n)
            _close(got, want, dtype)


def test_operand_swap_and_types():
    t = dict(op="matmul", dtype="bf16", a=0, b=64, dst=128, batch=2, m=3, k=5, n=4, trans_a=False, trans_b=True,
             a_batch_stride=15, b_batch_stride=0)
    call = matmul_call(t)
    # cuBLAS's A is our B (transposed storage -> "T"), its (m, n) our (n, m)
    assert (call.op_a, call.op_b, call.m, call.n, call.k) == ("T", "N", 4, 3, 5)
    assert (call.a.offset, call.stride_a, call.lda) == (64, 0, 5)
    assert (call.b.offset, call.stride_b, call.ldb) == (0, 15, 5)
    assert (call.c.offset, call.stride_c, call.ldc, call.compute) == (128, 12, 4, "32F")
    assert matmul_call(dict(t, dtype="f32")).compute == "32F"
    assert matmul_call(dict(t, dtype="f32"), tf32=True).compute == "32F_FAST_TF32"
    assert matmul_call(dict(t, dtype="f16"), tf32=True).compute == "32F"  # TF32 concerns f32 inputs only
    with pytest.raises(NotMappable, match="32-bit"):
        matmul_call(dict(t, m=2**31, a_batch_stride=0))


def _gemm_case(lim, rng, dtype, m, n, k, batch, a_layout, b_layout, a_real, b_real, d_real, bias):
    """A portable gemm launch over an arena and a scratch buffer, plus the float64 answer."""
    real = cublas_calls.REAL[dtype]
    kinds = {"a": real if a_real else dtype, "b": real if b_real else dtype}
    bufs = {ARENA: np.zeros(1 << 16, np.uint8), SCRATCH: np.zeros(1 << 16, np.uint8)}
    ops, cursor = {}, {ARENA: 256, SCRATCH: 128}
    for name, (rows, cols), layout, is_real in (("a", (m, k), a_layout, a_real), ("b", (k, n), b_layout, b_real)):
        values = rng.standard_normal((batch, rows, cols))
        stored = values if layout == "row" else values.transpose(0, 2, 1)  # "col": stored transposed
        buf = SCRATCH if is_real else ARENA
        off = cursor[buf]
        data = _store(stored, kinds[name])
        bufs[buf][off: off + data.size] = data
        cursor[buf] = off + data.size + 64
        rs, cs = (cols, 1) if layout == "row" else (1, rows)
        ops[name] = ((buf, off, is_real, rows * cols, rs, cs), values.astype(STORAGE[kinds[name]]).astype(np.float64))
    bias_vals = rng.standard_normal((batch, n))
    bias_off = cursor[ARENA]
    bufs[ARENA][bias_off: bias_off + batch * n * 8] = 0
    data = _store(bias_vals, dtype)
    bufs[ARENA][bias_off: bias_off + data.size] = data
    d_buf = SCRATCH if d_real else ARENA
    d_off = cursor[d_buf] + data.size + 64 if d_buf is ARENA else cursor[d_buf]
    item = gemm(lim, dtype, m, n, k, batch, ops["a"][0], ops["b"][0], (d_buf, d_off, d_real, m * n, n),
                bias=(ARENA, bias_off, n) if bias else None)
    want = ops["a"][1] @ ops["b"][1]
    if bias:
        want = want + bias_vals.astype(STORAGE[dtype]).astype(np.float64)[:, None, :]
    d_kind = real if d_real else dtype
    return item, bufs, want, (d_buf, d_off, d_kind)


LIMITS = {target: launches.DeviceLimits(1024, 48 << 10, True, target=target) for target in ("cpu", "gpu")}


@pytest.mark.parametrize("target", sorted(LIMITS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_portable_gemm_launches_through_the_interpreter(dtype, target):
    rng = np.random.default_rng(5)
    mapped = refused = 0
    for (m, k, n), batch, a_l, b_l, bias in itertools.product([(3, 5, 2), (1, 4, 7), (6, 1, 3), (3, 2, 130)], (1, 2), ("row", "col"),
                                                              ("row", "col"), (False, True)):
        for a_real, b_real, d_real in ((False, False, False), (False, False, True), (True, True, True), (False, True, True)):
            item, bufs, want, (d_buf, d_off, d_kind) = _gemm_case(LIMITS[target], rng, dtype, m, n, k, batch, a_l, b_l, a_real, b_real,
                                                                 d_real, bias)
            a_kind = cublas_calls.REAL[dtype] if a_real else dtype
            b_kind = cublas_calls.REAL[dtype] if b_real else dtype
            if a_kind != b_kind or (a_kind, d_kind) not in cublas_calls.TYPE_PAIRS:
                with pytest.raises(NotMappable):
                    gemm_launch_calls(item)
                refused += 1
                continue
            calls = gemm_launch_calls(item)
            assert len(calls) == (2 if bias else 1)
            bufs[cublas_calls.ones(dtype)] = _store(np.ones(max(c.ones_needed for c in calls) or 1), dtype)
            for call in calls:
                execute(call, bufs)
            got = bufs[d_buf][d_off:].view(STORAGE[d_kind])[: batch * m * n].astype(np.float64).reshape(batch, m, n)
            _close(got, want, dtype)
            mapped += 1
    assert mapped and (refused or dtype in ("f32", "f64"))


def test_strides_cublas_cannot_take_are_refused():
    bad = RowMajor(ARENA, 0, "f32", 0, 3, 2)  # neither stride is 1
    good = RowMajor(ARENA, 0, "f32", 0, 4, 1)
    with pytest.raises(NotMappable, match="strides"):
        cublas_calls.strided_gemm(4, 4, 4, 1, bad, good, good)


@pytest.mark.parametrize("target", sorted(LIMITS))
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_recurrent_input_projection(dtype, target):
    """launches.rnn's layer-0 projection (x · W_ihᵀ + bias for both directions) as cuBLAS calls."""
    B, S, I, H, G = 2, 3, 5, 4, 4
    t = dict(op="lstm", dtype=dtype, batch=B, seq=S, input_size=I, hidden=H, num_layers=2, bidirectional=True,
             carry=False, x=0, w_ih=1024, w_hh=4096, bias=8192, h0=0, c0=0, dst=9216)
    plan = launches.plan(t, LIMITS[target], rnn_kernel="step")
    steps = with_cublas(plan.launches)
    calls = [s for s in steps if isinstance(s, GemmCall)]
    assert len(calls) == 4  # per layer: the bias call and the gemm
    # W_ih is read straight from the arena where the gemm's input has its type: layer 0, and every layer in
    # f32; a 16-bit layer 1 keeps the stage, since its input (layer 0's output) is in the compute type
    stages = sum(1 for s in steps if isinstance(s, launches.Launch) and s.kernel == "transpose_real")
    assert stages == (0 if dtype == "f32" else 1)
    assert not any(isinstance(s, launches.Launch) and s.kernel == "gemm" for s in steps)
    rng = np.random.default_rng(2)
    arena = np.zeros(16384, np.uint8)
    x, w, bias = rng.standard_normal((B * S, I)), rng.standard_normal((2, G * H, I)), rng.standard_normal((2, 2, G * H))
    for off, vals in ((0, x), (1024, w), (8192, bias)):
        data = _store(vals, dtype)
        arena[off: off + data.size] = data
    scratch = np.zeros(plan.scratch_bytes, np.uint8)
    bufs = {ARENA: arena, SCRATCH: scratch, cublas_calls.ones(dtype): _store(np.ones(B * S), dtype)}
    for call in calls[:2]:
        execute(call, bufs)
    q = lambda v: v.astype(STORAGE[dtype]).astype(np.float64)  # noqa: E731
    xw = calls[1].c
    got = scratch[xw.offset:].view(np.float32)[: 2 * B * S * G * H].reshape(2, B * S, G * H)
    for d in range(2):
        _close(got[d].astype(np.float64), q(x) @ q(w[d]).T + q(bias[0, d]), "f32" if dtype == "f32" else dtype)
