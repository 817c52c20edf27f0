"""The package's layering: imports flow one way down an explicit order of layers (DESIGN.md, "Layers"),
no import circle inside rlx_gpu, and host_fallback imports nothing of rlx_gpu.

The import graph is read from the source with ``ast`` (every ``import``/``from ... import``, at module
level or inside functions and ``if TYPE_CHECKING:`` blocks), so a lazy import that hides a circle at
run time still counts.
"""
from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rlx_gpu"

#: rlx_gpu's layers, top first: a module may import its own layer's modules and those of layers below
#: it, never above. ``rlx_gpu`` is the package's public face; the last layer holds the shared leaves.
LAYERS = (
    ("cli",),
    ("conformance",),
    ("onnx", "torch"),  # frontends: ONNX models and PyTorch calls through the graph builder into schedules
    ("rlx_gpu",),
    ("graph",),
    ("runtime",),
    ("backends",),
    ("launches",),
    ("schedule",),
    ("errors", "units", "paths"),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that the file at ``path`` imports."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # ``from pkg import mod`` imports pkg.mod; ``from pkg import name`` takes a name from pkg itself.
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
        else:
            continue
        for target in targets:
            # ``import a.b.c`` also runs a and a.b; the deepest known module is the edge.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


@functools.lru_cache(maxsize=1)  # parsing the package takes a couple of seconds; three tests read it
def import_graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imported_modules(f, modules) for f in files}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as ``[a, b, ..., a]``, or None (depth-first search with colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of a module of rlx_gpu (by its subpackage or top-level module)."""
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else parts[0]
    for depth, names in enumerate(LAYERS):
        if name in names:
            return depth
    raise AssertionError(f"{module} lies in no layer of LAYERS: add {name!r} to the layer it belongs to")


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    """Every import that reaches a layer above its own, or sideways between two leaves of one layer."""
    bad = []
    for module, imported in sorted(graph.items()):
        for target in sorted(imported):
            here, there = layer_of(module), layer_of(target)
            same_part = module.split(".")[:2] == target.split(".")[:2]
            if there < here or (there == here and not same_part):
                bad.append(f"{module} ({'/'.join(LAYERS[here])}) imports {target} ({'/'.join(LAYERS[there])})")
    return bad


def test_the_layer_check_refuses_an_upward_edge_and_accepts_a_downward_one():
    assert upward_edges({"rlx_gpu.backends.core": {"rlx_gpu.launches.core", "rlx_gpu.errors"}}) == []
    assert upward_edges({"rlx_gpu.backends.core": {"rlx_gpu.runtime.options"}}) == [
        "rlx_gpu.backends.core (backends) imports rlx_gpu.runtime.options (runtime)"]
    assert upward_edges({"rlx_gpu.units": {"rlx_gpu.errors"}}) != []  # leaves stay independent


def test_imports_flow_down_the_layers():
    bad = upward_edges(import_graph())
    assert not bad, "imports against the layer order (DESIGN.md, Layers):\n" + "\n".join(bad)


#: what the layers above the backends may import of them: the discovery list, the surface, the run options,
#: the one rule that turns an allocation failure into a DeviceError
BACKEND_SURFACE = {"rlx_gpu.backends", "rlx_gpu.backends.base", "rlx_gpu.backends.options",
                   "rlx_gpu.backends.allocation"}


def test_the_layers_above_reach_the_backends_only_through_their_surface():
    """A backend module (and the core under it) is imported by the registry by name, when asked for."""
    backends = LAYERS.index(("backends",))
    bad = sorted(f"{module} imports {target}" for module, imported in import_graph().items()
                 if layer_of(module) < backends
                 for target in imported if layer_of(target) == backends and target not in BACKEND_SURFACE)
    assert not bad, "\n".join(bad)


def test_the_cycle_finder_finds_a_circle_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_relative_absolute_and_function_level_imports():
    graph = import_graph()
    assert "rlx_gpu.schedule.validate" in graph["rlx_gpu.schedule.io"]  # from .validate import validate
    assert "rlx_gpu.graph.models" in graph["rlx_gpu.cli"]  # inside a function
    assert "rlx_gpu.conformance.cases" in graph["rlx_gpu.conformance.reference_ssm"]
    assert "rlx_gpu.graph.builder" in graph["rlx_gpu.onnx.values"]  # a frontend over the builder


def test_no_import_circle_inside_rlx_gpu():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_host_fallback_imports_nothing_of_rlx_gpu():
    code = ("import host_fallback, sys; "
            "bad = sorted(m for m in sys.modules if m.startswith('rlx_gpu')); "
            "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr


def imported_test_modules(source: str) -> set[str]:
    """The ``test_*`` modules that ``source`` imports, counting the code of its string constants that parse as
    Python (a child process's script)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add(node.module or "")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
            try:
                found.update(imported_test_modules(node.value))
            except SyntaxError:  # prose, not code
                pass
    return {name for name in found if name.split(".")[0].startswith("test_")}


def test_the_test_import_check_sees_imports_and_child_scripts():
    # the sources are formatted here, so this file's own constants import nothing
    assert imported_test_modules("from {t}a import x\nimport os, {t}b.c\nfrom support import y".format(t="test_")) == \
        {"test_a", "test_b.c"}
    assert imported_test_modules('CHILD = """\nimport sys\nfrom {t}c import z\n"""'.format(t="test_")) == {"test_c"}
    assert imported_test_modules('"""to import tests, see test_layers."""\nfrom support.rnn_host import build') == set()


def test_no_test_module_imports_another():
    """What tests share lives in tests/support/; a test module (or a support module, or a tool) importing a
    test module would run its collection-time code and couple two test files."""
    files = sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "tools").rglob("*.py")) + \
        sorted((ROOT / "benchmarks").rglob("*.py"))
    bad = {str(f.relative_to(ROOT)): sorted(found) for f in files if (found := imported_test_modules(f.read_text()))}
    assert not bad, f"import a test module (move what they share into tests/support/): {bad}"


#: The test folders, one per layer of the code they test (docs/testing.md lists what each holds).
TEST_LAYERS = ("cli", "frontends", "graph", "runtime", "schedule", "devices", "conformance", "host", "project")


def test_every_test_module_lives_in_its_layers_folder():
    tests = ROOT / "tests"
    misplaced = sorted(str(f.relative_to(ROOT)) for f in tests.rglob("test_*.py")
                       if f.parent == tests or f.relative_to(tests).parts[0] not in TEST_LAYERS)
    assert not misplaced, f"put each test module in the folder of its layer, one of {TEST_LAYERS}: {misplaced}"
    assert sorted(p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(
        TEST_LAYERS + ("support",))


HOST = ROOT / "host_fallback"
ABI = HOST / "abi"
#: What rlx_gpu.schedule may import of host_fallback: the ABI model, and the arena's typed views (the storage type
#: of each element type, which needs ml_dtypes and so stays out of the leaf) — never a host kernel module.
SCHEDULE_MAY_IMPORT = ("host_fallback.abi", "host_fallback.arena")


def absolute_imports(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports (``package``: the dotted package it lies in), relative imports resolved."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            found.update(f"{source}.{a.name}" if node.level and not node.module else source for a in node.names)
    return found


def test_the_schedule_reads_only_the_abi_model_of_host_fallback():
    bad = sorted(f"{module_name(f)} imports {m}" for f in sorted((PACKAGE / "schedule").rglob("*.py"))
                 for m in absolute_imports(f, "rlx_gpu.schedule")
                 if m.split(".")[0] == "host_fallback" and not m.startswith(SCHEDULE_MAY_IMPORT))
    assert not bad, "\n".join(bad)


def test_the_abi_model_is_a_leaf():
    """host_fallback/abi imports the standard library, NumPy and itself: nothing else of host_fallback, no rlx_gpu."""
    bad = sorted(f"{f.relative_to(ROOT)} imports {m}" for f in sorted(ABI.rglob("*.py"))
                 for m in absolute_imports(f, "host_fallback.abi")
                 if not (m.split(".")[0] in sys.stdlib_module_names or m.split(".")[0] == "numpy"
                         or m == "host_fallback.abi" or m.startswith("host_fallback.abi.")))
    assert not bad, "\n".join(bad)


def test_the_leaf_check_sees_an_import_out_of_the_leaf(tmp_path):
    module = tmp_path / "probe.py"
    module.write_text("from ..arena import STORAGE\nfrom . import model\nimport numpy\n")
    assert absolute_imports(module, "host_fallback.abi") == {"host_fallback.arena", "host_fallback.abi.model", "numpy"}
