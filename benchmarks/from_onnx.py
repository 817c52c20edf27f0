"""ONNX models of torch.nn.LSTM / GRU / RNN: imported by rlx_gpu.onnx and run on the host, against onnxruntime.

    python benchmarks/from_onnx.py [--seq 128] [--runs 5] [--warmup 1] [--rounds 3] [--ops lstm,gru,rnn]

Default shape: batch 32, seq 128, input = hidden = 256, 2 layers, bidirectional, f32 (prefill). Each
module is exported with ``torch.onnx.export``; the one model runs in onnxruntime's CPU provider (as
many intra-op threads as NumPy's OpenBLAS has) and, imported, on rlx_gpu's host device (a ``CallPlan``, as ``Executable.run`` uses: the input copied into
its resident arena, the schedule run, the outputs copied out), torch itself
beside them. The table shows medians of ``--rounds`` x ``--runs`` timed calls, the sides taking turns
(``benchmarks/rnn.py``'s ``alternate_ms``), the ratios, and the largest difference from onnxruntime.
Needs torch, onnx and onnxruntime (the test extra).
"""
from __future__ import annotations

import argparse
import io
import os
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.rnn import alternate_ms, cpu_ticks, warn_if_shared  # noqa: E402
from host_fallback.threads import blas_threads  # noqa: E402
import rlx_gpu  # noqa: E402
import rlx_gpu.onnx  # noqa: E402

MODULES = {"lstm": "LSTM", "gru": "GRU", "rnn": "RNN"}
BATCH, SIZE, LAYERS = 32, 256, 2  # the prefill target's shape (bidirectional, input = hidden = SIZE)


def export(torch, op: str, seq: int) -> tuple[object, bytes, np.ndarray]:
    """The torch module, its ONNX model and a seeded time-major input."""
    torch.manual_seed(0)
    module = getattr(torch.nn, MODULES[op])(SIZE, SIZE, num_layers=LAYERS, bidirectional=True).eval()
    x = torch.randn(seq, BATCH, SIZE)
    stream = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names = ["y", "h_n", "c_n"][:3 if op == "lstm" else 2]
        torch.onnx.export(module, (x,), stream, dynamo=False, input_names=["x"], output_names=names)
    return module, stream.getvalue(), x.numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=128, help="sequence length (batch 32, input = hidden = 256, "
                    "2 layers, bidirectional: the prefill target's shape)")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per round and side")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs before each round's timed ones")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, the sides taking turns")
    ap.add_argument("--ops", default="lstm,gru,rnn")
    args = ap.parse_args()

    import onnxruntime
    import torch

    threads = blas_threads() or os.cpu_count() or 1
    torch.set_num_threads(threads)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    device = rlx_gpu.get_device("host")
    print(f"B={BATCH} S={args.seq} I=H={SIZE} layers={LAYERS} bidirectional f32; "
          f"{threads} threads (torch, onnxruntime, OpenBLAS); onnxruntime {onnxruntime.__version__}")
    rows = []
    start, t0 = cpu_ticks(), time.perf_counter()
    for op in args.ops.split(","):
        module, model, x = export(torch, op, args.seq)
        session = onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        schedule = rlx_gpu.onnx.load(model)
        plan = rlx_gpu.CallPlan(schedule, device)
        xt = torch.from_numpy(x)

        def imported():
            return plan({"x": x})

        def with_torch():
            with torch.no_grad():
                return module(xt)

        torch_ms, ort_ms, rlx_ms = alternate_ms(
            [with_torch, lambda: session.run(names, {"x": x}), imported], args.runs, args.warmup, args.rounds)
        want = dict(zip(names, session.run(names, {"x": x})))
        got = imported()
        diff = max(float(np.max(np.abs(got[n].astype(np.float64) - want[n]))) for n in names)
        rows.append((op, torch_ms, ort_ms, rlx_ms, diff))
    warn_if_shared(start, t0)
    print(f"{'op':<6}{'torch ms':>10}{'ort ms':>10}{'rlx ms':>10}{'rlx/ort':>9}{'rlx/torch':>11}{'max|rlx-ort|':>14}")
    for op, torch_ms, ort_ms, rlx_ms, diff in rows:
        print(f"{op:<6}{torch_ms:>10.1f}{ort_ms:>10.1f}{rlx_ms:>10.1f}{rlx_ms / ort_ms:>8.2f}x"
              f"{rlx_ms / torch_ms:>10.2f}x{diff:>14.2e}")


if __name__ == "__main__":
    main()
