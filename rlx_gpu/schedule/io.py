"""Reading and writing schedules: JSON or YAML text, paths, parsed objects; loading validates (ABI.md §2)."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ScheduleError
from .model import Schedule
from .validate import validate


def parse_text(text: str) -> Any:
    """JSON, or YAML as the same structure; raises ``ScheduleError`` when the text is neither."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as json_error:
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ScheduleError(f"schedule text is neither JSON ({json_error}) nor YAML "
                                f"({' '.join(str(err).split())})") from err


def read_source(source: Any) -> Any:
    """Turn a path, JSON/YAML text or an already parsed object into the parsed structure."""
    if isinstance(source, Schedule):
        return source.to_dict()
    if isinstance(source, Mapping):
        return source
    if isinstance(source, os.PathLike) or (isinstance(source, str) and "\n" not in source
                                             and not source.lstrip().startswith(("{", "[")) and Path(source).exists()):
        try:
            return parse_text(Path(source).read_text())
        except ScheduleError as err:
            raise ScheduleError(f"{source}: {err}") from err
    if isinstance(source, str):
        parsed = parse_text(source)
        if isinstance(parsed, str) and "\n" not in source:  # one line that parses to a bare string: a path
            raise ScheduleError(f"no such file: {source!r} (a schedule is a path to a JSON or YAML file, "
                                f"JSON/YAML text, or a mapping)")
        return parsed
    raise TypeError(f"a schedule is a dict, JSON/YAML text or a path, not {type(source).__name__}")


def load_schedule(source: Any) -> Schedule:
    """Parse and validate a schedule; raises ``rlx_gpu.ScheduleError`` naming the thunk, op and field."""
    return source if isinstance(source, Schedule) else validate(read_source(source))


def save_schedule(schedule: Schedule, path: str | os.PathLike) -> None:
    """Write a schedule as JSON, or YAML when the file name ends in .yaml/.yml."""
    path = Path(path)
    data = schedule.to_dict()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        path.write_text(yaml.safe_dump(data, sort_keys=False))
    else:
        path.write_text(json.dumps(data, indent=1))
