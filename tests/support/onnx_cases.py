"""ONNX models for the importer's tests and tools/onnx_sweep.py: ONNX's own node tests and random recurrent nodes.

``node_tests()`` collects the node tests the onnx wheel ships the generators of (``onnx.backend.test
.case.node``: every LSTM, GRU, RNN and Scan case) as models with their inputs and ONNX's expected
outputs. ``recurrent_case(op, combo, seed)`` builds one LSTM/GRU/RNN node over one combination of
attributes (``COMBINATIONS[op]``, every value of every attribute) with seeded weights and inputs.
``run_imported`` runs a model through ``rlx_gpu.onnx`` on a device; ``run_onnxruntime`` is the reference.
"""
from __future__ import annotations

import functools
import importlib
import itertools
from typing import Any, Iterator

import numpy as np

import rlx_gpu
import rlx_gpu.onnx

NODE_TEST_MODULES = ("lstm", "gru", "rnn", "scan")


@functools.lru_cache(maxsize=1)
def node_tests() -> tuple[tuple[str, Any, dict[str, np.ndarray], dict[str, np.ndarray]], ...]:
    """``(name, model, inputs, expected)`` of every ONNX node test of LSTM, GRU, RNN and Scan."""
    import onnx
    from onnx import helper

    found = []

    def collect(node: Any, inputs: list, outputs: list, name: str, **kw: Any) -> None:
        in_names = [n for n in node.input if n]
        out_names = [n for n in node.output if n]

        def info(n: str, a: Any) -> Any:
            a = np.asarray(a)
            return helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)

        graph = helper.make_graph([node], name, [info(n, a) for n, a in zip(in_names, inputs)],
                                  [info(n, a) for n, a in zip(out_names, outputs)])
        opsets = kw.get("opset_imports") or [helper.make_opsetid("", onnx.defs.get_schema(node.op_type).since_version)]
        found.append((name, helper.make_model(graph, opset_imports=opsets),
                      {n: np.asarray(a) for n, a in zip(in_names, inputs)},
                      {n: np.asarray(a) for n, a in zip(out_names, outputs)}))

    for stem in NODE_TEST_MODULES:
        module = importlib.import_module(f"onnx.backend.test.case.node.{stem}")
        module.expect = collect  # the generators call the module's expect; collect instead of writing files
        for cls in vars(module).values():
            if isinstance(cls, type) and cls.__module__ == module.__name__:
                for attr in sorted(vars(cls)):
                    if attr.startswith("export"):
                        getattr(cls, attr)()
    return tuple(found)


GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
SLOTS = {"LSTM": 3, "GRU": 2, "RNN": 1}
#: the functions random activations draw from (ONNX names), with how many of alpha, beta each takes
FUNCTIONS = {"Sigmoid": 0, "Tanh": 0, "Relu": 0, "Affine": 2, "LeakyRelu": 1, "ThresholdedRelu": 1,
             "ScaledTanh": 2, "HardSigmoid": 2, "Elu": 1, "Softsign": 0, "Softplus": 0}

COMMON = {
    "direction": ("forward", "reverse", "bidirectional"),
    "layout": (0, 1),
    "clip": (None, 0.6),
    # default; every alpha/beta given; some given (the rest filled as onnxruntime fills them)
    "activations": ("default", "given", "partial"),
    # absent; all rows full length; lengths in [0, seq] (a row of length 0 among them)
    "sequence_lens": ("absent", "full", "varied"),
    "initial": (False, True),
    "bias": (False, True),
}
COMBINATIONS = {
    "LSTM": {**COMMON, "input_forget": (0, 1), "peepholes": (False, True)},
    "GRU": {**COMMON, "linear_before_reset": (0, 1)},
    "RNN": dict(COMMON),
}


def combinations(op: str) -> Iterator[dict[str, Any]]:
    """Every combination of ``COMBINATIONS[op]``."""
    axes = COMBINATIONS[op]
    for values in itertools.product(*axes.values()):
        yield dict(zip(axes, values))


def sample(op: str, count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` combinations of ``op`` in which every value of every attribute appears (given ``count`` is at
    least the largest number of values): row ``i`` takes value ``perm[i] mod n`` of each attribute, each
    attribute with its own seeded permutation of the rows, so the attributes vary independently."""
    rng = np.random.default_rng(seed)
    perms = {name: rng.permutation(count) for name in COMBINATIONS[op]}
    return [{name: values[int(perms[name][i]) % len(values)] for name, values in COMBINATIONS[op].items()}
            for i in range(count)]


def recurrent_case(op: str, combo: dict[str, Any], seed: int = 0, batch: int = 3, seq: int = 4, inputs: int = 3,
                   hidden: int = 5) -> tuple[Any, dict[str, np.ndarray]]:
    """One ``op`` node with the attributes of ``combo``: its model and seeded inputs (weights as initializers)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    dirs = 2 if combo["direction"] == "bidirectional" else 1
    g = GATES[op]
    layout = combo["layout"]
    scale = 1 / np.sqrt(hidden)
    inits = [numpy_helper.from_array(rng.uniform(-scale, scale, shape).astype(np.float32), name)
             for name, shape in (("W", (dirs, g * hidden, inputs)), ("R", (dirs, g * hidden, hidden)))]
    names = ["X", "W", "R"]
    feeds = {"X": rng.standard_normal((batch, seq, inputs) if layout else (seq, batch, inputs)).astype(np.float32)}
    if combo["bias"]:
        bias = rng.uniform(-scale, scale, (dirs, 2 * g * hidden)).astype(np.float32)
        inits.append(numpy_helper.from_array(bias, "B"))
    names.append("B" if combo["bias"] else "")
    if combo["sequence_lens"] != "absent":
        lens = np.full(batch, seq) if combo["sequence_lens"] == "full" else np.array([seq, 0, *rng.integers(
            1, seq + 1, batch - 2)])[:batch]
        feeds["sequence_lens"] = lens.astype(np.int32)
    names.append("sequence_lens" if combo["sequence_lens"] != "absent" else "")
    state_shape = (batch, dirs, hidden) if layout else (dirs, batch, hidden)
    states = ["initial_h", "initial_c"] if op == "LSTM" else ["initial_h"]
    for s in states:
        if combo["initial"]:
            feeds[s] = rng.standard_normal(state_shape).astype(np.float32) * 0.5
        names.append(s if combo["initial"] else "")
    if op == "LSTM" and combo["peepholes"]:
        inits.append(numpy_helper.from_array(rng.uniform(-0.5, 0.5, (dirs, 3 * hidden)).astype(np.float32), "P"))
        names.append("P")
    attrs: dict[str, Any] = {"hidden_size": hidden, "direction": combo["direction"], "layout": layout}
    if combo["clip"] is not None:
        attrs["clip"] = combo["clip"]
    for key in ("input_forget", "linear_before_reset"):
        if key in combo:
            attrs[key] = combo[key]
    if combo["activations"] != "default":
        funcs = [str(f) for f in rng.choice(list(FUNCTIONS), SLOTS[op] * dirs)]
        alphas = [float(rng.uniform(0.1, 1.0)) for f in funcs if FUNCTIONS[f] >= 1]
        betas = [float(rng.uniform(0.1, 1.0)) for f in funcs if FUNCTIONS[f] == 2]
        keep = 1.0 if combo["activations"] == "given" else 0.5
        attrs["activations"] = funcs
        if alphas[:int(len(alphas) * keep)]:
            attrs["activation_alpha"] = alphas[:int(len(alphas) * keep)]
        if betas[:int(len(betas) * keep)]:
            attrs["activation_beta"] = betas[:int(len(betas) * keep)]
    outputs = ["Y", "Y_h", "Y_c"] if op == "LSTM" else ["Y", "Y_h"]
    node = helper.make_node(op, names, outputs, name=f"{op.lower()}0", **attrs)
    x_info = [helper.make_tensor_value_info(n, TensorProto.INT32 if n == "sequence_lens" else TensorProto.FLOAT,
                                            a.shape) for n, a in feeds.items()]
    out_info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs]
    graph = helper.make_graph([node], f"{op}_{seed}", x_info, out_info, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    return model, feeds


def run_onnxruntime(model: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The outputs of onnxruntime's CPU provider, by name.

    Its CPU kernels refuse ``layout = 1``: a batch-major recurrent node runs there as the same node with
    ``layout = 0``, its inputs and outputs transposed around it (here, independently of the importer).
    """
    import onnxruntime

    node = model.graph.node[0] if len(model.graph.node) == 1 else None
    if node is not None and node.op_type in GATES and any(a.name == "layout" and a.i for a in node.attribute):
        return _batch_major_through_time_major(model, feeds)
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def _batch_major_through_time_major(model: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnx

    time_major = onnx.ModelProto()
    time_major.CopyFrom(model)
    node = time_major.graph.node[0]
    next(a for a in node.attribute if a.name == "layout").i = 0
    # X, initial_h and initial_c (inputs 0, 5, 6) swap their first two axes
    back = {node.input[i]: (1, 0, 2) for i in (0, 5, 6) if i < len(node.input) and node.input[i]}
    for info in (*time_major.graph.input, *time_major.graph.output):
        info.type.tensor_type.ClearField("shape")
    out = run_onnxruntime(time_major, {n: a.transpose(back[n]) if n in back else a for n, a in feeds.items()})
    outputs = dict(zip(node.output, ((2, 0, 1, 3), (1, 0, 2), (1, 0, 2))))
    return {n: a.transpose(outputs[n]) for n, a in out.items()}


def run_imported(model: Any, feeds: dict[str, np.ndarray], device: str = "host") -> dict[str, np.ndarray]:
    schedule = rlx_gpu.onnx.load(model)
    arena = schedule.pristine_arena()
    for name, values in feeds.items():
        schedule.tensors[name].write(arena, values)
    out = rlx_gpu.get_device(device).run(schedule, arena)
    return {name: schedule.tensors[name].read(out) for name in schedule.outputs}


def abi_final_states(model: Any, feeds: dict[str, np.ndarray],
                     reference: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """onnxruntime's outputs with the final state of each length-0 row set to its initial state (ABI.md §8
    keeps it; onnxruntime writes 0)."""
    lens = feeds.get("sequence_lens")
    if lens is None or lens.all():
        return reference
    node = model.graph.node[0]
    layout = next((a.i for a in node.attribute if a.name == "layout"), 0)
    out = dict(reference)
    for final, initial in (("Y_h", "initial_h"), ("Y_c", "initial_c")):
        if final in out:
            fixed = out[final].copy()
            start = feeds.get(initial, np.zeros_like(fixed))
            for b in np.flatnonzero(lens == 0):
                if layout:
                    fixed[b] = start[b]
                else:
                    fixed[:, b] = start[:, b]
            out[final] = fixed
    return out
