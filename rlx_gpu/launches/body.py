"""Launch geometry of the body ops (ABI.md §5) and the gemm shared with the recurrent projection."""
from __future__ import annotations

from host_fallback.abi.body import BINARY_FNS, UNARY_FNS

from .core import ARENA, SCRATCH, Buf, Launch, LaunchPlan, Thunk, grid, linear_local, real_size, strided_grid
from ..schedule.limits import MAX_RANK
from functools import lru_cache
from typing import Any
from .arguments import Partial, bind_some, kernel_launch
from .limits import DeviceLimits
from .registry import register
from .signatures import signature

#: The kernel's code of every unary/binary fn. ``backends.programs`` emits them as ``#define RLX_UNARY_EXP 0``
#: ..., so the kernel text names each function and never depends on the order of the table.
FN_CODES = {"unary": {fn: code for code, fn in enumerate(UNARY_FNS)},
            "binary": {fn: code for code, fn in enumerate(BINARY_FNS)}}


def fn_defines() -> dict[str, int]:
    """``RLX_UNARY_EXP``, ``RLX_BINARY_ADD``, ... -> the code the launches pass for that fn."""
    return {f"RLX_{op.upper()}_{fn.upper()}": code for op, codes in FN_CODES.items() for fn, code in codes.items()}


def _linear(lim: DeviceLimits, kernel: str, dtype: str, n: int, args: dict[str, Any],
            src_dtype: str | None = None, shared: Partial | None = None) -> Launch:
    local = linear_local(n, 256)
    family = "cast" if src_dtype else "body"  # kernels/cast.cl: a cast never builds the body family
    return kernel_launch(family, kernel, dtype, grid((n,), (local,)), (local,), args, target=lim.target,
                         src_dtype=src_dtype, shared=shared)


def gemm(
    lim: DeviceLimits,
    dtype: str,
    m: int,
    n: int,
    k: int,
    batch: int,
    a: tuple[Buf, int, bool, int, int, int],
    b: tuple[Buf, int, bool, int, int, int],
    d: tuple[Buf, int, bool, int, int],
    bias: tuple[Buf, int, int] | None = None,
) -> Launch:
    """``D[z] = A[z]·B[z] (+ bias[z])``; operands are ``(buffer, byte offset, is_scratch_real, strides...)``:
    A and B ``(batch, row, col)`` element strides, D ``(batch, row)``, bias ``(buffer, offset, batch stride)``."""
    abuf, aoff, areal, abs_, ars, acs = a
    bbuf, boff, breal, bbs, brs, bcs = b
    dbuf, doff, dreal, dbs, drs = d
    cbuf, coff, cbs = bias if bias is not None else (ARENA, 0, 0)
    args = dict(ab=(abuf, aoff), a_real=areal, a_bs=abs_, a_rs=ars, a_cs=acs,
                bb=(bbuf, boff), b_real=breal, b_bs=bbs, b_rs=brs, b_cs=bcs,
                cb=(cbuf, coff), has_bias=bias is not None, c_bs=cbs,
                db=(dbuf, doff), d_real=dreal, d_bs=dbs, d_rs=drs, m=m, n=n, k=k)
    tile = (lim.tune("GEMM_LX"), lim.tune("GEMM_LY"), 1)
    if lim.target == "gpu":  # one work-group per GEMM_TILE square of one batch item, all along x
        side = lim.tune("GEMM_TILE")
        groups = -(-n // side) * -(-m // side) * batch
        size = (groups * tile[0], tile[1], 1)
    else:
        size = grid((-(-n // lim.tune("GEMM_CN")), -(-m // lim.tune("GEMM_RM")), batch), tile)
    return kernel_launch("body", "gemm", dtype, size, tile, args, target=lim.target)


def transpose_real(lim: DeviceLimits, dtype: str, rows: int, cols: int, batch: int,
                   src: tuple[Buf, int, int, int, int], dst: tuple[Buf, int], src_real: bool = False) -> Launch:
    """``dst[z][c][r] = src[z](r, c)`` in the compute type; ``src`` is ``(buffer, offset, batch, row, col
    element strides)``, in arena storage or (``src_real``) compute-type scratch, ``dst`` dense scratch."""
    sbuf, soff, sbs, srs, scs = src
    local = (linear_local(rows, 64), 1, 1)
    args = dict(sb=(sbuf, soff), s_real=src_real, s_bs=sbs, s_rs=srs, s_cs=scs, db=dst, rows=rows, cols=cols, batch=batch)
    # cpu target: an item walks its whole source row (a stream the prefetcher follows; a group's items write runs
    # of dst): a grid over the columns swept every row per column, re-reading each cache line (1.5x slower on PoCL)
    size = strided_grid((rows, cols if lim.target == "gpu" else 1, batch), local, lim.max_grid)
    return kernel_launch("body", "transpose_real", dtype, size, local, args, target=lim.target)


def _unary(t: Thunk, lim: DeviceLimits, **_: object) -> LaunchPlan:
    n = t["n"]
    args = dict(xb=(ARENA, t["x"]), db=(ARENA, t["dst"]), n=n, fn=FN_CODES["unary"][t["fn"]])
    return LaunchPlan((_linear(lim, "unary", t["dtype"], n, args),))


#: the binary kernel's parameters of each axis: extent, then a's and b's element strides
_EXTENTS, _A_STRIDES, _B_STRIDES = (tuple(f"{name}{axis}" for axis in range(MAX_RANK)) for name in ("d", "as", "bs"))


@lru_cache(maxsize=256)  # the scan driver accumulates per step: its shape's arguments are bound once
def _broadcast_shape(target: str, dtype: str, fn: str, shape: tuple[int, ...], a_strides: tuple[int, ...],
                     b_strides: tuple[int, ...]) -> tuple[int, Partial]:
    """The element count and the binary kernel's arguments but its tensors: fn, extents and strides, padded on
    the left (a zero extent means nothing to launch; the kernel's divisions stay defined regardless)."""
    pad, n = MAX_RANK - len(shape), 1
    for d in shape:
        n *= d
    args: dict[str, Any] = dict(n=n, fn=FN_CODES["binary"][fn])
    args.update(zip(_EXTENTS, [1] * pad + [max(d, 1) for d in shape]))
    args.update(zip(_A_STRIDES, [0] * pad + list(a_strides)))
    args.update(zip(_B_STRIDES, [0] * pad + list(b_strides)))
    return n, bind_some(signature("body", "binary", target), dtype, args)


def _broadcast(lim: DeviceLimits, dtype: str, fn: str, shape: list[int], a: tuple[Buf, int], a_strides: list[int],
               b: tuple[Buf, int], b_strides: list[int], dst: tuple[Buf, int]) -> Launch:
    n, shared = _broadcast_shape(lim.target, dtype, fn, tuple(shape), tuple(a_strides), tuple(b_strides))
    return _linear(lim, "binary", dtype, n, dict(ab=a, bb=b, db=dst), shared=shared)


def _binary(t: Thunk, lim: DeviceLimits, **_: object) -> LaunchPlan:
    return LaunchPlan((_broadcast(lim, t["dtype"], t["fn"], t["shape"], (ARENA, t["a"]), t["a_strides"],
                            (ARENA, t["b"]), t["b_strides"], (ARENA, t["dst"])),))


def accumulate(lim: DeviceLimits, dtype: str, count: int, dst: tuple[Buf, int], src: tuple[Buf, int]) -> Launch:
    """``dst[i] += src[i]`` for ``count`` elements (the scan driver's upstream accumulation)."""
    return _broadcast(lim, dtype, "add", [count], dst, [1], src, [1], dst)


def _matmul(t: Thunk, lim: DeviceLimits, **_: object) -> LaunchPlan:
    m, k, n = t["m"], t["k"], t["n"]
    # A(i, kk) is at i*k + kk, or at kk*m + i when stored transposed; likewise B.
    a_rs, a_cs = (1, m) if t["trans_a"] else (k, 1)
    b_rs, b_cs = (1, k) if t["trans_b"] else (n, 1)
    if t["trans_b"] and n > 1:
        # the gemm wants B's columns contiguous: stage B(kk, c) as real scratch [batch][k][n] first
        stage = transpose_real(lim, t["dtype"], n, k, t["batch"], (ARENA, t["b"], t["b_batch_stride"], k, 1), (SCRATCH, 0))
        launch = gemm(
            lim, t["dtype"], m, n, k, t["batch"],
            (ARENA, t["a"], False, t["a_batch_stride"], a_rs, a_cs),
            (SCRATCH, 0, True, k * n, n, 1),
            (ARENA, t["dst"], False, m * n, n),
        )
        return LaunchPlan((stage, launch), t["batch"] * k * n * real_size(t["dtype"]))
    launch = gemm(
        lim, t["dtype"], m, n, k, t["batch"],
        (ARENA, t["a"], False, t["a_batch_stride"], a_rs, a_cs),
        (ARENA, t["b"], False, t["b_batch_stride"], b_rs, b_cs),
        (ARENA, t["dst"], False, m * n, n),
    )
    return LaunchPlan((launch,))


def _reduce_sum(t: Thunk, lim: DeviceLimits, **_: object) -> LaunchPlan:
    outer, r, inner = t["outer"], t["r"], t["inner"]
    args = dict(xb=(ARENA, t["x"]), db=(ARENA, t["dst"]), outer=outer, r=r, inner=inner)
    local = (linear_local(inner), 1)
    size = strided_grid((inner, outer), local, lim.max_grid)
    return LaunchPlan((kernel_launch("body", "reduce_sum", t["dtype"], size, local, args, target=lim.target),))


def copy_launch(lim: DeviceLimits, nbytes: int, src: tuple[Buf, int], dst: tuple[Buf, int], dtype: str = "f32") -> Launch:
    """``dst[0:nbytes] = src[0:nbytes]`` between (or within) buffers; bytes, so any dtype's program serves."""
    return _linear(lim, "copy_bytes", dtype, nbytes, dict(sb=src, db=dst, nbytes=nbytes))


def _copy(t: Thunk, lim: DeviceLimits, **_: object) -> LaunchPlan:
    return LaunchPlan((copy_launch(lim, t["nbytes"], (ARENA, t["src"]), (ARENA, t["dst"]), t["dtype"]),))


def _fill(t: Thunk, lim: DeviceLimits, **_: object) -> LaunchPlan:
    n, dt = t["n"], t["dtype"]
    return LaunchPlan((_linear(lim, "fill", dt, n, dict(db=(ARENA, t["dst"]), n=n, value=t["value"])),))


def _cast(t: Thunk, lim: DeviceLimits, **_: object) -> LaunchPlan:
    n = t["n"]
    args = dict(sb=(ARENA, t["src"]), db=(ARENA, t["dst"]), n=n)
    return LaunchPlan((_linear(lim, "cast", t["dtype"], n, args, src_dtype=t["src_dtype"]),))


def unsupported(t: Thunk, lim: DeviceLimits) -> str | None:
    items = lim.tune("GEMM_LX") * lim.tune("GEMM_LY")
    if t["op"] == "matmul" and lim.max_work_group < items:
        return f"matmul needs work-groups of {items} items at the {lim.target} target; the device allows {lim.max_work_group}"
    if t["op"] == "binary" and len(t["shape"]) > MAX_RANK:
        return f"binary supports rank <= {MAX_RANK}, got rank {len(t['shape'])}"
    return None


for _op, _planner in {"unary": _unary, "binary": _binary, "matmul": _matmul, "reduce_sum": _reduce_sum, "copy": _copy,
                      "fill": _fill}.items():
    register(_op, _planner, unsupported, family="body")
register("cast", _cast, unsupported, family="cast")  # kernels/cast.cl: a cast never builds the body family
