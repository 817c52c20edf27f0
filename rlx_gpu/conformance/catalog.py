"""The conformance cases as data: every op × dtype × representative shape, plus the cast matrix,
NaN/Inf propagation through every elementwise function, the scan family with its gradients, and the
combined-field cases (``combined``).

``cases(quick=...)`` lists them; ``quick`` keeps the small shapes (seconds on a CPU, and what the
Oclgrind simulator runs). A case is only a description; :mod:`.runner` lays it out and checks it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from host_fallback.abi import BACKWARD, DTYPES, OPTIONAL_INPUTS, SCAN_OPS, Field, OPS as SPECS, gradient, used

from .cases import SMALL
from .combined import combined
from .references import BINARY, CASES, REFERENCES, UNARY, V2_FIELDS


@dataclass(frozen=True)
class Case:
    """One thunk to run: ``params`` are its fields other than offsets and dtype."""

    op: str
    dtype: str
    params: Mapping[str, Any]
    options: Mapping[str, Any] = field(default_factory=dict)  # RunOptions fields (rnn_kernel, recompute)
    poison: str | None = None  # an input field whose first elements become NaN, +Inf, -Inf, 0, -0
    poison_step: int | None = None  # instead: one ``poison_value`` in ``poison`` at this step of batch row 0
    poison_value: float = float("nan")
    large: bool = False        # left out by --quick
    seed: int = 7
    variant: str = ""          # names what sets this case apart from the others of its op
    refused: str | None = None  # an integer tensor holding a value outside its rule: the run must be refused
    combined: bool = False     # one of the combined-field cases (``combined``): sampled per kernel where runs are costly

    def has(self, field: Field) -> bool:
        """Whether this case's thunk has the optional ``field``: its flag set, or (nullable) not null.

        A nullable field is null where ``params`` gives it as False (the scan cases carry their bodies);
        a field used only under a flag (a carried state's gradient, of version 2) is present with its flag;
        another version-2 field where ``params`` give it a value other than its default.
        """
        if field.used_when:
            return bool(self.params.get(field.used_when))
        if field.version > 1:
            return field.name in used({"op": self.op, "dtype": self.dtype, **self.params})
        return self.params.get(field.name, True) is not False

    @property
    def family(self) -> str:
        if self.refused:
            return "run_data"
        if self.combined:
            return "combined"
        if self.op in SCAN_OPS:
            return "scan"
        return "nan_inf" if self.poison else ("cast" if self.op == "cast" else "thunk")

    @property
    def name(self) -> str:
        """A stable id: op, variant and shape (the dtype is reported beside it)."""
        return "-".join(p for p in (self.op, self.variant, shape_label(self.params)) if p)

    @property
    def id(self) -> str:
        return f"{self.name}-{self.dtype}"


def shape_label(params: Mapping[str, Any]) -> str:
    """The integer fields joined by ``x`` (``2x5x3x4x2``), lists as ``[3.1.5]``."""
    parts = []
    for value in params.values():
        if isinstance(value, bool) or not isinstance(value, (int, list)):
            continue
        parts.append(f"[{'.'.join(map(str, value))}]" if isinstance(value, list) else str(value))
    return "x".join(parts)


def _flags(params: Mapping[str, Any], options: Mapping[str, Any]) -> str:
    names = {"bidirectional": "bidir", "carry": "carry", "relu": "relu", "gate_per_channel": "per_channel",
             "carry_state": "carry", "trans_a": "ta", "trans_b": "tb"}
    flags = [short for key, short in names.items() if params.get(key) is True]
    return ".".join(flags + [str(v) for v in options.values()])


#: (op, params, run options, large) of the per-dtype thunk cases, as each op's reference module declares them
THUNKS = [(op, *case) for op in SPECS if op in CASES for case in CASES[op].thunks]
#: (op, params, field, step, value) of the causality cases: one NaN or Inf at ``step`` of batch row 0 must reach
#: that row's outputs from that step on and nothing else (NaN and signed Inf positions compared with the float64
#: reference and the host)
CAUSAL = [(op, *case) for op in SPECS if op in CASES for case in CASES[op].causal]
#: (op, params, field, label) of the run-time data cases: an integer tensor outside its rule (ABI.md §8)
#: must be refused with a RunError naming the field, leaving the arena as it was.
REFUSED = [(op, *case) for op in SPECS if op in CASES for case in CASES[op].refused]
#: (op, save_trajectory, num_checkpoints) of the scan-family cases (length ``SCAN_LENGTH``, the ``carry + x`` body)
SCANS = [("scan", True, 0), ("scan", False, 0), ("scan_backward", True, 2), ("scan_backward_xs", False, 3)]
SCAN_LENGTH = 5
NAN_INF_DTYPES = ("f32", "bf16")
#: The dtypes of the cases ``optional_field_cases`` adds: a 32-bit and a 16-bit storage.
OPTIONAL_DTYPES = ("f32", "bf16")
CASES.exempt(SCAN_OPS, "the catalog makes the scan family's cases (SCANS) over cases.scan_case's body")


#: (op, field) -> the params that give the op's small case (``cases.SMALL``) the version-2 ``field``
#: (ABI.md §8), with what the field needs beside it; a field not listed is a flag or a tensor: ``True``.
#: The "present" case of state_dtype / param_dtype is f32, which means the default for an f32 thunk.
PRESENT: dict[tuple[str, str], dict[str, Any]] = {
    (op, f): dict(params) for op in SPECS if op in CASES and op not in BACKWARD
    for f, params in CASES[op].present.items()}


def _with_gradients(forward: str, params: dict[str, Any]) -> dict[str, Any]:
    """The params of a backward op's case: ``params`` and the gradient of every optional input they place."""
    return {**params, **{gradient(name): True for name in OPTIONAL_INPUTS[forward] if params.get(name)}}


# a backward op's field is present as its forward's is (unless it declares its own); an optional input and its
# gradient come together
for _backward_op, _forward_op in BACKWARD.items():
    PRESENT.update({(_backward_op, f): _with_gradients(_forward_op, p) for (op, f), p in list(PRESENT.items())
                    if op == _forward_op})
    for _name in OPTIONAL_INPUTS[_forward_op]:
        _given = _with_gradients(_forward_op, PRESENT.get((_forward_op, _name), {_name: True}))
        PRESENT[(_backward_op, _name)] = PRESENT[(_backward_op, gradient(_name))] = _given
    if _backward_op in CASES:
        PRESENT.update({(_backward_op, f): dict(params) for f, params in CASES[_backward_op].present.items()})


def present(op: str, field: Field) -> dict[str, Any]:
    """The params that make the small case of ``op`` have the optional ``field``."""
    if field.version > 1:
        return dict(PRESENT.get((op, field.name), {field.name: True}))
    return {field.used_when or field.name: True}


def _special(value: float) -> str:
    return "nan" if value != value else ("inf" if value > 0 else "ninf")


def _variant(op: str, params: Mapping[str, Any], options: Mapping[str, Any]) -> str:
    fn = params.get("fn", "")
    return ".".join(p for p in (fn, _flags(params, options)) if p)


def cases(quick: bool = False) -> list[Case]:
    """Every case, in a stable order (thunks, casts, NaN/Inf, scans); ``quick`` drops the large shapes."""
    out = [Case(op, dtype, params, options, large=large, variant=_variant(op, params, options))
           for op, params, options, large in THUNKS for dtype in DTYPES]
    out += [Case("cast", dtype, dict(n=45, src_dtype=src), seed=3, variant=f"from_{src}")
            for dtype in DTYPES for src in DTYPES]
    for dtype in NAN_INF_DTYPES:
        out += [Case("unary", dtype, dict(fn=fn, n=40), poison="x", seed=1, variant=f"{fn}.nan_inf") for fn in UNARY]
        out += [Case("binary", dtype, dict(fn=fn, shape=[40], a_strides=[1], b_strides=[1]), poison="b", seed=1,
                     variant=f"{fn}.nan_inf") for fn in BINARY]
    out += [Case(op, dtype, params, poison=field, poison_step=step, poison_value=value, seed=5,
                 variant=".".join(p for p in (_flags(params, {}), f"{_special(value)}_at_{step}") if p))
            for op, params, field, step, value in CAUSAL for dtype in NAN_INF_DTYPES]
    out += [Case(op, dtype, dict(save_trajectory=save, num_checkpoints=k, length=SCAN_LENGTH),
                 {"recompute": "treeverse"}, seed=1, variant=("traj" if save else "final") + f".k{k}")
            for op, save, k in SCANS for dtype in DTYPES]
    out += optional_field_cases(out)
    out += [Case(op, "f32", dict(_base(op)[0], **params), seed=3, refused=field, variant=f"bad_{field}.{label}")
            for op, params, field, label in REFUSED]
    out += [Case(op, dtype, params, options, variant=".".join(["combined", label, *map(str, options.values())]),
                 combined=True) for label, op, dtype, params, options in combined()]
    return [c for c in out if not (quick and c.large)]


def _base(op: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(params, options)`` of the small case that ``optional_field_cases`` varies per op."""
    if op in SCAN_OPS:
        return dict(save_trajectory=True, num_checkpoints=0, length=SCAN_LENGTH), {"recompute": "treeverse"}
    return dict(SMALL[op]), {}


def optional_field_cases(existing: Iterable[Case]) -> list[Case]:
    """For every op and every optional field of the op table (``OpDef.optional_fields``), a case
    with the field present and one with it absent, in each of ``OPTIONAL_DTYPES``, where ``existing``
    has none: so a field marked optional is run both ways on every device the day it is added."""
    have = {(c.op, c.dtype, f.name, c.has(f)) for c in existing for f in SPECS[c.op].optional_fields}
    out: list[Case] = []
    for op, spec in SPECS.items():
        if op in BACKWARD and op not in REFERENCES:  # a backward op is certified once its reference exists
            continue
        for f in spec.optional_fields:
            for present in (True, False):
                if present and f.version > 1 and f.name not in V2_FIELDS.get(op, ()):
                    continue
                for dtype in OPTIONAL_DTYPES:
                    if (op, dtype, f.name, present) in have:
                        continue
                    params, options = _base(op)
                    if present:
                        params.update(globals()["present"](op, f))
                    elif f.version == 1:
                        params[f.used_when or f.name] = False
                    label = f.used_when or f.name
                    made = Case(op, dtype, params, options, seed=2,
                                variant=".".join(p for p in (_variant(op, params, options),
                                                             label if present and f.version > 1 else "",
                                                             "" if present else f"no_{label}") if p))
                    have |= {(op, dtype, g.name, made.has(g)) for g in spec.optional_fields}
                    out.append(made)
    return out


def select(all_cases: Iterable[Case], ops: Iterable[str] | None = None, dtypes: Iterable[str] | None = None) -> list[Case]:
    """The cases of the named ops and dtypes (``None``: all)."""
    ops, dtypes = (None if ops is None else set(ops)), (None if dtypes is None else set(dtypes))
    return [c for c in all_cases if (ops is None or c.op in ops) and (dtypes is None or c.dtype in dtypes)]
