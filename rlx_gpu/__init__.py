"""rlx_gpu: recurrent and sequence kernels on CUDA, OpenCL and the host, behind one arena-offset ABI."""
from __future__ import annotations

from .abi import Schedule, TensorView, Thunk, load_schedule, save_schedule
from .config import Config, load_config
from .autodiff import vjp
from .builder import Graph
from .errors import DeviceError, FallbackForbidden, GraphError, KernelBuildError, RlxError, ScheduleError
from .models import build_model, list_models
from .registry import discover, get_device

__version__ = "0.1.0"

__all__ = ["load_schedule", "save_schedule", "get_device", "discover", "load_config", "Config", "Schedule",
           "Thunk", "TensorView", "ScheduleError", "KernelBuildError", "FallbackForbidden", "DeviceError",
           "RlxError", "GraphError", "Graph", "vjp", "build_model", "list_models", "__version__"]
