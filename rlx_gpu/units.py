"""Sizes and times in human units, and plain-text tables, for messages and reports."""
from __future__ import annotations

from typing import Any, Sequence


def human_bytes(n: int) -> str:
    """``1536`` → ``'1.5 KiB'``; exact below 1 KiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_time(seconds: float) -> str:
    """``0.00123`` → ``'1.23 ms'``."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def plural(count: int, noun: str) -> str:
    """``plural(1, "thunk")`` → ``'1 thunk'``, ``plural(3, "thunk")`` → ``'3 thunks'``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def text_table(rows: list[Sequence[Any]], header: Sequence[str]) -> str:
    """Left-aligned columns under a header and a rule of dashes."""
    cells = [list(map(str, header))] + [list(map(str, r)) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
