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


class KernelBuildWarning(UserWarning):
    """A device program built, but its compiler said something about the source (the log's diagnostics)."""


class FallbackForbidden(RlxError):
    """The fallback policy is ``forbid`` and a thunk would have to leave the chosen device."""


class RunError(RlxError, ValueError):
    """A run refused for its run-time data (ABI.md §8's integer tensors); nothing of that thunk was written."""


class DeviceError(RlxError):
    """A device spec names no usable device."""


class DLPackError(RlxError, BufferError):
    """A tensor cannot cross the DLPack border (dtype, device, layout or protocol version); nothing was shared."""


def brief(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to about ``limit`` characters, in time bounded by ``limit``: a huge or
    self-referencing value (a YAML alias bomb, a 10**4000 literal) is never expanded."""
    text = _brief(value, limit, depth=3)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _brief(value: object, budget: int, depth: int) -> str:
    if value is None or isinstance(value, (bool, float)):
        return repr(value)
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 256 else f"<int of {value.bit_length()} bits>"
    if isinstance(value, (str, bytes, bytearray)):
        return repr(value[:budget]) + ("..." if len(value) > budget else "")
    if isinstance(value, (list, tuple, dict)):
        opening, closing = ("{", "}") if isinstance(value, dict) else ("[", "]")
        if depth == 0:
            return f"{opening}...{closing}"
        parts: list[str] = []
        used = 0
        for item in (value.items() if isinstance(value, dict) else value):
            if used >= budget:
                parts.append("...")
                break
            if isinstance(value, dict):
                key = _brief(item[0], budget - used, depth - 1)
                part = f"{key}: {_brief(item[1], budget - used - len(key), depth - 1)}"
            else:
                part = _brief(item, budget - used, depth - 1)
            parts.append(part)
            used += len(part) + 2
        return opening + ", ".join(parts) + closing
    return f"<{type(value).__name__}>"
