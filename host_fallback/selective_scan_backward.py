"""Host kernel of ``selective_scan_backward`` (ABI.md §9 over selective_scan, §4 and §8): the chunked reverse.

The thunk recomputes its forward in two passes, so memory stays ``O(S/L * state)`` plus one chunk:

1. forward over the whole sequence, keeping only the state entering each chunk of ``L`` steps (the
   checkpoints);
2. the chunks in reverse: each recomputes its ``L`` states from its checkpoint, walks the reverse
   recurrence of the state's gradient ``g_t = c_t dy_t + exp(delta_{t+1} a) g_{t+1}`` back through
   them (two operations a step, over every batch row, channel and state entry at once), and forms
   every input and parameter gradient of the chunk in bulk: batched products over its steps for
   ``d_b``, ``d_c`` and ``c . h``, elementwise terms and sums over steps and rows for ``d_x``,
   ``d_delta``, ``d_a``, ``d_d``, ``d_delta_bias``, ``d_z``.

The state is laid out group- and state-major, ``[rows, G, N, H/G]``, as the forward's blocked path
keeps it, so every broadcast runs along a group's contiguous channels. Packed sequences
(``cu_seqlens``) run one after another, each from its own starting state; with ``carry_state``,
``d_state`` holds the final states' gradients (slots included) and receives the initial ones'.
16-bit storage computes in f32, widened to ``state_dtype``/``param_dtype`` where they are wider; each
chunk's gradients are rounded once on store. Long sequences split the batch rows across threads
(``threads.run_split``, as the forward does); the parameter gradients are summed chunk by chunk,
sequence by sequence and block by block in a fixed order, so a thunk gives the same bytes on every
run of one machine.

Where Numba is there and the thunk computes in f32 (f32, f16 or bf16 storage), a batch row (a packed sequence)
runs as one compiled call instead (``_Compiled``: ``jit_ssm_backward.selective_scan_backward_run``, the same two passes with the
same chunks, its loops along blocks of channels); ``RLX_HOST_JIT=0`` keeps NumPy's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from . import compiled_step, jit, threads
from .abi import complete
from .arena import STORAGE
from .bound import Bound
from .implementations import KERNELS
from .sequences import Sequences, StatePool
from .abi.ssm import SCAN_RESERVE_CHUNK
from .ssm import SCAN_ELEMENT_WORK, SOFTPLUS_LINEAR, _read, compute_type, reserve_views, softplus

#: Steps per chunk: the checkpoints cost ``S/L`` states and a chunk's working set about six ``[L]``
#: states, so ``L`` near ``sqrt(S/6)`` keeps the memory least; 32 also keeps a chunk of the benchmark's
#: B2 H256 N16 in a few MiB.
CHUNK = 32


def _sigmoid(u: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-u) = inf for very negative u gives 0, as it should
        return 1.0 / (1.0 + np.exp(-u))


def _steps_first(v: np.ndarray, groups: int) -> np.ndarray:
    """``[R, T, H]`` -> ``[T, R, G, 1, H/G]`` (a view): one step's channels as a row of each group."""
    rows, steps, hidden = v.shape
    return np.moveaxis(v, 1, 0).reshape(steps, rows, groups, 1, hidden // groups)


def _rows_first(v: np.ndarray) -> np.ndarray:
    """Inverse of ``_steps_first``: ``[T, R, G, 1, W]`` -> ``[R, T, H]``."""
    return np.moveaxis(v.reshape(v.shape[0], v.shape[1], -1), 0, 1)


def _outer(column: np.ndarray, row: np.ndarray) -> np.ndarray:
    """``[..., N, 1] x [..., 1, W] -> [..., N, W]``: as an einsum, a third faster than the broadcast product."""
    return np.einsum("...nx,...xw->...nw", column, row)


@dataclass
class _Chunk:
    """One chunk's inputs in the compute type: ``x``, ``delta`` (after bias and softplus) and ``dx = delta x`` as
    ``[T, R, G, 1, W]``, ``b`` as ``[T, R, G, N, 1]``; ``decay = exp(delta a)`` and ``states``, first ``delta b x``
    and after ``walk`` the states after each step, both ``[T, R, G, N, W]``."""

    x: np.ndarray
    delta: np.ndarray
    dx: np.ndarray
    slope: np.ndarray | None  # d delta / d (delta + bias): softplus' derivative, None without softplus
    b: np.ndarray
    decay: np.ndarray
    states: np.ndarray

    def walk(self, entering: np.ndarray) -> np.ndarray:
        """Turn ``states`` from the inputs ``delta b x`` into the states after each step, from ``entering``
        (``[R, G, N, W]``, left as it is); return the last."""
        prev, term = entering, np.empty_like(entering)
        for i in range(len(self.decay)):
            np.multiply(self.decay[i], prev, out=term)
            self.states[i] += term
            prev = self.states[i]
        return prev


@dataclass
class _Sums:
    """The parameters' gradients of one block of rows, summed over its chunks in a fixed order: ``a`` as
    ``[G, N, W]``, ``d`` as ``[G, 1, W]``, ``bias`` as ``[H]`` (``None`` where the thunk lacks the parameter)."""

    a: np.ndarray
    d: np.ndarray | None
    bias: np.ndarray | None

    def add(self, other: "_Sums") -> None:
        for mine, theirs in ((self.a, other.a), (self.d, other.d), (self.bias, other.bias)):
            if mine is not None:
                mine += theirs


class _Thunk:
    """A selective_scan_backward thunk bound to its arena: its tensors and parameters."""

    def __init__(self, t: Mapping[str, Any], arena: np.ndarray, chunk: int):
        self.t, self.bound, self.chunk = t, Bound(t, arena), chunk
        self.ctype = compute_type(t)
        self.groups, self.n = t["groups"], t["state_size"]
        width = t["hidden"] // self.groups
        everything = slice(None)
        a = _read(self.bound, "a", everything, self.ctype).reshape(self.groups, width, self.n)
        self.a = np.ascontiguousarray(np.swapaxes(a, -1, -2))  # [G, N, W]
        self.d = None if t["d"] is None else _read(self.bound, "d", everything, self.ctype).reshape(self.groups, 1, width)
        self.bias = None if t["delta_bias"] is None else _read(self.bound, "delta_bias", everything, self.ctype)

    def sums(self) -> _Sums:
        """Zeroed gradients of the parameters the thunk has."""
        return _Sums(np.zeros_like(self.a), None if self.d is None else np.zeros_like(self.d),
                     None if self.bias is None else np.zeros(self.t["hidden"], self.ctype))

    # --- a chunk's tensors ----------------------------------------------------------------------------
    def _get(self, field: str, rows: slice, steps: slice) -> np.ndarray:
        """``[R, T, ...]`` of a ``[B, S, ...]`` field in the compute type (a view of the arena where it can be)."""
        return _read(self.bound, field, (rows, steps), self.ctype)

    def _bc(self, field: str, rows: slice, steps: slice) -> np.ndarray:
        """``b`` or ``c`` of a chunk as ``[T, R, G, N]``."""
        v = self._get(field, rows, steps)
        return np.moveaxis(v.reshape(*v.shape[:2], self.groups, self.n), 1, 0)

    def load(self, rows: slice, steps: slice) -> _Chunk:
        """A chunk's inputs, its decays and its input terms ``delta b x`` (what the forward needs)."""
        x = _steps_first(self._get("x", rows, steps), self.groups)
        u = self._get("delta", rows, steps)
        if self.bias is not None:
            u = u + self.bias
        slope = None
        if self.t["delta_softplus"]:
            slope = np.where(u > SOFTPLUS_LINEAR, 1.0, _sigmoid(u)).astype(self.ctype, copy=False)
            slope = _steps_first(slope, self.groups)
            u = softplus(u)
        delta = _steps_first(np.asarray(u, self.ctype), self.groups)
        b = self._bc("b", rows, steps)[..., None]
        decay = np.multiply(delta, self.a)
        np.exp(decay, out=decay)
        dx = delta * x
        return _Chunk(x, delta, dx, slope, b, decay, _outer(b, dx))

    def _put(self, field: str, rows: slice, steps: slice, values: np.ndarray) -> None:
        """Write ``[R, T, ...]`` values of a chunk into a ``[B, S, ...]`` gradient, rounded into its type."""
        target = self.bound.view(field)[rows, steps]
        target[...] = values.reshape(target.shape).astype(STORAGE[self.bound.regions[field].dtype], copy=False)

    # --- the two passes -------------------------------------------------------------------------------
    def reverse(self, rows: slice, tokens: slice, entering: np.ndarray, d_final: np.ndarray, sums: _Sums,
                saved: np.ndarray | None = None) -> np.ndarray:
        """Every gradient of the rows ``rows`` over the tokens ``tokens`` (one recurrence each), from their
        starting states and their final states' gradients (``[R, H, N]``), the parameters' added to ``sums``;
        returns the starting states' gradients. ``saved``: a saved forward's states leaving each chunk
        (``[R, C, H, N]``), read instead of the forward pass over the chunks."""
        spans = [slice(lo, min(tokens.stop, lo + self.chunk)) for lo in range(tokens.start, tokens.stop, self.chunk)]
        state = self._state_layout(entering)
        checkpoints = np.empty((len(spans), *state.shape), self.ctype)
        for k, span in enumerate(spans[:-1]):  # the last chunk's states are recomputed below anyway
            checkpoints[k] = state
            state = self._state_layout(saved[:, k]) if saved is not None else self.load(rows, span).walk(state)
        checkpoints[-1] = state
        grad = self._state_layout(d_final)
        for k in reversed(range(len(spans))):
            grad = self._chunk(rows, spans[k], checkpoints[k], grad, sums)
        return np.swapaxes(grad.reshape(grad.shape[0], self.groups, self.n, -1), -1, -2).reshape(entering.shape)

    def _state_layout(self, s: np.ndarray) -> np.ndarray:
        """``[R, H, N]`` -> a fresh ``[R, G, N, W]`` in the compute type."""
        s = s.reshape(s.shape[0], self.groups, -1, self.n)
        return np.ascontiguousarray(np.swapaxes(s, -1, -2), dtype=self.ctype)

    def _chunk(self, rows: slice, steps: slice, entering: np.ndarray, grad: np.ndarray, sums: _Sums) -> np.ndarray:
        """One chunk of the reverse: its states from ``entering``, then every gradient of its steps from
        ``grad``, the gradient of the state it hands on; returns the gradient of ``entering``."""
        t = self.t
        ch = self.load(rows, steps)
        ch.walk(entering)
        h = ch.states
        c = self._bc("c", rows, steps)
        dy = _steps_first(self._get("d_dst", rows, steps), self.groups)
        if t["d"] is not None or t["z"] is not None:
            dy = self._gate(rows, steps, ch, c, dy, sums)
        # the state's gradient after each step: c dy from the output, then the step after it through its decay
        g = _outer(c[..., None], dy)
        carry = grad.copy()
        for i in reversed(range(len(g))):
            g[i] += carry
            np.multiply(ch.decay[i], g[i], out=carry)
        self._put("d_c", rows, steps, np.moveaxis(h @ np.swapaxes(dy, -1, -2), 0, 1))
        self._put("d_b", rows, steps, np.moveaxis(g @ np.swapaxes(ch.dx, -1, -2), 0, 1))
        gb = np.swapaxes(ch.b, -1, -2) @ g  # [T, R, G, 1, W]: sum over n of g b
        # through the decay: p = g * exp(delta a) * h_prev is the gradient of delta a
        p = np.multiply(ch.decay, g, out=ch.decay)
        p[0] *= entering
        p[1:] *= h[:-1]
        # the two contractions of p as einsums: each one pass over p, half the time of a product and a sum
        sums.a += np.einsum("trgnw,trgw->gnw", p, ch.delta[..., 0, :])
        d_delta = np.einsum("trgnw,gnw->trgw", p, self.a)[..., None, :]
        d_delta += ch.x * gb
        d_x = ch.delta * gb
        if t["d"] is not None:
            d_x += dy * self.d
        self._put("d_x", rows, steps, _rows_first(d_x))
        if ch.slope is not None:
            d_delta *= ch.slope
        if sums.bias is not None:
            sums.bias += d_delta.sum(axis=(0, 1)).reshape(-1)
        self._put("d_delta", rows, steps, _rows_first(d_delta))
        return carry

    def _gate(self, rows: slice, steps: slice, ch: _Chunk, c: np.ndarray, dy: np.ndarray, sums: _Sums) -> np.ndarray:
        """Back through ``y = (c . h + d x) * silu(z)``: write ``d_z``, sum ``d_d``; return the gradient of ``c . h``."""
        y = np.swapaxes(c[..., None], -1, -2) @ ch.states  # [T, R, G, 1, W]
        if self.d is not None:
            y += self.d * ch.x
        if self.t["z"] is not None:
            z = _steps_first(self._get("z", rows, steps), self.groups)
            gate = _sigmoid(z)
            with np.errstate(invalid="ignore"):  # z = ±inf: the forward's 0 * inf is NaN too
                self._put("d_z", rows, steps, _rows_first(dy * y * gate * (1 + z * (1 - gate))))
            dy = dy * (z * gate)
        if sums.d is not None:
            sums.d += (dy * ch.x).sum(axis=(0, 1))
        return dy

    def store(self, sums: _Sums) -> None:
        """Write the parameters' gradients."""
        self.bound.store("d_a", np.swapaxes(sums.a, -1, -2).reshape(self.t["hidden"], self.n))
        if sums.d is not None:
            self.bound.store("d_d", sums.d.reshape(-1))
        if sums.bias is not None:
            self.bound.store("d_delta_bias", sums.bias)


class _Compiled:
    """The compiled reverse of a thunk (``jit``'s ``selective_scan_backward_run``): a sequence's every gradient in
    one call, where NumPy's ``_Thunk.reverse`` makes about forty array passes a chunk. It reads and writes the
    arena's views where a tensor is stored in f32, else f32 copies (16-bit storage: the outputs rounded once, on
    store, as NumPy's path rounds them)."""

    def __init__(self, run: _Thunk, kernel: Any):
        self.run, self.kernel, t = run, kernel, run.t
        self.shape = {f: (t["groups"], t["state_size"]) for f in ("b", "c", "d_b", "d_c")}  # [T, G, N]
        self.params = [None if t[f] is None else self._get(f, slice(None)) for f in ("a", "delta_bias", "d")]

    @classmethod
    def of(cls, run: _Thunk) -> "_Compiled | None":
        """Where it applies: Numba there (not ``RLX_HOST_JIT=0``), a thunk computing in f32 (f32, f16 or bf16
        storage), no output overlapping another tensor (``compiled_step.apart``), and f32 arena views Numba takes
        (aligned, writable)."""
        kernel = jit.kernel("selective_scan_backward_run")
        bound = run.bound
        if kernel is None or run.ctype != np.float32 or not compiled_step.apart(bound.regions):
            return None
        usable = all(bound.view(r.field).flags.aligned and bound.view(r.field).flags.writeable
                     for r in bound.regions.values() if r.dtype == "f32")
        return cls(run, kernel) if usable else None

    def _get(self, field: str, index: Any) -> np.ndarray:
        """``field[index]`` in f32, C-contiguous: the arena's view where it is stored so, else a copy."""
        v = _read(self.run.bound, field, index, np.float32)
        v = np.ascontiguousarray(v)
        return v.reshape(v.shape[0], *self.shape[field]) if field in self.shape else v

    def _out(self, field: str, index: Any) -> np.ndarray:
        """Where the kernel writes ``field[index]``: the arena's view where it is stored in f32, else an f32 array
        (``_put`` rounds it in)."""
        target = self.run.bound.view(field)[index]
        out = target if target.dtype == np.float32 else np.empty(target.shape, np.float32)
        return out.reshape(out.shape[0], *self.shape[field]) if field in self.shape else out

    def _put(self, field: str, index: Any, values: np.ndarray) -> None:
        target = self.run.bound.view(field)[index]
        if not np.shares_memory(target, values):
            target[...] = values.reshape(target.shape).astype(target.dtype)

    def reverse(self, rows: slice, tokens: slice, entering: np.ndarray, d_final: np.ndarray, sums: _Sums,
                saved: np.ndarray | None = None) -> np.ndarray:
        """``_Thunk.reverse``, one call a batch row."""
        return np.stack([self._row(row, tokens, entering[k], d_final[k], sums, None if saved is None else saved[k])
                         for k, row in enumerate(range(rows.start, rows.stop))])

    def _row(self, row: int, tokens: slice, entering: np.ndarray, d_final: np.ndarray, sums: _Sums,
             saved: np.ndarray | None) -> np.ndarray:
        """One batch row's tokens: its starting state and final state's gradient ``[H, N]``, ``saved`` its saved
        states ``[C, H, N]``; returns the starting state's gradient."""
        t, at = self.run.t, (row, tokens)
        hidden, n, gated = t["hidden"], t["state_size"], t["z"] is not None
        d_a = np.zeros((hidden, n), np.float32)
        d_d, d_bias = (np.zeros(hidden if t[f] is not None else 0, np.float32) for f in ("d", "delta_bias"))
        d_state = np.array(d_final, np.float32)  # (updated in place to the starting state's gradient)
        a, bias, d = (compiled_step.NONE[1] if v is None else v for v in self.params)
        x, delta, b, c, dy = (self._get(f, at) for f in ("x", "delta", "b", "c", "d_dst"))
        z = self._get("z", at) if gated else compiled_step.NONE[2]
        fields = ("d_x", "d_delta", "d_z", "d_b", "d_c") if gated else ("d_x", "d_delta", "d_b", "d_c")
        outs = {f: self._out(f, at) for f in fields}
        chunks = -(-(tokens.stop - tokens.start) // self.run.chunk)
        keep = np.empty((chunks, hidden, n), np.float32) if saved is None else saved  # (the checkpoints' memory)
        self.kernel(x, delta, b, c, a, bias, d, z, dy, np.ascontiguousarray(entering, np.float32), keep, d_state,
                    outs["d_x"], outs["d_delta"], outs.get("d_z", compiled_step.NONE[2]), outs["d_b"], outs["d_c"],
                    d_a, d_d, d_bias, self.run.chunk, bool(t["delta_softplus"]), saved is not None)
        for f, values in outs.items():
            self._put(f, at, values)
        groups = self.run.groups
        sums.a += np.swapaxes(d_a.reshape(groups, -1, n), -1, -2)
        if sums.d is not None:
            sums.d += d_d.reshape(groups, 1, -1)
        if sums.bias is not None:
            sums.bias += d_bias
        return d_state


def selective_scan_backward(thunk: Mapping[str, Any], arena: np.ndarray, *, chunk: int | None = None,
                            workers: int | None = None) -> None:
    """The gradients of a selective_scan (ABI.md §9): every ``d_`` output of the thunk from ``d_dst`` and,
    with ``carry_state``, the final states' gradients in ``d_state`` (overwritten with the initial ones').

    ``chunk`` (steps per checkpoint, default ``CHUNK``) trades the checkpoints' memory for the chunk's;
    ``workers`` (threads over blocks of batch rows; packed sequences run on one) overrides the choice.
    """
    t = complete(thunk)
    if chunk is not None and chunk < 1:
        raise ValueError(f"selective_scan_backward: chunk must be at least 1 step, got {chunk}")
    run = _Thunk(t, arena, chunk or CHUNK)
    reverse = (_Compiled.of(run) or run).reverse
    shape = (t["state_size"],)
    states = StatePool(t, run.bound, run.ctype, shape)
    grads = StatePool(t, run.bound, run.ctype, shape, field="d_state")
    batch, channels = slice(0, t["batch"]), slice(0, t["hidden"])
    entering, d_final = states.initial(batch, channels), grads.initial(batch, channels)
    seqs = Sequences.of(t, run.bound)
    sums = run.sums()
    if seqs is None:
        d_initial = np.empty_like(d_final)
        blocks: dict[int, _Sums] = {}
        # a saved forward (ABI.md §9.1) is read where its chunks are the backward's
        views = reserve_views(t, arena) if run.chunk == SCAN_RESERVE_CHUNK else None

        def compute(bs: slice, _: slice) -> _Sums:
            part = run.sums()
            d_initial[bs] = reverse(bs, slice(0, t["seq"]), entering[bs], d_final[bs], part,
                                    None if views is None else views["states"][bs])
            return part

        def keep(bs: slice, _: slice, part: _Sums) -> None:
            blocks[bs.start] = part

        work = t["batch"] * t["seq"] * t["hidden"] * t["state_size"] * SCAN_ELEMENT_WORK
        parts = threads.parts_for(t["op"], work, t["batch"], 1, workers)
        threads.run_split(compute, keep, t["batch"], 1, parts)
        for start in sorted(blocks):  # in row order, whichever block finished first
            sums.add(blocks[start])
    else:
        d_initial = np.array(d_final)  # an empty sequence hands its final state's gradient straight back
        for row, lo, hi in seqs.runs():
            one = slice(row, row + 1)
            d_initial[one] = reverse(slice(0, 1), slice(lo, hi), entering[one], d_final[one], sums)
    run.store(sums)
    grads.store(batch, channels, d_initial)


KERNELS.add("selective_scan_backward", selective_scan_backward)
