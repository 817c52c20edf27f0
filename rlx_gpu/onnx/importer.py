"""The walk over an ONNX graph: its inputs, initializers, nodes in order and outputs, into a builder graph.

``Importer`` keeps the value of every ONNX name (``values.Value``), reads and checks each node's
attributes against what its handler knows, and hands the node to the handler of its op (a table the
package assembles from ``glue``, ``recurrent`` and ``scan``). A scan's body is imported by a nested
``Importer`` into the body graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..errors import GraphError, ModelError
from ..graph.nodes import BodyGraph, Tensor
from .values import Value, View, dense

#: ONNX element types with a float counterpart in the ABI, and the integer ones folded at import.
FLOAT_TYPES = {1: "f32", 10: "f16", 11: "f64", 16: "bf16"}
INT32 = 6


def _type_name(elem_type: int) -> str:
    from onnx import TensorProto

    try:
        return f"{TensorProto.DataType.Name(elem_type).lower()} ({elem_type})"
    except ValueError:
        return str(elem_type)


class OnnxImportError(ModelError):
    """An ONNX model holds a node, attribute or value this importer cannot express as a schedule."""


@dataclass(frozen=True)
class Handler:
    """How one ONNX op is imported: ``run(importer, node, inputs) -> outputs`` and the attributes it reads."""

    run: Callable[["Importer", Any, list[Value | None]], Sequence[Value | None]]
    attributes: frozenset[str]


class Importer:
    """Imports one ONNX graph (the model's, or a scan body) into ``graph``."""

    def __init__(self, graph: BodyGraph, handlers: Mapping[str, Handler], opset: int,
                 shapes: Mapping[str, Sequence[int]] | None = None):
        self.graph = graph
        self.handlers = handlers
        self.opset = opset
        self.shapes = dict(shapes or {})
        self.values: dict[str, Value] = {}
        self.prefixes: set[str] = set()

    # ----------------------------------------------------------------- errors and attributes
    @staticmethod
    def error(node: Any, message: str) -> OnnxImportError:
        return OnnxImportError(f"ONNX node {node.name or '(unnamed)'!r} ({node.op_type}): {message}")

    def unsupported(self, node: Any, attribute: str, value: Any, why: str) -> OnnxImportError:
        return self.error(node, f"attribute {attribute}={value!r} is not supported: {why}")

    @staticmethod
    def attributes(node: Any) -> dict[str, Any]:
        from onnx import helper

        out = {}
        for a in node.attribute:
            value = helper.get_attribute_value(a)
            if isinstance(value, bytes):
                value = value.decode()
            elif isinstance(value, list) and value and isinstance(value[0], bytes):
                value = [v.decode() for v in value]
            out[a.name] = value
        return out

    def prefix(self, node: Any) -> str:
        """A name for ``node``'s weights, unique in this graph: the node's name, else its first output's,
        else its op, with ``_1``, ``_2``, ... after a name an earlier node took (in the graph's order)."""
        base = node.name or next((o for o in node.output if o), node.op_type)
        name, k = base, 0
        while name in self.prefixes:
            k += 1
            name = f"{base}_{k}"
        self.prefixes.add(name)
        return name

    # ----------------------------------------------------------------- values
    def constant(self, node: Any, value: Value | None, what: str) -> np.ndarray:
        """``value`` as a NumPy array; a run-time value is refused, naming ``what`` it is."""
        if not isinstance(value, np.ndarray):
            raise self.error(node, f"{what} must be known when the model is imported (an initializer or a "
                                   f"Constant); it is computed at run time")
        return value

    def dense(self, value: Value, dtype: str | None = None) -> Tensor:
        return dense(self.graph, value, dtype)

    def _readers(self, proto: Any, name: str) -> str:
        """``; it is read by ONNX node ... as its input ...`` for every node of ``proto`` that reads ``name``."""
        from onnx import defs

        said = []
        for node in proto.node:
            for k, given in enumerate(node.input):
                if given == name:
                    try:
                        formal = defs.get_schema(node.op_type, self.opset, node.domain).inputs
                        what = formal[min(k, len(formal) - 1)].name
                    except defs.SchemaError:
                        what = str(k)
                    said.append(f"ONNX node {node.name or '(unnamed)'!r} ({node.op_type}) as its input {what}")
        return f"; it is read by {', and by '.join(said)}" if said else ""

    def declare_inputs(self, proto: Any) -> None:
        """The graph inputs that are no initializer: named tensors of the schedule, shaped by their type or
        by ``shapes``; every input whose shape is symbolic is named in one error."""
        symbolic = {}
        inputs = [info.name for info in proto.input if info.name not in self.values]
        unknown = sorted(set(self.shapes) - set(inputs))
        if unknown:
            raise OnnxImportError(f"shapes names {', '.join(map(repr, unknown))}, which is no graph input; the graph "
                                  f"inputs are {', '.join(map(repr, inputs)) or 'none'}")
        for info in proto.input:
            if info.name in self.values:
                continue
            kind = info.type.tensor_type
            dtype = FLOAT_TYPES.get(kind.elem_type) or ("i32" if kind.elem_type == INT32 else None)
            if dtype is None:
                raise OnnxImportError(f"graph input {info.name!r} has the ONNX element type "
                                      f"{_type_name(kind.elem_type)}; the schedule takes float32, float16, bfloat16, "
                                      f"float64 and int32 inputs{self._readers(proto, info.name)}: give it as an "
                                      f"initializer or a Constant")
            dims = list(kind.shape.dim)
            if info.name in self.shapes:
                shape = [int(d) for d in self.shapes[info.name]]
                declared = [d.dim_value if d.HasField("dim_value") else None for d in dims]
                if len(shape) != len(declared) or any(g < 1 or (d is not None and g != d)
                                                      for g, d in zip(shape, declared)):
                    raise OnnxImportError(
                        f"shapes[{info.name!r}] = {shape} does not fit graph input {info.name!r} of shape "
                        f"{[d if d is not None else (e.dim_param or '?') for d, e in zip(declared, dims)]}: "
                        f"give {len(declared)} sizes of at least 1, equal to its fixed ones")
            elif any(not d.HasField("dim_value") for d in dims):
                symbolic[info.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in dims]
                continue
            else:
                shape = [d.dim_value for d in dims]
            self.values[info.name] = View.of(self.graph.input(info.name, shape, dtype))
        if symbolic:
            given = {name: ",".join(str(d) if isinstance(d, int) else "N" for d in dims)
                     for name, dims in symbolic.items()}
            listed = "; ".join(f"graph input {name!r} has the symbolic shape {dims}" for name, dims in symbolic.items())
            raise OnnxImportError(
                f"{listed}; a schedule has fixed sizes: give them as shapes="
                f"{{{', '.join(f'{n!r}: [{d}]' for n, d in given.items())}}} (rlx-gpu import or rlx-gpu run "
                f"{' '.join(f'--shape {n}={d}' for n, d in given.items())}) with N a size")

    # ----------------------------------------------------------------- the walk
    def run_nodes(self, nodes: Sequence[Any]) -> None:
        for node in nodes:
            handler = self.handlers.get(node.op_type) if node.domain in ("", "ai.onnx") else None
            if handler is None:
                known = ", ".join(sorted(self.handlers))
                raise self.error(node, f"the op {node.domain + '.' if node.domain else ''}{node.op_type} is not "
                                       f"supported; the importer reads {known}")
            for name in self.attributes(node):
                if name not in handler.attributes:
                    value = self.attributes(node)[name]
                    raise self.unsupported(node, name, value, f"{node.op_type} is read with "
                                           f"{', '.join(sorted(handler.attributes)) or 'no attributes'}")
            inputs = []
            for name in node.input:
                if name and name not in self.values:
                    raise self.error(node, f"input {name!r} is defined by no earlier node, initializer or input")
                inputs.append(self.values[name] if name else None)
            try:
                outputs = handler.run(self, node, inputs)
            except OnnxImportError:
                raise
            except (GraphError, ValueError) as err:  # the builder's checks and NumPy's shape rules, of this node
                raise self.error(node, str(err)) from err
            for name, value in zip(node.output, outputs):
                if name:
                    if value is None:
                        raise self.error(node, f"output {name!r} is not produced by the import")
                    self.values[name] = value

    def import_graph(self, proto: Any) -> None:
        """Initializers, inputs and nodes of the ONNX ``proto`` graph; outputs are left to the caller."""
        from onnx import numpy_helper

        for init in proto.initializer:
            self.values[init.name] = numpy_helper.to_array(init)
        self.declare_inputs(proto)
        self.run_nodes(proto.node)

    def declare_outputs(self, proto: Any) -> None:
        """Every graph output as a named output tensor of the schedule."""
        for info in proto.output:
            value = self.values[info.name]
            dtype = FLOAT_TYPES.get(info.type.tensor_type.elem_type)
            if dtype is None:
                raise OnnxImportError(f"graph output {info.name!r} has ONNX element type "
                                      f"{info.type.tensor_type.elem_type}; schedule outputs are float tensors")
            self.graph.output(info.name, self.dense(value, dtype))
