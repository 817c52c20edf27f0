"""The OpenCL kernels of selective_scan_backward, mamba2_backward and gated_delta_net_backward (ABI.md §9),
at both kernel targets.

Each case turns on many of the forward's §8 fields at once and runs through the executor on every
OpenCL test device at the cpu and the gpu target; its gradients are compared with torch autograd of a
float64 forward written here from ABI.md §4 and §8 (a loop over steps, independent of the kernels):
every ``d_`` output, and the whole ``d_state`` pool (entries no row names stay as they were). The
kernels must also give the same bytes on a second run, and a NaN in ``d_dst`` must reach only what the
poisoned step depends on. (Every dtype, f64 among them, and each field present and absent: the conformance
catalog's backward cases, which tests/conformance/test_conformance.py runs on the same devices.)
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("rlx_gpu.backends.opencl")
from host_fallback.abi import complete  # noqa: E402
from host_fallback.arena import STORAGE  # noqa: E402
from rlx_gpu.conformance import runner  # noqa: E402
from rlx_gpu.conformance.cases import schedule_of  # noqa: E402
from rlx_gpu.conformance.catalog import Case  # noqa: E402
from rlx_gpu.conformance.compare import nmse  # noqa: E402
from rlx_gpu.conformance.devices import find, open_device  # noqa: E402
from rlx_gpu.graph.builder import Graph  # noqa: E402
from rlx_gpu.runtime.config import load_config  # noqa: E402
from rlx_gpu.runtime.executor import Device  # noqa: E402
from rlx_gpu.runtime.options import RunOptions  # noqa: E402
from support.conformance_devices import KERNEL_OPENCL as OPENCL  # noqa: E402

F = torch.nn.functional

_CARRIED = dict(carry_state=True, state=True, d_state=True)
_PACKED = dict(batch=1, cu_seqlens=[0, 5, 5, 40], num_seqs=3, state_slots=[2, 0, 3], num_slots=4)  # one empty
CASES = [
    # every field at once: varlen into slots, a 16-bit thunk with f32 state and parameters, chunks of
    # checkpoints (40 steps) and blocks of channels
    Case("selective_scan_backward", "bf16", dict(
        seq=40, hidden=12, state_size=4, groups=2, delta_bias=True, d_delta_bias=True, delta_softplus=True, d=True,
        d_d=True, z=True, d_z=True, state_dtype="f32", param_dtype="f32", **_CARRIED, **_PACKED)),
    Case("mamba2_backward", "bf16", dict(
        seq=40, heads=4, head_dim=3, state_size=5, groups=2, dt_bias=True, d_dt_bias=True, dt_softplus=True,
        dt_limit=[0.05, 1.5], d=True, d_d=True, z=True, d_z=True, state_dtype="f32", param_dtype="f32",
        **_CARRIED, **_PACKED)),
    # batch rows and slots without varlen; version 1's shared b, c
    Case("selective_scan_backward", "f32", dict(batch=2, seq=37, hidden=5, state_size=16, z=True, d_z=True,
                                                state_slots=[1, 0], num_slots=2, **_CARRIED)),
    Case("mamba2_backward", "f32", dict(batch=2, seq=6, heads=2, head_dim=5, state_size=4, groups=1,
                                        dt_limit=[0.1, 0.3], d=True, d_d=True)),
    # gated_delta_net: every field (grouped value heads, K != V, per-channel gate, q/k norm, scale, f32 state
    # beside bf16, varlen into slots), then batch rows with a carried state
    Case("gated_delta_net_backward", "bf16", dict(
        seq=40, heads=2, value_heads=4, state_size=4, value_size=3, gate_per_channel=True, qk_l2norm=True,
        scale=0.5, carry_state=True, state_dtype="f32", **_PACKED)),
    Case("gated_delta_net_backward", "f32", dict(batch=2, seq=37, heads=2, state_size=5, gate_per_channel=False,
                                                 carry_state=True)),
]


def _rows(t, seq):
    """(batch row, first step, end step, state entry) of every independent sequence of ``t``."""
    if t["cu_seqlens"] is not None:
        cu = t["_cu"]
        spans = [(0, cu[i], cu[i + 1]) for i in range(t["num_seqs"])]
    else:
        spans = [(b, 0, seq) for b in range(t["batch"])]
    slots = t["_slots"] if t["state_slots"] is not None else list(range(len(spans)))
    return [(b, t0, t1, slot) for (b, t0, t1), slot in zip(spans, slots)]


def _delta(t, raw, bias_field, softplus_field):
    """The forward's delta (dt) transform of §8: bias, softplus, the clamp."""
    v = raw + t["_T"][bias_field] if t[bias_field] is not None else raw
    if t[softplus_field]:
        v = F.softplus(v)  # the identity above 20, as §8 says
    if t.get("dt_limit") is not None:
        lo, hi = t["dt_limit"]
        v = torch.clamp(v, min=lo, max=hi if hi is not None else float("inf"))
    return v


def _finish(t, y, xv, zv, dv):
    if t["d"] is not None:
        y = y + dv * xv
    if t["z"] is not None:
        y = y * F.silu(zv)
    return y


def _selective_scan(t, T):
    """dst and the final states of selective_scan (ABI.md §4, §8), step by step in float64."""
    x, a = T["x"], T["a"]
    h_, n = a.shape
    b, c = (T["b"], T["c"]) if T["b"].dim() == 4 else (T["b"][:, :, None], T["c"][:, :, None])
    grp = torch.arange(h_) // (h_ // b.shape[2])
    out, finals = torch.zeros_like(x.detach()), {}
    for row, t0, t1, slot in _rows(t, x.shape[1]):
        h = T["state"][slot] if t["carry_state"] else torch.zeros(h_, n, dtype=x.dtype)
        ys = []
        for s in range(t0, t1):
            dl = _delta(t, T["delta"][row, s], "delta_bias", "delta_softplus")
            h = torch.exp(dl[:, None] * a) * h + (dl * x[row, s])[:, None] * b[row, s][grp]
            zv = T["z"][row, s] if t["z"] is not None else None
            ys.append(_finish(t, (h * c[row, s][grp]).sum(-1), x[row, s], zv, T.get("d")))
        if ys:
            out[row, t0:t1] = torch.stack(ys)
        finals[slot] = h
    return out, finals


def _mamba2(t, T):
    """dst and the final states of mamba2 (ABI.md §4, §8), step by step in float64."""
    x, a = T["x"], T["a"]
    _, _, hd, p = x.shape
    n = T["b"].shape[-1]
    grp = torch.arange(hd) // (hd // T["b"].shape[2])
    out, finals = torch.zeros_like(x.detach()), {}
    for row, t0, t1, slot in _rows(t, x.shape[1]):
        st = T["state"][slot] if t["carry_state"] else torch.zeros(hd, p, n, dtype=x.dtype)
        ys = []
        for s in range(t0, t1):
            dt = _delta(t, T["dt"][row, s], "dt_bias", "dt_softplus")
            st = (torch.exp(dt * a)[:, None, None] * st
                  + (dt[:, None] * x[row, s])[:, :, None] * T["b"][row, s][grp][:, None, :])
            y = (st * T["c"][row, s][grp][:, None, :]).sum(-1)
            zv = T["z"][row, s] if t["z"] is not None else None
            dv = T["d"][:, None] if t["d"] is not None else None
            ys.append(_finish(t, y, x[row, s], zv, dv))
        if ys:
            out[row, t0:t1] = torch.stack(ys)
        finals[slot] = st
    return out, finals


def _gated_delta_net(t, T):
    """dst and the final states of gated_delta_net (ABI.md §4, §8), step by step in float64."""
    q, k, v = T["q"], T["k"], T["v"]
    h, hv = q.shape[2], v.shape[2]
    key = torch.arange(hv) // (hv // h)
    scale = t["scale"] if t["scale"] is not None else q.shape[-1] ** -0.5
    out, finals = torch.zeros_like(v.detach()), {}
    for row, t0, t1, slot in _rows(t, q.shape[1]):
        st = T["state"][slot] if t["carry_state"] else torch.zeros(hv, q.shape[-1], v.shape[-1], dtype=q.dtype)
        ys = []
        for s in range(t0, t1):
            qv, kv = q[row, s][key], k[row, s][key]
            if t["qk_l2norm"]:
                qv = qv / torch.sqrt((qv * qv).sum(-1, keepdim=True) + 1e-6)
                kv = kv / torch.sqrt((kv * kv).sum(-1, keepdim=True) + 1e-6)
            gate = torch.exp(T["g"][row, s])
            st = st * (gate[:, :, None] if t["gate_per_channel"] else gate[:, None, None])
            u = (v[row, s] - torch.einsum("hkv,hk->hv", st, kv)) * T["beta"][row, s][:, None]
            st = st + kv[:, :, None] * u[:, None, :]
            ys.append(scale * torch.einsum("hkv,hk->hv", st, qv))
        if ys:
            out[row, t0:t1] = torch.stack(ys)
        finals[slot] = st
    return out, finals


_FORWARD = {"selective_scan_backward": _selective_scan, "mamba2_backward": _mamba2,
            "gated_delta_net_backward": _gated_delta_net}
_INPUTS = {"selective_scan_backward": ("x", "delta", "a", "b", "c", "delta_bias", "d", "z", "state"),
           "mamba2_backward": ("x", "dt", "a", "b", "c", "dt_bias", "d", "z", "state"),
           "gated_delta_net_backward": ("q", "k", "v", "g", "beta", "state")}


def expected_gradients(t, load):
    """Every d_ output of backward thunk ``t`` (completed) by torch autograd of the float64 forward."""
    t = dict(t)
    if t["cu_seqlens"] is not None:
        t["_cu"] = [int(v) for v in load("cu_seqlens")]
    if t["state_slots"] is not None:
        t["_slots"] = [int(v) for v in load("state_slots")]
    names = [f for f in _INPUTS[t["op"]] if t.get(f) is not None and (f != "state" or t["carry_state"])]
    T = {f: torch.tensor(load(f), dtype=torch.float64, requires_grad=True) for f in names}
    t["_T"] = T
    out, finals = _FORWARD[t["op"]](t, T)
    loss = (out * torch.tensor(load("d_dst"))).sum()
    if t["carry_state"]:
        d_final = torch.tensor(load("d_state"))
        loss = loss + sum((finals[slot] * d_final[slot]).sum() for slot in finals)
    grads = torch.autograd.grad(loss, [T[f] for f in names], allow_unused=True)
    want = {f"d_{f}": (np.zeros(T[f].shape) if g is None else g.numpy()) for f, g in zip(names, grads)}
    if t["carry_state"]:  # entries of the pool no row names keep their bytes
        kept = load("d_state").copy()
        for slot in finals:
            kept[slot] = want["d_state"][slot]
        want["d_state"] = kept
    return want


@pytest.fixture(scope="module", params=[(spec, target) for spec in OPENCL for target in ("cpu", "gpu")], ids=str)
def session(request):
    spec, target = request.param
    return open_device(find(spec), target)


def _run(session, laid):
    config = load_config()
    device = Device(session, config, RunOptions.build(config))
    with np.errstate(all="ignore"):
        return device.run(schedule_of(dict(laid.thunk), laid.arena.size), laid.arena.copy())


def _loader(laid, arena):
    regions = {r.field: r for r in laid.regions}

    def load(field):
        r = regions[field]
        return arena[r.offset: r.offset + r.nbytes].view(STORAGE[r.dtype]).astype(
            np.float64 if r.dtype != "i32" else np.int64).reshape(r.shape)
    return load


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.op}-{c.dtype}")
def test_gradients_match_torch_autograd_of_the_float64_forward(session, case):
    laid = runner.lay_out(case)
    assert session.unsupported(laid.thunk) is None, session.unsupported(laid.thunk)
    want = expected_gradients(complete(laid.thunk), _loader(laid, laid.arena))
    got = _run(session, laid)
    load = _loader(laid, got)
    bound = load_config().tolerance(case.op, case.dtype)
    assert set(want) == {r.field for r in laid.regions if r.field.startswith("d_") and r.field != "d_dst"}
    for field, value in want.items():
        err = nmse(load(field), value)
        assert err < bound, f"{field}: nmse {err:.3g} (bound {bound:.3g})"
    assert np.array_equal(_run(session, laid), got), "a second run gave other bytes"


def test_a_nan_in_d_dst_reaches_only_the_steps_it_depends_on(session):
    # the variant of the f32 case above (one program build less)
    case = Case("selective_scan_backward", "f32", dict(batch=2, seq=40, hidden=3, state_size=4, z=True, d_z=True,
                                                       state_slots=[0, 1], num_slots=2, **_CARRIED),
                poison="d_dst", poison_step=33, poison_value=np.nan)
    laid = runner.lay_out(case)
    load = _loader(laid, _run(session, laid))
    dx, dz, d_b = load("d_x"), load("d_z"), load("d_b")
    assert np.isnan(dx[0, :34]).any() and np.isfinite(dx[0, 34:]).all() and np.isfinite(dx[1]).all()
    assert np.isnan(dz[0, 33, 0]) and np.isfinite(dz[0, 34:]).all() and np.isfinite(dz[1]).all()
    assert np.isfinite(d_b[0, 34:]).all() and np.isfinite(d_b[1]).all()
    assert np.isfinite(load("d_state")[1]).all() and np.isnan(load("d_state")[0]).any()


def test_a_graph_trains_through_mamba2_on_opencl_without_falling_back(tmp_path, monkeypatch):
    """Graph.backward of a mamba2 call (D, z, dt bias, softplus, clamp, groups, carried state), compiled
    for OpenCL with fallback forbidden: forward and backward thunks run there, against torch autograd."""
    config = tmp_path / "forbid.yaml"
    config.write_text("fallback: forbid\n")
    monkeypatch.setenv("RLX_CONFIG", str(config))
    b, s, h, p, n, groups = 2, 37, 4, 3, 5, 2
    rng = np.random.default_rng(7)
    data = {"x": rng.standard_normal((b, s, h, p)), "dt": np.abs(rng.standard_normal((b, s, h))) * 0.5,
            "a": -np.abs(rng.standard_normal(h)), "b": rng.standard_normal((b, s, groups, n)),
            "c": rng.standard_normal((b, s, groups, n)), "d": rng.standard_normal(h),
            "dt_bias": rng.standard_normal(h) * 0.3, "z": rng.standard_normal((b, s, h, p)),
            "state": rng.standard_normal((b, h, p, n)), "dy": rng.standard_normal((b, s, h, p)),
            "ds": rng.standard_normal((b, h, p, n))}
    g = Graph("f32")
    inputs = {k: g.input(k, v.shape) for k, v in data.items()}
    y, _ = g.mamba2(*(inputs[k] for k in ("x", "dt", "a", "b", "c")), D=inputs["d"], z=inputs["z"],
                    dt_bias=inputs["dt_bias"], dt_softplus=True, dt_limit=(0.05, 1.5), initial_state=inputs["state"])
    # with a saved forward (Graph's default): the device's forward writes it, its backward reads it
    grads = g.backward(y, inputs["dy"], {"state": inputs["ds"]})
    for name, t in grads.items():
        g.output(f"d_{name}", t)
    got = g.compile(OPENCL[0]).run(**{k: v.astype(np.float32) for k, v in data.items()})

    stored = {k: torch.tensor(v.astype(np.float32).astype(np.float64), requires_grad=True) for k, v in data.items()}
    t = {"cu_seqlens": None, "state_slots": None, "carry_state": True, "batch": b, "dt_bias": 1, "dt_softplus": True,
         "dt_limit": [0.05, 1.5], "d": 1, "z": 1, "_T": stored}
    out, finals = _mamba2(t, stored)
    loss = (out * stored["dy"]).sum() + sum((finals[r] * stored["ds"][r]).sum() for r in finals)
    loss.backward()
    for name in grads:
        err = nmse(got[f"d_{name}"], stored[name].grad.numpy())
        assert err < 1e-7, f"d_{name}: nmse {err:.3g}"


def test_every_catalog_case_of_these_ops_runs_on_the_device(session):
    """The conformance catalog's cases of the three backward ops (every field present and absent, the saved
    forward (reserve) among them, every dtype) are the device's to run, not the host's: none is refused."""
    from rlx_gpu.conformance.catalog import cases

    ours = [c for c in cases() if c.op in _FORWARD and not c.refused]
    assert {c.op for c in ours} == set(_FORWARD) and {c.dtype for c in ours} == {"f16", "bf16", "f32", "f64"}
    assert {c.op for c in ours if "reserve" in c.params} == set(_FORWARD)
    refused = {c.id: session.unsupported(runner.lay_out(c).thunk) for c in ours}
    assert not {k: v for k, v in refused.items() if v is not None}
