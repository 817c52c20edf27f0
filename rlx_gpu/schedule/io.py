"""Reading and writing schedules: JSON or YAML text, paths, parsed objects; loading validates (ABI.md §2).

Every malformed input, whatever its form, raises ``ScheduleError`` here (see ``read_source``).
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ..errors import ScheduleError, brief
from .model import Schedule
from .validate import validate
from .yaml_reader import load_yaml, yaml_message


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
        return load_yaml(text)
    except (yaml.YAMLError, RecursionError, ValueError, TypeError, OverflowError) as err:
        yaml_error = _cut(yaml_message(err), 160)
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
        text = _read_file(Path(source))
        try:
            return parse_text(text)
        except ScheduleError as err:
            raise ScheduleError(f"{_cut(str(source), 200)}: {err}") from None
    if isinstance(source, (bytes, bytearray)):
        return parse_text(_decode(bytes(source), "schedule bytes"))
    if isinstance(source, str):
        parsed = parse_text(source)
        if isinstance(parsed, str) and _looks_like_a_schedule_file(source):
            raise ScheduleError(f"no such file: {brief(source, 200)} (a schedule is a path to a JSON or YAML file, "
                                f"JSON/YAML text or bytes, or a mapping)")
        return parsed
    raise ScheduleError(f"a schedule is a mapping, JSON/YAML text or bytes, or a path, not {type(source).__name__}")


def _looks_like_a_schedule_file(text: str) -> bool:
    """One line naming a .json/.yaml/.yml file: when no such file exists, say so rather than "got str"."""
    return "\n" not in text and text.strip().lower().endswith((".json", ".yaml", ".yml"))


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
    naming the file (when the source is one), the thunk, op and field, for every malformed input."""
    if isinstance(source, Schedule):
        return source
    parsed = read_source(source)
    try:
        return validate(parsed)
    except ScheduleError as err:
        if isinstance(source, os.PathLike) or (isinstance(source, str) and _names_a_file(source)):
            raise ScheduleError(f"{_cut(str(source), 200)}: {err}") from err
        raise


def save_schedule(schedule: Schedule, path: str | os.PathLike) -> None:
    """Write a schedule as JSON, or YAML when the file name ends in .yaml/.yml."""
    path = Path(path)
    data = schedule.to_dict()
    if path.suffix in (".yaml", ".yml"):
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    else:
        path.write_text(json.dumps(data, indent=1))
