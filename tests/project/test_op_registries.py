"""Every op is complete (DESIGN.md principle 17): for each op of the op definitions, every kind of
implementation registered against op names — host kernel, device planner, program family, float64
reference, conformance cases, builder method, torch function — has an entry for it or names why not.
A failure prints the whole matrix (op x kind), each gap marked ``MISSING``.
"""
from __future__ import annotations

import pytest

import host_fallback
from host_fallback.registry import NotRegistered, Registry
from rlx_gpu import launches
from rlx_gpu.backends import programs
from rlx_gpu.conformance import catalog
from rlx_gpu.conformance.references import REFERENCES
from rlx_gpu.graph.builder import Graph  # noqa: F401  (its modules register the builder methods)
from rlx_gpu.graph.registry import BUILDERS
from rlx_gpu.paths import data_dir
from host_fallback.abi import OPS  # the op definitions: the one place op names come from

OK = "yes"
MISSING = "MISSING"


def _cell(registry: Registry, op: str) -> str:
    if op in registry:
        return OK
    return f"no: {registry.reasons[op]}" if op in registry.reasons else MISSING


def _family(op: str) -> str:
    """The op's program family, built by the backends and written in kernels/ (or why it has none)."""
    device_op = launches.PLANNERS.get(op)
    if device_op is None:
        return _cell(launches.PLANNERS, op)  # no planner: its reason (or its gap) is the family's
    if device_op.family not in programs.FAMILIES or not (data_dir("kernels") / f"{device_op.family}.cl").is_file():
        return f"{MISSING} ({device_op.family})"
    return OK


def _torch_functions() -> Registry | str:
    try:
        import rlx_gpu.torch  # noqa: F401  (its modules register the functions)
    except ImportError as err:
        return f"no: torch is not importable ({err})"
    from rlx_gpu.torch.registry import FUNCTIONS
    return FUNCTIONS


def matrix() -> dict[str, dict[str, str]]:
    """op -> kind -> ``yes``, ``no: <reason>`` or ``MISSING``."""
    cased = {c.op for c in catalog.cases()}
    torch_functions = _torch_functions()
    rows = {}
    for op in OPS:
        rows[op] = {
            "host kernel": _cell(host_fallback.KERNELS, op),
            "device planner": _cell(launches.PLANNERS, op),
            "program family": _family(op),
            "float64 reference": _cell(REFERENCES, op),
            "conformance cases": OK if op in cased else MISSING,
            "builder method": _cell(BUILDERS, op),
            "torch function": torch_functions if isinstance(torch_functions, str) else _cell(torch_functions, op),
        }
    return rows


def _table(rows: dict[str, dict[str, str]]) -> str:
    kinds = list(next(iter(rows.values())))
    lines = ["op | " + " | ".join(kinds)]
    lines += [f"{op} | " + " | ".join(cells[k] for k in kinds) for op, cells in rows.items()]
    return "\n".join(lines)


def test_every_op_is_complete_or_says_why_not():
    rows = matrix()
    gaps = [(op, kind) for op, cells in rows.items() for kind, cell in cells.items() if cell.startswith(MISSING)]
    assert not gaps, f"{len(gaps)} gap(s): {gaps}\n{_table(rows)}"


def test_no_registry_names_an_op_the_definitions_lack():
    """A registration under a misspelt or removed op name is caught, not silently never looked up."""
    registries = [host_fallback.KERNELS, host_fallback.PREPARE, host_fallback.WORKING, host_fallback.PATHS,
                  launches.PLANNERS, REFERENCES, BUILDERS]
    torch_functions = _torch_functions()
    if not isinstance(torch_functions, str):
        registries.append(torch_functions)
    for registry in registries:
        unknown = (set(registry) | set(registry.reasons)) - set(OPS)
        assert not unknown, f"the {registry.kind} registry names op(s) {sorted(unknown)} that no definition has"


def test_a_lookup_names_the_op_the_kind_and_what_is_registered():
    table: Registry[int] = Registry("test kernel")
    table.add(("a", "b"), 1)
    table.exempt("c", "runs elsewhere")
    with pytest.raises(NotRegistered, match=r"no test kernel for op 'd'; registered: a, b"):
        table["d"]
    with pytest.raises(KeyError, match=r"no test kernel for op 'c' \(runs elsewhere\)"):
        table["c"]
    assert table.get("d") is None and table.missing(["a", "c", "d", "e"]) == ["d", "e"]


def test_an_op_registered_twice_is_refused_unless_the_registry_takes_many():
    table: Registry[int] = Registry("test kernel")
    table.register("a")(1)
    with pytest.raises(ValueError, match="test kernel of op 'a' registered twice"):
        table.add("a", 2)
    with pytest.raises(ValueError, match="both registered and exempt"):
        table.exempt("a", "why")
    many: Registry[tuple[int, ...]] = Registry("test function", many=True)
    many.add("a", 1)
    many.add(("a", "b"), 2)
    assert many == {"a": (1, 2), "b": (2,)}
