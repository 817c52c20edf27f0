"""Per-call cost of one decode step (S=1, carried state) through the resident arena API, side by side
with torch on the same CPU and with the copy-everything path ``dev.run(schedule, numpy_arena)``.

    python benchmarks/percall.py [--devices host,opencl] [--runs 50] [--rounds 5] [--warmup 10]

Cases: lstm and gru (B=1 and B=32, input = hidden = 256, 1 layer, f32) against ``torch.nn.LSTM/GRU``
with the same weights, and gated_delta_net (B=8, heads 8, N=64, state carried) against the same
recurrence written in torch ops. Every call is one full step as a caller sees it: write the step's
inputs, run, read the output; the state stays where each path keeps it (torch: its tensors; resident:
the device arena, updated in place; copy-everything: the host arena, copied in and out every call).
Medians in microseconds of ``--rounds`` blocks of ``--runs`` timed calls per path, the paths taking
turns block by block; torch gets as many threads as NumPy's OpenBLAS. ``max |diff|`` compares the
resident path's output after the timed calls with torch's, after as many steps from the same state.
Then one gru B=1 decode step through the compiled-graph API (``Graph.gru`` with ``h0`` an input,
``g.compile(device)``, ``exe.run(x=..., h0=...)`` per step) against torch, and what a ``CallPlan``
(the per-call path under ``exe.run``) adds to its thunks' own time on each device, for that step and a
Mamba-2 decode step of nine inputs (three of them parameters, also timed with stamps), with the
host-device copies of a call. ``--graph-only`` runs only these two tables. On a loaded machine run it with
``OPENBLAS_NUM_THREADS=1`` (torch follows): a two-thread step waits at its barriers for a
descheduled thread. Needs only numpy, ml_dtypes, torch, pyopencl (for opencl)
and this repository.
"""
from __future__ import annotations

import argparse
import base64
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# benchmarks/rnn.py: turn-taking medians and the load check
from rnn import alternate_ms, cpu_ticks, warn_if_shared  # noqa: E402

from host_fallback.abi import regions  # noqa: E402
from host_fallback.threads import blas_threads  # noqa: E402
from rlx_gpu import get_device, load_schedule  # noqa: E402
from rlx_gpu.schedule.model import ABI_V1, ABI_V2  # noqa: E402
from rlx_gpu.conformance.cases import lay_out  # noqa: E402
from rlx_gpu.graph.torch_weights import pack_recurrent  # noqa: E402

SIZE = 256


@dataclass
class Case:
    """One decode step: the schedule, its constant tensors, the inputs of a step, and torch's step."""

    name: str
    schedule: Any
    inputs: dict[str, np.ndarray]
    torch_step: Callable[[], np.ndarray]


def schedule_for(thunk: dict, arena_bytes: int, inputs: list[str], constants: dict[str, np.ndarray],
                 abi: str = ABI_V1) -> Any:
    """A one-thunk schedule naming every tensor by its field; ``constants`` become init blocks."""
    tensors = {r.field: {"offset": r.offset, "dtype": r.dtype, "shape": list(r.shape)} for r in regions(thunk)}
    init = [{"offset": tensors[n]["offset"], "b64": base64.b64encode(np.ascontiguousarray(a, np.float32)).decode()}
            for n, a in constants.items()]
    return load_schedule({"abi": abi, "arena_bytes": arena_bytes, "tensors": tensors, "inputs": inputs,
                          "outputs": ["dst"], "init": init, "thunks": [thunk]})


def recurrent_case(torch: Any, op: str, batch: int) -> Case:
    model = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[op](SIZE, SIZE, batch_first=True)
    params = dict(batch=batch, seq=1, input_size=SIZE, hidden=SIZE, num_layers=1, bidirectional=False, carry=True)
    thunk, arena_bytes = lay_out(op, "f32", params)
    x = torch.randn(batch, 1, SIZE)
    schedule = schedule_for(thunk, arena_bytes, ["x"], pack_recurrent(model))
    state = [torch.zeros(1, batch, SIZE) for _ in range(2 if op == "lstm" else 1)]

    def step() -> np.ndarray:
        with torch.no_grad():
            y, new = model(x, tuple(state) if op == "lstm" else state[0])
        state[:] = list(new) if op == "lstm" else [new]
        return y.numpy()

    return Case(f"{op} B={batch}", schedule, {"x": x.numpy()}, step)


def gdn_case(torch: Any, batch: int = 8, heads: int = 8, n: int = 64) -> Case:
    params = dict(batch=batch, seq=1, heads=heads, state_size=n, gate_per_channel=False, carry_state=True)
    thunk, arena_bytes = lay_out("gated_delta_net", "f32", params)
    gen = torch.Generator().manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(batch, 1, heads, n, generator=gen), dim=-1)
    inputs = {"q": torch.randn(batch, 1, heads, n, generator=gen), "k": k,
              "v": torch.randn(batch, 1, heads, n, generator=gen),
              "g": -torch.rand(batch, 1, heads, generator=gen) * 0.1,
              "beta": torch.rand(batch, 1, heads, generator=gen)}
    schedule = schedule_for(thunk, arena_bytes, list(inputs), {})
    q, k, v, g, beta = (inputs[f][:, 0] for f in ("q", "k", "v", "g", "beta"))
    state = torch.zeros(batch, heads, n, n)  # [b, h, i (key), j (value)]
    decay, scale = g.exp()[..., None, None], n ** -0.5

    def step() -> np.ndarray:  # ABI.md §4, one step
        with torch.no_grad():
            state.mul_(decay)
            u = (v - torch.einsum("bhij,bhi->bhj", state, k)) * beta[..., None]
            state.add_(k[..., :, None] * u[..., None, :])
            return (torch.einsum("bhij,bhi->bhj", state, q) * scale)[:, None].numpy()

    return Case("gdn B=8 H=8 N=64", schedule, {f: t.numpy() for f, t in inputs.items()}, step)


def copy_everything(dev: Any, case: Case) -> Callable[[], np.ndarray]:
    """Today's ``dev.run(schedule, numpy_arena)``: every call copies the whole arena in and out."""
    sched, views = case.schedule, case.schedule.tensors
    arena = [sched.pristine_arena()]

    def step() -> np.ndarray:
        for name, values in case.inputs.items():
            views[name].write(arena[0], values)
        arena[0] = dev.run(sched, arena[0])
        return views["dst"].read(arena[0])

    return step


def resident(dev: Any, case: Case) -> tuple[Callable[[], np.ndarray], Any]:
    """The resident API: the arena stays on the device; a call writes the inputs, runs, reads ``dst``."""
    arena = dev.arena(case.schedule)

    def step() -> np.ndarray:
        for name, values in case.inputs.items():
            arena.write(name, values)
        dev.run(case.schedule, arena)
        return arena.read("dst")

    return step, arena


def graph_gru_decode(torch: Any, dev: Any) -> tuple[Callable[[], np.ndarray], Callable[[], np.ndarray], Any]:
    """A gru B=1 decode step through the compiled-graph API: ``Graph.gru`` with ``h0`` as an input,
    ``g.compile(device)``, then ``exe.run(x=x, h0=h)`` per step with ``h`` the last ``h_n``; beside
    it torch's ``GRU`` carrying its own state. Returns (ours, torch's, the Executable)."""
    import rlx_gpu

    model = torch.nn.GRU(SIZE, SIZE, batch_first=True)
    g = rlx_gpu.Graph(dtype="f32")
    x, h0 = g.input("x", (1, 1, SIZE)), g.input("h0", (1, 1, SIZE))
    weights = {name: g.weight(name, values) for name, values in pack_recurrent(model).items()}
    y, _ = g.gru(x, **weights, hidden=SIZE, h0=h0, name="gru")
    g.output("y", y)
    exe = g.compile(dev.spec)
    exe._device = dev  # the opened device of this benchmark, not a second one
    xs = np.random.default_rng(0).standard_normal((1, 1, SIZE)).astype(np.float32)
    xt, ours_h, torch_h = torch.from_numpy(xs), [np.zeros((1, 1, SIZE), np.float32)], [torch.zeros(1, 1, SIZE)]

    def ours() -> np.ndarray:
        out = exe.run(x=xs, h0=ours_h[0])
        ours_h[0] = out["gru.h_n"]
        return out["y"]

    def theirs() -> np.ndarray:
        with torch.no_grad():
            out, torch_h[0] = model(xt, torch_h[0])
        return out.numpy()

    return ours, theirs, exe


def mamba2_step(dev: Any) -> tuple[Any, dict[str, np.ndarray], dict[str, int]]:
    """A Mamba-2 decode step (``selective_state_update``'s form: B=1 S=1 H=8 P=64 N=64 with D, z,
    dt_bias, softplus and the state carried in place) as a one-thunk schedule of nine inputs, its call
    plan on ``dev`` (profiled: each thunk waits, so its record is its own time), the inputs of a step
    and stamps for its parameters (A, D, dt_bias)."""
    from rlx_gpu.runtime.call_plan import CallPlan

    params = dict(batch=1, seq=1, heads=8, head_dim=64, state_size=64, dt_bias=True, dt_softplus=True, d=True,
                  z=True, carry_state=True, state=True)
    thunk, arena_bytes = lay_out("mamba2", "f32", params)
    inputs = ["x", "dt", "a", "b", "c", "dt_bias", "d", "z", "state"]
    schedule = schedule_for(thunk, arena_bytes, inputs, {}, ABI_V2)
    rng = np.random.default_rng(0)
    values = {name: rng.uniform(-0.5, 0.5, schedule.tensors[name].shape).astype(np.float32) for name in inputs}
    values["a"] = -np.abs(values["a"])
    return CallPlan(schedule, dev, profile=True), values, {"a": 1, "d": 1, "dt_bias": 1}


def plan_overhead(plan: Any, inputs: dict[str, np.ndarray], stamps: dict[str, int] | None,
                  calls: int) -> tuple[float, float, float, int]:
    """Median µs per call of ``plan(inputs, stamps)``, of its thunks' own time (its ``last_report``) and
    of the difference per call (what the plan adds: inputs in, checks, outputs out), and the
    host-device copies of a call."""
    clock, whole, own, extra = time.perf_counter, [], [], []
    for call in range(calls + calls // 5):
        t0 = clock()
        plan(inputs, stamps)
        t1 = clock()
        if call >= calls // 5:  # after the warm-up
            thunks = sum(r.seconds for r in plan.last_report.records)
            whole.append(t1 - t0)
            own.append(thunks)
            extra.append(t1 - t0 - thunks)
    return (*(statistics.median(v) * 1e6 for v in (whole, own, extra)), plan.last_report.copies)


def print_graph_decode(torch: Any, devices: list[Any], args: Any) -> None:
    """The compiled-graph decode table (torch, exe.run, ratio per device) and the call plans' overhead."""
    from rlx_gpu.runtime.call_plan import CallPlan

    print(f"\ngru B=1 H={SIZE} decode step through Graph.compile(device) + exe.run(x, h0) per step, median µs "
          f"of {args.rounds}x{args.runs} calls after {args.warmup} warm-up, torch and ours in turns:")
    print(f"{'device':<12}{'torch':>8}{'exe.run':>9}{'ratio':>8}{'max |diff|':>12}")
    rows = []
    calls = args.rounds * args.runs
    for dev in devices:
        ours, theirs, exe = graph_gru_decode(torch, dev)
        us = [ms * 1e3 for ms in alternate_ms([theirs, ours], args.runs, args.warmup, args.rounds)]
        diff = float(np.abs(ours() - theirs()).max())  # both took the same number of steps
        print(f"{dev.spec:<12}{us[0]:>8.0f}{us[1]:>9.0f}{us[1] / us[0]:>7.2f}x{diff:>12.1e}")
        inputs = {"x": np.zeros((1, 1, SIZE), np.float32), "h0": np.zeros((1, 1, SIZE), np.float32)}
        with CallPlan(exe.schedule, dev, profile=True) as plan:
            rows.append((dev.spec, "gru graph step, 2 inputs", plan_overhead(plan, inputs, None, calls)))
        plan, values, stamps = mamba2_step(dev)
        with plan:
            rows.append((dev.spec, "mamba2 step, 9 inputs", plan_overhead(plan, values, None, calls)))
            rows.append((dev.spec, "  A, D, dt_bias stamped", plan_overhead(plan, values, stamps, calls)))
    print(f"\nCallPlan per call, median µs of {calls} calls (profiled: each thunk waits for the device; "
          f"overhead = call - thunks, per call; copies: host-device commands):")
    print(f"{'device':<12}{'step':<28}{'call':>8}{'thunks':>8}{'overhead':>10}{'copies':>8}")
    for spec, label, (whole, own, extra, copies) in rows:
        print(f"{spec:<12}{label:<28}{whole:>8.1f}{own:>8.1f}{extra:>10.1f}{copies:>8}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("``", ""))
    ap.add_argument("--devices", default="host,opencl")
    ap.add_argument("--runs", type=int, default=50, help="timed calls per block and path")
    ap.add_argument("--warmup", type=int, default=10, help="untimed calls before each block")
    ap.add_argument("--rounds", type=int, default=5, help="blocks per path, the paths taking turns")
    ap.add_argument("--graph-only", action="store_true", help="only the compiled-graph and call-plan tables")
    args = ap.parse_args()

    import torch

    threads = blas_threads() or os.cpu_count() or 1
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cases = [] if args.graph_only else [recurrent_case(torch, op, b) for op in ("lstm", "gru") for b in (1, 32)]
    cases += [] if args.graph_only else [gdn_case(torch)]
    devices = [get_device(spec) for spec in args.devices.split(",")]
    print(f"decode step S=1, f32, H=I={SIZE}; torch.set_num_threads({threads}) = NumPy's OpenBLAS threads; "
          f"median µs of {args.rounds}x{args.runs} calls per path after {args.warmup} warm-up, in turns")
    start, t0 = cpu_ticks(), time.perf_counter()
    print(f"{'case':<18}{'device':<12}{'torch':>8}{'resident':>10}{'copy-all':>10}{'res/torch':>11}"
          f"{'copy/res':>10}{'max |diff|':>12}")
    for case in cases:
        for dev in devices:
            step, arena = resident(dev, case)
            paths = [case.torch_step, step, copy_everything(dev, case)]
            us = [ms * 1e3 for ms in alternate_ms(paths, args.runs, args.warmup, args.rounds)]
            diff = float(np.abs(step() - case.torch_step()).max())  # both took the same number of steps
            arena.free()
            print(f"{case.name:<18}{dev.spec:<12}{us[0]:>8.0f}{us[1]:>10.0f}{us[2]:>10.0f}{us[1] / us[0]:>10.2f}x"
                  f"{us[2] / us[1]:>9.2f}x{diff:>12.1e}")
    print_graph_decode(torch, devices, args)
    warn_if_shared(start, t0)


if __name__ == "__main__":
    main()
