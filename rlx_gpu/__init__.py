"""rlx_gpu: recurrent and sequence kernels on CUDA, OpenCL and the host, behind one arena-offset ABI."""
from __future__ import annotations

from .abi import Schedule, TensorView, Thunk, load_schedule, save_schedule
from .config import Config, load_config
from .errors import DeviceError, FallbackForbidden, KernelBuildError, RlxError, ScheduleError
from .registry import discover, get_device

__version__ = "0.1.0"

__all__ = ["load_schedule", "save_schedule", "get_device", "discover", "load_config", "Config", "Schedule",
           "Thunk", "TensorView", "ScheduleError", "KernelBuildError", "FallbackForbidden", "DeviceError",
           "RlxError", "__version__"]
