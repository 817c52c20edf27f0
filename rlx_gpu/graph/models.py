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
import difflib
import inspect
from typing import Any, Iterable, Mapping

import numpy as np

from host_fallback.abi.rnn import GATES, RECURRENT_BIASES

from ..errors import GraphError, ModelError
from ..paths import data_dir
from .builder import Graph, Tensor
from .lowering import Executable
from .recurrent_ops import recurrent_weight_counts


def examples_dir() -> Path:
    return data_dir("configs") / "examples"


def list_models() -> list[str]:
    """Names of the bundled example models (``configs/examples/*.yaml``)."""
    return sorted(p.stem for p in examples_dir().glob("*.yaml"))


MODEL_KEYS = ("dtype", "seed", "inputs", "weights", "steps", "outputs")
VALUE_KEYS = ("shape", "low", "high", "scale")
NOT_STEPS = ("compile", "output", "input", "weight")
WORDS = ("fn", "name", "dtype")  # step arguments whose strings are words, not tensor names


def _unknown(where: str, given: Iterable[str], known: Iterable[str], what: str = "key") -> None:
    """Refuse the first name of ``given`` outside ``known``, suggesting the nearest known one."""
    known = list(known)
    for name in given:
        if name not in known:
            near = difflib.get_close_matches(str(name), known, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ModelError(f"{where}: unknown {what} {name!r}{hint}; expected one of {', '.join(known)}")


def _shape(where: str, spec: Any) -> tuple[int, ...]:
    """The shape of an input or weight spec: a list of sizes, or ``{shape, low, high}`` / ``{shape, scale}``."""
    if isinstance(spec, Mapping):
        _unknown(where, spec, VALUE_KEYS)
        if ("low" in spec) != ("high" in spec):
            raise ModelError(f"{where}: a uniform range needs both low and high, got {sorted(spec)}")
        spec = spec.get("shape")
    if not isinstance(spec, list) or not spec or not all(type(n) is int and n >= 1 for n in spec):
        raise ModelError(f"{where}: expected a shape (a list of sizes >= 1, or {{shape: [...], ...}}), got {spec!r}")
    return tuple(spec)


def _random(rng: np.random.Generator, spec: Any) -> np.ndarray:
    """Values for an input or weight spec: a shape (standard normal) or ``{shape, low, high}``."""
    if isinstance(spec, Mapping):
        shape = tuple(spec["shape"])
        if "low" in spec:
            return rng.uniform(spec["low"], spec["high"], size=shape)
        return rng.standard_normal(shape) * spec.get("scale", 1.0)
    return rng.standard_normal(tuple(spec))


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


def _check_step(where: str, op: str, method: Any, args: Mapping[str, Any]) -> None:
    """The step's keys against the builder method's parameters: none unknown, every required one given."""
    params = {n: p for n, p in inspect.signature(method).parameters.items()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    _unknown(where, args, [*params, "op", "out"])
    filled = {"w_ih", "w_hh", *RECURRENT_BIASES[op]} if op in GATES else set()
    missing = [n for n, p in params.items() if p.default is p.empty and n not in args and n not in filled]
    if missing:
        raise ModelError(f"{where}: missing {', '.join(map(repr, missing))}; {op} takes {', '.join(params)}")
    if op in GATES and not (isinstance(args.get("x"), Tensor) and len(args["x"].shape) == 3):
        got = list(args["x"].shape) if isinstance(args.get("x"), Tensor) else repr(args.get("x"))
        raise ModelError(f"{where}: x must be a tensor of shape [batch, seq, input_size], got {got}")


def build_graph(spec: Any, rng: np.random.Generator, dtype: str | None = None,
                where: str = "model") -> tuple[Graph, dict]:
    """Build ``spec`` into a Graph; returns it and random values for its inputs (in compute precision).

    Every mistake in ``spec`` raises ``ModelError`` naming ``where`` (the file), the key and what it expects.
    """
    if not isinstance(spec, Mapping):
        raise ModelError(f"{where}: expected a mapping of {', '.join(MODEL_KEYS)}, got {type(spec).__name__}")
    _unknown(where, spec, MODEL_KEYS if dtype is None else MODEL_KEYS[:1] + MODEL_KEYS[2:])
    try:
        g = Graph(dtype or spec.get("dtype", "f32"))
    except GraphError as err:
        raise ModelError(f"{where}: dtype: {err}") from err
    for key, kind in (("inputs", Mapping), ("weights", Mapping), ("steps", list), ("outputs", list)):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise ModelError(f"{where}: {key}: expected a {'mapping' if kind is Mapping else 'list'}, "
                             f"got {type(spec[key]).__name__} {spec[key]!r}")
    env: dict[str, Tensor] = {}
    values: dict[str, np.ndarray] = {}
    for name, ispec in (spec.get("inputs") or {}).items():
        env[name] = g.input(name, _shape(f"{where}: inputs.{name}", ispec))
        values[name] = _random(rng, ispec)
    for name, wspec in (spec.get("weights") or {}).items():
        _shape(f"{where}: weights.{name}", wspec)
        env[name] = g.weight(name, _random(rng, wspec))

    def resolve(key: str, v: Any, at: str) -> Any:
        if isinstance(v, str) and v in env:
            return env[v]
        if isinstance(v, list) and key in ("xs", "bcast"):
            return [resolve(key, item, at) for item in v]
        if isinstance(v, Mapping) and "shape" in v:
            _shape(f"{at}.{key}", v)
            return g.constant(_random(rng, v))
        if isinstance(v, Mapping) and key == "body":
            return build_graph(v, rng, g.dtype, f"{at}.body")[0]
        return v

    for i, step in enumerate(spec.get("steps") or []):
        at = f"{where}: steps[{i}]"
        if not isinstance(step, Mapping) or "op" not in step or "out" not in step:
            raise ModelError(f"{at}: expected a mapping with op, out and the op's arguments, got {step!r}")
        step = dict(step)
        op, out = step.pop("op"), step.pop("out")
        method = getattr(g, op, None) if isinstance(op, str) and not op.startswith("_") else None
        if not callable(method) or op in NOT_STEPS:
            ops = sorted(n for n in dir(g) if not n.startswith("_") and callable(getattr(g, n)) and n not in NOT_STEPS)
            _unknown(at, [op], ops, "op")
        at = f"{at} ({op})"
        args = {k: resolve(k, v, at) for k, v in step.items()}
        _check_step(at, op, method, args)
        if op in GATES:
            _recurrent_weights(g, rng, op, args["x"], args, args.get("name") or f"{op}{i}")
        try:
            result = method(**args)
        except GraphError as err:
            raise ModelError(f"{at}: {err}") from err
        except (TypeError, AttributeError, ValueError, IndexError) as err:
            unknown = [f"{k}: {v!r}" for k, v in step.items() if isinstance(v, str) and v not in env and k not in WORDS]
            if unknown:
                raise ModelError(f"{at}: {', '.join(unknown)} names no tensor defined before this step "
                                 f"(defined: {', '.join(env)})") from err
            raise ModelError(f"{at}: {type(err).__name__}: {err}") from err
        names = [out] if isinstance(out, str) else list(out)
        results = result if isinstance(result, tuple) else (result,)
        if len(names) > len(results):
            raise ModelError(f"{at}: {len(names)} names in out for {len(results)} results")
        env.update(zip(names, results))
    for name in spec.get("outputs") or []:
        if name not in env:
            raise ModelError(f"{where}: outputs: {name!r} is no tensor of the model; defined: {', '.join(env)}")
        g.output(name, env[name])
    return g, values


def model_path(path_or_name: str | Path) -> Path:
    """A model file: a path, or the name of a bundled example."""
    path = Path(path_or_name)
    if not path.is_file():
        path = examples_dir() / f"{path_or_name}.yaml"
    if not path.is_file():
        raise ModelError(f"no model file {str(path_or_name)!r} and no bundled example of that name; "
                         f"bundled examples: {', '.join(list_models())}")
    return path


def load_spec(path_or_name: str | Path) -> Any:
    """The parsed model file (a path, or the name of a bundled example)."""
    import yaml

    from ..schedule.yaml_reader import yaml_message

    path = model_path(path_or_name)
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ModelError(f"model {path}: not YAML: {yaml_message(err)}") from err


def build_model(path_or_name: str | Path, device: str | None = None) -> tuple[Executable, dict[str, np.ndarray]]:
    """Compile an example model; returns the Executable and seeded inputs for it."""
    spec = load_spec(path_or_name)
    seed = spec.get("seed", 0) if isinstance(spec, Mapping) else 0
    g, values = build_graph(spec, np.random.default_rng(seed), where=f"model {model_path(path_or_name)}")
    return g.compile(device), values
