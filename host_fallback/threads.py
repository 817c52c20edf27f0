"""Host kernels on several cores: OpenBLAS thread control and a persistent worker pool.

NumPy releases the GIL inside ufunc loops and BLAS calls, so independent slices of one kernel
(batch items, heads, directions) run on separate cores when each Python thread calls a
single-threaded BLAS. The cores a kernel may take are the thread count OpenBLAS was started with
(``OPENBLAS_NUM_THREADS``): a user who gave NumPy one thread gets one thread here too.

The workers live in a pool that outlives the call: each worker keeps its own ``chunked.scratch``
arrays, and a fresh thread per call would page-fault every multi-megabyte scratch array on first
touch (measured: gated_delta_net B=2 S=1024 took 27 ms in two fresh threads, 15 ms in two pooled
ones, 24 ms in one). A process forked while the pool exists gets a new pool on first use.
"""
from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

import numpy as np

T = TypeVar("T")


class _Blas:
    """The thread count of every OpenBLAS loaded in this process, read and set through ctypes
    (threadpoolctl does the same with more machinery)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._libs: list[tuple[Callable[[], int], Callable[[int], None]]] | None = None

    def reset_lock(self) -> None:
        self._lock = threading.Lock()

    def _find(self) -> list[tuple[Callable[[], int], Callable[[int], None]]]:
        if self._libs is None:
            self._libs = []
            try:
                with open("/proc/self/maps") as maps:
                    paths = sorted({line.split()[-1] for line in maps if "openblas" in line.rsplit("/", 1)[-1]})
            except OSError:
                paths = []
            for path in paths:
                try:
                    lib = ctypes.CDLL(path)
                except OSError:
                    continue
                for prefix in ("scipy_openblas", "openblas"):
                    for suffix in ("64_", "", "_64"):
                        get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                        put = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                        if get is not None and put is not None:
                            get.restype, put.restype = ctypes.c_int, None
                            self._libs.append((get, put))
                            break
                    else:
                        continue
                    break
        return self._libs

    def threads(self) -> list[int]:
        """Thread count of each OpenBLAS found (empty when there is none)."""
        return [get() for get, _ in self._find()]

    @contextmanager
    def single_threaded(self) -> Iterator[None]:
        """Set every OpenBLAS to one thread, process-wide, and restore it after; one caller at a time."""
        with self._lock:
            libs = self._find()
            before = [get() for get, _ in libs]
            for _, put in libs:
                put(1)
            try:
                yield
            finally:
                for (_, put), n in zip(libs, before):
                    put(n)


_blas = _Blas()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def _after_fork() -> None:
    # the parent's pool threads do not exist in a child, and a lock held by one of them stays held
    global _pool, _pool_size, _pool_lock
    _blas.reset_lock()
    _pool, _pool_size, _pool_lock = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def blas_threads() -> int | None:
    """Threads of NumPy's OpenBLAS (the largest count when several are loaded); ``None`` if not found."""
    counts = _blas.threads()
    return max(counts) if counts else None


def single_threaded_blas():
    """A context in which every OpenBLAS runs one thread (as each of ``run_all``'s jobs does), restored after."""
    return _blas.single_threaded()


def cores() -> int:
    """How many threads a kernel may run at once: the OpenBLAS thread count, at most the CPUs this
    process may use; 1 where no OpenBLAS is found (its thread count cannot then be handed over)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(blas_threads() or 1, usable))


def _workers(count: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < count:
            if _pool is not None:
                _pool.shutdown(wait=True)
            _pool, _pool_size = ThreadPoolExecutor(count, thread_name_prefix="host_fallback"), count
        return _pool


def run_all(jobs: list[Callable[[], None]]) -> None:
    """Run ``jobs`` at once, the first on this thread and the rest on pool workers, each with a
    single-threaded BLAS; wait for all, then re-raise the first error any raised."""
    if len(jobs) == 1:
        jobs[0]()
        return
    errors = np.geterr()  # a worker thread starts from NumPy's default error state: it gets the caller's
    with _blas.single_threaded():
        pending: list[Future[None]] = [_workers(len(jobs) - 1).submit(_under(errors, job)) for job in jobs[1:]]
        failed: list[BaseException] = []
        try:
            jobs[0]()
        except BaseException as err:  # re-raised below, after every worker is done with the arena
            failed.append(err)
        for future in pending:
            err = future.exception()
            if err is not None:
                failed.append(err)
    if failed:
        raise failed[0]


def _under(errors: dict[str, str], job: Callable[[], None]) -> Callable[[], None]:
    """``job`` run under the NumPy error state ``errors``."""
    def run() -> None:
        with np.errstate(**errors):
            job()
    return run


def _spans(total: int, parts: int) -> list[slice]:
    """``range(total)`` cut into ``min(parts, total)`` contiguous slices whose sizes differ by at most one."""
    parts = max(1, min(parts, total))
    edges = [total * i // parts for i in range(parts + 1)]
    return [slice(lo, hi) for lo, hi in zip(edges, edges[1:])]


#: Smallest kernel (multiply-adds into the state over the whole sequence, as each kernel counts them)
#: that ``parts_for`` splits across cores: below it the threads mostly trade the GIL. Measured with
#: ``benchmarks/ssm.py --split`` (B=2, 2 cores, one thread / two): gated_delta_net H=8 N=64 at seq 128
#: (8.4M) 2.6 / 3.3 ms, at seq 256 (16.8M) 5.5 / 4.7 ms; mamba2 H=8 P=64 N=64 at seq 256 3.4 / 2.9 ms.
SPLIT_MIN_WORK = 1 << 24


def parts_for(op: str, work: int, batch: int, units: int, forced: int | None) -> int:
    """How many threads a kernel over ``batch x units`` independent recurrences runs on: ``forced``
    if given, else every core (``cores()``) once ``work`` reaches ``SPLIT_MIN_WORK``; never more
    than there are recurrences."""
    if forced is not None and (isinstance(forced, bool) or not isinstance(forced, int) or forced < 1):
        raise ValueError(f"{op}: workers must be a positive int, got {forced!r}")
    wanted = forced if forced is not None else (cores() if work >= SPLIT_MIN_WORK else 1)
    return max(1, min(wanted, batch * units))


def run_split(compute: Callable[[slice, slice], T], store: Callable[[slice, slice, T], None], batch: int,
              units: int, parts: int) -> None:
    """Run ``store(bs, us, compute(bs, us))`` over ``parts`` disjoint blocks of the ``batch x units``
    grid at once (``run_all``), cutting whichever axis leaves the smallest largest block (the batch
    axis on a tie: its blocks are contiguous in memory).

    No block stores before every block has computed, so a ``compute`` that loads its inputs first
    sees them as they were even where a thunk's output overlaps another block's inputs.
    """
    if parts == 1 or batch * units == 0:
        full = (slice(0, batch), slice(0, units))
        store(*full, compute(*full))
        return
    by_batch = -(-batch // min(parts, batch)) * units
    by_unit = batch * -(-units // min(parts, units))
    if by_batch <= by_unit:
        blocks = [(bs, slice(0, units)) for bs in _spans(batch, parts)]
    else:
        blocks = [(slice(0, batch), us) for us in _spans(units, parts)]
    computed = threading.Barrier(len(blocks))

    def block(bs: slice, us: slice) -> None:
        try:
            result = compute(bs, us)
        except BaseException:
            computed.abort()  # the other blocks then store nothing
            raise
        try:
            computed.wait()
        except threading.BrokenBarrierError:
            return  # another block failed; run_all raises its error
        store(bs, us, result)

    run_all([lambda bs=bs, us=us: block(bs, us) for bs, us in blocks])
