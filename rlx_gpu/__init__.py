"""rlx_gpu: recurrent and sequence kernels on CUDA, OpenCL and the host, behind one arena-offset ABI."""
from .errors import (ConfigError, DeviceError, FallbackForbidden, GraphError, InputError, KernelBuildError, ModelError,
                     RlxError, RunError, ScheduleError)
from .graph.autodiff import vjp
from .graph.builder import Graph
from .graph.models import build_model, list_models
from .runtime.call_plan import CallPlan
from .runtime.config import Config, load_config
from .runtime.executor import get_device
from .runtime.registry import discover
from .schedule.io import load_schedule, save_schedule
from .schedule.model import Schedule, TensorView, Thunk
from .schedule.reserve import reserve_bytes

__version__ = "0.1.0"

__all__ = ["load_schedule", "save_schedule", "get_device", "discover", "load_config", "Config", "Schedule",
           "Thunk", "TensorView", "CallPlan", "ScheduleError", "RunError", "KernelBuildError", "FallbackForbidden", "DeviceError",
           "RlxError", "GraphError", "ModelError", "ConfigError", "InputError", "Graph", "vjp", "build_model",
           "list_models", "reserve_bytes", "__version__"]
