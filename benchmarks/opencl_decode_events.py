"""Where a batch-1 decode step through rlx_gpu.torch goes on an OpenCL device, by the launch's profiling events:
the step's Python before its launch, the enqueue call, the launch's wait from queued to running (on PoCL's
threaded driver: a worker thread woken), the kernel itself, the wait's return after the kernel's end, and the
Python after it, beside torch's own step.

    python benchmarks/opencl_decode_events.py [--opencl opencl:1:0] [--steps 600] [--warmup 20] [--quick]

Cases: the three state-space decode steps of ``benchmarks/torch_decode.py`` (f32, batch 1, the state carried),
each a call of one launch. The device's queue is made with profiling on and the primitives' ``enqueue`` and
``finish`` are wrapped to stamp their calls (``time.perf_counter_ns``); PoCL's event times have a clock of their
own, so a step's offset is taken as its event's queued time less the enqueue call's start (the queued stamp is
taken within the call: the columns after the kernel may be late by up to the call's first microseconds).
Medians in µs of ``--steps`` steps after ``--warmup``; torch's step is the median of the same count, taken after
the device's. The columns sum to about the step (medians of parts, not of the whole). Needs torch, pyopencl
and this repository.
"""
from __future__ import annotations

import os

for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):  # before NumPy and torch start their pools
    os.environ[_variable] = "1"

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]

import torch  # noqa: E402

# benchmarks/torch_decode.py: the cases, the device switch and the choice of an OpenCL device
from torch_decode import cases, opencl_device, rlx_device  # noqa: E402
from rnn import cpu_line  # noqa: E402

from rlx_gpu.backends import opencl  # noqa: E402

COLUMNS = ("before", "enqueue", "queued→start", "kernel", "end→seen", "after", "step", "torch")


class Stamps:
    """Wraps ``OpenCLPrimitives`` (a profiling queue; ``enqueue`` and ``finish`` stamped) while it is used."""

    def __init__(self):
        self.marks: dict[str, object] = {}
        prims = opencl.OpenCLPrimitives
        self.saved = {name: getattr(prims, name) for name in ("__init__", "enqueue", "finish")}
        marks, saved = self.marks, self.saved

        def init(prim, *args, **kwargs):
            saved["__init__"](prim, *args, **kwargs)
            prim.queue = prim.cl.CommandQueue(prim.context, properties=prim.cl.command_queue_properties.PROFILING_ENABLE)

        def enqueue(prim, kernel, launch, args):
            marks["enqueue0"] = time.perf_counter_ns()
            saved["enqueue"](prim, kernel, launch, args)
            marks["enqueue1"], marks["event"] = time.perf_counter_ns(), prim._unfinished
            marks["launches"] = marks.get("launches", 0) + 1

        def finish(prim):
            pending = prim._unfinished is not None
            saved["finish"](prim)
            if pending:
                marks["seen"] = time.perf_counter_ns()

        prims.__init__, prims.enqueue, prims.finish = init, enqueue, finish

    def restore(self) -> None:
        for name, value in self.saved.items():
            setattr(opencl.OpenCLPrimitives, name, value)

    def step(self, call) -> dict[str, float] | None:
        """One call of ``call``, split into the columns (µs); None unless it was one launch and its wait."""
        self.marks.clear()
        start = time.perf_counter_ns()
        call()
        end = time.perf_counter_ns()
        m = self.marks
        if m.get("launches") != 1 or "seen" not in m:
            return None
        p = m["event"].profile
        offset = p.queued - m["enqueue0"]
        parts = dict(before=m["enqueue0"] - start, enqueue=m["enqueue1"] - m["enqueue0"],
                     kernel=p.end - p.start, after=end - m["seen"], step=end - start)
        parts["queued→start"] = p.start - p.queued
        parts["end→seen"] = m["seen"] - (p.end - offset)
        return {k: v / 1e3 for k, v in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--opencl", default=None, help="the OpenCL device spec (default: the first usable one that "
                                                       "is not a simulator)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per case (default 600; --quick 20)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 20; --quick 2)")
    parser.add_argument("--quick", action="store_true", help="fewer steps: a check that everything runs")
    args = parser.parse_args()
    steps = args.steps or (20 if args.quick else 600)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 20)
    spec, name = opencl_device(args.opencl)
    if spec is None:
        raise SystemExit(f"no OpenCL device: {name}")
    torch.set_num_threads(1)
    print(cpu_line())
    print(f"opencl = {spec} {name}; load average {os.getloadavg()[0]:.1f}; median µs of {steps} steps")
    print("| case | " + " | ".join(COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    stamps = Stamps()
    try:
        with torch.no_grad():
            for case in cases()[:3]:  # the state-space steps: one launch a call
                ours, theirs = case.make(True), case.make(False)
                rows = []
                with rlx_device(spec):
                    for i in range(warmup):
                        ours.step(i)
                    for i in range(steps):
                        row = stamps.step(lambda: ours.step(i))
                        if row is None:
                            raise SystemExit(f"{case.name}: a step on {spec} was not one launch and one wait")
                        rows.append(row)
                own = []
                for i in range(warmup + steps):
                    start = time.perf_counter_ns()
                    theirs.step(i)
                    own.append((time.perf_counter_ns() - start) / 1e3)
                medians = {c: statistics.median(r[c] for r in rows) for c in COLUMNS[:-1]}
                medians["torch"] = statistics.median(own[warmup:])
                print(f"| {case.name} | " + " | ".join(f"{medians[c]:.1f}" for c in COLUMNS) + " |")
    finally:
        stamps.restore()


if __name__ == "__main__":
    main()
