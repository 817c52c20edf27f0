"""The errors rlx_gpu raises; each message says what failed, where, and how to fix it."""
from __future__ import annotations


class RlxError(Exception):
    """Base of every rlx_gpu error."""


class ScheduleError(RlxError, ValueError):
    """A schedule failed validation; nothing was launched."""


class GraphError(RlxError, ValueError):
    """A builder op was declared with shapes, counts or dtypes the ABI cannot run."""


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
