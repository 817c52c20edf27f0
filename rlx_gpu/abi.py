"""The schedule model of ABI.md §2: frozen Thunk and Schedule, JSON/YAML reading and writing.

``Thunk`` and ``Schedule`` are read-only Mappings over their ABI fields, so the host kernels (which know
nothing of rlx_gpu) take them exactly as they take a thunk parsed from JSON.
"""
from __future__ import annotations

import base64
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterator

import numpy as np
import yaml

from host_fallback.arena import ELEM_SIZE, STORAGE, view

from .errors import ScheduleError, brief

ABI_VERSION = "rlx-thunks/1"


@dataclass(frozen=True)
class TensorView:
    """A named view of the arena: ``shape`` elements of ``dtype`` at byte ``offset``."""

    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def count(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.count * ELEM_SIZE[self.dtype]

    def read(self, arena: np.ndarray) -> np.ndarray:
        """A copy of this tensor out of a host arena, in its storage dtype."""
        return view(arena, self.offset, self.dtype, self.shape).copy()

    def write(self, arena: np.ndarray, values: np.ndarray) -> None:
        """Store ``values`` (any float dtype, rounded to nearest even) into a host arena."""
        values = np.asarray(values)
        if values.shape != self.shape:
            raise ValueError(f"expected shape {list(self.shape)} for this {self.dtype} tensor, got {list(values.shape)}")
        view(arena, self.offset, self.dtype, self.shape)[...] = values.astype(STORAGE[self.dtype])


@dataclass(frozen=True)
class InitBlock:
    """Constant bytes written at ``offset`` before the first thunk runs."""

    offset: int
    data: bytes


@dataclass(frozen=True, eq=False)
class Thunk(Mapping):
    """One validated thunk: ``index`` is its position in its schedule, ``fields`` its ABI fields."""

    index: int
    op: str
    dtype: str
    fields: Mapping[str, Any]

    def __getitem__(self, key: str) -> Any:
        if key == "op":
            return self.op
        if key == "dtype":
            return self.dtype
        return self.fields[key]

    def __iter__(self) -> Iterator[str]:
        yield "op"
        yield "dtype"
        yield from self.fields

    def __len__(self) -> int:
        return 2 + len(self.fields)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": self.op, "dtype": self.dtype}
        for key, value in self.fields.items():
            out[key] = value.to_dict() if isinstance(value, Schedule) else _plain(value)
        return out


@dataclass(frozen=True, eq=False)
class Schedule(Mapping):
    """A validated schedule; nested scan bodies are Schedules too."""

    arena_bytes: int
    thunks: tuple[Thunk, ...]
    tensors: Mapping[str, TensorView] = field(default_factory=dict)
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    init: tuple[InitBlock, ...] = ()

    _KEYS = ("abi", "arena_bytes", "tensors", "inputs", "outputs", "init", "thunks")

    def __getitem__(self, key: str) -> Any:
        if key == "abi":
            return ABI_VERSION
        if key == "init":
            return [{"offset": b.offset, "b64": base64.b64encode(b.data).decode()} for b in self.init]
        if key == "tensors":
            return {n: {"offset": t.offset, "dtype": t.dtype, "shape": list(t.shape)} for n, t in self.tensors.items()}
        if key in ("inputs", "outputs"):
            return list(getattr(self, key))
        if key in self._KEYS:
            return getattr(self, key)
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._KEYS)

    def __len__(self) -> int:
        return len(self._KEYS)

    def pristine_arena(self) -> np.ndarray:
        """A zeroed arena with ``init`` applied."""
        arena = np.zeros(self.arena_bytes, dtype=np.uint8)
        self.apply_init(arena)
        return arena

    def apply_init(self, arena: np.ndarray) -> None:
        """Write every ``init`` block into a host arena in place."""
        for block in self.init:
            arena[block.offset: block.offset + len(block.data)] = np.frombuffer(block.data, dtype=np.uint8)

    def to_dict(self) -> dict[str, Any]:
        out = {k: self[k] for k in self._KEYS if k != "thunks"}
        out["thunks"] = [t.to_dict() for t in self.thunks]
        return out


def _plain(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """PyYAML's safe loader (libyaml's parser when present) refusing duplicate and merge (``<<``) keys.

    An alias is constructed once and shared, never expanded; libyaml bounds nesting at 1000 levels.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise yaml.constructor.ConstructorError(None, None, "merge keys (<<) are not accepted",
                                                        key_node.start_mark)
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:
                raise yaml.constructor.ConstructorError(None, None, f"unhashable key {brief(key)}",
                                                        key_node.start_mark) from None
            if duplicate:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {brief(key)}",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _DuplicateKey(ValueError):
    pass


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"duplicate key {brief(key)} in a JSON object")
        out[key] = value
    return out


def parse_text(text: str) -> Any:
    """JSON, or YAML as the same structure; raises ``ScheduleError`` when the text is neither.

    The text is read as JSON first; when that fails it is read as YAML, and when that fails too the
    message gives the JSON error with its line and column (and the YAML one). Duplicate keys are
    refused in both.
    """
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except _DuplicateKey as err:
        raise ScheduleError(f"schedule text: {err}") from None
    except RecursionError:
        raise ScheduleError("schedule text: nested too deeply to be a schedule (JSON)") from None
    except ValueError as err:  # JSONDecodeError, or an int literal longer than Python converts
        json_error = err
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a safe loader)
    except (yaml.YAMLError, RecursionError, ValueError, TypeError, OverflowError) as err:
        yaml_error = _cut(" ".join(str(err).split()), 160)
    if text.lstrip()[:1] in ("{", "["):
        raise ScheduleError(f"schedule text is neither JSON ({_cut(str(json_error), 120)}) nor YAML ({yaml_error})")
    raise ScheduleError(f"schedule text is neither YAML ({yaml_error}) nor JSON ({_cut(str(json_error), 120)})")


def _cut(message: str, limit: int) -> str:
    return message if len(message) <= limit else message[: limit - 3] + "..."


def read_source(source: Any) -> Any:
    """Turn a schedule source into the parsed structure; raises ``ScheduleError``.

    A source is a ``Schedule`` or a mapping (returned as is), a ``pathlib.Path`` or other ``os.PathLike``
    (always read as a file), JSON/YAML text as ``str`` or UTF-8 ``bytes`` — or a ``str`` that names an
    existing file, which is then read: a string is a path only when such a file exists.
    """
    if isinstance(source, Schedule):
        return source.to_dict()
    if isinstance(source, Mapping):
        return source
    if isinstance(source, os.PathLike) or (isinstance(source, str) and _names_a_file(source)):
        return parse_text(_read_file(Path(source)))
    if isinstance(source, (bytes, bytearray)):
        return parse_text(_decode(bytes(source), "schedule bytes"))
    if isinstance(source, str):
        return parse_text(source)
    raise ScheduleError(f"a schedule is a mapping, JSON/YAML text or bytes, or a path, not {type(source).__name__}")


def _names_a_file(text: str) -> bool:
    return "\n" not in text and os.path.isfile(text)  # isfile answers False for an impossible name


def _read_file(path: Path) -> str:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ScheduleError(f"no such file: {brief(str(path), 200)}") from None
    except OSError as err:
        raise ScheduleError(f"cannot read the schedule file {brief(str(path), 200)}: {err.strerror}") from None
    return _decode(data, f"the schedule file {brief(str(path), 200)}")


def _decode(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ScheduleError(f"{what} is not UTF-8 text (byte {err.start}: {data[err.start:err.start + 1]!r})") from None


def load_schedule(source: Any) -> Schedule:
    """Parse and validate a schedule (any source ``read_source`` takes); raises ``rlx_gpu.ScheduleError``,
    naming the thunk, op and field, for every malformed input."""
    from .validate import validate

    return source if isinstance(source, Schedule) else validate(read_source(source))


def save_schedule(schedule: Schedule, path: str | os.PathLike) -> None:
    """Write a schedule as JSON, or YAML when the file name ends in .yaml/.yml."""
    path = Path(path)
    data = schedule.to_dict()
    if path.suffix in (".yaml", ".yml"):
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    else:
        path.write_text(json.dumps(data, indent=1))


def freeze_fields(fields: dict[str, Any]) -> Mapping[str, Any]:
    """Read-only field mapping; lists become tuples so a thunk cannot be changed after validation."""
    def freeze(v: Any) -> Any:
        return tuple(freeze(x) for x in v) if isinstance(v, list) else v

    return MappingProxyType({k: freeze(v) for k, v in fields.items()})
