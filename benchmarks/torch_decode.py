"""Batch-1 decode steps of rlx_gpu.torch against the same steps in plain torch, one thread, and the char-LSTM
language model's training step: the figures issue 33 sets targets for (host ≤ 1.0x torch, OpenCL ≤ 2.0x,
bridge overhead ≤ 30 µs, training ≤ 1.5x), in one run.

    python benchmarks/torch_decode.py [--devices host,opencl] [--opencl opencl:1:0[,...]] [--runs 200] [--rounds 7]
                                      [--warmup 5] [--train-steps 20] [--train-runs 5] [--no-training]
                                      [--quick] [--markdown]

Cases (f32, batch 1, one token per call, the state carried from call to call, each step's inputs drawn
from a pool of 8 so that no call sees the tensors of the call before):

- ``selective_state_update`` in Mamba-2's form, B1 H8 P64 N64 (state ``[1, 8, 64, 64]``; dt, A, D and
  dt_bias per head, broadcast along P by stride-0 views as a Mamba-2 block passes them; ngroups 1; z;
  dt_softplus), against mamba_ssm's ``selective_state_update_ref`` in torch ops;
- the same in Mamba-1's form, B1 D1536 N16 (state ``[1, 1536, 16]``);
- ``fused_recurrent_gated_delta_rule`` T=1 B1 H8 K=V=64, initial state in and final state out (q and k
  L2-normalised), against fla's naive recurrent step in torch ops;
- ``rlx_gpu.torch.LSTM(256, 256, batch_first=True)``, one step with (h, c) carried, against
  ``torch.nn.LSTM`` with the same state_dict;
- ``mamba3_siso_step`` B1 H8 P64 N64 with 16 angles, one q/k group, biases, D and Z, its four states carried,
  against §11's step in torch ops (``benchmarks/mamba3.py``'s ``torch_step``, the anchor's
  ``mamba3_siso_step_ref`` form);
- ``causal_conv1d_update`` B1 D1536 W4 (silu, bias, a cache of 3 columns shifted in place, Mamba's), against
  Dao-AILab's ``causal_conv1d_update_ref`` (``benchmarks/causal_conv1d.py``'s ``update_ref``);
- the Mamba-2 state update and the convolution at B4 on pools of 16 (``state_batch_indices``,
  ``conv_state_indices``: a serving engine's), the references stepping the rows they gather and scattering them
  back.

Each case first checks that rlx_gpu.torch and torch agree (``max |diff|`` of the output and the state after
the same 8 steps from the same state, on each device), then times the paths taking turns, a block of
``--warmup`` untimed and ``--runs`` timed steps each, over ``--rounds`` rounds: torch, rlx_gpu.torch on the
host (``RLX_DEVICE=host``) and on the OpenCL device (``--opencl``; default: the registry's first usable
OpenCL device that is not a simulator; several, comma-separated, each get columns of their own: e.g. PoCL's two
drivers, ``POCL_DEVICES="pthread basic"``), switched by ``RLX_DEVICE`` between blocks (the bridge compiles
per value). Medians in µs per step (wall time). The bridge overhead is the host call's time minus the
time of the thunks it ran (``rlx_gpu.torch.bridge.last_report()``), per block. Then the training step of
``configs/examples/train_lstm_lm.py``'s LSTM model (2 layers, hidden 32; forward, backward, Adam) with
``rlx_gpu.torch.LSTM`` against ``torch.nn.LSTM`` on the host (``benchmarks/torch_training.py``'s
timing). torch runs one thread (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=OPENBLAS_NUM_THREADS=1``,
so the host kernels' BLAS too); an OpenCL CPU device such as PoCL runs its own threads. A warning follows
the tables when other processes used the CPUs meanwhile. Needs torch, pyopencl (for OpenCL) and this
repository.
"""
from __future__ import annotations

import os

for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):  # before NumPy and torch start their pools
    os.environ[_variable] = "1"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any, Callable, Iterator  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# benchmarks/rnn.py: the CPU header and the load check; benchmarks/torch_training.py: the training step
from rnn import cpu_line, cpu_ticks, warn_if_shared  # noqa: E402
from causal_conv1d import update_ref  # noqa: E402  (benchmarks/causal_conv1d.py: Dao-AILab's reference step)
from mamba3 import torch_step  # noqa: E402  (benchmarks/mamba3.py: §11's step in torch ops)
from torch_training import example, step_times  # noqa: E402

import rlx_gpu.torch as rlx  # noqa: E402
from rlx_gpu.conformance.devices import find  # noqa: E402
from rlx_gpu.errors import DeviceError  # noqa: E402
from rlx_gpu.runtime.registry import status  # noqa: E402
from rlx_gpu.torch import bridge  # noqa: E402

#: Steps' inputs drawn per case; step i takes entry i % POOL.
POOL = 8
TARGETS = {"host": 1.0, "opencl": 2.0, "overhead": 30.0, "training": 1.5}


@dataclass
class Stepper:
    """One path of a case: ``step(i)`` takes decode step i (the state carried) and returns its output;
    ``state()`` is the state now."""

    step: Callable[[int], torch.Tensor]
    state: Callable[[], torch.Tensor]


@dataclass
class Case:
    """A decode case: ``make(rlx_side)`` gives a fresh path (rlx_gpu.torch or torch) from the initial state."""

    name: str
    make: Callable[[bool], Stepper]


def _normal(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def state_update_ref(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                     C: torch.Tensor, D: torch.Tensor, z: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """mamba_ssm's ``selective_state_update_ref`` with dt_softplus, in torch ops: ``state`` (``[b, h, p, n]``,
    or Mamba-1's ``[b, d, n]``) updated in place, ``out = (state·C + D·x)·silu(z)`` returned. B and C are
    ``[b, 1, n]`` (one group, broadcast over the heads) or Mamba-1's ``[b, n]``."""
    mamba1 = state.dim() == 3
    if mamba1:
        state, x, dt, z, B, C = (t.unsqueeze(1) for t in (state, x, dt, z, B, C))  # one head
        A, D, dt_bias = (t.unsqueeze(0) for t in (A, D, dt_bias))
    dt = F.softplus(dt + dt_bias)
    dA = torch.exp(dt[..., None] * A)
    dB = dt[..., None] * B[:, :, None, :]
    state.copy_(state * dA + dB * x[..., None])
    out = (state * C[:, :, None, :]).sum(-1) + D * x
    out = out * F.silu(z)
    return out.squeeze(1) if mamba1 else out


def state_update_case(name: str, heads: int | None, dim: int, dstate: int, batch: int = 1,
                      pool: int | None = None) -> Case:
    """``selective_state_update``: Mamba-2's form (``heads`` given; dt, A, D, dt_bias per head broadcast along
    ``dim`` by stride-0 views, one group) or Mamba-1's (``heads`` None); with ``pool``, ``batch`` rows updating
    entries of a pool of that many states (``state_batch_indices``, a serving engine's), the reference stepping
    the rows it gathers and scattering them back."""
    g = torch.Generator().manual_seed(0)
    lead = (heads,) if heads else ()
    if heads:
        A = (-torch.rand(heads, generator=g) - 0.5)[:, None, None].expand(heads, dim, dstate)
        D, dt_bias = (_normal(g, heads)[:, None].expand(heads, dim) for _ in range(2))
    else:
        A, D, dt_bias = -torch.rand(dim, dstate, generator=g) - 0.5, _normal(g, dim), _normal(g, dim)
    bc = (1, 1, dstate) if heads else (1, dstate)
    steps = []
    for _ in range(POOL):
        dt = _normal(g, batch, heads, 1).expand(batch, heads, dim) if heads else _normal(g, batch, dim)
        steps.append(dict(x=_normal(g, batch, *lead, dim), dt=dt, B=_normal(g, batch, *bc[1:]),
                          C=_normal(g, batch, *bc[1:]), z=_normal(g, batch, *lead, dim)))
    initial = _normal(g, pool or batch, *lead, dim, dstate) * 0.1
    rows = None if pool is None else torch.randperm(pool, generator=g)[:batch].to(torch.int32)

    def make(rlx_side: bool) -> Stepper:
        state = initial.clone()
        if rlx_side:
            def step(i: int) -> torch.Tensor:
                s = steps[i % POOL]
                return rlx.selective_state_update(state, s["x"], s["dt"], A, s["B"], s["C"], D=D, z=s["z"],
                                                  dt_bias=dt_bias, dt_softplus=True, state_batch_indices=rows)
        elif rows is None:
            def step(i: int) -> torch.Tensor:
                return state_update_ref(state, A=A, D=D, dt_bias=dt_bias, **steps[i % POOL])
        else:
            def step(i: int) -> torch.Tensor:
                taken = state[rows.long()]
                out = state_update_ref(taken, A=A, D=D, dt_bias=dt_bias, **steps[i % POOL])
                state[rows.long()] = taken
                return out
        return Stepper(step, lambda: state)

    return Case(name, make)


def gdn_case(name: str, heads: int, size: int) -> Case:
    """``fused_recurrent_gated_delta_rule`` at T=1 B1, the final state carried as the next initial state."""
    g = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(POOL):
        q, k = (F.normalize(_normal(g, 1, 1, heads, size), dim=-1) for _ in range(2))
        steps.append(dict(q=q, k=k, v=_normal(g, 1, 1, heads, size), g=-torch.rand(1, 1, heads, generator=g) * 0.5,
                          beta=torch.rand(1, 1, heads, generator=g)))
    initial = _normal(g, 1, heads, size, size) * 0.1
    scale = size ** -0.5

    def make(rlx_side: bool) -> Stepper:
        state = [initial.clone()]
        if rlx_side:
            def step(i: int) -> torch.Tensor:
                s = steps[i % POOL]
                o, state[0] = rlx.fused_recurrent_gated_delta_rule(s["q"], s["k"], s["v"], g=s["g"], beta=s["beta"],
                                                                   initial_state=state[0], output_final_state=True)
                return o
        else:
            S = state[0]  # [1, H, K, V], updated in place

            def step(i: int) -> torch.Tensor:  # fla's naive recurrent step
                s = steps[i % POOL]
                q, k, v, beta = s["q"][:, 0], s["k"][:, 0], s["v"][:, 0], s["beta"][:, 0]
                S.mul_(s["g"][:, 0].exp()[..., None, None])
                u = (v - (S * k[..., None]).sum(-2)) * beta[..., None]
                S.add_(k[..., None] * u[..., None, :])
                return ((q * scale)[..., None] * S).sum(-2)[:, None]
        return Stepper(step, lambda: state[0])

    return Case(name, make)


def lstm_case(name: str, size: int) -> Case:
    """One step of an LSTM(size, size, batch_first=True) at batch 1, (h, c) carried."""
    torch.manual_seed(2)
    reference = torch.nn.LSTM(size, size, batch_first=True)
    ours = rlx.LSTM(size, size, batch_first=True)
    ours.load_state_dict(reference.state_dict())
    g = torch.Generator().manual_seed(2)
    xs = [_normal(g, 1, 1, size) for _ in range(POOL)]
    initial = (_normal(g, 1, 1, size) * 0.1, _normal(g, 1, 1, size) * 0.1)

    def make(rlx_side: bool) -> Stepper:
        module = ours if rlx_side else reference
        hc = [initial]

        def step(i: int) -> torch.Tensor:
            y, hc[0] = module(xs[i % POOL], hc[0])
            return y

        return Stepper(step, lambda: torch.cat(hc[0]))

    return Case(name, make)


def mamba3_case(name: str, heads: int, p: int, n: int) -> Case:
    """``mamba3_siso_step`` at batch 1 (one q/k group, ``n // 4`` angles, biases, D, Z), its four states carried,
    against §11's step in torch ops (``benchmarks/mamba3.py``'s ``torch_step``, the states updated in place)."""
    g = torch.Generator().manual_seed(3)
    params = dict(q_bias=_normal(g, heads, n), k_bias=_normal(g, heads, n), d=_normal(g, heads))
    steps = [dict(q=_normal(g, 1, 1, n), k=_normal(g, 1, 1, n), v=_normal(g, 1, heads, p),
                  adt=-torch.rand(1, heads, generator=g) * 0.1, dt=torch.rand(1, heads, generator=g) * 0.1,
                  trap=_normal(g, 1, heads), angles=_normal(g, 1, heads, n // 4), z=_normal(g, 1, heads, p), **params)
             for _ in range(POOL)]
    initial = [_normal(g, 1, heads, n // 4), _normal(g, 1, heads, p, n) * 0.1, _normal(g, 1, heads, n),
               _normal(g, 1, heads, p)]

    def make(rlx_side: bool) -> Stepper:
        states = [[t.clone() for t in initial]]
        if rlx_side:
            def step(i: int) -> torch.Tensor:
                s = steps[i % POOL]
                out, states[0] = rlx.mamba3_siso_step(s["q"], s["k"], s["v"], s["adt"], s["dt"], s["trap"],
                                                      s["q_bias"], s["k_bias"], s["angles"], s["d"], s["z"],
                                                      Input_States=states[0])
                return out
        else:
            def step(i: int) -> torch.Tensor:
                return torch_step(steps[i % POOL], states[0])
        return Stepper(step, lambda: states[0][1])

    return Case(name, make)


def conv_case(name: str, dim: int, width: int, batch: int = 1, pool: int | None = None) -> Case:
    """``causal_conv1d_update`` (silu, bias, a cache of ``width-1`` columns shifted in place; with ``pool``,
    ``batch`` rows updating entries of a pool of caches, ``conv_state_indices``) against Dao-AILab's
    ``causal_conv1d_update_ref`` (``benchmarks/causal_conv1d.py``'s ``update_ref``, on the rows it gathers)."""
    g = torch.Generator().manual_seed(4)
    weight, bias = torch.randn(dim, width, generator=g) * 0.5, _normal(g, dim)
    steps = [_normal(g, batch, dim) for _ in range(POOL)]
    initial = _normal(g, pool or batch, dim, width - 1)
    rows = None if pool is None else torch.randperm(pool, generator=g)[:batch].to(torch.int32)

    def make(rlx_side: bool) -> Stepper:
        cache = initial.clone()
        if rlx_side:
            def step(i: int) -> torch.Tensor:
                return rlx.causal_conv1d_update(steps[i % POOL], cache, weight, bias, activation="silu",
                                                conv_state_indices=rows)
        elif rows is None:
            def step(i: int) -> torch.Tensor:
                return update_ref(steps[i % POOL], cache, weight, bias)
        else:
            def step(i: int) -> torch.Tensor:
                taken = cache[rows.long()]
                out = update_ref(steps[i % POOL], taken, weight, bias)
                cache[rows.long()] = taken
                return out
        return Stepper(step, lambda: cache)

    return Case(name, make)


def cases() -> list[Case]:
    return [state_update_case("selective_state_update Mamba-2 B1 H8 P64 N64", 8, 64, 64),
            state_update_case("selective_state_update Mamba-1 B1 D1536 N16", None, 1536, 16),
            gdn_case("fused_recurrent_gated_delta_rule T1 B1 H8 K=V=64", 8, 64),
            lstm_case("rlx_gpu.torch.LSTM one step B1 I=H=256", 256),
            mamba3_case("mamba3_siso_step B1 H8 P64 N64 A16", 8, 64, 64),
            conv_case("causal_conv1d_update B1 D1536 W4", 1536, 4),
            state_update_case("selective_state_update Mamba-2 B4 of a pool of 16", 8, 64, 64, batch=4, pool=16),
            conv_case("causal_conv1d_update B4 D1536 W4 of a pool of 16", 1536, 4, batch=4, pool=16)]


@contextlib.contextmanager
def rlx_device(spec: str | None) -> Iterator[None]:
    """``RLX_DEVICE=spec`` for the calls inside (nothing for the torch path's ``None``)."""
    before = os.environ.get("RLX_DEVICE")
    if spec is not None:
        os.environ["RLX_DEVICE"] = spec
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("RLX_DEVICE", None)
        else:
            os.environ["RLX_DEVICE"] = before


def thunk_seconds() -> float | None:
    """The seconds the thunks of this thread's latest rlx_gpu.torch call took, or None without a report."""
    report = bridge.last_report()
    return None if report is None else sum(r.seconds for r in report.records)


@dataclass
class Side:
    """A side of a case's timing: its device (None: plain torch), its stepper, and whether to read the
    bridge's reports (the host side's overhead)."""

    device: str | None
    stepper: Stepper
    reports: bool = False


def agreement(case: Case, device: str, steps: int) -> tuple[float, set[str]]:
    """``max |diff|`` between rlx_gpu.torch on ``device`` and torch (output and state) after ``steps`` steps
    from the same state, and the backends the rlx side's thunks ran on."""
    ours, theirs = case.make(True), case.make(False)
    with torch.no_grad(), rlx_device(device):
        for i in range(steps):
            got, want = ours.step(i), theirs.step(i)
        report = bridge.last_report()
    diff = max(float((got - want).abs().max()), float((ours.state() - theirs.state()).abs().max()))
    return diff, {r.backend for r in report.records} if report else set()


def time_paths(paths: list[Side], runs: int, rounds: int, warmup: int) -> list[tuple[float, float | None]]:
    """For each path, the median µs per step over ``rounds`` blocks of ``runs`` steps (after ``warmup`` untimed
    ones), the paths taking turns block by block; with ``reports``, also the median µs per step of the call's
    time outside its thunks (None when the bridge gave no report)."""
    steps: list[list[float]] = [[] for _ in paths]
    outside: list[list[float]] = [[] for _ in paths]
    done = [0] * len(paths)  # steps each path has taken, so its inputs go on through the pool
    with torch.no_grad():
        for _ in range(rounds):
            for p, path in enumerate(paths):
                step = path.stepper.step
                with rlx_device(path.device):
                    for _ in range(warmup):
                        step(done[p])
                        done[p] += 1
                    total, inside = 0.0, []
                    for _ in range(runs):
                        start = time.perf_counter()
                        step(done[p])
                        total += time.perf_counter() - start
                        done[p] += 1
                        if path.reports:
                            inside.append(thunk_seconds())
                steps[p].append(total / runs * 1e6)
                if inside and None not in inside:
                    outside[p].append((total - sum(inside)) / runs * 1e6)
    return [(statistics.median(s), statistics.median(o) if o else None) for s, o in zip(steps, outside)]


def opencl_device(wanted: str | None) -> tuple[str | None, str]:
    """The OpenCL device to time (``wanted``, else the first usable one that is not a simulator): its spec and
    name, or (None, why there is none)."""
    if wanted:
        try:
            info = find(wanted)
        except DeviceError as err:
            return None, str(err)
        if info.backend != "opencl":
            return None, f"--opencl {wanted} is a {info.backend} device, not an OpenCL one"
    else:
        st = status("opencl")
        info = next((d for d in st.devices if not d.details.get("simulator")), None)
        if info is None:
            return None, st.reason or "the only OpenCL devices here are simulators"
    return info.spec, info.name


def judged(value: float | None, target: float, form: str) -> str:
    """``value`` in ``form`` with ✓ when it meets ``target`` (at most), ✗ when not; a dash when not measured."""
    return "—" if value is None else f"{form.format(value)} {'✓' if value <= target else '✗'}"


def decode_rows(args: argparse.Namespace, devices: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Each case's figures: torch, host, overhead and OpenCL µs, the ratios, the agreement per device."""
    rows = []
    for case in cases():
        diffs, ran_on = {}, {}
        for label, spec in devices:
            diffs[label], ran_on[label] = agreement(case, spec, POOL)
        paths = [Side(None, case.make(False))] + [Side(spec, case.make(True), reports=label == "host")
                                                  for label, spec in devices]
        timed = time_paths(paths, args.runs, args.rounds, args.warmup)
        row: dict[str, Any] = {"case": case.name, "torch": timed[0][0], "diff": diffs, "ran_on": ran_on}
        for (label, _), (us, outside) in zip(devices, timed[1:]):
            row[label] = us
            if label == "host":
                row["overhead"] = outside
        rows.append(row)
        print(f"  timed {case.name}", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict[str, Any]], markdown: bool, opencl: list[str]) -> list[str]:
    """The decode table, fixed-width or Markdown; ``opencl``: the OpenCL devices' specs (a pair of columns each)."""
    named = len(opencl) > 1  # several OpenCL devices: each column names its device
    heads = [spec if named else "OpenCL" for spec in opencl] or ["OpenCL"]
    header = ["case", "torch µs", "host µs", f"host/torch (≤ {TARGETS['host']:.1f}x)",
              f"overhead µs (≤ {TARGETS['overhead']:.0f})"]
    for head in heads:
        header += [f"{head} µs", f"{head}/torch (≤ {TARGETS['opencl']:.1f}x)"]
    header.append(f"max |diff| host / {' / '.join(heads)}")
    body = []
    for row in rows:
        us = {label: row.get(label) for label in ("host", *(opencl or [None]))}
        ratios = {label: None if t is None else t / row["torch"] for label, t in us.items()}
        cells = [row["case"], f"{row['torch']:.1f}", "—" if us["host"] is None else f"{us['host']:.1f}",
                 judged(ratios["host"], TARGETS["host"], "{:.2f}x"),
                 judged(row.get("overhead"), TARGETS["overhead"], "{:.1f}")]
        for label in opencl or [None]:
            cells += ["—" if us[label] is None else f"{us[label]:.1f}",
                      judged(ratios[label], TARGETS["opencl"], "{:.2f}x")]
        cells.append(" / ".join(f"{row['diff'][d]:.1e}" if d in row["diff"] else "—"
                                for d in ("host", *(opencl or [None]))))
        body.append(cells)
    if markdown:  # a "|" inside a cell escaped
        header, *body = [[c.replace("|", r"\|") for c in cells] for cells in [header, *body]]
        return [f"| {' | '.join(cells)} |" for cells in [header, ["---"] * len(header), *body]]
    widths = [max(len(cells[i]) for cells in [header, *body]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
            for cells in [header, *body]]


def training_line(steps: int, runs: int) -> str:
    """The char-LSTM LM training step, rlx_gpu.torch.LSTM against torch.nn.LSTM on the host, one thread."""
    data = example.batches(steps)
    with rlx_device("host"):
        times, ratio = step_times(example.models("lstm"), data, runs)
    (ref_label, reference), (label, ours) = times.items()
    return (f"{example.TITLES['lstm']}, batch {example.BATCH} window {example.WINDOW}, training step on the host, "
            f"median of {runs} x {steps} steps: {ref_label} {reference * 1e3:.1f} ms, {label} {ours * 1e3:.1f} ms: "
            f"{judged(ratio, TARGETS['training'], '{:.2f}x')} (target ≤ {TARGETS['training']:.1f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="host,opencl", help="comma-separated: host, opencl")
    parser.add_argument("--opencl", default=None, help="the OpenCL device spec, or several comma-separated (default: "
                                                       "the first usable one that is not a simulator)")
    parser.add_argument("--runs", type=int, default=None, help="timed steps per block (default 200; --quick 20)")
    parser.add_argument("--rounds", type=int, default=None, help="blocks per path, taking turns (default 7; --quick 3)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps before each block (default 5; --quick 2)")
    parser.add_argument("--train-steps", type=int, default=None, help="training steps per run (default 20; --quick 4)")
    parser.add_argument("--train-runs", type=int, default=None, help="training runs per side (default 5; --quick 1)")
    parser.add_argument("--no-training", action="store_true", help="leave out the training step")
    parser.add_argument("--quick", action="store_true", help="fewer steps: a check that everything runs")
    parser.add_argument("--markdown", action="store_true", help="print the decode table in Markdown")
    args = parser.parse_args()
    defaults = dict(runs=(200, 20), rounds=(7, 3), warmup=(5, 2), train_steps=(20, 4), train_runs=(5, 1))
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    wanted = [d.strip() for d in args.devices.split(",") if d.strip()]
    unknown = set(wanted) - {"host", "opencl"}
    if unknown:
        parser.error(f"--devices {args.devices}: unknown {', '.join(sorted(unknown))}; expected host and/or opencl")
    torch.set_num_threads(1)

    devices = [("host", "host")] if "host" in wanted else []
    names = [f"host = {status('host').devices[0].name}"] if devices else []
    skipped = []
    for want in (args.opencl or "").split(",") if "opencl" in wanted else ():
        spec, name = opencl_device(want.strip() or None)
        if spec is None:
            skipped.append(f"OpenCL skipped: {name}")
        else:
            devices.append((spec, spec))  # an OpenCL device's label is its spec
            names.append(f"opencl = {spec} {name}")
    print(cpu_line())
    print(f"torch {torch.__version__}, torch.set_num_threads(1), OMP_NUM_THREADS=OPENBLAS_NUM_THREADS=1; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"devices: {'; '.join(names) or 'none'}")
    for line in skipped:
        print(line)
    print(f"decode, f32, batch 1, one token per call: median µs per step of {args.rounds} x {args.runs} steps "
          f"(after {args.warmup} warm-up), paths taking turns")
    start, t0 = cpu_ticks(), time.perf_counter()
    rows = decode_rows(args, devices)
    opencl = [label for label, _ in devices if label != "host"]
    for line in table(rows, args.markdown, opencl):
        print(line)
    for row, label in ((row, label) for row in rows for label in opencl):
        fell_back = row["ran_on"].get(label, set()) - {"opencl"}
        if fell_back:
            print(f"note: {row['case']} on {label} ran thunks on {', '.join(sorted(fell_back))} too")
    if not args.no_training:
        print(training_line(args.train_steps, args.train_runs))
    warn_if_shared(start, t0)


if __name__ == "__main__":
    main()
