"""The benchmark section of tools/gpu_check.py: event-timed medians at the GPU shapes
(``rlx_gpu.conformance.cases.GPU_SHAPES``).

Ours runs through the CUDA session on a resident arena (inputs written once, the runner planned once);
the anchors are ``torch.nn.LSTM`` / ``GRU`` (cuDNN) and the torch chunked twins of ``benchmarks/ssm.py``
on the same GPU; the byte floor is the thunk's footprint (bytes read + written once) over the copy
bandwidth measured by the ceilings section. Targets: lstm/gru <= 1.5x cuDNN; selective_scan,
mamba2, gated_delta_net <= 0.5x the twin and <= 3x the floor; gdn decode <= 3x the floor; scan <= 10 us
per step with graphs.
"""
from __future__ import annotations

import statistics
from typing import Any, Callable

import numpy as np

RUNS = 5


def cuda_session() -> Any:
    """The session of the first CUDA device; raises RuntimeError with the reason when there is none."""
    from rlx_gpu.runtime.registry import open_session, status

    st = status("cuda")
    if not st.available:
        raise RuntimeError(f"the cuda backend is unavailable: {st.reason}")
    return open_session(st.devices[0])


def events_ms(stream: Any, fn: Callable[[], Any], runs: int = RUNS, warmup: int = 2) -> float:
    """Median of ``runs`` CUDA-event-timed calls of ``fn`` on ``stream`` after ``warmup`` untimed ones."""
    import cupy as cp

    for _ in range(warmup):
        fn()
    spent = []
    for _ in range(runs):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        spent.append(cp.cuda.get_elapsed_time(start, end))
    return statistics.median(spent)


def torch_ms(fn: Callable[[], Any], runs: int = RUNS, warmup: int = 2) -> float:
    import torch

    for _ in range(warmup):
        fn()
    spent = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        spent.append(start.elapsed_time(end))
    return statistics.median(spent)


def shapes() -> list[tuple[str, dict]]:
    from backends import gdn, recurrent

    def one_layer(op: str) -> dict:
        return dict(recurrent(op, 64, 512, 1024, 1024), num_layers=1, bidirectional=False)

    return [
        ("lstm B64 S512 I=H=1024", one_layer("lstm")),
        ("gru B64 S512 I=H=1024", one_layer("gru")),
        ("selective_scan B8 S4096 D4096 N16", dict(op="selective_scan", batch=8, seq=4096, hidden=4096, state_size=16,
                                                  x=0, delta=0, a=0, b=0, c=0, dst=0)),
        ("mamba2 B8 S4096 H32 P64 N128", dict(op="mamba2", batch=8, seq=4096, heads=32, head_dim=64, state_size=128,
                                             x=0, dt=0, a=0, b=0, c=0, dst=0)),
        ("gdn B4 S8192 H16 N128", gdn(4, 8192, 16, 128, per_channel=False, carry=False)),
        ("gdn decode B64 S1 H16 N128", gdn(64, 1, 16, 128, per_channel=False, carry=True)),
    ]


def _fields(t: dict, arena: np.ndarray) -> dict[str, np.ndarray]:
    from host_fallback.abi import regions
    from host_fallback.arena import STORAGE

    return {r.field: arena[r.offset: r.offset + r.nbytes].view(STORAGE[r.dtype]).reshape(r.shape) for r in regions(t)}


def footprint_bytes(t: dict) -> int:
    """Bytes a thunk must move at least: each tensor it reads, read once; each it writes, written once."""
    from host_fallback.abi import regions

    return sum(r.nbytes * (int(r.reads) + int(r.writes)) for r in regions(t))


def _anchor(t: dict, fields: dict[str, np.ndarray]) -> tuple[str, Callable[[], Any] | None]:
    """(name, a no-argument callable on CUDA) for the op's anchor, or None where there is none."""
    import torch
    from ssm import TORCH

    op = t["op"]
    # like against like: ours computes f32 in f32, so cuDNN and cuBLAS may not round inputs to TF32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if op in ("lstm", "gru"):
        cls = torch.nn.LSTM if op == "lstm" else torch.nn.GRU
        net = cls(t["input_size"], t["hidden"], batch_first=True).cuda()
        x = torch.from_numpy(np.ascontiguousarray(fields["x"])).cuda()

        def cudnn():
            with torch.no_grad():
                return net(x)
        return "cuDNN", cudnn
    if op in TORCH and t["seq"] > 1:
        fn, names = TORCH[op]
        args = [torch.from_numpy(np.ascontiguousarray(fields[f], np.float32)).cuda() for f in names]

        def twin():
            with torch.no_grad():
                return fn(*args)
        return "torch twin", twin
    return "", None


TARGETS = {"lstm": ("anchor", 1.5), "gru": ("anchor", 1.5), "selective_scan": ("both", 0.5),
           "mamba2": ("both", 0.5), "gated_delta_net": ("both", 0.5)}


def benchmarks(ck: Any, shared: dict) -> None:
    import cupy as cp
    from backends import lay_out

    from rlx_gpu.runtime.options import RunOptions

    session = cuda_session()
    stream = session.prims.stream
    bandwidth = float(shared.get("bandwidth", 0.0))
    rng = np.random.default_rng(0)
    table = ["| op | ours ms | anchor | anchor ms | ours/anchor | floor ms | ours/floor | target |",
             "|---|---|---|---|---|---|---|---|"]
    for label, template in shapes():
        if ck.left() < 40:
            ck.add("bench", label, "fail", "not run: time budget spent")
            continue
        t, host = lay_out(template, rng)
        fields = _fields(t, host)
        if t["op"] == "gated_delta_net":  # unit keys keep the delta rule stable (as in the conformance samples)
            fields["k"][...] = fields["k"] / np.linalg.norm(fields["k"].astype(np.float64), axis=-1, keepdims=True)
        arena = session.alloc(host.size)
        session.write(arena, 0, host)
        run = session.runner(t, RunOptions())
        ours = events_ms(stream, lambda: run(arena), RUNS)
        floor = footprint_bytes(t) / bandwidth * 1e3 if bandwidth else float("nan")
        name, anchor = _anchor(t, fields)
        theirs = torch_ms(anchor) if anchor else float("nan")
        session.free(arena)
        kind, bound = TARGETS.get(t["op"], ("floor", None))
        if t["seq"] == 1:
            kind, bound = "floor", 3.0
        met = []
        if kind in ("anchor", "both") and anchor:
            met.append(ours <= bound * theirs)
        if kind in ("floor", "both") and bandwidth:
            met.append(ours <= 3.0 * floor)
        target = f"<= {bound}x {name}" if kind == "anchor" else f"<= {bound}x twin, <= 3x floor" if kind == "both" \
            else "<= 3x floor"
        table.append(f"| {label} | {ours:.3f} | {name or '-'} | {theirs:.3f} | {ours / theirs:.2f} | {floor:.3f} | "
                     f"{ours / floor:.2f} | {target}: {'met' if all(met) else 'missed'} |")
        ck.write("bench.md", "\n".join(table) + "\n")
        ck.add("bench", label, "ok" if all(met) else "miss", f"ours {ours:.3f} ms, {name or 'no anchor'} {theirs:.3f} ms, "
               f"floor {floor:.3f} ms")
        del host, fields
    scan_per_step(ck, session, stream, table)
    cp.get_default_memory_pool().free_all_blocks()


def scan_per_step(ck: Any, session: Any, stream: Any, table: list[str]) -> None:
    """A scan of 2048 steps over the conformance body (carry + x, 1024 f32): time per step with each
    step's body replayed as a CUDA graph, and with graphs off (what a replay saves per step)."""
    from rlx_gpu.conformance import cases as samples
    from rlx_gpu.runtime.options import RunOptions

    length = 2048
    fields = samples.scan_case("scan", "f32", length=length, carry_n=1024)
    t, nbytes = samples.lay_out("scan", "f32", fields)
    per_step_us = {}
    for graphs in (True, False):
        if ck.left() < 40:
            ck.add("bench", f"scan per step, graphs {'on' if graphs else 'off'}", "fail", "not run: time budget spent")
            continue
        session.use_graphs = graphs
        arena = session.alloc(nbytes)
        try:
            run = session.runner(t, RunOptions())
            before = dict(session.prims.graphs.counts)
            per_step_us[graphs] = events_ms(stream, lambda: run(arena), RUNS) * 1e3 / length
            replayed = session.prims.graphs.counts["replayed"] - before["replayed"]
        finally:
            session.use_graphs = True
            session.free(arena)
        if graphs:
            met = per_step_us[graphs] <= 10
            table.append(f"| scan {length} steps, carry 1024 f32, graphs | {per_step_us[graphs] * length / 1e3:.3f} | - | - "
                         f"| - | - | - | {per_step_us[graphs]:.2f} us/step <= 10: {'met' if met else 'missed'} |")
            ck.add("bench", "scan per step", "ok" if met else "miss",
                   f"{per_step_us[graphs]:.2f} us per step, {replayed} step graphs replayed")
        else:
            table.append(f"| scan {length} steps, carry 1024 f32, no graphs | {per_step_us[graphs] * length / 1e3:.3f} | - "
                         f"| - | - | - | - | {per_step_us[graphs]:.2f} us/step |")
            ck.add("bench", "scan per step without graphs", "ok", f"{per_step_us[graphs]:.2f} us per step")
        ck.write("bench.md", "\n".join(table) + "\n")
