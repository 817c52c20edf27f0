"""mamba3's host kernel (host_fallback.mamba3) against plain torch, in one run: the figures issue 37 sets targets
for (prefill B2 S2048 H8 P64 N64 ≤ 1.0x a plain-torch chunked Mamba-3 forward; a decode step ≤ 1.0x the
anchor's ``mamba3_siso_step_ref`` form in torch).

    python benchmarks/mamba3.py [--threads 2] [--runs 3] [--rounds 3] [--warmup 1] [--quick] [--device opencl:1:0]

Cases (f32, q/k biases, D and Z, N/4 angles, one q/k group):

- prefill B2 S2048 H8 P64 N64: torch's chunked form written here as the anchor's chunked reference computes it
  (the angle cumsum, the rotated biased q/k, then per chunk of 64 the masked intra-chunk products with the
  trapezoid's scale folded into the keys, the state carried between chunks), against the host's chunked path,
  and the host's step recurrence beside them (the reason the chunked form exists);
- decode step B16 H8 P64 N64: §11's six steps for one token in torch ops on the four states (the
  ``mamba3_siso_step_ref`` form), against the host's step straight on its state pools (``host_fallback.mamba3``'s
  array function: NumPy's step path) and against the thunk a runtime runs (``host_fallback.bound_kernel`` on its
  arena: the compiled whole step where Numba is installed).

With ``--device SPEC`` (an OpenCL device, at its own kernel target; ``RLX_TARGET`` forces one), the prefill also
times that device's chunked form (launches/mamba3.py) against its step recurrence (``ssm_kernel`` forced
each way; the arena stays on the device, no transfers timed), in the same turns as the host's.

Before timing, each case checks that the sides agree (max |diff| of the outputs). The sides take turns (a block
of ``--warmup`` untimed and ``--runs`` timed calls each, over ``--rounds`` rounds); medians in ms. Needs torch.
"""
from __future__ import annotations

import os

for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):  # before NumPy and torch start their pools
    os.environ.setdefault(_variable, "2")

import argparse  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]

import numpy as np  # noqa: E402
import torch  # noqa: E402

# benchmarks/rnn.py: the CPU header, the load check and the turn-taking timer
from rnn import alternate_ms, cpu_line, cpu_ticks, warn_if_shared  # noqa: E402

import host_fallback  # noqa: E402
from host_fallback import mamba3 as host  # noqa: E402
from host_fallback.abi import regions  # noqa: E402
from rlx_gpu.conformance import cases  # noqa: E402
from rlx_gpu.conformance.devices import find, open_device  # noqa: E402

TARGET = 1.0
FIELDS = ("q", "k", "v", "adt", "dt", "trap", "angles", "q_bias", "k_bias", "d", "z")
STATES = ("angle_state", "state", "k_state", "v_state")


def inputs(b: int, s: int, h: int, p: int, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Token-major f32 inputs in the layer's ranges (negative log-decays, positive steps)."""
    rng = np.random.default_rng(seed)
    a = n // 4
    shapes = dict(q=(b, s, 1, n), k=(b, s, 1, n), v=(b, s, h, p), adt=(b, s, h), dt=(b, s, h), trap=(b, s, h),
                  angles=(b, s, h, a), q_bias=(h, n), k_bias=(h, n), d=(h,), z=(b, s, h, p))
    out = {f: rng.standard_normal(shape).astype(np.float32) for f, shape in shapes.items()}
    out["adt"], out["dt"] = -np.abs(out["adt"]) * 0.1, np.abs(out["dt"]) * 0.1
    return out


def _rotate(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    a = theta.shape[-1]
    even, odd = x[..., 0:2 * a:2], x[..., 1:2 * a:2]
    cos, sin = theta.cos(), theta.sin()
    turned = torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2)
    return torch.cat([turned, x[..., 2 * a:]], -1)


def _prepared(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """§11 steps 1-3 for every token: λ, α's log, β' = (1−λ)·dt, γ = λ·dt, and the rotated, biased q and k."""
    heads = t["v"].shape[2]
    lam = t["trap"].sigmoid()
    theta = torch.cumsum(math.pi * t["angles"].tanh() * t["dt"][..., None], dim=1)
    q = _rotate(t["q"].expand(-1, -1, heads, -1) + t["q_bias"], theta)
    k = _rotate(t["k"].expand(-1, -1, heads, -1) + t["k_bias"], theta)
    return lam, (1 - lam) * t["dt"], lam * t["dt"], q, k


def torch_chunked(t: dict[str, torch.Tensor], chunk: int = 64) -> torch.Tensor:
    """The plain-torch chunked Mamba-3 forward (zero initial state): per chunk of ``chunk`` tokens, the masked
    intra-chunk products (keys scaled by γ_s + β'_{s+1}, the diagonal by γ_t), the carried state's part, and the
    state passed to the next chunk with the trapezoid's boundary term."""
    _, bprime, gamma, q, k = _prepared(t)
    v, adt = t["v"], t["adt"]
    b, s, h, p = v.shape
    n = q.shape[-1]
    state = v.new_zeros(b, h, p, n)
    k_bar, v_bar = v.new_zeros(b, h, n), v.new_zeros(b, h, p)
    out = torch.empty_like(v)
    for lo in range(0, s, chunk):
        hi = min(s, lo + chunk)
        qc, kc, vc = (x[:, lo:hi].transpose(1, 2) for x in (q, k, v))
        gc, bc = gamma[:, lo:hi].transpose(1, 2), bprime[:, lo:hi].transpose(1, 2)
        c = adt[:, lo:hi].transpose(1, 2).cumsum(-1)
        s0 = state + bc[..., 0, None, None] * v_bar[..., :, None] * k_bar[..., None, :]
        weight = gc.clone()
        weight[..., :-1] += bc[..., 1:]
        mask = torch.tril(torch.ones(hi - lo, hi - lo, dtype=torch.bool), -1)
        decay = torch.exp((c[..., :, None] - c[..., None, :]).masked_fill(~mask, -math.inf)) * weight[..., None, :]
        decay = decay + torch.diag_embed(gc)
        y = (qc @ kc.transpose(-1, -2) * decay) @ vc + c.exp()[..., None] * (qc @ s0.transpose(-1, -2))
        out[:, lo:hi] = y.transpose(1, 2)
        tail = (c[..., -1:] - c).exp() * weight
        state = c[..., -1].exp()[..., None, None] * s0 + (vc * tail[..., None]).transpose(-1, -2) @ kc
        k_bar, v_bar = kc[..., -1, :], vc[..., -1, :]
    out = out + t["d"][:, None] * v
    return out * t["z"] * t["z"].sigmoid()


def torch_step(t: dict[str, torch.Tensor], states: list[torch.Tensor]) -> torch.Tensor:
    """One decode token in torch ops (``mamba3_siso_step_ref``'s form): the four states advanced in place."""
    theta, big_s, k_bar, v_bar = states
    heads = t["v"].shape[1]
    lam, dt = t["trap"].sigmoid(), t["dt"]
    alpha = t["adt"].exp()
    theta += math.pi * t["angles"].tanh() * dt[..., None]
    q = _rotate(t["q"].expand(-1, heads, -1) + t["q_bias"], theta)
    k = _rotate(t["k"].expand(-1, heads, -1) + t["k_bias"], theta)
    v = t["v"]
    big_s.mul_(alpha[..., None, None]).add_(((1 - lam) * dt * alpha)[..., None, None] * v_bar[..., :, None]
                                            * k_bar[..., None, :])
    big_s.add_((lam * dt)[..., None, None] * v[..., :, None] * k[..., None, :])
    y = (big_s @ q[..., None])[..., 0] + t["d"][:, None] * v
    k_bar.copy_(k)
    v_bar.copy_(v)
    return y * t["z"] * t["z"].sigmoid()


def laid_out(arrays: dict[str, np.ndarray], pools: list[np.ndarray] | None = None) -> tuple[dict, np.ndarray]:
    """A f32 mamba3 thunk of ``arrays`` (every optional field) and its arena holding them; with ``pools``, the four
    carried states (``carry_state``) too."""
    b, s, h, p = arrays["v"].shape
    fields = dict(batch=b, seq=s, heads=h, head_dim=p, state_size=arrays["q"].shape[-1],
                  num_angles=arrays["angles"].shape[-1], groups=arrays["q"].shape[2],
                  **dict.fromkeys(("q_bias", "k_bias", "d", "z"), True))
    values = dict(arrays)
    if pools is not None:
        fields.update(carry_state=True, **dict.fromkeys(STATES, True))
        values.update(zip(STATES, pools))
    thunk, size = cases.lay_out("mamba3", "f32", fields)
    arena = np.zeros(size, np.uint8)
    for r in regions(thunk):
        if r.field in values:
            arena[r.offset: r.offset + r.nbytes] = values[r.field].astype(np.float32).reshape(-1).view(np.uint8)
    return thunk, arena


def device_prefill(spec: str, arrays: dict[str, np.ndarray]) -> tuple[str, dict[str, object], object]:
    """On the device ``spec``: its description, form ("chunked", "step") -> a function that
    runs the prefill of ``arrays`` once and waits, and one that reads its output back."""
    thunk, arena = laid_out(arrays)
    info = find(spec)
    session = open_device(info)
    dev = session.upload(arena)
    dst = next(r for r in regions(thunk) if r.field == "dst")

    def form(kernel: str):  # ssm_kernel: "chunked", or "lanes" (the step recurrence)
        def run():
            session.launch(thunk, dev, ssm_kernel=kernel)
            session.finish()
        return run

    def output() -> np.ndarray:
        return session.read(dev, dst.offset, dst.nbytes).view(np.float32).reshape(dst.shape)
    forms = {"chunked": form("chunked"), "step": form("lanes")}
    return f"{info.name} ({spec}, {session.limits.target} target)", forms, output


def _report(name: str, times: list[float], labels: list[str]) -> None:
    ratios = ", ".join(f"{lab} {ms:.2f} ms ({ms / times[0]:.2f}x)" for lab, ms in zip(labels, times))
    print(f"{name}: {ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="S512 prefill, fewer runs")
    parser.add_argument("--device", help="also the prefill's chunked and step forms on this OpenCL device")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_line(), f"threads {args.threads}")
    start, t0 = cpu_ticks(), time.perf_counter()
    seq = 512 if args.quick else 2048
    arrays = inputs(2, seq, 8, 64, 64)
    tensors = {f: torch.from_numpy(a) for f, a in arrays.items()}
    sides = {"torch chunked": lambda: torch_chunked(tensors), "host chunked": lambda: host.mamba3(**arrays),
             "host step": lambda: host.mamba3(**arrays, path="step")}
    with torch.no_grad():
        want = torch_chunked(tensors).numpy()
        got = host.mamba3(**arrays)
        print(f"prefill B2 S{seq} H8 P64 N64: max |host - torch| = {np.max(np.abs(got - want)):.2g}")
        if args.device:
            name, forms, output = device_prefill(args.device, arrays)
            for kernel, run in forms.items():
                run()
                print(f"device {name} {kernel}: max |device - torch| = {np.max(np.abs(output() - want)):.2g}")
            sides.update({"device chunked": forms["chunked"], "device step": forms["step"]})
        times = alternate_ms(list(sides.values()), args.runs, args.warmup, args.rounds)
    _report(f"prefill B2 S{seq} H8 P64 N64", times, list(sides))
    one = inputs(16, 1, 8, 64, 64, seed=1)
    rng = np.random.default_rng(2)
    pools = [rng.standard_normal(s).astype(np.float32) for s in ((16, 8, 16), (16, 8, 64, 64), (16, 8, 64), (16, 8, 64))]
    torch_states = [torch.from_numpy(p.copy()) for p in pools]
    step_inputs = {f: torch.from_numpy(a[:, 0] if a.ndim > 2 or f in ("adt", "dt", "trap") else a)
                   for f, a in one.items()}
    with torch.no_grad():
        want = torch_step(step_inputs, [s.clone() for s in torch_states]).numpy()
        got = host.mamba3(**one, states=[p.copy() for p in pools])[:, 0]
        print(f"decode B16 H8 P64 N64: max |host - torch| = {np.max(np.abs(got - want)):.2g}")
        thunk, arena = laid_out(one, pools)
        step_thunk = host_fallback.bound_kernel(thunk, {})
        step_thunk(arena)
        dst = next(r for r in regions(thunk) if r.field == "dst")
        got = arena[dst.offset: dst.offset + dst.nbytes].view(np.float32).reshape(dst.shape)[:, 0]
        print(f"decode B16 H8 P64 N64: max |host thunk - torch| = {np.max(np.abs(got - want)):.2g}")
        times = alternate_ms([lambda: torch_step(step_inputs, torch_states), lambda: host.mamba3(**one, states=pools),
                              lambda: step_thunk(arena)], args.runs * 10, args.warmup, args.rounds)
    _report("decode B16 H8 P64 N64", times, ["torch step", "host step", "host thunk"])
    warn_if_shared(start, t0)


if __name__ == "__main__":
    main()
