"""ONNX models as schedules: ``rlx_gpu.onnx.load(path)`` and ``rlx-gpu import MODEL.onnx -o schedule.json``.

One ONNX graph becomes one schedule: LSTM, GRU, RNN and Scan nodes with their initializers, and the
glue around them (``glue.HANDLERS``). Initializers become the schedule's ``init``; the graph's inputs
and outputs become its named tensors, with the ONNX names and shapes (a symbolic size is given by
``shapes``). A node, attribute or value the importer cannot express is an ``OnnxImportError``
naming the node, op, attribute and value. Needs the ``onnx`` package (the ``onnx`` extra).
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from ..graph.builder import Graph
from ..graph.lowering import lower
from ..schedule.io import load_schedule
from ..schedule.model import Schedule
from . import glue, recurrent, scan
from .importer import Importer, OnnxImportError

__all__ = ["load", "import_model", "OnnxImportError", "HANDLERS"]

#: every ONNX op the importer reads, with its handler
HANDLERS = {**glue.HANDLERS, **recurrent.HANDLERS, **scan.HANDLERS}

def _read_model(source: Any) -> Any:
    try:
        import onnx
    except ImportError as err:
        raise OnnxImportError('reading ONNX models needs the onnx package: pip install -e ".[onnx]" in the '
                              'checkout') from err
    if isinstance(source, onnx.ModelProto):
        return source
    try:
        if isinstance(source, (bytes, bytearray)):
            return onnx.load_from_string(bytes(source))
        return onnx.load(os.fspath(source))
    except (OSError, ValueError) as err:
        raise OnnxImportError(f"cannot read the ONNX model {source if not isinstance(source, bytes) else '(bytes)'}: "
                              f"{err}") from err
    except Exception as err:  # protobuf's DecodeError derives from Exception only
        raise OnnxImportError(f"{source}: not an ONNX model ({type(err).__name__}: {err})") from err


def import_model(source: Any, *, shapes: Mapping[str, Sequence[int]] | None = None) -> dict[str, Any]:
    """The JSON form of the schedule of an ONNX model (a path, its bytes, or an ``onnx.ModelProto``).

    ``shapes`` fixes the sizes of graph inputs whose ONNX shape is symbolic, by input name.
    """
    model = _read_model(source)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    graph = Graph()
    importer = Importer(graph, HANDLERS, opset, shapes)
    importer.import_graph(model.graph)
    importer.declare_outputs(model.graph)
    schedule, _ = lower(graph)  # labelled rlx-thunks/2 where a field of ABI.md §8 is used
    return schedule


def load(source: Any, *, shapes: Mapping[str, Sequence[int]] | None = None) -> Schedule:
    """An ONNX model as a validated ``Schedule``: see ``import_model``."""
    return load_schedule(import_model(source, shapes=shapes))
