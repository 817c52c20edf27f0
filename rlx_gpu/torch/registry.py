"""The torch functions and modules of every op, registered against the op's name where each is written
(``@FUNCTIONS.register("mamba2")``; an op may have several): the completeness test reads it. No call
looks anything up here."""
from __future__ import annotations

from typing import Any

from host_fallback.abi import BACKWARD, SCAN_OPS
from host_fallback.registry import Registry

FUNCTIONS: Registry[tuple[Any, ...]] = Registry("torch function", many=True)
FUNCTIONS.exempt(BACKWARD, "torch reaches it through autograd of its forward op's function")
FUNCTIONS.exempt(("unary", "binary", "matmul", "reduce_sum", "copy", "fill", "cast"),
                 "torch has it natively: the frontend wraps the fused ops")
FUNCTIONS.exempt(SCAN_OPS, "torch has no scan whose signature the frontend could take (rlx_gpu.onnx takes ONNX's Scan)")
