"""Validation at the border (ABI.md §2): every rule checked before anything launches.

Each failure raises ``ScheduleError`` naming the thunk index, op, field, the value and what was expected.
"""
from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any, Callable

from host_fallback import scan_rules
from host_fallback.arena import ELEM_SIZE

from ..errors import ScheduleError
from ..units import human_bytes
from .model import ABI_VERSION, InitBlock, Schedule, TensorView, Thunk, freeze_fields
from .ops import DTYPES, MAX_RANK, SPECS, Field, OpSpec, element_counts, footprint

_TOP_KEYS = {"abi", "arena_bytes", "tensors", "inputs", "outputs", "init", "thunks", "meta"}
_RECURRENT = ("lstm", "gru", "rnn")


class _Where:
    """Names the place a message is about: ``body of thunk 2 (scan) → thunk 0 (matmul), field 'a'``."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def thunk(self, index: int, op: str) -> "_Where":
        return _Where(f"{self.prefix}thunk {index} ({op})")

    def fail(self, field: str | None, message: str) -> ScheduleError:
        where = self.prefix or "schedule"
        return ScheduleError(f"{where}, field {field!r}: {message}" if field else f"{where}: {message}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(where: _Where, name: str, v: Any, minimum: int, what: str) -> int:
    if not _is_int(v):
        raise where.fail(name, f"expected {what}, got {type(v).__name__} {v!r}")
    if v < minimum:
        raise where.fail(name, f"expected {what}, got {v}")
    return v


def _int_list(where: _Where, name: str, v: Any, width: int | None, what: str) -> list:
    if not isinstance(v, (list, tuple)):
        raise where.fail(name, f"expected a list of {what}, got {type(v).__name__} {v!r}")
    for i, item in enumerate(v):
        if width is None:
            _int(where, f"{name}[{i}]", item, 0, "an int >= 0")
        else:
            if not isinstance(item, (list, tuple)) or len(item) != width:
                raise where.fail(f"{name}[{i}]", f"expected [{what}] ({width} ints), got {item!r}")
            for j, x in enumerate(item):
                _int(where, f"{name}[{i}][{j}]", x, 0, "an int >= 0")
    return [list(x) if isinstance(x, (list, tuple)) else x for x in v]


def _check_field(where: _Where, f: Field, v: Any) -> Any:
    kind = f.kind
    if kind == "offset":
        return _int(where, f.name, v, 0, "a byte offset >= 0")
    if kind == "pos":
        return _int(where, f.name, v, 1, "an int >= 1")
    if kind == "count":
        return _int(where, f.name, v, 0, "an int >= 0")
    if kind == "bool":
        if not isinstance(v, bool):
            raise where.fail(f.name, f"expected true or false, got {type(v).__name__} {v!r}")
        return v
    if kind == "float":
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise where.fail(f.name, f"expected a number, got {type(v).__name__} {v!r}")
        return float(v)
    if kind == "enum":
        if v not in f.choices:
            raise where.fail(f.name, f"expected one of {', '.join(f.choices)}, got {v!r}")
        return v
    if kind == "dtype":
        if v not in DTYPES:
            raise where.fail(f.name, f"expected a dtype ({', '.join(DTYPES)}), got {v!r}")
        return v
    if kind == "elem_size":
        if not _is_int(v) or v not in (2, 4, 8):
            raise where.fail(f.name, f"expected 2, 4 or 8 (bytes per carry element), got {v!r}")
        return v
    if kind in ("shape", "strides"):
        out = _int_list(where, f.name, v, None, "ints >= 0")
        if kind == "shape" and not 1 <= len(out) <= MAX_RANK:
            raise where.fail(f.name, f"expected rank 1..{MAX_RANK}, got rank {len(out)} ({out})")
        return out
    if kind == "offsets":
        return _int_list(where, f.name, v, None, "byte offsets >= 0")
    if kind == "xs":
        return _int_list(where, f.name, v, 3, "body_x_off, outer_xs_off, per_step_bytes")
    if kind == "bcast":
        return _int_list(where, f.name, v, 3, "body_b_off, outer_b_off, total_bytes")
    if kind == "pairs":
        return _int_list(where, f.name, v, 2, "outer_xs_off, per_step_bytes")
    if kind in ("schedule", "opt_schedule"):
        if v is None and kind == "opt_schedule":
            return None
        if not isinstance(v, Mapping):
            raise where.fail(f.name, f"expected a nested schedule object, got {type(v).__name__}")
        return _schedule(v, _Where(f"{where.prefix}, field {f.name!r} → "), nested=True)
    raise AssertionError(f"unknown field kind {kind}")


def _rules_scan_family(where: _Where, t: Mapping[str, Any]) -> None:
    try:
        scan_rules.check(t)
    except scan_rules.FieldError as err:
        raise where.fail(err.field, err.message) from None


def _rules_binary(where: _Where, f: Mapping[str, Any]) -> None:
    for name in ("a_strides", "b_strides"):
        if len(f[name]) != len(f["shape"]):
            raise where.fail(name, f"rank {len(f[name])} differs from shape's rank {len(f['shape'])}")


def _rules_copy(where: _Where, f: Mapping[str, Any]) -> None:
    n, src, dst = f["nbytes"], f["src"], f["dst"]
    if n and src < dst + n and dst < src + n:
        raise where.fail("dst", f"range [{dst}, {dst + n}) overlaps src range [{src}, {src + n}); copy ranges "
                                "must not overlap")


#: Cross-field rules by op; each gets the thunk's fields with ``op`` and ``dtype``.
_RULES: dict[str, Callable[[_Where, Mapping[str, Any]], None]] = {
    "scan": _rules_scan_family, "scan_backward": _rules_scan_family, "scan_backward_xs": _rules_scan_family,
    "binary": _rules_binary, "copy": _rules_copy,
}


def _thunk(index: int, raw: Any, where: _Where, arena_bytes: int, tensors: Mapping[str, TensorView]) -> Thunk:
    if not isinstance(raw, Mapping):
        raise where.fail(None, f"thunk {index} is a {type(raw).__name__}, expected an object")
    op = raw.get("op")
    if op not in SPECS:
        raise where.thunk(index, str(op)).fail("op", f"unknown op {op!r}; expected one of {', '.join(SPECS)}")
    spec: OpSpec = SPECS[op]
    here = where.thunk(index, op)
    dtype = raw.get("dtype")
    if dtype not in spec.dtypes:
        raise here.fail("dtype", f"expected one of {', '.join(spec.dtypes)}, got {dtype!r}")
    missing = [n for n in spec.field_names if n not in raw]
    if missing:
        raise here.fail(missing[0], f"missing (required fields still absent: {', '.join(missing)})")
    extra = sorted(set(raw) - set(spec.field_names) - {"op", "dtype"})
    if extra:
        raise here.fail(extra[0], f"unknown field for {op} (known: {', '.join(spec.field_names)})")
    fields = {f.name: _check_field(here, f, raw[f.name]) for f in spec.fields}
    if op in _RULES:
        _RULES[op](here, {"op": op, "dtype": dtype, **fields})
    thunk = Thunk(index, op, dtype, freeze_fields(fields))
    reads, writes = footprint(thunk)
    for r in {id(r): r for r in reads + writes}.values():
        size = ELEM_SIZE[r.dtype]
        if r.offset % size:
            raise here.fail(r.field, f"offset {r.offset} is not a multiple of {size} (the {r.dtype} element size)")
        if r.offset + r.nbytes > arena_bytes:
            raise here.fail(r.field, f"bytes [{r.offset}, {r.offset + r.nbytes}) ({list(r.shape)} {r.dtype}, "
                                     f"{human_bytes(r.nbytes)}) fall outside the arena of {arena_bytes} bytes")
    if op in _RECURRENT:
        _recurrent_counts(here, thunk, tensors)
    return thunk


def _recurrent_counts(here: _Where, thunk: Thunk, tensors: Mapping[str, TensorView]) -> None:
    """A named tensor placed at an RNN input must hold exactly the element count ABI.md §3 expects."""
    by_offset = {(t.offset, t.dtype): name for name, t in tensors.items()}
    for field, expected in element_counts(thunk).items():
        name = by_offset.get((thunk[field], thunk.dtype))
        if name is not None and field != "dst" and tensors[name].count != expected:
            raise here.fail(field, f"input {name!r} has {tensors[name].count} elements, expected {expected}")


def _schedule(raw: Mapping[str, Any], where: _Where, nested: bool) -> Schedule:
    extra = sorted(set(raw) - _TOP_KEYS)
    if extra:
        raise where.fail(extra[0], f"unknown schedule key (known: {', '.join(sorted(_TOP_KEYS))})")
    if not (nested and "abi" not in raw) and raw.get("abi") != ABI_VERSION:
        raise where.fail("abi", f"unknown abi {raw.get('abi')!r}; this reader implements {ABI_VERSION!r}")
    arena_bytes = _int(where, "arena_bytes", raw.get("arena_bytes"), 1, "a size in bytes >= 1")
    tensors: dict[str, TensorView] = {}
    raw_tensors = raw.get("tensors", {}) or {}
    if not isinstance(raw_tensors, Mapping):
        raise where.fail("tensors", f"expected an object of named views, got {type(raw_tensors).__name__}")
    for name, t in raw_tensors.items():
        tw = _Where(f"{where.prefix}tensor {name!r}")
        if not isinstance(t, Mapping) or set(t) != {"offset", "dtype", "shape"}:
            raise tw.fail(None, f"expected {{offset, dtype, shape}}, got {t!r}")
        if t["dtype"] not in DTYPES:
            raise tw.fail("dtype", f"expected one of {', '.join(DTYPES)}, got {t['dtype']!r}")
        view = TensorView(_int(tw, "offset", t["offset"], 0, "a byte offset >= 0"), t["dtype"],
                          tuple(_int_list(tw, "shape", t["shape"], None, "ints >= 0")))
        if view.offset % ELEM_SIZE[view.dtype] or view.offset + view.nbytes > arena_bytes:
            raise tw.fail("offset", f"bytes [{view.offset}, {view.offset + view.nbytes}) are misaligned for "
                                    f"{view.dtype} or outside the arena of {arena_bytes} bytes")
        tensors[name] = view
    names = {}
    for key in ("inputs", "outputs"):
        listed = raw.get(key, []) or []
        unknown = [n for n in listed if n not in tensors]
        if not isinstance(listed, list) or unknown:
            raise where.fail(key, f"names {unknown or listed!r} that are not in tensors ({', '.join(tensors)})")
        names[key] = tuple(listed)
    init = []
    for i, block in enumerate(raw.get("init", []) or []):
        if not isinstance(block, Mapping) or set(block) != {"offset", "b64"}:
            raise where.fail(f"init[{i}]", f"expected {{offset, b64}}, got {block!r}")
        offset = _int(where, f"init[{i}].offset", block["offset"], 0, "a byte offset >= 0")
        try:
            data = base64.b64decode(block["b64"], validate=True)
        except (binascii.Error, TypeError) as err:
            raise where.fail(f"init[{i}].b64", f"not valid base64 ({err})") from err
        if offset + len(data) > arena_bytes:
            raise where.fail(f"init[{i}]", f"bytes [{offset}, {offset + len(data)}) fall outside the arena of "
                                           f"{arena_bytes} bytes")
        init.append(InitBlock(offset, data))
    raw_thunks = raw.get("thunks")
    if not isinstance(raw_thunks, list):
        raise where.fail("thunks", f"expected a list of thunks, got {type(raw_thunks).__name__}")
    thunks = tuple(_thunk(i, t, where, arena_bytes, tensors) for i, t in enumerate(raw_thunks))
    return Schedule(arena_bytes, thunks, tensors, names["inputs"], names["outputs"], tuple(init))


def validate(raw: Any) -> Schedule:
    """Check a parsed schedule against ABI.md and return it frozen; raises ``ScheduleError``."""
    if isinstance(raw, Schedule):
        return raw
    if not isinstance(raw, Mapping):
        raise ScheduleError(f"schedule: expected an object, got {type(raw).__name__}")
    return _schedule(raw, _Where(""), nested=False)


__all__ = ["validate"]
