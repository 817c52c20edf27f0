"""The ABI model (ABI.md): one definition per op, the leaf both ``rlx_gpu`` and the host kernels read.

This package imports the standard library and NumPy alone: nothing else of ``host_fallback`` and
nothing of ``rlx_gpu``. ``OPS`` maps every op name to its ``OpDef`` (``model``): fields, dtypes,
regions, rules, carried states, gradients, run-time data rules and conformance inputs. The ops are
defined by family (``rnn``, ``ssm``, ``gdn``, ``body``, ``scan``: the stems of the host kernels,
launch planners and kernel texts; ``backward`` generates
ABI.md §9's), each module's ``OpDef`` found by ``ops``; ``aliasing``, ``state`` and ``int_tensors`` hold the rules
several families share, ``runtime_data`` applies the integer tensors' rules. docs/design.md tells how
to add an op.
"""
from .model import (DTYPES, ELEM_SIZE, TENSOR_DTYPES, Checked, DataError, Field, FieldError, OpDef, Region, Rule,
                    Thunk)
from .backward import gradient
from .int_tensors import INT_FIELDS
from .ops import (BACKWARD, FLAGGED_STATES, FORWARD_OPS, OPS, OPTIONAL_INPUTS, complete, default, footprint,
                  forward_op, forward_thunk, is_default, regions, used)
from .scan import SCAN_OPS

__all__ = ["BACKWARD", "DTYPES", "ELEM_SIZE", "FLAGGED_STATES", "FORWARD_OPS", "INT_FIELDS", "OPS", "OPTIONAL_INPUTS",
           "SCAN_OPS", "TENSOR_DTYPES", "Checked", "DataError", "Field", "FieldError", "OpDef", "Region", "Rule",
           "Thunk", "complete", "default", "footprint", "forward_op", "forward_thunk", "gradient", "is_default",
           "regions", "used"]
