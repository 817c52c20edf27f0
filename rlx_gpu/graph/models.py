"""Example models: a YAML description built through the Graph builder with seeded random weights.

A model file holds ``dtype``, ``seed``, ``inputs`` (name → shape, or ``{shape, low, high}`` for a
uniform range; standard normal otherwise), optional ``weights`` (same form), ``steps`` and
``outputs``. A step names a Graph method (``op``), its arguments (a string that names an earlier
tensor is that tensor; a mapping with ``shape`` is a fresh random weight) and ``out`` (a name or a
list of names for the results). Recurrent steps create their own weights (PyTorch's uniform
``±1/√hidden``) unless given. A ``scan`` step's ``body`` is a nested model without ``seed`` whose
``inputs`` are the carry, the per-step rows and the broadcast inputs, in that order.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from host_fallback.layout import GATES

from ..paths import data_dir
from .builder import Graph, GraphError, Tensor
from .lowering import Executable
from .sequence_ops import recurrent_weight_counts


def examples_dir() -> Path:
    return data_dir("configs") / "examples"


def list_models() -> list[str]:
    """Names of the bundled example models (``configs/examples/*.yaml``)."""
    return sorted(p.stem for p in examples_dir().glob("*.yaml"))


def _random(rng: np.random.Generator, spec: Any) -> np.ndarray:
    """Values for an input or weight spec: a shape (standard normal) or ``{shape, low, high}``."""
    if isinstance(spec, Mapping):
        shape = tuple(spec["shape"])
        if "low" in spec:
            return rng.uniform(spec["low"], spec["high"], size=shape)
        return rng.standard_normal(shape) * spec.get("scale", 1.0)
    return rng.standard_normal(tuple(spec))


def _shape(spec: Any) -> tuple[int, ...]:
    return tuple(spec["shape"] if isinstance(spec, Mapping) else spec)


def _recurrent_weights(g: Graph, rng: np.random.Generator, op: str, x: Tensor, args: dict[str, Any],
                       prefix: str) -> None:
    """Fill in the weights of an lstm/gru/rnn step that the file leaves out, with ABI.md §3's packing."""
    hidden = args["hidden"]
    bound = 1.0 / np.sqrt(hidden)
    counts = recurrent_weight_counts(op, x.shape[2], hidden, args.get("num_layers", 1),
                                     bool(args.get("bidirectional")))
    for field, count in counts.items():
        if field not in args:
            args[field] = g.weight(f"{prefix}.{field}", rng.uniform(-bound, bound, size=count))


def build_graph(spec: Mapping[str, Any], rng: np.random.Generator, dtype: str | None = None) -> tuple[Graph, dict]:
    """Build ``spec`` into a Graph; returns it and random values for its inputs (in compute precision)."""
    g = Graph(dtype or spec.get("dtype", "f32"))
    env: dict[str, Tensor] = {}
    values: dict[str, np.ndarray] = {}
    for name, ispec in (spec.get("inputs") or {}).items():
        env[name] = g.input(name, _shape(ispec))
        values[name] = _random(rng, ispec)
    for name, wspec in (spec.get("weights") or {}).items():
        env[name] = g.weight(name, _random(rng, wspec))

    def resolve(key: str, v: Any) -> Any:
        if isinstance(v, str) and v in env:
            return env[v]
        if isinstance(v, list) and key in ("xs", "bcast"):
            return [resolve(key, item) for item in v]
        if isinstance(v, Mapping) and "shape" in v:
            return g.constant(_random(rng, v))
        if isinstance(v, Mapping) and key == "body":
            return build_graph(v, rng, g.dtype)[0]
        return v

    for i, step in enumerate(spec.get("steps") or []):
        step = dict(step)
        op, out = step.pop("op"), step.pop("out")
        method = getattr(g, op, None)
        if op.startswith("_") or not callable(method) or op in ("compile", "output", "input", "weight"):
            raise GraphError(f"step {i}: unknown op {op!r}")
        args = {k: resolve(k, v) for k, v in step.items()}
        if op in GATES:
            _recurrent_weights(g, rng, op, args["x"], args, args.get("name") or f"{op}{i}")
        result = method(**args)
        names = [out] if isinstance(out, str) else list(out)
        results = result if isinstance(result, tuple) else (result,)
        if len(names) > len(results):
            raise GraphError(f"step {i} ({op}): {len(names)} names in out for {len(results)} results")
        env.update(zip(names, results))
    for name in spec.get("outputs") or []:
        g.output(name, env[name])
    return g, values


def load_spec(path_or_name: str | Path) -> dict[str, Any]:
    """The parsed model file: a path, or the name of a bundled example."""
    import yaml

    path = Path(path_or_name)
    if not path.exists():
        path = examples_dir() / f"{path_or_name}.yaml"
    if not path.exists():
        raise FileNotFoundError(f"no model file {path_or_name!r}; bundled examples: {', '.join(list_models())}")
    return yaml.safe_load(path.read_text())


def build_model(path_or_name: str | Path, device: str | None = None) -> tuple[Executable, dict[str, np.ndarray]]:
    """Compile an example model; returns the Executable and seeded inputs for it."""
    spec = load_spec(path_or_name)
    g, values = build_graph(spec, np.random.default_rng(spec.get("seed", 0)))
    return g.compile(device), values
