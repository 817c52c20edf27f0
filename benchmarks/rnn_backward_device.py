"""lstm / gru / rnn backward thunks on PoCL at both kernel targets beside the host (host_fallback).

    python benchmarks/rnn_backward_device.py [--ops lstm gru rnn] [--shapes small target] [--runs 3]

Shapes: ``target`` is the training shape: batch 32, seq 128, input = hidden = 256, 2 layers, bidirectional, f32;
``small`` is batch 8, seq 32, input = hidden = 64, one bidirectional layer. Each time is the median of
``--runs`` runs of the backward thunk alone (which recomputes its forward) after one untimed run that builds the
programs (the conformance runner's ``time_case``, on its standard-normal inputs: at hidden 256 the tanh rnn's
gradient overflows to Inf and NaN through W_hh, the same on every side); the load average is printed beside the table, since
neighbours on the machine slow every column.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rlx_gpu.conformance import runner  # noqa: E402
from rlx_gpu.conformance.catalog import Case  # noqa: E402
from rlx_gpu.conformance.devices import find, open_device  # noqa: E402
from rlx_gpu.launches.limits import TARGETS  # noqa: E402
from rlx_gpu.runtime.registry import open_session, status  # noqa: E402

SHAPES = {
    "small": dict(batch=8, seq=32, input_size=64, hidden=64, num_layers=1, bidirectional=True, carry=True),
    "target": dict(batch=32, seq=128, input_size=256, hidden=256, num_layers=2, bidirectional=True, carry=False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", nargs="+", default=["lstm", "gru", "rnn"], choices=["lstm", "gru", "rnn"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    pocl = [i for i in status("opencl").devices if i.details.get("platform") == "Portable Computing Language"]
    if not pocl:
        raise SystemExit(f"no PoCL device: {status('opencl').reason}")
    sessions = {target: open_device(find(pocl[0].spec), target) for target in TARGETS}
    host_session = open_session(status("host").devices[0])
    print(f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'shape':<7} {'op':<5} {'host':>9} " + " ".join(f"{'PoCL ' + t:>10}" for t in TARGETS)
          + " " + " ".join(f"{t + ' / host':>11}" for t in TARGETS))
    for shape in args.shapes:
        for op in args.ops:
            params = dict(SHAPES[shape], **({"relu": False} if op == "rnn" else {}))
            case = Case(f"{op}_backward", "f32", params)
            with warnings.catch_warnings():  # the rnn's gradient overflows at hidden 256 (see the docstring), on
                warnings.simplefilter("ignore", RuntimeWarning)  # the host's worker threads too
                host = runner.time_case(host_session, case, args.runs)
            device = {target: runner.time_case(session, case, args.runs) for target, session in sessions.items()}
            print(f"{shape:<7} {op:<5} {host * 1e3:>7.0f}ms " + " ".join(f"{device[t] * 1e3:>8.0f}ms" for t in TARGETS)
                  + " " + " ".join(f"{device[t] / host:>11.2f}" for t in TARGETS), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
