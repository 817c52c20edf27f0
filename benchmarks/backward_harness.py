"""What the host backward benchmarks (gdn_backward, mamba2_backward, selective_scan_backward, rnn_backward,
backward_memory) share: their command line, the BLAS's threads, the peak memory one call allocates, and a
table's column heads."""
from __future__ import annotations

import argparse
import os
import sys
import tracemalloc


def with_backward_arguments(parser: argparse.ArgumentParser, runs: int) -> argparse.ArgumentParser:
    """``parser`` with the options every host backward benchmark takes: ``--runs`` (medians of that many runs,
    ``runs`` by default), ``--seq`` (the timed length) and ``--memory-seq`` (the length memory is traced at)."""
    parser.add_argument("--runs", type=int, default=runs)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--memory-seq", type=int, default=4096)
    return parser


def blas_threads(threads: int) -> None:
    """Run this script again with ``OPENBLAS_NUM_THREADS=threads`` unless it is set so already: the BLAS reads it
    once, when NumPy loads."""
    if os.environ.get("OPENBLAS_NUM_THREADS") != str(threads):
        os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
        os.execv(sys.executable, [sys.executable, *sys.argv])


def peak_bytes(fn) -> int:
    """The most bytes ``fn`` held allocated at once beyond what was allocated when it started (tracemalloc,
    which sees every NumPy buffer)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def print_head(head: str) -> None:
    """A table's column heads and a rule under them."""
    print(head)
    print("-" * len(head))
