"""Host kernel of ``mamba2_backward`` (ABI.md §9 over §4's mamba2 and its §8 fields): the SSD form in reverse.

Per (row, head) the forward is ``S_t = exp(l_t) S_{t-1} + u_t (x) b_t``, ``y_t = S_t c_t`` with
``l = dt*a`` and ``u = dt*x``, then ``out = (y + d*x) * silu(z)``. The backward takes the gradient
``gy`` of ``y`` (``d_dst * silu(z)``) and returns the gradients of ``u``, ``l``, ``b``, ``c`` and of the
initial state, from which the chain rule gives every ``d_`` output (``dt``'s through the bias, softplus
and clamp; ``a``, ``d``, ``dt_bias`` summed over rows and steps).

The chunked path (``mamba2_backward_chunked``: mamba_ssm's chunk kernels, its GEMMs in NumPy, the rest compiled
where Numba is there and the thunk computes in f32) works on chunks of ``length`` steps: its extra memory is
two states per chunk (entering, and the gradient leaving) plus one slab's
temporaries. Short sequences take the step path: the reverse recurrence, its states recomputed
chunk by chunk from checkpoints saved by a first forward walk. The bulk GEMMs are not causal for a
NaN or Inf (``0 * inf``), so every (row, head) lane whose bulk results hold a non-finite value is
redone on the step path, whose operation order is the recurrence's. Packed sequences run as batch
rows of their own, those of equal chunk count side by side (zero-padded: a padded step has no input
and no decay). Every sum runs in a fixed order over fixed blocks, so a thunk gives the same bytes on
every run; 16-bit storage computes in f32 (``ssm.compute_type``), rounding only the stored outputs.

With a saved forward (ABI.md §9.1 ``reserve``, written by the forward: ``abi.ssm.mamba2_reserve_slots``)
the chunked path reads the states leaving each chunk, ``y`` and ``W`` instead of computing them (a forward loop
over the chunks and three GEMMs per chunk); packed sequences have none.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from . import threads
from .abi import complete
from .abi.ssm import RESERVE_CHUNK
from .bound import Bound
from .chunked import dot_last, floor_log_decays, pick_path
from .implementations import KERNELS, PATHS
from .mamba2_backward_chunked import chunked_backward, times_dt
from .sequences import Sequences, StatePool
from .ssm import MAMBA2_CHUNK, MAMBA2_STEP_MAX, SOFTPLUS_LINEAR, compute_type, reserve_views, softplus

Thunk = Mapping[str, Any]




def _steps(logd, u, b, c, s0, gy, ds, length):
    """The reverse recurrence, vectorized over lanes: ``logd [B, S, H]``, ``u, gy [B, S, H, P]``, ``b, c
    [B, S, H, N]``, ``s0, ds [B, H, P, N]`` (the initial state, the final state's gradient). The states
    entering every ``length`` steps are saved by a forward walk, and each chunk's states recomputed from
    its checkpoint before its steps are walked back. Returns ``(y, du, dlogd, db, dc, ds0)``."""
    seq = logd.shape[1]
    y, du, db, dc = np.empty_like(u), np.empty_like(u), np.empty_like(b), np.empty_like(c)
    dlogd = np.empty_like(logd)
    decay = np.exp(logd)[..., None, None]

    def step(s: np.ndarray, t: int) -> np.ndarray:
        return decay[:, t] * s + u[:, t, ..., None] * b[:, t, ..., None, :]

    checkpoints, s = [], s0
    for t in range(seq):
        if t % length == 0:
            checkpoints.append(s)
        s = step(s, t)
    ds = ds.copy()
    for k in reversed(range(len(checkpoints))):
        span = range(k * length, min(seq, (k + 1) * length))
        states = [checkpoints[k]]  # states[i]: the state entering step span[i]
        for t in span:
            states.append(step(states[-1], t))
        for i in reversed(range(len(span))):
            t, after = span[i], states[i + 1]
            y[:, t] = (after @ c[:, t, ..., None])[..., 0]
            ds += gy[:, t, ..., None] * c[:, t, ..., None, :]
            dc[:, t] = (gy[:, t, ..., None, :] @ after)[..., 0, :]
            du[:, t] = (ds @ b[:, t, ..., None])[..., 0]
            db[:, t] = (u[:, t, ..., None, :] @ ds)[..., 0, :]
            dlogd[:, t] = decay[:, t, ..., 0, 0] * np.sum(states[i] * ds, axis=(-2, -1))
            ds *= decay[:, t]
    return y, du, dlogd, db, dc, ds


def _chain_rule(chain, du, lanes=None) -> None:
    """``chain``'s ``dx = du dt`` and ``xdu = du . x`` (``chain``: ``(x, dt, dx, xdu)``, ``[B, S, H, ...]``), at
    the lanes ``(rows, heads)`` only where given."""
    x, dt, dx, xdu = chain
    if lanes is None:
        np.multiply(du, dt[..., None], out=dx)
        xdu[...] = dot_last(du, x)
    else:
        rows, heads = lanes
        dx[rows, :, heads] = du[rows, :, heads] * dt[rows, :, heads][..., None]
        xdu[rows, :, heads] = dot_last(du[rows, :, heads], x[rows, :, heads])


def ssd_backward(path: str, logd, u, b, c, s0, gy, ds, length, need_y, saved=None, into=None, chain=None):
    """``_steps``' results by ``path``; on the chunked path every (row, head) lane holding a non-finite
    value is redone on the step path, so NaN and Inf land where the recurrence puts them. ``saved``: a saved
    forward's ``(states, y, scores)``, which the chunked path reads (the step path recomputes its few steps).
    ``into``: arrays for ``db`` and ``dc`` the chunked path may write into (``chunked_backward``). ``chain``: where
    ``u = dt x``, ``(x, dt, dx, xdu)``, the last two filled with ``du dt`` and ``du . x`` (by the compiled pass
    where it ran); with it ``u`` may be ``None`` (``chunked_backward``: formed where read)."""
    if path == "step":
        result = _steps(logd, times_dt(u, chain), b, c, s0, gy, ds, length)
        if chain is not None:
            _chain_rule(chain, result[1])
        return result
    with np.errstate(all="ignore"):
        *result, nonfinite = chunked_backward(logd, u, b, c, s0, gy, ds, length, need_y, saved, into, chain)
    if chain is not None and nonfinite is None:  # (NumPy's path)
        _chain_rule(chain, result[1])
    checked = result[1 - need_y:] if nonfinite is None else [nonfinite, result[-1]] + result[:need_y]
    if all(np.isfinite(np.sum(r)) for r in checked):  # (a sum holding a NaN or Inf is not finite)
        return tuple(result)
    bad = np.zeros(s0.shape[:2], bool) if nonfinite is None else ~np.isfinite(nonfinite)
    for r in result[1 - need_y: -1] if nonfinite is None else result[:need_y]:
        bad |= ~np.isfinite(r.reshape(*r.shape[:3], -1)).all(axis=(1, 3))
    bad |= ~np.isfinite(result[-1]).all(axis=(-2, -1))
    if bad.any():
        rows, heads = np.nonzero(bad)
        u = times_dt(u, chain)
        lane = lambda v: v[rows, :, heads][:, :, None]  # noqa: E731  [K, S, 1, ...]: K lanes as batch rows
        with np.errstate(all="ignore"):
            redo = _steps(lane(logd), lane(u), lane(b), lane(c), s0[rows, heads][:, None], lane(gy),
                          ds[rows, heads][:, None], length)
        for r, again in zip(result[1 - need_y: -1], redo[1 - need_y: -1]):
            r[rows, :, heads] = again[:, :, 0]
        result[-1][rows, heads] = redo[-1][:, 0]
        if chain is not None:
            _chain_rule(chain, result[1], (rows, heads))
    return tuple(result)


def _step_sizes(t: Thunk, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """ABI.md §8's ``dt`` from ``raw`` (the bias added), softplus-ed and clamped where asked, and its
    derivative by ``raw`` (``None``: 1): softplus above 20 is the identity; the clamp passes at its bounds."""
    dt, slope = raw, None
    if t["dt_softplus"]:
        dt = softplus(raw)
        slope = -np.expm1(-dt)  # sigmoid(raw) = 1 - exp(-softplus(raw)), exact for very negative raw too
        slope[raw > SOFTPLUS_LINEAR] = 1
    if t["dt_limit"] is not None:
        low, high = t["dt_limit"]
        inside = (dt >= low) & (dt <= (np.inf if high is None else high))
        slope = inside.astype(dt.dtype) if slope is None else slope * inside
        dt = np.clip(dt, low, high)
    return dt, slope


def _packed(path: str | None, seqs: Sequences, length: int, need_y: bool, logd, u, b, c, s0, gy, ds):
    """``ssd_backward`` over packed sequences (batch 1, ``s0``/``ds`` one row per sequence): the non-empty
    sequences of equal chunk count run side by side as zero-padded batch rows (a padded step has no input
    and no decay, so it passes every state and gradient on unchanged). Same results; an empty sequence's
    initial-state gradient is its final state's."""
    shapes = {"du": u.shape, "dlogd": logd.shape, "db": b.shape, "dc": c.shape, **({"y": u.shape} if need_y else {})}
    out = {name: np.zeros(shape, u.dtype) for name, shape in shapes.items()}
    ds0 = ds.copy()
    by_count: dict[int, list[tuple[int, int, int]]] = {}
    for run in seqs.runs():
        by_count.setdefault(-(-(run[2] - run[1]) // length), []).append(run)
    for count in sorted(by_count):
        spans = by_count[count]
        width, rows = max(hi - lo for _, lo, hi in spans), [r for r, _, _ in spans]

        def gather(v: np.ndarray) -> np.ndarray:
            rows_of = np.zeros((len(spans), width, *v.shape[2:]), v.dtype)
            for k, (_, lo, hi) in enumerate(spans):
                rows_of[k, : hi - lo] = v[0, lo:hi]
            return rows_of

        y, *grads, init = ssd_backward(_path(path, width), *(gather(v) for v in (logd, u, b, c)), s0[rows],
                                        gather(gy), ds[rows], length, need_y)
        for name, v in zip(("y", "du", "dlogd", "db", "dc"), (y, *grads)):
            if name in out:  # (the step path gives y either way)
                for k, (_, lo, hi) in enumerate(spans):
                    out[name][0, lo:hi] = v[k, : hi - lo]
        ds0[rows] = init
    return out.get("y"), out["du"], out["dlogd"], out["db"], out["dc"], ds0


def _path(forced: str | None, seq: int) -> str:
    return pick_path("mamba2_backward", forced, seq, MAMBA2_STEP_MAX, "chunked")


def _silu_slopes(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(silu(z), silu'(z))``, ``silu(z) = z sigmoid(z)``."""
    with np.errstate(over="ignore"):
        sig = 1 / (1 + np.exp(-z))
    return z * sig, sig * (1 + z * (1 - sig))


def _in_place(bound: Bound, f: str, rows: tuple, per_head: dict) -> np.ndarray | None:
    """The arena's ``d_f`` block at ``rows`` where the pass can write it itself (stored as computed, C-contiguous,
    no group's heads to sum in ``per_head``; ABI.md: no write range overlaps a read range), else ``None``."""
    v = None if f in per_head else bound.in_place(f"d_{f}", rows)
    return v if v is not None and v.flags.c_contiguous else None


def _run(thunk: Thunk, arena: np.ndarray, path: str | None, chunk: int | None, workers: int | None) -> None:
    t = complete(thunk)
    length = chunk or MAMBA2_CHUNK
    bound = Bound(t, arena)
    ctype = compute_type(t)
    bsz, seq, heads, p, n, groups = t["batch"], t["seq"], t["heads"], t["head_dim"], t["state_size"], t["groups"]
    group_of = np.arange(heads) // (heads // groups)
    seqs = Sequences.of(t, bound)
    # a saved forward (ABI.md §9.1) is read where its chunks are the backward's (packed sequences have none)
    views = reserve_views(t, arena) if length == RESERVE_CHUNK and seqs is None else None
    pools = [StatePool(t, bound, ctype, (p, n), f) for f in ("state", "d_state")]
    read = lambda f, index: bound.view(f)[index].astype(ctype, copy=False)  # noqa: E731
    # per-(row, head) partial sums and, with groups, per-head gradients of b and c (summed over each group's
    # heads at the end), each block writing its own part: the sums run in one order however the blocks are cut
    per_head = {f: np.empty((bsz, seq, heads, n), ctype) for f in ("b", "c") if groups < heads}
    partial = {f: np.zeros((bsz, heads), ctype) for f in ("a", "d", "dt_bias")}
    d_initial: list[tuple[slice, slice, np.ndarray]] = []

    def compute(bs: slice, hs: slice) -> dict[str, np.ndarray]:
        rows = (bs, slice(None), hs)
        x, a, g = read("x", rows), read("a", hs), read("d_dst", rows)
        raw = read("dt", rows) if t["dt_bias"] is None else read("dt", rows) + read("dt_bias", hs)
        dt, slope = _step_sizes(t, raw)
        gs = rows if groups == heads else (bs, slice(None), group_of[hs])
        silu, silu_slope = (None, None) if t["z"] is None else _silu_slopes(read("z", rows))
        gy = g if silu is None else g * silu  # the gradient of y + d*x
        # u = dt x: formed where a path reads it, from the chain rule's x and dt (packed sequences: here)
        u = None if seqs is None else dt[..., None] * x
        args = (floor_log_decays(dt * a), u, read("b", gs), read("c", gs),
                pools[0].initial(bs, hs), gy, pools[1].initial(bs, hs))
        need_y = t["z"] is not None
        # d_x, d_b, d_c straight to the arena where they can be (no copy each in store); the chain rule through u = dt x
        into = {f: v for f in ("x", "b", "c") if (v := _in_place(bound, f, rows, per_head)) is not None}
        chain = (x, dt, into["x"] if "x" in into else np.empty(x.shape, ctype), np.empty(dt.shape, ctype))
        if seqs is None:
            saved = None if views is None else tuple(views[f][bs, :, hs] for f in ("states", "y", "scores"))
            y, du, dlogd, db, dc, ds0 = ssd_backward(_path(path, seq), *args, length, need_y, saved,
                                                     {"d" + f: into[f] for f in "bc" if f in into}, chain)
        else:
            y, du, dlogd, db, dc, ds0 = _packed(path, seqs, length, need_y, *args)
            _chain_rule(chain, du)
        for f, got in (("b", db), ("c", dc)):
            if f in into and not np.may_share_memory(got, into[f]):  # (the path wrote its own array)
                np.copyto(into[f], got)
        d_dt = dlogd * a + chain[3]
        if slope is not None:
            d_dt *= slope
        out = {"x": chain[2], "dt": d_dt, "b": db, "c": dc, "a": np.sum(dlogd * dt, axis=1),
               "dt_bias": np.sum(d_dt, axis=1), "state": ds0, "in_place": into}
        if t["d"] is not None:
            skip = read("d", hs)[:, None]
            out["x"] += skip * gy
            out["d"] = np.sum(gy * x, axis=(1, 3))
            if y is not None:
                y += skip * x
        if t["z"] is not None:
            out["z"] = g * y * silu_slope
        return out

    def store(bs: slice, hs: slice, out: dict[str, np.ndarray]) -> None:
        for f in ("x", "dt", "b", "c", "z"):
            if f in per_head:
                per_head[f][bs, :, hs] = out[f]
            elif f in out and f not in out["in_place"]:
                bound.store(f"d_{f}", out[f], (bs, slice(None), hs))
        for f in ("a", "dt_bias", "d"):
            if f in out:
                partial[f][bs, hs] = out[f]
        d_initial.append((bs, hs, out["state"]))

    work = bsz * seq * heads * p * n
    threads.run_split(compute, store, bsz, heads, threads.parts_for("mamba2_backward", work, bsz, heads, workers))
    for f, grad in per_head.items():  # each group's heads in order
        bound.store(f"d_{f}", grad.reshape(bsz, seq, groups, -1, n).sum(axis=3))
    bound.store("d_a", partial["a"].sum(axis=0))
    for f in ("dt_bias", "d"):
        if t[f] is not None:
            bound.store(f"d_{f}", partial[f].sum(axis=0))
    for bs, hs, d_init in d_initial:
        pools[1].store(bs, hs, d_init)


def mamba2_backward(thunk: Thunk, arena: np.ndarray, *, path: str | None = None, chunk: int | None = None,
                    workers: int | None = None) -> None:
    """The gradients of mamba2 (ABI.md §9): from ``d_dst`` (and ``d_state``, the final state's gradient),
    every ``d_`` output of the forward's floating-point inputs, ``d_state`` rewritten as the initial state's.

    ``path`` (``"step"`` or ``"chunked"``), ``chunk`` (chunk length, also the step path's checkpoint
    interval) and ``workers`` (threads over the batch x heads recurrences) override the choice.
    """
    _run(thunk, arena, path, chunk, workers)


def path_for(thunk: Thunk, *, path: str | None = None, chunk: int | None = None, workers: int | None = None) -> str:
    """Name the path ``mamba2_backward`` runs ``thunk`` on: ``step`` or ``chunked L=64``."""
    name = _path(path, thunk["seq"])
    return name if name == "step" else f"chunked L={chunk or MAMBA2_CHUNK}"


KERNELS.add("mamba2_backward", mamba2_backward)
PATHS.add("mamba2_backward", path_for)
