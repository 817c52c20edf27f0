"""A training step of configs/examples/train_lstm_lm.py's models on the host: rlx_gpu.torch against plain
torch (torch.nn.LSTM; the gated delta rule written in torch ops, as fla's naive reference).

    python benchmarks/torch_training.py [--models lstm gdn] [--steps 20] [--runs 3] [--torch-threads N] [--batch 8]
                                        [--cpu-time]

One step is the whole of the example's step: embedding, the recurrent layer (or block), the read-out,
the cross-entropy, ``backward()`` and Adam's update; only the recurrent layer (the rule) differs
between the two runs (rlx_gpu's forward thunk, which writes its saved forward, then its backward thunk,
which reads it).
Each side first takes two steps (compiling, warming torch's kernels), then the median over ``--runs``
of ``--steps`` steps, taking turns; the ratio is the median of the runs' own ratios (paired).
``--cpu-time`` times the process's CPU time instead of wall time (a loaded machine's waits for a core
are not counted). The load average is printed beside the table, since neighbours on the machine slow
both sides (torch's threads most of all).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("train_lstm_lm", ROOT / "configs" / "examples" / "train_lstm_lm.py")
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


def step_times(models: dict[str, torch.nn.Module], data: list, runs: int, clock=time.perf_counter
               ) -> tuple[dict[str, float], float]:
    """The median seconds per training step of each model, after two warm-up steps, taking turns, and the
    median of each run's own ratio (the second model's time over the first's: paired, so that a neighbour's
    load slows both sides of a run)."""
    for model in models.values():
        example.train(model, data[:2])
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(runs):
        for name, model in models.items():
            start = clock()
            example.train(model, data)
            times[name].append((clock() - start) / len(data))
    reference, ours = times.values()
    return {name: statistics.median(t) for name, t in times.items()}, statistics.median(
        b / a for a, b in zip(reference, ours))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(example.MODELS), choices=list(example.MODELS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=example.BATCH)
    parser.add_argument("--torch-threads", type=int, default=None, help="default: torch's own choice")
    parser.add_argument("--cpu-time", action="store_true", help="CPU time instead of wall time (a loaded machine)")
    args = parser.parse_args()
    os.environ.setdefault("RLX_DEVICE", "host")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    data = example.batches(args.steps, batch=args.batch)
    print(f"load average {os.getloadavg()[0]:.1f}; torch threads {torch.get_num_threads()}; "
          f"batch {args.batch}, window {example.WINDOW}")
    for kind in args.models:
        step, ratio = step_times(example.models(kind), data, args.runs,
                                 time.process_time if args.cpu_time else time.perf_counter)
        print(example.TITLES[kind])
        for name, seconds in step.items():
            print(f"{name:>38}: {seconds * 1e3:7.1f} ms per training step")
        print(f"{'ratio':>38}: {ratio:7.2f}x, median of the runs' own (target <= 1.5x for the lstm)")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
