"""The shape of an op's definition (ABI.md): its fields, the regions it touches, the rules a thunk of it obeys.

An ``OpDef`` says everything the ABI says about one op; the validator, the layout, the defaults, the
backward-op generator, the run-time data checks and the conformance inputs all read it. This module
holds the types alone (and the element types they name); the ops are defined in the family modules
beside it and gathered in ``abi.ops.OPS``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from functools import cached_property
from typing import Any, Callable, Mapping, Sequence

import numpy as np

Thunk = Mapping[str, Any]

#: The element types of a thunk (ABI.md §1), and the bytes of each element type a region may have:
#: ``u8`` names the byte-level slots of the scan family, ``i32`` the integer tensors of version 2.
DTYPES = ("f32", "f16", "bf16", "f64")
ELEM_SIZE: dict[str, int] = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "u8": 1, "i32": 4}
#: The element types of a named tensor: a thunk's, and ``i32`` for the integer tensors of ABI.md §8.
TENSOR_DTYPES = DTYPES + ("i32",)


class FieldError(ValueError):
    """A field value the ABI forbids; ``field`` names it as the schedule spells it."""

    def __init__(self, op: str, field: str, message: str):
        super().__init__(f"{op}, field {field!r}: {message}")
        self.field, self.message = field, message


class DataError(ValueError):
    """An integer tensor holds a value outside its rule: ``field``, ``index`` and ``value`` say where.

    ``where`` names the body thunk holding the field when the thunk that ran is a scan (ABI.md §6),
    from that scan down: ``field 'body' → thunk 0 (selective_scan) at step 3, `` (empty at top level).
    """

    def __init__(self, field: str, index: int, value: int, rule: str, where: str = ""):
        super().__init__(f"{where}field {field!r}[{index}] = {value}: {rule}")
        self.field, self.index, self.value, self.rule, self.where = field, index, value, rule, where

    def within(self, where: str) -> "DataError":
        """The same error one scan level up: ``where`` names the body thunk of that scan it came from."""
        return DataError(self.field, self.index, self.value, self.rule, where + self.where)


@dataclass(frozen=True)
class Region:
    """One tensor of a thunk: ``field`` names it as the schedule spells it (``xs_inputs[1]``)."""

    field: str
    offset: int
    shape: tuple[int, ...]
    dtype: str  # an ABI dtype, or "u8" for the scan family's byte-level slots
    access: str  # "r", "w" or "rw"
    nbytes: int = dataclass_field(init=False)  # exact: shape's product times the element size

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", math.prod(self.shape) * ELEM_SIZE[self.dtype])

    @property
    def reads(self) -> bool:
        return "r" in self.access

    @property
    def writes(self) -> bool:
        return "w" in self.access


@dataclass(frozen=True)
class Field:
    """One thunk field: ``kind`` names the check the validator applies to its value.

    A field is optional when it is nullable (an ``opt_`` kind: ``null`` means absent), when
    ``used_when`` names the op's flag without which it is unused (an offset written as 0), or when it
    belongs to ABI version 2 (``version``): a version-2 field may be left out, meaning ``default`` (a
    value, or a function of the thunk for a default that follows other fields), and a version-1
    schedule may not name it.
    """

    name: str
    kind: str
    choices: tuple[str, ...] = ()
    used_when: str = ""
    version: int = 1
    default: Any = None

    @property
    def nullable(self) -> bool:
        return self.kind.startswith("opt_")

    @property
    def optional(self) -> bool:
        return self.nullable or bool(self.used_when) or self.version > 1


@dataclass
class Checked:
    """What a rule reads of one thunk under check: ``given`` holds ``op``, ``dtype`` and the fields the
    thunk names (each already checked for its kind); ``thunk`` every field (absent ones at their
    defaults) and ``regions`` its footprint, both set once the footprint lies inside the arena;
    ``named(region)`` is the schedule's named tensor placed at a region and its element count, if any."""

    given: Thunk
    thunk: Thunk = dataclass_field(default_factory=dict)
    regions: Sequence[Region] = ()
    named: Callable[[Region], tuple[str, int] | None] = lambda region: None


@dataclass(frozen=True)
class Rule:
    """One check of a thunk: ``check(checked)`` raises ``FieldError`` naming the field to fix.

    A rule ``on_footprint`` reads the completed thunk and its regions, and runs once the footprint is
    known to lie inside the arena; any other reads the fields given, before that."""

    check: Callable[[Checked], None]
    on_footprint: bool = False


#: ``sample(field, params, x)``: standard-normal draws ``x`` for input ``field`` moved into the range the op
#: is defined on (conformance inputs: positive log arguments, decays below 1 ...).
Sampler = Callable[[str, Mapping[str, Any], np.ndarray], np.ndarray]
#: ``rule(values, thunk)``: raises ``DataError`` for the first value of an integer tensor the ABI forbids.
DataRule = Callable[[np.ndarray, Thunk], None]


def as_drawn(field: str, params: Mapping[str, Any], x: np.ndarray) -> np.ndarray:
    """The inputs of an op defined everywhere: the draws as they are."""
    return x


@dataclass(frozen=True, eq=False)
class OpDef:
    """An op of ABI.md, everything about it in one place.

    ``layout(thunk)`` lists the regions of a thunk whose every field is given (``regions`` completes
    it first); ``rules`` run in order on every thunk; ``data_rules`` check its integer tensors before it
    runs (field -> rule); ``states`` are the tensors it carries from call to call (read, then written in
    place); ``differentiable`` ops get an ``OP_backward`` (ABI.md §9), made by ``abi.backward``;
    ``forward`` names the op a backward op differentiates. ``place`` is where ABI.md defines it: its section,
    then its rank there (``(4, 3)``: §4's third op); ``ops`` orders every op by it, and messages cite the section.
    ``reserve_size(fields)`` is the least ``reserve_bytes`` of an op with a saved forward (ABI.md §9.1,
    ``abi.reserve``; ``None``: it has none).
    """

    name: str
    fields: tuple[Field, ...]
    layout: Callable[[Thunk], list[Region]]
    dtypes: tuple[str, ...] = DTYPES
    version: int = 1
    rules: tuple[Rule, ...] = ()
    data_rules: Mapping[str, DataRule] = dataclass_field(default_factory=dict)
    states: tuple[str, ...] = ()
    differentiable: bool = False
    forward: str = ""
    sample: Sampler = as_drawn
    place: tuple[int, ...] = ()
    reserve_size: Callable[[Thunk], int] | None = None

    @property
    def section(self) -> str:
        """The section of ABI.md that defines it: ``§10``."""
        return f"§{self.place[0]}"

    @cached_property
    def field_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @cached_property
    def optional_fields(self) -> tuple[Field, ...]:
        """The fields a thunk of this op may go without (see ``Field.optional``)."""
        return tuple(f for f in self.fields if f.optional)

    @cached_property
    def required(self) -> tuple[str, ...]:
        """The fields every thunk of this op names (version 1's)."""
        return tuple(f.name for f in self.fields if f.version == 1)

    @cached_property
    def v2_fields(self) -> frozenset[str]:
        return frozenset(f.name for f in self.fields if f.version > 1)

    @cached_property
    def keys(self) -> frozenset[str]:
        """Every key a thunk of this op has: its fields, ``op`` and ``dtype``."""
        return frozenset(self.field_names) | {"op", "dtype"}

    @cached_property
    def shape_params(self) -> tuple[str, ...]:
        """The integer fields its tensors' shapes follow (``batch``, ``seq``, ``hidden`` ...)."""
        return tuple(f.name for f in self.fields if f.kind in ("pos", "count"))

    @cached_property
    def defaults(self) -> dict[str, Any]:
        """Version-2 field -> its default (a value, or a function of the thunk), in field order."""
        return {f.name: f.default for f in self.fields if f.version > 1}

    @cached_property
    def _defaults(self) -> tuple[tuple[str, Any, bool], ...]:
        return tuple((name, value, callable(value)) for name, value in self.defaults.items())

    def default(self, t: Thunk, name: str) -> Any:
        """The value field ``name`` has when ``t`` leaves it out."""
        value = self.defaults[name]
        return value(t) if callable(value) else value

    def complete(self, t: Thunk) -> dict[str, Any]:
        """``t`` as a plain dict with every version-2 field, absent ones at their defaults."""
        out = dict(t)
        for name, value, computed in self._defaults:
            if name not in out:
                out[name] = value(out) if computed else value
        return out

    def regions(self, t: Thunk) -> list[Region]:
        """Every tensor ``t`` reads or writes, in field order."""
        return self.layout(self.complete(t) if self._defaults else t)


def offsets(*names: str, used_when: str = "") -> tuple[Field, ...]:
    return tuple(Field(n, "offset", used_when=used_when) for n in names)


def positive(*names: str) -> tuple[Field, ...]:
    return tuple(Field(n, "pos") for n in names)


def flags(*names: str) -> tuple[Field, ...]:
    return tuple(Field(n, "bool") for n in names)


def same(name: str) -> Callable[[Thunk], Any]:
    """A default that follows another field: the value of ``name``."""
    return lambda t: t[name]


def newer(name: str, kind: str, default: Any, choices: tuple[str, ...] = ()) -> Field:
    """A field of ABI version 2, meaning ``default`` when left out."""
    return Field(name, kind, choices, version=2, default=default)


def fail(t: Thunk, field: str, message: str) -> FieldError:
    return FieldError(t["op"], field, message)


def rule(check: Callable[[Thunk], None]) -> Rule:
    """A rule on the fields a thunk gives (``check(given)``)."""
    return Rule(lambda c: check(c.given))
