"""ABI.md §9.1's saved forward: the optional ``reserve`` and ``reserve_bytes`` fields, their region and rule.

A forward op that has a saved forward takes ``reserve`` (an offset, null: none) and ``reserve_bytes``; its
backward op takes the same pair, read-only (``backward`` keeps every forward field). What a reserve holds
is the op's layout (``Slot`` list, in the op's definition module, documented in docs/abi.md): the minimum
size is the end of its last slot, rounded up to ``ALIGN``, a function of the shape and dtype fields only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from .model import ELEM_SIZE, Checked, Field, Region, Rule, Thunk, fail, newer

RESERVE = "reserve"
#: The reserve's offset and every size within it are multiples of this: any slot's element type is aligned.
ALIGN = 16
FIELDS: tuple[Field, ...] = (newer(RESERVE, "opt_offset", None), newer("reserve_bytes", "count", 0))


@dataclass(frozen=True)
class Slot:
    """One array of a reserve: ``name`` (``y``, ``h_prev`` ...) of layer-direction or layer ``index``, at byte
    ``offset`` from the reserve's start, C-ordered ``shape`` of element type ``dtype``."""

    name: str
    index: int
    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def end(self) -> int:
        return self.offset + math.prod(self.shape) * ELEM_SIZE[self.dtype]


def packed(arrays: list[tuple[str, int, tuple[int, ...], str]]) -> list[Slot]:
    """``(name, index, shape, dtype)`` one after the other, each at a multiple of its element size (callers
    list the wider element types first, so nothing is padded but the end)."""
    out, offset = [], 0
    for name, index, shape, dtype in arrays:
        offset = -(-offset // ELEM_SIZE[dtype]) * ELEM_SIZE[dtype]
        out.append(Slot(name, index, offset, shape, dtype))
        offset = out[-1].end
    return out


def size(slots: list[Slot]) -> int:
    """The bytes a reserve of ``slots`` needs: the last one's end, rounded up to ``ALIGN``."""
    end = max((s.end for s in slots), default=0)
    return -(-end // ALIGN) * ALIGN


def element_type(t: Thunk) -> str:
    """The element type of a state-space op's reserve: f64 where the thunk computes in f64 (its dtype,
    ``state_dtype`` or ``param_dtype``), else f32."""
    return "f64" if "f64" in (t["dtype"], t.get("state_dtype"), t.get("param_dtype")) else "f32"


def refuse_packed(t: Thunk) -> None:
    """A state-space op's reserve refused for packed sequences (its chunks are a batch row's, not a sequence's)."""
    if t.get(RESERVE) is not None and t.get("cu_seqlens") is not None:
        raise fail(t, RESERVE, "a saved forward of packed sequences (cu_seqlens) is not supported yet; "
                               "leave reserve out (the backward recomputes the forward)")


def region(t: Thunk) -> list[Region]:
    """The reserve's region of a completed thunk (exactly ``reserve_bytes`` bytes, written), none without one."""
    if t.get(RESERVE) is None:
        return []
    return [Region(RESERVE, t[RESERVE], (t["reserve_bytes"],), "u8", "w")]


def rule(minimum: Callable[[Thunk], int]) -> Rule:
    """The fields given: ``reserve_bytes`` only with a ``reserve``, at least ``minimum(fields)`` bytes, and the
    reserve's offset a multiple of ``ALIGN``."""
    def check(c: Checked) -> None:
        t = c.given
        if t.get(RESERVE) is None:
            if t.get("reserve_bytes"):
                raise fail(t, "reserve_bytes", "given without reserve (the offset of the saved forward)")
            return
        if t[RESERVE] % ALIGN:
            raise fail(t, RESERVE, f"offset {t[RESERVE]} is not a multiple of {ALIGN}")
        need, given = minimum(t), t.get("reserve_bytes", 0)
        if given < need:
            raise fail(t, "reserve_bytes", f"expected at least {need} bytes (rlx_gpu.reserve_bytes of the "
                                           f"forward's fields), got {given}")
    return Rule(check)
