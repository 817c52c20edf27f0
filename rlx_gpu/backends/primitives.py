"""What a device backend implements: the :class:`Primitives` protocol (memory, program build, kernel
launch and the device's limits in the backend's own API), and the :class:`DeviceArena` the core keeps
its buffers in. ``core.KernelSession`` builds everything else on these."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Protocol

import numpy as np

from ..launches import DeviceLimits, Launch
from .base import DeviceInfo
from .programs import Program


class Primitives(Protocol):
    """What a device backend implements; ``core.KernelSession`` builds everything else on these.

    Buffers are whatever :meth:`allocate` returns; the core never looks inside one. Every call
    is made with the session's lock held, so a backend needs no locking of its own. Device-to-device
    copies and sums run the portable body kernels (``launches.body.copy_launch``), so there is no
    copy primitive.

    Attributes
    ----------
    info : DeviceInfo
        The probed device this opens.
    dialect : str
        The program dialect: the name of the backend module whose ``PRELUDE`` it uses (``"opencl"``, ``"cuda"``).
    device_key : Hashable
        Identity of the compile target (an OpenCL context, a CUDA device): the program cache key.
    build_options : tuple of str
        Compiler options; part of the program cache key.
    limits : DeviceLimits
        What launch geometry must respect.
    max_alloc_bytes : int
        The largest single buffer :meth:`allocate` may be asked for.
    global_mem_bytes : int
        The device's memory; an arena plus its scratch must fit.
    fp64_feature : str
        What the device must report for f64 (``"cl_khr_fp64"``), named when it does not.
    shared : bool
        Buffers are memory the host writes and reads in place (fine-grained SVM on a CPU device): a
        :meth:`write` or :meth:`read` is a host copy, not a command, and waits for the launches before it.
    """

    info: DeviceInfo
    dialect: str
    device_key: Hashable
    build_options: tuple[str, ...]
    limits: DeviceLimits
    max_alloc_bytes: int
    global_mem_bytes: int
    fp64_feature: str
    shared: bool

    def allocate(self, nbytes: int) -> Any:
        """An uninitialised device buffer.

        Parameters
        ----------
        nbytes : int
            At least 1 and at most ``max_alloc_bytes`` (the core checks both).
        """

    def release(self, buffer: Any) -> None:
        """Free a buffer from :meth:`allocate`; it is not used again."""

    def write(self, buffer: Any, offset: int, data: np.ndarray) -> None:
        """Copy host bytes into ``buffer`` at byte ``offset``; done when the call returns.

        Parameters
        ----------
        data : numpy.ndarray
            Contiguous, 1-D ``uint8``, non-empty, within the buffer.
        """

    def read(self, buffer: Any, offset: int, out: np.ndarray) -> None:
        """Fill ``out`` (contiguous 1-D ``uint8``, non-empty) from ``buffer`` at ``offset``, after every
        launch enqueued before; done when the call returns."""

    def zero(self, buffer: Any, offset: int, nbytes: int) -> None:
        """Set ``nbytes`` (> 0) at ``offset`` to zero, ordered after the launches enqueued before."""

    def build_program(self, program: Program) -> Any:
        """Compile ``program.source`` with ``build_options``; raise ``KernelBuildError`` with the log."""

    def get_kernel(self, built: Any, name: str) -> Any:
        """The kernel called ``name`` in a program from :meth:`build_program`."""

    def enqueue(self, kernel: Any, launch: Launch, args: tuple[Any, ...]) -> None:
        """Launch ``kernel`` over ``launch.global_size`` work-items in groups of ``launch.local_size``.

        Parameters
        ----------
        args : tuple
            ``launch.args`` with every ``Buf`` replaced by a buffer from :meth:`allocate`; the other
            entries are NumPy scalars (``int64``, ``int32``, ``float32``, ``float64``). Launches run
            in the order they are enqueued. A tuple is never changed: given the same tuple object
            again, a backend may take the arguments as set already.
        """

    def finish(self) -> None:
        """Wait until every enqueued launch and copy has completed."""

    def host_view(self, buffer: Any) -> np.ndarray:
        """Where ``shared``: the bytes of ``buffer`` as the host reads and writes them (``numpy.uint8``), valid
        between a :meth:`finish` and the next launch; elsewhere ``NotImplementedError``."""


@dataclass(eq=False)
class DeviceArena:
    """``nbytes`` of device memory in one buffer (at least 1 byte: some APIs refuse empty buffers).

    ``pending`` is a host image not uploaded yet (see ``core.ScanMemory``); ``image`` the host copy
    that body thunks placed on the host run on (``runtime.fallback.HostRun``). A ``resident`` arena
    (``runtime.arena.Arena``) lives between runs, so ``kept`` holds, per bound launch plan, the scratch
    whose staged part (``LaunchPlan.staging``) stays valid until a write overlaps what it was staged from.
    ``args`` holds the argument tuples of the launches run on it (``KernelSession.enqueue_bound``).
    """

    buffer: Any
    nbytes: int
    pending: np.ndarray | None = None
    image: np.ndarray | None = None
    resident: bool = False
    kept: dict[Any, Any] = field(default_factory=dict)
    args: dict[int, Any] = field(default_factory=dict)
