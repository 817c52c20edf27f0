"""The errors rlx_gpu raises; each message says what failed, where, and how to fix it."""
from __future__ import annotations


class RlxError(Exception):
    """Base of every rlx_gpu error."""


class ScheduleError(RlxError, ValueError):
    """A schedule failed validation; nothing was launched."""


class GraphError(RlxError, ValueError):
    """A builder op was declared with shapes, counts or dtypes the ABI cannot run."""


class ModelError(RlxError, ValueError):
    """A model file (``configs/examples/*.yaml`` form) names a key, shape or op the builder cannot build."""


class ConfigError(RlxError, ValueError):
    """A configuration file (``configs/default.yaml`` form) has a key or value outside its vocabulary."""


class InputError(RlxError, ValueError):
    """Input values given for a schedule (an ``.npz`` file, a mapping) do not match its inputs."""


class KernelBuildError(RlxError):
    """A device program failed to compile; carries the build log, the options and the numbered source."""

    def __init__(self, what: str, log: str, options: list[str], source: str):
        numbered = "\n".join(f"{i:5d}  {line}" for i, line in enumerate(source.splitlines(), 1))
        super().__init__(f"{what}\n--- options: {' '.join(options)}\n--- build log:\n{log}\n--- source:\n{numbered}")
        self.log, self.options, self.source = log, options, source


class FallbackForbidden(RlxError):
    """The fallback policy is ``forbid`` and a thunk would have to leave the chosen device."""


class DeviceError(RlxError):
    """A device spec names no usable device."""


class DLPackError(RlxError, BufferError):
    """A tensor cannot cross the DLPack border (dtype, device, layout or protocol version); nothing was shared."""
