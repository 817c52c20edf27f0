"""Typed run options: how kernels run (never what they compute), built once from config and arguments.

They live with the backends, which are what they steer; the runtime builds them from its config and
hands them down. A misspelled or unknown option is an error naming the known ones. ``host_fallback``
cannot import this package, so :meth:`RunOptions.host_keywords` maps the options to its kernels'
keyword parameters at the border, and :meth:`RunOptions.planner_keywords` to the device launch planners'.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from host_fallback.scan import STRATEGIES as RECOMPUTE

from ..errors import RlxError
from ..launches.rnn import RNN_KERNELS
from ..launches.ssm import SSM_KERNELS

HOST_PATHS = ("step", "chunked", "blocked")


@dataclass(frozen=True)
class RunOptions:
    """Every option a run takes; ``None`` lets the kernel decide.

    Attributes
    ----------
    recompute : str
        ``segment`` or ``treeverse``: how ``scan_backward`` recomputes carries between checkpoints
        (ABI.md §6; never changes a result bit).
    rnn_kernel : str
        Device recurrent kernel: ``auto`` (by shape), ``persistent`` or ``step``.
    ssm_kernel : str
        Device state-space kernel, where an op has a chunked and a step form (its planner module in
        ``launches`` says at which targets): ``auto`` (by sequence length), ``lanes`` (the step recurrence)
        or ``chunked``.
    workers : int or None
        Host threads one thunk may split across (ssm, mamba2, gated_delta_net).
    host_path : str or None
        Host algorithm of the state-space ops: ``step``, ``chunked`` (mamba2, gated_delta_net) or
        ``blocked`` (selective_scan).
    host_chunk : int or None
        Chunk (or block) length of the host's chunked and blocked paths.
    parallel_directions : bool or None
        Host bidirectional recurrences: run both directions at once.
    """

    recompute: str = "segment"
    rnn_kernel: str = "auto"
    ssm_kernel: str = "auto"
    workers: int | None = None
    host_path: str | None = None
    host_chunk: int | None = None
    parallel_directions: bool | None = None

    def __post_init__(self) -> None:
        _choice("recompute", self.recompute, RECOMPUTE)
        _choice("rnn_kernel", self.rnn_kernel, RNN_KERNELS)
        _choice("ssm_kernel", self.ssm_kernel, SSM_KERNELS)
        if self.host_path is not None:
            _choice("host_path", self.host_path, HOST_PATHS)
        for name in ("workers", "host_chunk"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise RlxError(f"run option {name}={value!r}: expected a positive integer or None")
        if self.parallel_directions not in (None, True, False):
            raise RlxError(f"run option parallel_directions={self.parallel_directions!r}: expected True, False or None")

    @classmethod
    def build(cls, config: Any = None, **options: Any) -> "RunOptions":
        """The options of ``config`` (a ``runtime.config.Config``: its ``scan.recompute``) with ``options``
        on top; unknown names are errors."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise RlxError(f"unknown run option(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
        if config is not None:
            options.setdefault("recompute", config.recompute)
        return cls(**options)

    @cached_property
    def host_keywords(self) -> dict[str, Any]:
        """The keywords ``host_fallback.execute`` takes (it hands each kernel the ones it declares)."""
        named = {"recompute": self.recompute, "workers": self.workers, "path": self.host_path,
                 "chunk": self.host_chunk, "parallel_directions": self.parallel_directions}
        return {k: v for k, v in named.items() if v is not None}

    @cached_property
    def planner_keywords(self) -> dict[str, Any]:
        """The keywords of ``launches.plan``."""
        return {"rnn_kernel": self.rnn_kernel, "ssm_kernel": self.ssm_kernel}


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise RlxError(f"run option {name}={value!r} is not one of {', '.join(allowed)}")
