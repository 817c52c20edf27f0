"""Row-major gemms of the arena ABI as column-major cuBLAS ``gemmStridedBatchedEx`` calls (pure logic).

cuBLAS is column-major; a row-major ``[r, c]`` matrix with row stride ``ld`` is the column-major
``[c, r]`` matrix with the same ``ld``. So the row-major ``D = A·B`` is computed as the column-major
``Dᵀ = Bᵀ·Aᵀ``: cuBLAS's first operand is our B, its second our A, and its (m, n) are our (n, m) —
the operand swap, no data moves. A :class:`GemmCall` names every argument of that call (operations,
sizes, leading dimensions, element strides, buffers + byte offsets, data and compute types), so the
CUDA backend only resolves buffers to pointers, and a test can execute the call's BLAS semantics on
NumPy buffers.

Precision: 16-bit inputs accumulate in f32 (compute type ``32F``); f32 uses ``32F`` (no TF32) unless
the caller passes ``tf32=True`` (the config's ``cuda.tf32`` or ``RLX_CUDA_TF32=1``); f64 uses ``64F``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

from ..launches.arguments import named
from ..launches.core import ARENA, Buf, Launch, LaunchPlan, Thunk
from ..launches.limits import TUNING
from ..launches.signatures import signature

INT_MAX = 2**31 - 1  # cuBLAS takes m, n, k, leading dimensions and the batch count as 32-bit ints
COMPUTE = {"f32": "32F", "f16": "32F", "bf16": "32F", "f64": "64F"}
REAL = {"f32": "f32", "f16": "f32", "bf16": "f32", "f64": "f64"}  # compute type of each storage dtype
#: (input type, output type) pairs gemmEx accepts with the compute types above
TYPE_PAIRS = {("f32", "f32"), ("f64", "f64"), ("f16", "f16"), ("f16", "f32"), ("bf16", "bf16"), ("bf16", "f32")}


def ones(dtype: str) -> Buf:
    """A backend-owned buffer of ones in ``dtype`` (the rank-1 bias call's second operand)."""
    return Buf(f"ones_{dtype}")


@dataclass(frozen=True)
class Operand:
    """A matrix operand: buffer, byte offset of batch item 0, element type."""

    buf: Buf
    offset: int
    dtype: str


@dataclass(frozen=True)
class GemmCall:
    """``C_z = alpha·op_a(A_z)·op_b(B_z) + beta·C_z`` for ``z < batch``, column-major (BLAS definition).

    ``op(X)`` is X (``"N"``) or Xᵀ (``"T"``); element ``(i, j)`` of a stored matrix is at
    ``i + j·ld``; ``A_z`` starts ``z·stride_a`` elements after ``a`` (0 shares one matrix).
    ``op_a(A)`` is ``m×k``, ``op_b(B)`` ``k×n``, C ``m×n``.
    """

    op_a: str
    op_b: str
    m: int
    n: int
    k: int
    a: Operand
    lda: int
    stride_a: int
    b: Operand
    ldb: int
    stride_b: int
    c: Operand
    ldc: int
    stride_c: int
    batch: int
    compute: str
    beta: float = 0.0
    alpha: float = 1.0

    @property
    def ones_needed(self) -> int:
        """Elements of :func:`ones` this call reads (0 unless it is a bias call)."""
        return self.n if self.b.buf.name.startswith("ones_") else 0

    @property
    def args(self) -> tuple[Buf, Buf, Buf]:
        """The buffers of A, B and C, in that order: what a session resolves, as for a launch's ``Buf`` arguments."""
        return self.a.buf, self.b.buf, self.c.buf

    @property
    def empty(self) -> bool:
        """Nothing to compute (``k == 0`` is not empty: it scales C by beta)."""
        return self.batch == 0 or self.m == 0 or self.n == 0


@dataclass(frozen=True)
class RowMajor:
    """A row-major operand of ``D[z] = A[z]·B[z]``: element (row, col) of batch z at
    ``offset + (z·batch_stride + row·row_stride + col·col_stride)·elem``."""

    buf: Buf
    offset: int
    dtype: str
    batch_stride: int
    row_stride: int
    col_stride: int


class NotMappable(ValueError):
    """cuBLAS cannot take this gemm as one call; the message says why (the portable gemm runs it)."""


def _column_major(x: RowMajor, rows: int, cols: int) -> tuple[str, int]:
    """(op, ld) that present ``op(stored)`` as the column-major ``[cols, rows]`` matrix xᵀ."""
    # xᵀ(c, r) = x(r, c) at r·rs + c·cs: with cs == 1 the stored matrix is xᵀ itself (ld = rs);
    # with rs == 1 it is x stored column-major (ld = cs) and cuBLAS transposes it
    if x.col_stride == 1 and x.row_stride >= max(1, cols):
        return "N", max(1, x.row_stride)
    if x.row_stride == 1 and x.col_stride >= max(1, rows):
        return "T", max(1, x.col_stride)
    raise NotMappable(f"operand at {x.buf.name}+{x.offset} has strides (row {x.row_stride}, col {x.col_stride}) "
                      f"for a [{rows}, {cols}] matrix: cuBLAS needs one of them 1 and the other at least the extent")


def strided_gemm(m: int, n: int, k: int, batch: int, a: RowMajor, b: RowMajor, d: RowMajor,
                 tf32: bool = False, beta: float = 0.0) -> GemmCall:
    """The call for the row-major ``D[z] (m×n) = A[z] (m×k) · B[z] (k×n) (+ beta·D[z])``."""
    if a.dtype != b.dtype:
        raise NotMappable(f"A is {a.dtype} and B is {b.dtype}; gemmEx needs one input type")
    if (a.dtype, d.dtype) not in TYPE_PAIRS:
        raise NotMappable(f"gemmEx has no {a.dtype} inputs -> {d.dtype} output combination")
    if d.col_stride != 1:
        raise NotMappable(f"D's column stride is {d.col_stride}; cuBLAS writes unit-stride columns")
    op_a, lda = _column_major(b, k, n)  # cuBLAS's A is our Bᵀ (n×k)
    op_b, ldb = _column_major(a, m, k)  # cuBLAS's B is our Aᵀ (k×m)
    _, ldc = _column_major(d, m, n)
    too_big = {name: v for name, v in dict(m=n, n=m, k=k, lda=lda, ldb=ldb, ldc=ldc, batch=batch).items() if v > INT_MAX}
    if too_big:
        raise NotMappable(f"{too_big} exceed cuBLAS's 32-bit int arguments")
    compute = "32F_FAST_TF32" if tf32 and a.dtype == "f32" else COMPUTE[a.dtype]
    return GemmCall(op_a, op_b, n, m, k,
                    Operand(b.buf, b.offset, b.dtype), lda, b.batch_stride,
                    Operand(a.buf, a.offset, a.dtype), ldb, a.batch_stride,
                    Operand(d.buf, d.offset, d.dtype), ldc, d.batch_stride,
                    batch, compute, beta)


def matmul_call(t: Thunk, tf32: bool = False) -> GemmCall:
    """The call that runs a ``matmul`` thunk (ABI.md §5) on the arena."""
    m, k, n, dt = t["m"], t["k"], t["n"], t["dtype"]
    a_rs, a_cs = (1, m) if t["trans_a"] else (k, 1)
    b_rs, b_cs = (1, k) if t["trans_b"] else (n, 1)
    return strided_gemm(m, n, k, t["batch"],
                        RowMajor(ARENA, t["a"], dt, t["a_batch_stride"], a_rs, a_cs),
                        RowMajor(ARENA, t["b"], dt, t["b_batch_stride"], b_rs, b_cs),
                        RowMajor(ARENA, t["dst"], dt, m * n, n, 1), tf32)


def bias_call(m: int, n: int, batch: int, bias: RowMajor, d: RowMajor) -> GemmCall:
    """``D[z](r, c) = bias[z][c]`` as a rank-1 product ``ones[m] ⊗ bias[z]`` (beta 0)."""
    return strided_gemm(m, n, 1, batch, RowMajor(ones(bias.dtype), 0, bias.dtype, 0, 1, 1),
                        replace(bias, row_stride=n, col_stride=1), d)


# -- the portable ``body/gemm`` launch (launches.body.gemm) -------------------------------------------
def _named(item: Launch) -> dict[str, Any]:
    """``item``'s arguments by the parameter names of its kernel (kernels/body.cl)."""
    return named(signature(item.family, item.kernel, item.target), item.args)


def _operand(g: Mapping[str, Any], p: str, dtype: str, strides: tuple[str, ...]) -> RowMajor:
    """Operand ``p`` (a, b) of gemm arguments ``g``: its tensor ``<p>b``, ``<p>_real`` and strides ``<p>_<s>``."""
    kind = REAL[dtype] if g[f"{p}_real"] else dtype
    return RowMajor(*g[f"{p}b"], kind, *(g[f"{p}_{s}"] for s in strides))


def _unstaged(b: RowMajor, stage: Launch | None, k: int, n: int) -> RowMajor | None:
    """B read straight from the source of the ``transpose_real`` that staged it, when ``stage`` did.

    ``transpose_real`` writes ``dst[z][c][r] = src[z](r, c)`` densely; a gemm reading that as
    ``B(kk, col)`` with row stride ``rows`` and unit column stride reads ``src(col, kk)``.
    """
    if stage is None or stage.kernel != "transpose_real":
        return None
    s = _named(stage)
    if s["s_real"] or s["db"] != (b.buf, b.offset) or (s["rows"], s["cols"]) != (n, k):
        return None
    if (b.batch_stride, b.row_stride, b.col_stride) != (n * k, n, 1):
        return None
    return RowMajor(*s["sb"], stage.dtype, s["s_bs"], s["s_cs"], s["s_rs"])


def _gemm_batch(item: Launch, m: int, n: int) -> int:
    """The batch count of a portable gemm launch, read back from its geometry (launches.body.gemm): at
    the gpu target every batch item's GEMM_TILE squares line up along x, at the cpu target batch is z."""
    if item.target != "gpu":
        return item.global_size[2] // item.local_size[2]
    side = TUNING["gpu"]["GEMM_TILE"]
    return (item.global_size[0] // item.local_size[0]) // (-(-n // side) * -(-m // side))


def gemm_launch_calls(item: Launch, stage: Launch | None = None, tf32: bool = False) -> tuple[GemmCall, ...]:
    """The calls that replace the portable gemm launch ``item`` (a bias becomes a first rank-1 call).

    ``stage``, the launch just before, may be the ``transpose_real`` that staged B in the compute type;
    B is then read from its source instead when that makes the input types agree or saves the stage.
    Raises :class:`NotMappable` when cuBLAS cannot take it.
    """
    g = _named(item)
    m, n, k, dt = g["m"], g["n"], g["k"], item.dtype
    a = _operand(g, "a", dt, ("bs", "rs", "cs"))
    b = _operand(g, "b", dt, ("bs", "rs", "cs"))
    d = RowMajor(*g["db"], REAL[dt] if g["d_real"] else dt, g["d_bs"], g["d_rs"], 1)
    source = _unstaged(b, stage, k, n)
    if source is not None and source.dtype == a.dtype:
        b = source
    batch = _gemm_batch(item, m, n)
    calls = []
    if g["has_bias"]:
        bias = RowMajor(*g["cb"], dt, g["c_bs"], 0, 1)
        calls.append(bias_call(m, n, batch, bias, d))
    calls.append(strided_gemm(m, n, k, batch, a, b, d, tf32, beta=1.0 if g["has_bias"] else 0.0))
    return tuple(calls)


def with_cublas(launches: Iterable[Launch], tf32: bool = False) -> list[Launch | GemmCall]:
    """A planned thunk's launches with every portable gemm cuBLAS can take replaced by its calls.

    A ``transpose_real`` whose only reader was the gemm right after it is dropped when the calls read
    its source directly (the staged tensor is scratch that nothing else reads: launches.rnn / body).
    """
    out: list[Launch | GemmCall] = []
    items = list(launches)
    for i, item in enumerate(items):
        if item.kernel != "gemm":
            out.append(item)
            continue
        stage = items[i - 1] if i and items[i - 1].kernel == "transpose_real" else None
        try:
            calls = gemm_launch_calls(item, stage, tf32)
        except NotMappable:
            out.append(item)
            continue
        staged_b = _named(item)["bb"]
        if stage is not None and out and out[-1] is stage and all((c.a.buf, c.a.offset) != staged_b for c in calls):
            out.pop()
        out.extend(calls)
    return out


def lower(plan: LaunchPlan, tf32: bool = False) -> LaunchPlan:
    """``plan`` with its gemms as cuBLAS calls (:func:`with_cublas`); its staging launches that remain
    stay staging launches, the calls never are (a gemm reads the arena outside ``staging_reads``)."""
    steps = with_cublas(plan.launches, tf32)
    staging_ids = {id(plan.launches[i]) for i in plan.staging}
    staging = tuple(i for i, step in enumerate(steps) if id(step) in staging_ids)
    return replace(plan, launches=tuple(steps), staging=staging)  # type: ignore[arg-type]
