"""The builder method of every op, registered against the op's name where the method is written
(``@BUILDERS.register("lstm")``): the completeness test (tests/project/test_op_registries.py) reads it."""
from __future__ import annotations

from typing import Any, Callable

from host_fallback.registry import Registry

BUILDERS: Registry[Callable[..., Any]] = Registry("builder method")
