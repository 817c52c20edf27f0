"""The house's size limits (DESIGN.md, principle 9): no function of ``rlx_gpu/`` or ``host_fallback/`` over
80 lines, no module over 400 lines unless docs/design.md's "Module sizes" section names it with its reason.

Functions are read with ``ast`` (a function's lines run from its ``def`` to its last statement, decorators
not counted; a nested function counts for itself and within the function around it). The kernels' texts
(``kernels/``) are not Python and not counted.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rlx_gpu", "host_fallback")
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 400
DESIGN = ROOT / "docs" / "design.md"
SIZES_HEADING = "## Module sizes"


def _modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _long_functions() -> dict[str, int]:
    """``module::function`` -> its lines, for every function over ``MAX_FUNCTION_LINES``."""
    found = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found[f"{_name(path)}::{node.name}"] = lines
    return found


def _long_modules() -> dict[str, int]:
    """module -> its lines, for every module over ``MAX_MODULE_LINES``."""
    lengths = {_name(path): len(path.read_text().splitlines()) for path in _modules()}
    return {name: lines for name, lines in lengths.items() if lines > MAX_MODULE_LINES}


def _explained_modules() -> dict[str, str]:
    """module -> its reason, from the entries ``- `module`: reason`` of docs/design.md's "Module sizes"."""
    text = DESIGN.read_text()
    assert SIZES_HEADING in text, f"docs/design.md has no {SIZES_HEADING!r} section"
    section = text.split(SIZES_HEADING, 1)[1].split("\n## ", 1)[0]
    return {m[1]: m[2].strip() for m in re.finditer(r"^- `([\w/.]+\.py)`[^:]*:(.*)$", section, re.M)}


def test_no_function_is_over_80_lines():
    over = _long_functions()
    assert not over, (f"functions over {MAX_FUNCTION_LINES} lines (split them by step): "
                      + ", ".join(f"{name} ({lines})" for name, lines in sorted(over.items())))


def test_no_module_is_over_400_lines_without_a_reason():
    explained = _explained_modules()
    over = {name: lines for name, lines in _long_modules().items() if name not in explained}
    assert not over, (f"modules over {MAX_MODULE_LINES} lines: split them by concept, or give the reason in "
                      f"docs/design.md's {SIZES_HEADING!r}: "
                      + ", ".join(f"{name} ({lines})" for name, lines in sorted(over.items())))


def test_every_reason_is_given_and_needed():
    explained = _explained_modules()
    missing = sorted(name for name, reason in explained.items() if not reason)
    assert not missing, f"docs/design.md's {SIZES_HEADING!r} names modules without a reason: {missing}"
    stale = sorted(set(explained) - set(_long_modules()))
    assert not stale, f"docs/design.md's {SIZES_HEADING!r} names modules no longer over {MAX_MODULE_LINES} lines " \
                      f"(or gone): {stale}; remove their lines"

