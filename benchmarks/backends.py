"""Every op on host (NumPy) and OpenCL: median times and the opencl/host ratio in one table.

    PYTHONPATH=. python benchmarks/backends.py [--quick] [--repeat N] [--device opencl:P:D]

Shapes follow the host benchmarks (benchmarks/rnn.py: batch 32, seq 128, input = hidden = 256,
2 layers, bidirectional); ``--quick`` divides the large extents for a smoke run. Times exclude
compilation (one warm-up launch), planning (each thunk is planned once, as the executor does) and
host<->device transfers: the arena stays on the device, as in the executor. Ratio < 1 means OpenCL is
faster.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import host_fallback
from host_fallback.abi import regions
from host_fallback.arena import STORAGE
from rlx_gpu.conformance import cases
from rlx_gpu.backends import opencl
from rlx_gpu.conformance.devices import find
from rlx_gpu.runtime.options import RunOptions


def recurrent(op: str, b: int, s: int, i: int, h: int) -> dict:
    t = dict(op=op, dtype="f32", batch=b, seq=s, input_size=i, hidden=h, num_layers=2, bidirectional=True, carry=False,
             x=0, w_ih=0, w_hh=0, h0=0, dst=0)
    t.update(dict(b_ih=0, b_hh=0) if op == "gru" else dict(bias=0))
    if op == "lstm":
        t["c0"] = 0
    if op == "rnn":
        t["relu"] = False
    return t


def gdn(b: int, s: int, heads: int, n: int, per_channel: bool, carry: bool) -> dict:
    return dict(op="gated_delta_net", batch=b, seq=s, heads=heads, state_size=n, gate_per_channel=per_channel,
                carry_state=carry, q=0, k=0, v=0, g=0, beta=0, state=0, dst=0)


def shapes(q: int) -> list[tuple[str, dict]]:
    """(label, thunk without offsets); ``q`` divides the large extents."""
    b, s, h = 32 // q, 128 // q, 256 // q
    n = (1 << 20) // q
    return [
        ("lstm", recurrent("lstm", b, s, h, h)),
        ("gru", recurrent("gru", b, s, h, h)),
        ("rnn", recurrent("rnn", b, s, h, h)),
        ("selective_scan", dict(op="selective_scan", batch=2, seq=1024 // q, hidden=256, state_size=16, x=0, delta=0, a=0, b=0, c=0, dst=0)),
        ("mamba2", dict(op="mamba2", batch=2, seq=1024 // q, heads=8, head_dim=64, state_size=64, x=0, dt=0, a=0, b=0, c=0, dst=0)),
        ("gdn prefill", gdn(2, 1024 // q, 8, 64, per_channel=False, carry=False)),
        ("gdn prefill per-ch", gdn(2, 1024 // q, 8, 64, per_channel=True, carry=False)),
        ("gdn decode", gdn(8, 1, 8, 64, per_channel=False, carry=True)),
        ("matmul", dict(op="matmul", batch=1, m=512 // q, k=512 // q, n=512 // q, trans_a=False, trans_b=False,
                        a_batch_stride=0, b_batch_stride=0, a=0, b=0, dst=0)),
        ("unary tanh", dict(op="unary", fn="tanh", n=n, x=0, dst=0)),
        ("binary mul bcast", dict(op="binary", fn="mul", shape=[1024 // q, 1024], a_strides=[1024, 1], b_strides=[0, 1], a=0, b=0, dst=0)),
        ("reduce_sum", dict(op="reduce_sum", outer=64, r=256 // q, inner=512, x=0, dst=0)),
        ("copy", dict(op="copy", nbytes=4 * n, src=0, dst=0)),
        ("fill", dict(op="fill", n=n, value=0.5, dst=0)),
        ("cast f32->bf16", dict(op="cast", n=n, src_dtype="f32", src=0, dst=0)),
    ]


def lay_out(t: dict, rng: np.random.Generator) -> tuple[dict, np.ndarray]:
    fields = dict(t)
    ints = cases.int_values(fields)  # cu_seqlens, ...: given as their values
    t, arena_bytes = cases.lay_out(fields.pop("op"), "f32", fields)
    arena = np.zeros(arena_bytes, np.uint8)
    for r in regions(t):
        off = r.offset
        if r.dtype == "i32":
            arena[off: off + r.nbytes] = np.asarray(ints[r.field], STORAGE["i32"]).view(np.uint8)
        elif r.reads and r.dtype != "u8":
            vals = rng.standard_normal(r.shape) * 0.3
            if t["op"] in ("selective_scan", "mamba2") and r.field in ("delta", "dt"):
                vals = np.abs(vals)
            if r.field in ("a", "g") and t["op"] in ("selective_scan", "mamba2", "gated_delta_net"):
                vals = -np.abs(vals)
            arena[off: off + r.nbytes] = vals.astype(STORAGE[r.dtype]).reshape(-1).view(np.uint8)
    return t, arena


def with_device_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` with the options the OpenCL benchmarks share: ``--repeat`` (timed runs) and ``--device`` (a
    spec)."""
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default=None)
    return parser


def open_opencl(spec: str | None):
    """``(device info, OpenCL session)`` of ``spec``; a spec that names no device lists the ones there are."""
    info = find(spec or "opencl")
    return info, opencl.open(info)


def warm_launcher(session, t: dict, arena: np.ndarray, **options):
    """A function that launches thunk ``t`` once on a copy of ``arena`` on ``session`` and waits; compiled
    and warmed up before it is returned."""
    dev = session.alloc(arena.size)
    session.write(dev, 0, arena)

    def run():
        session.launch(t, dev, **options)
        session.finish()
    run()
    return run


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    parser = with_device_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    info, session = open_opencl(args.device)
    options = RunOptions.build()
    rng = np.random.default_rng(0)
    print(f"device: {info.name} ({info.spec}); medians of {args.repeat}; f32")
    print(f"{'op':<18} {'shape':<44} {'host ms':>9} {'opencl ms':>10} {'ocl/host':>9}")
    for label, template in shapes(4 if args.quick else 1):
        t, arena = lay_out(template, rng)
        host_arena = arena.copy()
        host = median_time(lambda: host_fallback.execute(t, host_arena), args.repeat)
        dev_arena = session.alloc(arena.size)
        session.write(dev_arena, 0, arena)
        run = session.runner(t, options)  # planned and bound once, as the executor does

        def on_device():
            run(dev_arena)
            session.finish()

        on_device()  # compile and warm up
        dev = median_time(on_device, args.repeat)
        shown = ("batch", "seq", "hidden", "state_size", "heads", "head_dim", "m", "n", "r", "nbytes")
        shown += ("k",) if template["op"] == "matmul" else ()  # elsewhere k is an offset field
        shape = ",".join(f"{k}={v}" for k, v in template.items() if k in shown)
        shape = shape.replace("batch=", "B=").replace("seq=", "S=").replace("hidden=", "H=").replace(
            "state_size=", "N=").replace("heads=", "H=").replace("head_dim=", "P=")
        print(f"{label:<18} {shape[:44]:<44} {host * 1e3:>9.2f} {dev * 1e3:>10.2f} {dev / host:>9.2f}")


if __name__ == "__main__":
    main()
