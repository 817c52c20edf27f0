"""The sizes of an ``lstm``/``gru``/``rnn`` thunk (``_Dims``) and its packing: which rows run at each step,
and where each step's columns lie in the time-chunked layout (``rnn``'s docstring says why)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from .abi.rnn import output_width
from .arena import COMPUTE, STORAGE

#: Internal gate order (ABI index of each internal gate): the gates of the first activation slot first.
_ORDER = {"lstm": (0, 1, 3, 2), "gru": (0, 1, 2), "rnn": (0,)}
#: Columns of a time chunk the projection GEMM aims for.
_CHUNK_COLUMNS = 128
#: Longest sequence that reads f32/f64 weights where they are stored (no per-call reordered copy).
_STORED_MAX_SEQ = 16


@dataclass(frozen=True)
class _Dims:
    op: str
    batch: int
    seq: int
    hidden: int
    width: int  # of h, dst and the layers above 0: proj_size when the lstm projects, else hidden
    layers: int
    gates: int
    dirs: int
    compute: np.dtype
    stored: bool  # weights used in place, ABI gate order, not scaled (decode); else the internal copy


def _dims(t: Mapping[str, Any]) -> _Dims:
    """Sizes of a thunk with ``batch, seq >= 1``."""
    compute = COMPUTE[t["dtype"]]
    stored = t["seq"] <= _STORED_MAX_SEQ and compute == STORAGE[t["dtype"]]
    return _Dims(t["op"], t["batch"], t["seq"], t["hidden"], output_width(t), t["num_layers"], len(_ORDER[t["op"]]),
                 2 if t["bidirectional"] else 1, compute, stored)


@dataclass(frozen=True)
class _Chunk:
    first: int  # its first column among all
    columns: int
    t0: int  # the time of its first step
    steps: tuple[tuple[int, int], ...]  # (first column inside the chunk, rows) of steps t0, t0+1, ...


@dataclass(frozen=True)
class _Packing:
    """Which rows run at each step, and where each step's columns lie in the time-chunked layout."""

    chunks: tuple[_Chunk, ...]
    columns: int
    widest: int  # columns of the widest chunk
    order: np.ndarray | None  # the rows by decreasing length (None: every row runs every step, in order)
    index: np.ndarray | None  # row*seq + t of every column, with ``order``
    lengths: np.ndarray | None


def _chunks(rows: Sequence[int]) -> tuple[_Chunk, ...]:
    """Cut the steps with ``rows[t] > 0`` running rows into chunks of at most ``_CHUNK_COLUMNS`` columns,
    at least one step each."""
    out, t, first = [], 0, 0
    while t < len(rows) and rows[t] > 0:
        t0, steps, width = t, [], 0
        while t < len(rows) and rows[t] > 0 and (not steps or width + rows[t] <= _CHUNK_COLUMNS):
            steps.append((width, rows[t]))
            width += rows[t]
            t += 1
        out.append(_Chunk(first, width, t0, tuple(steps)))
        first += width
    return tuple(out)


def _full_packing(batch: int, seq: int) -> _Packing:
    chunks = _chunks([batch] * seq)
    return _Packing(chunks, batch * seq, max(c.columns for c in chunks), None, None, None)


def _varlen_packing(lengths: np.ndarray, seq: int) -> _Packing:
    """The packing of rows of ``lengths`` (each in ``[0, seq]``, checked before the kernel runs)."""
    order = np.argsort(-lengths, kind="stable")
    running = np.count_nonzero(lengths[order][None, :] > np.arange(seq)[:, None], axis=1)
    chunks = _chunks(running.tolist())
    steps, rows = np.nonzero(np.arange(lengths.size)[None, :] < running[:, None])  # t-major, rows in order
    index = order[rows] * seq + steps
    widest = max((c.columns for c in chunks), default=0)
    return _Packing(chunks, int(index.size), widest, order, index, lengths)


def chunk_columns(batch: int, seq: int) -> list[int]:
    """Columns of each time chunk of a full batch (``batch``, ``seq >= 1``), in time order."""
    return [c.columns for c in _chunks([batch] * seq)]
