"""One decode step per call through the compiled-graph API, with carried state, for the three
state-space ops, side by side with the anchors' step functions written in torch on the same CPU.

    python benchmarks/decode.py [--devices host,opencl] [--batches 1,32] [--runs 30] [--rounds 5] [--warmup 5]

Cases (f32, S=1, state carried from call to call): Mamba (``selective_scan``) H=1536 N=16, Mamba-2
(``mamba2``) H=24 P=64 N=128, Gated DeltaNet H=16 K=V=128, each at batch 1 and 32. Ours is a graph
of the one op with the state an input (``initial_state``), compiled for the device
(``g.compile(device)``), then ``exe.run(inputs, state=last_state)`` per step, as a caller decodes
(``benchmarks/percall.py`` times the gru decode the same way). Where the builder does not take a
carried state for an op, its one-thunk schedule is written directly (the same schedule the builder
would make). Theirs are the anchors' step functions with the state kept in torch tensors and updated
in place: mamba_ssm's ``selective_state_update_ref`` (``dA = exp(dt*A)``, ``state = state*dA +
dt*B*x``, ``y = state·C``; for Mamba-2 with one ``A`` per head, as its step for ``ngroups = heads``)
and fla's ``naive_recurrent_gated_delta_rule`` at one step (``S *= exp(g)``, ``u = (v - Σ S*k) *
beta``, ``S += k u^T``, ``o = (q*scale)·S``), both without their optional D/z/bias terms (ours has
none either). Medians in µs of ``--rounds`` blocks of ``--runs`` calls, torch and ours taking turns;
torch gets as many threads as NumPy's OpenBLAS. ``ran on`` names the backend that ran the op's thunk
(a device without the kernel for a field falls back to the host); ``max |diff|`` compares ours with
torch after both took the same steps from the same state. On a loaded machine run it with
``OPENBLAS_NUM_THREADS=1``. Needs numpy, ml_dtypes, torch, pyopencl (for opencl) and this repository.

    python benchmarks/decode.py --thunk [--batches 1,32] [--runs 30] [--rounds 5] [--warmup 5]

times the op's thunk alone on the host, ``host_fallback.bound_kernel(thunk, {})`` called on its arena (what
a decode step's kernel costs beneath any runtime or bridge), with the compiled step (``jit``, Numba) and
with NumPy's (``RLX_HOST_JIT=0``), in turns, on one thread (NumPy's BLAS too), medians of single calls in
µs: ``THUNK_SHAPES``, the shapes and fields of Mamba-2 (H=8 P=64 N=64, one group, d, z, dt_bias,
softplus), Mamba (H=1536 N=16, d, z, delta_bias, softplus), Gated DeltaNet (H=8 K=V=64, with and
without q/k L2-norm) and Mamba-3 (H=8 P=64 N=64, 16 angles, one q/k group, biases, d, z) decoding with a
carried state, f32. Needs numpy, ml_dtypes, numba and this
repository (no torch).
"""
from __future__ import annotations

import argparse
import base64
import inspect
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# benchmarks/rnn.py: turn-taking medians and the load check
from rnn import alternate_ms, cpu_ticks, warn_if_shared  # noqa: E402

import host_fallback  # noqa: E402
from host_fallback import jit  # noqa: E402
from host_fallback.abi import regions  # noqa: E402
from host_fallback.arena import view  # noqa: E402
from host_fallback.threads import blas_threads, single_threaded_blas  # noqa: E402
from rlx_gpu import Graph, load_schedule  # noqa: E402
from rlx_gpu.conformance.cases import lay_out, schedule_of  # noqa: E402
from rlx_gpu.graph.lowering import Executable  # noqa: E402

#: name -> (op, its shape params but batch)
SHAPES = {
    "mamba H=1536 N=16": ("selective_scan", dict(hidden=1536, state_size=16)),
    "mamba2 H=24 P=64 N=128": ("mamba2", dict(heads=24, head_dim=64, state_size=128)),
    "gdn H=16 K=V=128": ("gated_delta_net", dict(heads=16, state_size=128)),
}


@dataclass
class Case:
    """One decode step: our executable and its inputs, and torch's step over its own state."""

    name: str
    exe: Executable
    inputs: dict[str, np.ndarray]  # a step's inputs, the state aside
    state: np.ndarray  # the initial state
    state_output: str
    torch_step: Callable[[], np.ndarray]


def _inputs(op: str, batch: int, p: dict[str, int], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One step's inputs (and the constant ``a``) in the ranges the ops are used in."""
    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    if op == "selective_scan":
        h, n = p["hidden"], p["state_size"]
        return {"x": normal(batch, 1, h), "delta": np.abs(normal(batch, 1, h)) * 0.1, "a": -np.abs(normal(h, n)),
                "b": normal(batch, 1, n), "c": normal(batch, 1, n)}
    if op == "mamba2":
        h, hd, n = p["heads"], p["head_dim"], p["state_size"]
        return {"x": normal(batch, 1, h, hd), "dt": np.abs(normal(batch, 1, h)) * 0.1, "a": -np.abs(normal(h)),
                "b": normal(batch, 1, h, n), "c": normal(batch, 1, h, n)}
    h, n = p["heads"], p["state_size"]
    k = normal(batch, 1, h, n)
    return {"q": normal(batch, 1, h, n), "k": k / np.linalg.norm(k, axis=-1, keepdims=True),
            "v": normal(batch, 1, h, n), "g": -np.abs(normal(batch, 1, h)) * 0.1,
            "beta": 1 / (1 + np.exp(-normal(batch, 1, h)))}


def _state_shape(op: str, batch: int, p: dict[str, int]) -> tuple[int, ...]:
    return {"selective_scan": (batch, p.get("hidden", 0), p["state_size"]),
            "mamba2": (batch, p.get("heads", 0), p.get("head_dim", 0), p["state_size"]),
            "gated_delta_net": (batch, p.get("heads", 0), p["state_size"], p["state_size"])}[op]


def _builder_carries(op: str) -> bool:
    return "initial_state" in inspect.signature(getattr(Graph, op)).parameters


def ours(op: str, batch: int, p: dict[str, int], values: dict[str, np.ndarray], device: str) -> tuple[Executable, str]:
    """The compiled one-op decode graph (the state an input, its final state an output) and that output's name."""
    if _builder_carries(op):
        g = Graph(dtype="f32")
        ins = {f: g.input(f, v.shape) for f, v in values.items() if f != "a"}
        state = g.input("state", _state_shape(op, batch, p))
        args = [ins[f] if f in ins else g.weight(f, values[f]) for f in
                {"selective_scan": ("x", "delta", "a", "b", "c"), "mamba2": ("x", "dt", "a", "b", "c"),
                 "gated_delta_net": ("q", "k", "v", "g", "beta")}[op]]
        y, _ = getattr(g, op)(*args, initial_state=state, name="op")
        g.output("y", y)
        return g.compile(device), "op.state"
    # the builder takes no carried state for this op yet: the one-thunk schedule it would make
    thunk, arena_bytes = lay_out(op, "f32", dict(batch=batch, seq=1, carry_state=True, state=True, **p))
    tensors = {r.field: {"offset": r.offset, "dtype": r.dtype, "shape": list(r.shape)} for r in regions(thunk)}
    schedule = schedule_of(thunk, arena_bytes)
    init = [{"offset": tensors["a"]["offset"], "b64": base64.b64encode(values["a"].tobytes()).decode()}]
    schedule.update(tensors=tensors, inputs=[f for f in values if f != "a"] + ["state"], outputs=["dst", "state"],
                    init=init)
    exe = Executable(load_schedule(schedule), None, device)
    return exe, "state"


def theirs(torch: Any, op: str, values: dict[str, np.ndarray], state: np.ndarray) -> Callable[[], np.ndarray]:
    """The anchor's step function over a torch state updated in place; returns the step's output."""
    t = {f: torch.from_numpy(v) for f, v in values.items()}
    s = torch.from_numpy(state.copy())
    if op == "selective_scan":  # selective_state_update_ref: state [B, D, N]
        x, dt, a, b, c = t["x"][:, 0], t["delta"][:, 0], t["a"], t["b"][:, 0], t["c"][:, 0]

        def step() -> np.ndarray:
            with torch.no_grad():
                da = torch.exp(dt[..., None] * a)  # [B, D, N]
                db = dt[..., None] * b[:, None, :]
                s.copy_(s * da + db * x[..., None])
                return torch.einsum("bdn,bn->bd", s, c)[:, None].numpy()
    elif op == "mamba2":  # one A per head: state [B, H, P, N]
        x, dt, a, b, c = t["x"][:, 0], t["dt"][:, 0], t["a"], t["b"][:, 0], t["c"][:, 0]

        def step() -> np.ndarray:
            with torch.no_grad():
                da = torch.exp(dt * a)  # [B, H]
                dbx = torch.einsum("bh,bhn,bhp->bhpn", dt, b, x)
                s.copy_(s * da[..., None, None] + dbx)
                return torch.einsum("bhpn,bhn->bhp", s, c)[:, None].numpy()
    else:  # naive_recurrent_gated_delta_rule at one step: state [B, H, K, V]
        q, k, v, g, beta = (t[f][:, 0] for f in ("q", "k", "v", "g", "beta"))
        q = q * q.shape[-1] ** -0.5

        def step() -> np.ndarray:
            with torch.no_grad():
                s.mul_(g.exp()[..., None, None])
                u = (v - (s * k[..., None]).sum(-2)) * beta[..., None]
                s.add_(k[..., None] * u[..., None, :])
                return torch.einsum("bhk,bhkv->bhv", q, s)[:, None].numpy()
    return step


def make_case(torch: Any, name: str, batch: int, device: str, rng: np.random.Generator) -> Case:
    op, p = SHAPES[name]
    values = _inputs(op, batch, p, rng)
    state = (rng.standard_normal(_state_shape(op, batch, p)) * 0.1).astype(np.float32)
    exe, state_output = ours(op, batch, p, values, device)
    return Case(f"{name} B={batch}", exe, {f: v for f, v in values.items() if f != "a"}, state, state_output,
                theirs(torch, op, values, state))


def our_step(case: Case) -> Callable[[], np.ndarray]:
    """``exe.run`` of one step, the state carried from the last call's output."""
    carried = [case.state.copy()]
    out_name = next(n for n in case.exe.schedule.outputs if n != case.state_output)

    def step() -> np.ndarray:
        out = case.exe.run(**case.inputs, state=carried[0])
        carried[0] = out[case.state_output]
        return out[out_name]

    return step


def ran_on(case: Case) -> str:
    """The backend of the op's thunk when this executable runs on its device."""
    bound = case.exe.device.bind(case.exe.schedule)
    return next(backend for thunk, backend, _ in bound.steps if thunk.op in ("selective_scan", "mamba2",
                                                                              "gated_delta_net"))


#: --thunk: name -> (op, its params but batch), the fields decoding models use (state carried, f32).
THUNK_SHAPES = {
    "mamba2 H=8 P=64 N=64 G=1 +d,z,dt_bias,softplus": (
        "mamba2", dict(heads=8, head_dim=64, state_size=64, groups=1, d=True, z=True, dt_bias=True,
                       dt_softplus=True)),
    "mamba H=1536 N=16 +d,z,delta_bias,softplus": (
        "selective_scan", dict(hidden=1536, state_size=16, d=True, z=True, delta_bias=True, delta_softplus=True)),
    "gdn H=8 K=V=64": ("gated_delta_net", dict(heads=8, state_size=64, gate_per_channel=False)),
    "gdn H=8 K=V=64 +qk_l2norm": ("gated_delta_net", dict(heads=8, state_size=64, gate_per_channel=False,
                                                            qk_l2norm=True)),
    "mamba3 H=8 P=64 N=64 A=16 G=1 +biases,d,z": (
        "mamba3", dict(heads=8, head_dim=64, state_size=64, num_angles=16, groups=1, q_bias=True, k_bias=True,
                       d=True, z=True, angle_state=True, k_state=True, v_state=True)),
}
#: Inputs a thunk step's op reads in another range than the others' (mamba3's dt is the step itself, after the
#: softplus the others apply inside; its adt the log-decay).
OP_RANGES = {"mamba3": {"dt": (0.01, 0.2), "adt": (-0.5, 0.0)}}


def thunk_step(op: str, batch: int, p: dict[str, Any],
               rng: np.random.Generator) -> tuple[Callable, Callable, np.ndarray]:
    """The op's one-token thunk with a carried state, bound (``bound_kernel``) twice: with the compiled step
    and with NumPy's (bound with ``RLX_HOST_JIT=0``, which a thunk reads as it is prepared); and their
    arena, filled with inputs in the ranges models feed (steps before softplus about -3..0.5, decays below
    1, unit keys)."""
    thunk, arena_bytes = lay_out(op, "f32", dict(batch=batch, seq=1, carry_state=True, state=True, **p))
    arena = np.zeros(arena_bytes, np.uint8)
    for r in regions(thunk):
        shape = r.shape
        values = {"a": lambda: -rng.uniform(0.1, 1.0, shape), "delta": lambda: rng.uniform(-3.0, 0.5, shape),
                  "dt": lambda: rng.uniform(-3.0, 0.5, shape), "g": lambda: -rng.uniform(0.0, 0.5, shape),
                  "beta": lambda: rng.uniform(0.0, 1.0, shape),
                  "k": lambda: rng.standard_normal(shape) / np.sqrt(shape[-1]),
                  "state": lambda: rng.standard_normal(shape) * 0.1}.get(r.field, lambda: rng.standard_normal(shape))
        if r.field in OP_RANGES.get(op, {}):
            low, high = OP_RANGES[op][r.field]
            values = lambda: rng.uniform(low, high, shape)  # noqa: E731
        if r.field != "dst":
            view(arena, r.offset, r.dtype, shape)[...] = values()
    run = host_fallback.bound_kernel(thunk, {})
    os.environ[jit.ENV] = "0"
    try:
        numpy_run = host_fallback.bound_kernel(thunk, {})
    finally:
        os.environ.pop(jit.ENV, None)
    return (lambda: run(arena)), (lambda: numpy_run(arena)), arena


def thunk_table(args: argparse.Namespace) -> None:
    """``--thunk``: each case's thunk with the compiled step and with NumPy's, in turns (one thread)."""
    if jit.kernel("mamba2_step") is None:
        raise SystemExit(f"--thunk compares the compiled step with NumPy's: it needs Numba and {jit.ENV} unset or 1")
    rng = np.random.default_rng(0)
    print(f"one thunk S=1, f32, state carried: bound_kernel on its arena; median µs of {args.rounds}x{args.runs} "
          f"single calls after {args.warmup} warm-up, in turns; NumPy's step with {jit.ENV}=0")
    print(f"{'case':<52}{'numba':>9}{'numpy':>9}{'speed-up':>10}")
    start, t0 = cpu_ticks(), time.perf_counter()
    for name, (op, p) in THUNK_SHAPES.items():
        for batch in (int(b) for b in args.batches.split(",")):
            step, numpy_run, _ = thunk_step(op, batch, p, rng)
            with single_threaded_blas():
                compiled, numpy_step = (ms * 1e3 for ms in alternate_ms([step, numpy_run], args.runs, args.warmup,
                                                                        args.rounds))
            print(f"{f'{name} B={batch}':<52}{compiled:>9.1f}{numpy_step:>9.1f}{numpy_step / compiled:>9.1f}x",
                  flush=True)
    warn_if_shared(start, t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="host,opencl")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--cases", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    ap.add_argument("--runs", type=int, default=30, help="timed calls per block and path")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls before each block")
    ap.add_argument("--rounds", type=int, default=5, help="blocks per path, the paths taking turns")
    ap.add_argument("--thunk", action="store_true", help="time the thunk alone, compiled step against NumPy's")
    args = ap.parse_args()
    if args.thunk:
        thunk_table(args)
        return

    import torch

    threads = blas_threads() or os.cpu_count() or 1
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    print(f"decode step S=1, f32, state carried; torch.set_num_threads({threads}) = NumPy's OpenBLAS threads; "
          f"median µs of {args.rounds}x{args.runs} calls after {args.warmup} warm-up, in turns")
    print(f"{'case':<30}{'device':<12}{'ran on':<10}{'torch':>9}{'exe.run':>9}{'ratio':>8}{'max |diff|':>12}")
    start, t0 = cpu_ticks(), time.perf_counter()
    for name in args.cases.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for device in args.devices.split(","):
                case = make_case(torch, name, batch, device, rng)
                ours_fn, theirs_fn = our_step(case), case.torch_step
                us = [ms * 1e3 for ms in alternate_ms([theirs_fn, ours_fn], args.runs, args.warmup, args.rounds)]
                diff = float(np.abs(ours_fn() - theirs_fn()).max())  # both took the same number of steps
                print(f"{case.name:<30}{device:<12}{ran_on(case):<10}{us[0]:>9.0f}{us[1]:>9.0f}"
                      f"{us[1] / us[0]:>7.2f}x{diff:>12.1e}", flush=True)
    warn_if_shared(start, t0)


if __name__ == "__main__":
    main()
