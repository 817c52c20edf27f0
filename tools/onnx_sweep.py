"""Every attribute combination of ONNX's LSTM, GRU and RNN, imported by rlx_gpu.onnx, against onnxruntime.

    python tools/onnx_sweep.py [--device host|opencl|...] [--target cpu|gpu] [--ops LSTM,GRU,RNN] [--seeds 1]

The tests run a covering sample of these combinations (``tests/support/onnx_cases.py``'s ``sample``); this
runs the whole product (``COMBINATIONS``: direction, layout, clip, activations, sequence_lens,
initial states, bias, and input_forget/peepholes or linear_before_reset), each with ``--seeds``
seeded models, plus ONNX's own node tests, and prints one line per failing case and a count per op.
A case passes when every output is within the conformance suite's f32 bound of onnxruntime's (the
final state of a length-0 row being its initial state, ABI.md §8).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from support.onnx_cases import (COMBINATIONS, abi_final_states, combinations, node_tests, recurrent_case,  # noqa: E402
                                run_imported, run_onnxruntime)
from rlx_gpu.conformance.compare import nmse  # noqa: E402

F32_BOUND = 1e-7


def check(model, feeds, device: str) -> str | None:
    """None when the import matches onnxruntime, else why not."""
    try:
        got = run_imported(model, feeds, device)
    except Exception as err:  # the sweep reports every failure and goes on
        return f"{type(err).__name__}: {str(err)[:300]}"
    want = abi_final_states(model, feeds, run_onnxruntime(model, feeds))
    errs = {n: nmse(got[n], w) for n, w in want.items()}
    bad = {n: e for n, e in errs.items() if not e <= F32_BOUND}
    return f"nmse {bad}" if bad else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="host")
    ap.add_argument("--target", choices=("cpu", "gpu"), help="force the kernel shapes of a device backend")
    ap.add_argument("--ops", default=",".join(COMBINATIONS))
    ap.add_argument("--seeds", type=int, default=1, help="seeded models per combination")
    args = ap.parse_args()
    if args.target:
        os.environ["RLX_TARGET"] = args.target
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for name, model, inputs, _ in node_tests():
        why = check(model, inputs, args.device)
        counts["node tests"]["passed" if why is None else "failed"] += 1
        if why:
            print(f"FAIL node test {name}: {why}")
    for op in args.ops.split(","):
        for i, combo in enumerate(combinations(op)):
            for seed in range(args.seeds):
                model, feeds = recurrent_case(op, combo, seed=i * args.seeds + seed)
                why = check(model, feeds, args.device)
                counts[op]["passed" if why is None else "failed"] += 1
                if why:
                    print(f"FAIL {op} {combo} seed {i * args.seeds + seed}: {why}")
    for what, c in counts.items():
        print(f"{what}: {c['passed']} passed, {c['failed']} failed")
    return 0 if all(not c["failed"] for c in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
