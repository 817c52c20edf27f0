"""The values validation reads: where a message points (``Where``) and the checks of each kind of value.

Each check returns the value as the schedule model keeps it or raises ``ScheduleError`` through
``Where.fail``, naming the place, the field, the value (shortened: ``errors.brief``) and what was expected.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from host_fallback.abi import Field

from ..errors import ScheduleError, brief
from .limits import MAX_ARENA_BYTES, MAX_DIM


class Where:
    """Names the place a message is about: ``body of thunk 2 (scan) → thunk 0 (matmul), field 'a'``."""

    def __init__(self, prefix: str, thunk: tuple[int, str] | None = None):
        self._prefix, self._thunk = prefix, thunk  # the text is built only when a message needs it

    @property
    def prefix(self) -> str:
        return self._prefix if self._thunk is None else f"{self._prefix}thunk {self._thunk[0]} ({self._thunk[1]})"

    def thunk(self, index: int, op: str) -> "Where":
        return Where(self._prefix, (index, op))

    def fail(self, field: str | None, message: str) -> ScheduleError:
        where = self.prefix or "schedule"
        steps = where.split(" → ")
        if len(steps) > 6:  # a deep nest: the outermost and innermost levels say where
            where = " → ".join(steps[:2] + [f"... {len(steps) - 4} levels ..."] + steps[-2:])
        if field:
            return ScheduleError(f"{where}{'' if where.endswith('→ ') else ', '}field {field!r}: {message}")
        return ScheduleError(f"{where.removesuffix(' → ')}: {message}")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def integer(where: Where, name: str, v: Any, minimum: int, what: str, maximum: int = MAX_DIM,
            limit: str = "dimension") -> int:
    if not is_int(v):
        raise where.fail(name, f"expected {what}, got {type(v).__name__} {brief(v)}")
    if v < minimum:
        raise where.fail(name, f"expected {what}, got {brief(v)}")
    if v > maximum:
        raise where.fail(name, f"{brief(v)} exceeds the limit {maximum} (2^{maximum.bit_length() - 1}, "
                               f"limit {limit!r})")
    return v


def offset(where: Where, name: str, v: Any) -> int:
    return integer(where, name, v, 0, "a byte offset >= 0", MAX_ARENA_BYTES, "arena_bytes")


def mapping(where: Where, name: str | None, v: Any, what: str) -> Mapping:
    """``v`` as a mapping whose keys are all strings."""
    if not isinstance(v, Mapping):
        raise where.fail(name, f"expected {what}, got {type(v).__name__} {brief(v)}")
    for key in v:
        if not isinstance(key, str):
            raise where.fail(name, f"keys must be strings, got {type(key).__name__} {brief(key)} in {what}")
    return v


def int_list(where: Where, name: str, v: Any, width: int | None, what: str, max_len: int | None = None,
             limit: str = "rank") -> list:
    if not isinstance(v, (list, tuple)):
        raise where.fail(name, f"expected a list of {what}, got {type(v).__name__} {brief(v)}")
    if max_len is not None and len(v) > max_len:
        raise where.fail(name, f"expected rank <= {max_len} (limit {limit!r}), got rank {len(v)}")
    for i, item in enumerate(v):
        if width is None:
            integer(where, f"{name}[{i}]", item, 0, "an int >= 0")
        else:
            if not isinstance(item, (list, tuple)) or len(item) != width:
                raise where.fail(f"{name}[{i}]", f"expected [{what}] ({width} ints), got {brief(item)}")
            for j, x in enumerate(item):
                integer(where, f"{name}[{i}][{j}]", x, 0, "an int >= 0")
    return [list(x) if isinstance(x, (list, tuple)) else x for x in v]


def number(here: Where, name: str, v: Any, what: str) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise here.fail(name, f"expected {what}, got {type(v).__name__} {brief(v)}")
    try:
        value = float(v)
    except OverflowError:
        raise here.fail(name, f"{brief(v)} is beyond the range of a float") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise here.fail(name, f"expected {what}, got {brief(v)}")
    return value


def limit(here: Where, name: str, v: Any) -> tuple[float, float | None] | None:
    """``dt_limit``: ``[lo, hi]`` with ``0 <= lo < hi``, ``hi`` null for +inf; null is the default (no clamp)."""
    if v is None:
        return None
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise here.fail(name, f"expected [lo, hi] (hi a number or null for +inf), got {brief(v)}")
    lo = number(here, f"{name}[0]", v[0], "a finite number >= 0")
    hi = None if v[1] is None else number(here, f"{name}[1]", v[1], "a finite number or null (+inf)")
    if lo < 0 or (hi is not None and not lo < hi):
        raise here.fail(name, f"expected 0 <= lo < hi, got {brief(list(v))}")
    return lo, hi


def activations(here: Where, f: Field, v: Any) -> tuple[tuple[str, float, float], ...]:
    """``activations``: a list of ``[name, alpha, beta]`` (the count per direction is a cross-field rule)."""
    if not isinstance(v, (list, tuple)) or not v:
        raise here.fail(f.name, f"expected a list of [name, alpha, beta], got {brief(v)}")
    out = []
    for i, entry in enumerate(v):
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            raise here.fail(f"{f.name}[{i}]", f"expected [name, alpha, beta], got {brief(entry)}")
        name = entry[0]
        if not isinstance(name, str) or name not in f.choices:
            raise here.fail(f"{f.name}[{i}]", f"unknown activation {brief(name)}; expected one of {', '.join(f.choices)}")
        alpha, beta = (number(here, f"{f.name}[{i}][{j}]", entry[j], "a finite number") for j in (1, 2))
        out.append((name, alpha, beta))
    return tuple(out)
