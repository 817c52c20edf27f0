"""Validation at the border (ABI.md §2): every rule checked before anything launches.

Each failure raises ``ScheduleError`` naming the thunk index, op, field, the value and what was expected.
Sizes are exact integers bounded by ``limits`` before anything is built in proportion to them, and
the work done here follows the size of the parsed text, never the values in it: values in messages
are shortened (``errors.brief``), objects a YAML alias repeats are validated once, and the number of
thunks (each repetition counted), scan steps and nesting levels are bounded.
"""
from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

from host_fallback.abi import DTYPES, ELEM_SIZE, OPS, TENSOR_DTYPES, Checked, Field, FieldError, OpDef, Region

from ..errors import ScheduleError, brief
from ..units import human_bytes
from .limits import (MAX_ARENA_BYTES, MAX_DIM, MAX_NESTING_DEPTH, MAX_NUM_LAYERS, MAX_RANK, MAX_SCAN_STEPS, MAX_THUNKS,
                     MAX_VIEW_RANK)
from . import values
from .model import ABI_V1, ABI_VERSIONS, InitBlock, Schedule, TensorView, Thunk, freeze_fields
from .values import Where

_TOP_KEYS = {"abi", "arena_bytes", "tensors", "inputs", "outputs", "init", "thunks", "meta"}
#: Fields bounded by their own limit rather than by ``dimension``.
_FIELD_LIMITS = {"num_layers": (MAX_NUM_LAYERS, "num_layers")}
#: What a malformed value can raise from inside a check that assumed its type.
_VALUE_ERRORS = (TypeError, ValueError, OverflowError, KeyError, IndexError, AttributeError)


class _Budget:
    """Counts the thunks validated so far, every repetition of an aliased body included."""

    def __init__(self) -> None:
        self.thunks = 0

    def add(self, where: Where, count: int) -> None:
        self.thunks += count
        if self.thunks > MAX_THUNKS:
            raise where.fail(None, f"the schedule has more than {MAX_THUNKS} thunks (nested bodies counted each "
                                   "time they appear; limit 'thunks'); split it")


class _Context:
    """What the thunks of one schedule are checked against, and what repeats are remembered."""

    def __init__(self, where: Where, arena_bytes: int, tensors: Mapping[str, TensorView], depth: int,
                 budget: _Budget, abi: str, results: frozenset[str] = frozenset()):
        self.where, self.arena_bytes, self.tensors, self.depth, self.budget = where, arena_bytes, tensors, depth, budget
        self.abi = abi
        self.results = results  # the outputs that are no inputs
        self.seen: dict[int, tuple[Any, Thunk, int, int]] = {}  # id(raw) -> (raw, thunk, thunks inside, steps)
        self._by_offset: dict[tuple[int, str], str] | None = None
        self.body_steps: dict[str, int] = {}  # scan steps of the bodies of the thunk being checked

    def by_offset(self) -> dict[tuple[int, str], str]:
        """The named tensors a thunk's read may be checked against, by (offset, dtype).

        An output that is no input is left out: until a thunk writes it, its space may hold an earlier
        thunk's temporaries (the builder's layout reuses it).
        """
        if self._by_offset is None:
            self._by_offset = {(t.offset, t.dtype): name for name, t in self.tensors.items()
                               if name not in self.results}
        return self._by_offset

    def named(self, region: Region) -> tuple[str, int] | None:
        """The named tensor placed at ``region`` (its offset and element type) and its element count, if any."""
        name = self.by_offset().get((region.offset, region.dtype)) if self.tensors else None
        return None if name is None else (name, self.tensors[name].count)


def _check_field(here: Where, f: Field, v: Any, ctx: _Context) -> Any:
    kind = f.kind
    if kind == "offset":
        return values.offset(here, f.name, v)
    if kind == "opt_offset":
        return None if v is None else values.offset(here, f.name, v)
    if kind == "limit":
        return values.limit(here, f.name, v)
    if kind == "opt_float":
        return None if v is None else values.number(here, f.name, v, "a finite number (null: the default)")
    if kind == "activations":
        return values.activations(here, f, v)
    if kind in ("pos", "count"):
        maximum, limit = _FIELD_LIMITS.get(f.name, (MAX_DIM, "dimension"))
        minimum = 1 if kind == "pos" else 0
        return values.integer(here, f.name, v, minimum, f"an int >= {minimum}", maximum, limit)
    if kind == "bool":
        if not isinstance(v, bool):
            raise here.fail(f.name, f"expected true or false, got {type(v).__name__} {brief(v)}")
        return v
    if kind == "float":
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise here.fail(f.name, f"expected a number, got {type(v).__name__} {brief(v)}")
        try:
            return float(v)
        except OverflowError:
            raise here.fail(f.name, f"{brief(v)} is beyond the range of a float") from None
    if kind in ("enum", "dtype"):
        choices = f.choices if kind == "enum" else DTYPES
        if not isinstance(v, str) or v not in choices:
            raise here.fail(f.name, f"expected one of {', '.join(choices)}, got {brief(v)}")
        return v
    if kind == "elem_size":
        if not values.is_int(v) or v not in (2, 4, 8):
            raise here.fail(f.name, f"expected 2, 4 or 8 (bytes per carry element), got {brief(v)}")
        return v
    if kind in ("shape", "strides"):
        out = values.int_list(here, f.name, v, None, "ints >= 0", MAX_RANK)
        if kind == "shape" and not out:
            raise here.fail(f.name, "expected rank 1..6, got rank 0 ([])")
        return out
    if kind == "offsets":
        return values.int_list(here, f.name, v, None, "byte offsets >= 0")
    if kind == "xs":
        return values.int_list(here, f.name, v, 3, "body_x_off, outer_xs_off, per_step_bytes")
    if kind == "bcast":
        return values.int_list(here, f.name, v, 3, "body_b_off, outer_b_off, total_bytes")
    if kind == "pairs":
        return values.int_list(here, f.name, v, 2, "outer_xs_off, per_step_bytes")
    if kind in ("schedule", "opt_schedule"):
        if v is None and kind == "opt_schedule":
            return None
        if ctx.depth >= MAX_NESTING_DEPTH:
            raise here.fail(f.name, f"scan bodies nest deeper than {MAX_NESTING_DEPTH} levels (limit 'nesting_depth')")
        values.mapping(here, f.name, v, "a nested schedule object")
        body, ctx.body_steps[f.name] = _schedule(v, Where(f"{here.prefix}, field {f.name!r} → "), ctx.abi,
                                                 ctx.depth + 1, ctx.budget)
        return body
    raise AssertionError(f"unknown field kind {kind}")


def _thunk(index: int, raw: Any, ctx: _Context) -> tuple[Thunk, int]:
    """The validated thunk and the scan steps it declares."""
    where = ctx.where
    if not isinstance(raw, (dict, Mapping)):  # dict first: the ABC check is slow
        raise where.fail(None, f"thunk {index} is a {type(raw).__name__}, expected an object")
    cached = ctx.seen.get(id(raw))
    if cached is not None:  # the same object again (a YAML alias): validated already in this arena
        _, thunk, inside, steps = cached
        ctx.budget.add(where.thunk(index, thunk.op), 1 + inside)
        return Thunk(index, thunk.op, thunk.dtype, thunk.fields), steps
    op = raw.get("op")
    if not isinstance(op, str) or op not in OPS:
        named = op if isinstance(op, str) and len(op) <= 24 else brief(op, 24)
        raise where.thunk(index, named).fail("op", f"unknown op {brief(op)}; expected one of {', '.join(OPS)}")
    here = where.thunk(index, op)
    ctx.budget.add(here, 1)
    before = ctx.budget.thunks
    try:
        thunk, steps = _thunk_fields(here, index, op, raw, ctx)
    except ScheduleError:
        raise
    except _VALUE_ERRORS as err:
        raise here.fail(None, f"malformed value ({type(err).__name__}: {brief(str(err))})") from err
    ctx.seen[id(raw)] = (raw, thunk, ctx.budget.thunks - before, steps)
    return thunk, steps


def _thunk_fields(here: Where, index: int, op: str, raw: Mapping, ctx: _Context) -> tuple[Thunk, int]:
    """The thunk checked field by field, then by its op's rules in their order (``OpDef.rules``)."""
    spec: OpDef = OPS[op]
    if ctx.abi == ABI_V1 and spec.version > 1:
        raise here.fail("op", f"{op} is an op of rlx-thunks/2 (ABI.md {spec.section}); this schedule is labelled {ABI_V1!r}: "
                              "label it 'rlx-thunks/2' to use it")
    dtype = raw.get("dtype")
    if not isinstance(dtype, str) or dtype not in spec.dtypes:
        raise here.fail("dtype", f"expected one of {', '.join(spec.dtypes)}, got {brief(dtype)}")
    missing = [n for n in spec.required if n not in raw]
    if missing:
        raise here.fail(missing[0], f"missing (required fields still absent: {', '.join(missing)})")
    extra = sorted(set(raw) - spec.keys, key=repr)
    if extra:
        key = extra[0] if isinstance(extra[0], str) and len(extra[0]) <= 40 else brief(extra[0], 40)
        raise here.fail(key, f"unknown field for {op} (known: {', '.join(spec.field_names)})")
    if ctx.abi == ABI_V1:
        newer = [f.name for f in spec.fields if f.version > 1 and f.name in raw]
        if newer:
            raise here.fail(newer[0], f"is a field of rlx-thunks/2 (ABI.md §8); this schedule is labelled "
                                      f"{ABI_V1!r}: label it 'rlx-thunks/2' to use it")
    ctx.body_steps = {}
    given = {f.name: _check_field(here, f, raw[f.name], ctx) for f in spec.fields if f.name in raw}
    for f in spec.optional_fields:  # a field used only with a flag (d_h0 of lstm_backward) is required with it
        if f.used_when and f.name not in given and given.get(f.used_when):
            raise here.fail(f.name, f"missing: {f.used_when} = true needs it")
    checked = Checked({"op": op, "dtype": dtype, **given}, named=ctx.named)
    placed: tuple[Thunk, int] | None = None
    try:
        for rule in spec.rules:
            if rule.on_footprint and placed is None:
                placed = _placed(here, index, spec, checked, ctx)
            rule.check(checked)
    except FieldError as err:
        raise here.fail(err.field, err.message) from None
    return placed or _placed(here, index, spec, checked, ctx)


def _placed(here: Where, index: int, spec: OpDef, checked: Checked, ctx: _Context) -> tuple[Thunk, int]:
    """The thunk completed with its defaults and the scan steps it declares, once its footprint is known to
    lie inside the arena, aligned; ``checked`` gets the completed fields and the regions."""
    fields = spec.complete(checked.given)
    op, dtype = fields.pop("op"), fields.pop("dtype")
    fields = {name: fields[name] for name in spec.field_names}
    thunk = Thunk(index, op, dtype, freeze_fields(fields))
    steps = sum(fields["length"] * (1 + inner) for inner in ctx.body_steps.values())
    if steps > MAX_SCAN_STEPS:
        raise here.fail("length", f"length {fields['length']} declares {steps} body executions (nested scans "
                                  f"included), over the limit {MAX_SCAN_STEPS} ('scan_steps')")
    checked.thunk = {"op": op, "dtype": dtype, **fields}  # a plain dict: the shape rules read it fast
    checked.regions = regs = spec.layout(checked.thunk)
    for r in regs:
        size = ELEM_SIZE[r.dtype]
        if r.offset % size:
            raise here.fail(r.field, f"offset {r.offset} is not a multiple of {size} (the {r.dtype} element size)")
        if r.offset + r.nbytes > ctx.arena_bytes:
            raise here.fail(r.field, f"bytes [{r.offset}, {r.offset + r.nbytes}) ({_shape(r.shape)} {r.dtype}, "
                                     f"{human_bytes(r.nbytes)}) fall outside the arena of {ctx.arena_bytes} bytes")
    return thunk, steps


def _shape(shape: tuple[int, ...]) -> str:
    return brief(list(shape), 60)


def _or_empty(value: Any, empty: Any) -> Any:
    """An absent or null optional section is empty; any other value is checked as given."""
    return empty if value is None else value


def _tensors(raw: Mapping, where: Where, arena_bytes: int) -> dict[str, TensorView]:
    raw_tensors = _or_empty(raw.get("tensors"), {})
    values.mapping(where, "tensors", raw_tensors, "an object of named views")
    tensors: dict[str, TensorView] = {}
    for name, t in raw_tensors.items():
        tw = Where(f"{where.prefix}tensor {brief(name, 40)}")
        values.mapping(tw, None, t, "{offset, dtype, shape}")
        if set(t) != {"offset", "dtype", "shape"}:
            raise tw.fail(None, f"expected the keys offset, dtype, shape, got {brief(sorted(t))}")
        if not isinstance(t["dtype"], str) or t["dtype"] not in TENSOR_DTYPES:
            raise tw.fail("dtype", f"expected one of {', '.join(TENSOR_DTYPES)}, got {brief(t['dtype'])}")
        shape = values.int_list(tw, "shape", t["shape"], None, "ints >= 0", MAX_VIEW_RANK, "view_rank")
        view = TensorView(values.offset(tw, "offset", t["offset"]), t["dtype"], tuple(shape))
        if view.offset % ELEM_SIZE[view.dtype] or view.offset + view.nbytes > arena_bytes:
            raise tw.fail("offset", f"bytes [{view.offset}, {view.offset + view.nbytes}) are misaligned for "
                                    f"{view.dtype} or outside the arena of {arena_bytes} bytes")
        tensors[name] = view
    return tensors


def _names(raw: Mapping, where: Where, key: str, tensors: Mapping[str, TensorView]) -> tuple[str, ...]:
    listed = _or_empty(raw.get(key), [])
    if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
        raise where.fail(key, f"expected a list of tensor names, got {brief(listed)}")
    unknown = [n for n in listed if n not in tensors]
    if unknown:
        raise where.fail(key, f"names {brief(unknown)} that are not in tensors ({brief(', '.join(tensors), 200)})")
    return tuple(listed)


def _init(raw: Mapping, where: Where, arena_bytes: int) -> tuple[InitBlock, ...]:
    blocks = _or_empty(raw.get("init"), [])
    if not isinstance(blocks, list):
        raise where.fail("init", f"expected a list of {{offset, b64}} blocks, got {type(blocks).__name__} "
                                 f"{brief(blocks)}")
    decoded: dict[int, bytes] = {}  # id(text) -> bytes: a text a YAML alias repeats is decoded once
    init = []
    for i, block in enumerate(blocks):
        values.mapping(where, f"init[{i}]", block, "{offset, b64}")
        if set(block) != {"offset", "b64"}:
            raise where.fail(f"init[{i}]", f"expected the keys offset, b64, got {brief(sorted(block))}")
        offset = values.offset(where, f"init[{i}].offset", block["offset"])
        text = block["b64"]
        if not isinstance(text, str):
            raise where.fail(f"init[{i}].b64", f"expected base64 text, got {type(text).__name__} {brief(text)}")
        if offset + len(text) // 4 * 3 - 2 > arena_bytes:
            raise where.fail(f"init[{i}]", f"{len(text)} base64 characters at offset {offset} fall outside the "
                                           f"arena of {arena_bytes} bytes")
        if id(text) not in decoded:
            try:
                decoded[id(text)] = base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError) as err:
                raise where.fail(f"init[{i}].b64", f"not valid base64 ({brief(str(err))})") from err
        data = decoded[id(text)]
        if offset + len(data) > arena_bytes:
            raise where.fail(f"init[{i}]", f"bytes [{offset}, {offset + len(data)}) fall outside the arena of "
                                           f"{arena_bytes} bytes")
        init.append(InitBlock(offset, data))
    ordered = sorted((b.offset, b.offset + len(b.data), i) for i, b in enumerate(init) if b.data)
    for (_, end, i), (start, _, j) in zip(ordered, ordered[1:]):
        if start < end:
            raise where.fail(f"init[{j}]", f"overlaps init[{i}] (bytes from {start} to {end}); init blocks must "
                                           "be disjoint")
    return tuple(init)


def _schedule(raw: Mapping, where: Where, holder_abi: str | None, depth: int,
              budget: _Budget) -> tuple[Schedule, int]:
    """The validated schedule and the scan steps (body executions) it declares; ``holder_abi`` is the
    label of the schedule holding a nested body (``None`` at the top)."""
    values.mapping(where, None, raw, "a schedule object")
    extra = sorted(set(raw) - _TOP_KEYS)
    if extra:
        raise where.fail(extra[0], f"unknown schedule key (known: {', '.join(sorted(_TOP_KEYS))})")
    abi = raw.get("abi", holder_abi)
    if abi not in ABI_VERSIONS:
        raise where.fail("abi", f"unknown abi {brief(raw.get('abi'))}; this reader implements "
                                f"{' and '.join(map(repr, ABI_VERSIONS))}")
    if holder_abi is not None and abi != holder_abi:
        raise where.fail("abi", f"a nested body takes the label of the schedule that holds it ({holder_abi!r}), "
                                f"got {brief(abi)}")
    arena_bytes = values.integer(where, "arena_bytes", raw.get("arena_bytes"), 1, "a size in bytes >= 1",
                                 MAX_ARENA_BYTES, "arena_bytes")
    try:
        tensors = _tensors(raw, where, arena_bytes)
        inputs, outputs = (_names(raw, where, key, tensors) for key in ("inputs", "outputs"))
        init = _init(raw, where, arena_bytes)
    except ScheduleError:
        raise
    except _VALUE_ERRORS as err:
        raise where.fail(None, f"malformed value ({type(err).__name__}: {brief(str(err))})") from err
    raw_thunks = raw.get("thunks")
    if not isinstance(raw_thunks, list):
        raise where.fail("thunks", f"expected a list of thunks, got {type(raw_thunks).__name__} {brief(raw_thunks)}")
    if len(raw_thunks) > MAX_THUNKS:
        raise where.fail("thunks", f"{len(raw_thunks)} thunks exceed the limit {MAX_THUNKS} ('thunks')")
    ctx = _Context(where, arena_bytes, tensors, depth, budget, abi, frozenset(outputs) - frozenset(inputs))
    thunks, steps = [], 0
    for i, t in enumerate(raw_thunks):
        thunk, thunk_steps = _thunk(i, t, ctx)
        thunks.append(thunk)
        steps += thunk_steps
        if steps > MAX_SCAN_STEPS:
            raise where.thunk(i, thunk.op).fail("length", f"the schedule's scans declare {steps} body executions "
                                                          f"so far, over the limit {MAX_SCAN_STEPS} ('scan_steps')")
    return Schedule(arena_bytes, tuple(thunks), tensors, inputs, outputs, init, abi), steps


def validate(raw: Any) -> Schedule:
    """Check a parsed schedule against ABI.md and return it frozen; raises ``ScheduleError``."""
    if isinstance(raw, Schedule):
        return raw
    if not isinstance(raw, Mapping):
        raise ScheduleError(f"schedule: expected an object, got {type(raw).__name__} {brief(raw)}")
    return _schedule(raw, Where(""), None, depth=0, budget=_Budget())[0]


__all__ = ["validate"]
