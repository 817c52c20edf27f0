"""docs/abi.md: every worked schedule is valid and runs, and the matmul, gated_delta_net, mamba2, lstm
and scan examples compute what the page says (NumPy written from the page, not from host_fallback)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import rlx_gpu
from host_fallback.abi import OPS

DOC = Path(__file__).resolve().parents[2] / "docs" / "abi.md"
TEXT = DOC.read_text()


def worked_examples() -> dict[str, dict]:
    """Every fenced JSON block that is a schedule, by its ``meta.example`` name, else the op of its first thunk."""
    blocks = [json.loads(b) for b in re.findall(r"```json\n(.*?)```", TEXT, re.S)]
    return {b.get("meta", {}).get("example", b["thunks"][0]["op"]): b for b in blocks if "abi" in b}


EXAMPLES = worked_examples()
sigmoid = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731


def test_one_worked_example_per_op_family_and_per_version_2_feature():
    assert set(EXAMPLES) == {"lstm", "mamba2", "gated_delta_net", "matmul", "scan", "mamba2-varlen-slots",
                             "selective_scan-fused-carried", "gated_delta_net-gva-varlen", "gru-onnx-seq_lens",
                             "lstm-proj-peepholes", "causal_conv1d-prefill-decode"}
    for name, example in EXAMPLES.items():
        assert example["abi"] == ("rlx-thunks/2" if "-" in name else "rlx-thunks/1"), name


def run(op: str, **given: np.ndarray) -> dict[str, np.ndarray]:
    """Load the worked example ``op``, write its inputs (seeded random unless given), run it on the host."""
    sched = rlx_gpu.load_schedule(EXAMPLES[op])
    rng = np.random.default_rng(1)
    arena = sched.pristine_arena()
    values = {}
    for name in sched.inputs:
        view = sched.tensors[name]
        values[name] = given.get(name, rng.standard_normal(view.shape) * 0.5)
        view.write(arena, values[name])
        values[name] = view.read(arena).astype(np.float64)  # what the arena holds (f32)
    out = rlx_gpu.get_device("host").run(sched, arena)
    return values, {name: sched.tensors[name].read(out).astype(np.float64) for name in sched.outputs}


def test_matmul_example_is_tanh_of_a_times_b_plus_bias():
    x, y = run("matmul")
    np.testing.assert_allclose(y["y"], np.tanh(x["a"] @ x["b"] + x["bias"]), rtol=1e-5, atol=1e-6)


def test_gated_delta_net_example_follows_the_four_steps():
    rng = np.random.default_rng(2)
    k = rng.standard_normal((1, 3, 2, 4))
    x, y = run("gated_delta_net", k=k / np.linalg.norm(k, axis=-1, keepdims=True),
               g=-np.abs(rng.standard_normal((1, 3, 2))), beta=rng.uniform(0.1, 0.9, (1, 3, 2)))
    N = 4
    state = x["state"].copy()
    out = np.zeros((1, 3, 2, N))
    for h in range(2):
        S = state[0, h]  # [i key, j value]
        for t in range(3):
            S *= np.exp(x["g"][0, t, h])
            u = (x["v"][0, t, h] - S.T @ x["k"][0, t, h]) * x["beta"][0, t, h]
            S += np.outer(x["k"][0, t, h], u)
            out[0, t, h] = S.T @ x["q"][0, t, h] / np.sqrt(N)
    np.testing.assert_allclose(y["y"], out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y["state"], state, rtol=1e-5, atol=1e-6)


def test_mamba2_example_follows_the_recurrence():
    rng = np.random.default_rng(3)
    x, y = run("mamba2", dt=np.abs(rng.standard_normal((1, 4, 2))) * 0.5, a=-np.abs(rng.standard_normal(2)))
    want = np.zeros((1, 4, 2, 3))
    for h in range(2):
        S = np.zeros((3, 2))
        for t in range(4):
            dt = x["dt"][0, t, h]
            S = np.exp(dt * x["a"][h]) * S + np.outer(dt * x["x"][0, t, h], x["b"][0, t, h])
            want[0, t, h] = S @ x["c"][0, t, h]
    np.testing.assert_allclose(y["y"], want, rtol=1e-5, atol=1e-6)


def test_lstm_example_follows_the_gate_order_and_carries_its_state():
    x, y = run("lstm")
    H = 5
    w_ih, w_hh, bias = x["w_ih"].reshape(4 * H, 4), x["w_hh"][0], x["bias"][0]
    h, c = x["h"][0].copy(), x["c"][0].copy()
    want = np.zeros((2, 3, H))
    for t in range(3):
        z = x["x"][:, t] @ w_ih.T + h @ w_hh.T + bias
        i, f, g, o = sigmoid(z[:, :H]), sigmoid(z[:, H:2 * H]), np.tanh(z[:, 2 * H:3 * H]), sigmoid(z[:, 3 * H:])
        c = f * c + i * g
        h = o * np.tanh(c)
        want[:, t] = h
    np.testing.assert_allclose(y["y"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y["h"][0], h, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y["c"][0], c, rtol=1e-5, atol=1e-6)


def test_scan_example_iterates_its_body():
    x, y = run("scan")
    h = x["h0"]
    for t in range(5):
        h = np.tanh(h + x["xs"][t])
    np.testing.assert_allclose(y["h"], h, rtol=1e-5, atol=1e-6)


softplus = lambda u: np.where(u > 20, u, np.log1p(np.exp(np.minimum(u, 20))))  # noqa: E731
silu = lambda u: u * sigmoid(u)  # noqa: E731


def test_the_serving_example_prefills_three_packed_prompts_into_their_slots():
    rng = np.random.default_rng(4)
    cu, slots = np.array([0, 2, 2, 6]), np.array([3, 0, 1])
    x, y = run("mamba2-varlen-slots", cu_seqlens=cu, slots=slots, A=-np.abs(rng.standard_normal(2)))
    want_state = x["state"].copy()
    want = np.zeros((1, 6, 2, 2))
    dt = np.maximum(softplus(x["dt"] + x["dt_bias"]), 0.0)  # [0, null]: clamped below at 0, no upper bound
    for seq, slot in enumerate(slots):
        for h in range(2):
            S = x["state"][slot, h].copy()  # [P, N]
            for t in range(cu[seq], cu[seq + 1]):
                d = dt[0, t, h]
                S = np.exp(d * x["A"][h]) * S + np.outer(d * x["x"][0, t, h], x["B"][0, t, 0])
                out = S @ x["C"][0, t, 0] + x["D"][h] * x["x"][0, t, h]
                want[0, t, h] = out * silu(x["z"][0, t, h])
            want_state[slot, h] = S
    np.testing.assert_allclose(y["y"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y["state"], want_state, rtol=1e-5, atol=1e-6)  # entry 2 untouched, entry 0 kept


def test_the_fused_selective_scan_example():
    rng = np.random.default_rng(5)
    x, y = run("selective_scan-fused-carried", A=-np.abs(rng.standard_normal((4, 2))))
    delta = softplus(x["delta"] + x["delta_bias"])
    want, state = np.zeros((2, 3, 4)), x["state"].copy()
    for b in range(2):
        for ch in range(4):
            g = ch // 2
            h = state[b, ch]
            for t in range(3):
                h = np.exp(delta[b, t, ch] * x["A"][ch]) * h + delta[b, t, ch] * x["B"][b, t, g] * x["u"][b, t, ch]
                out = h @ x["C"][b, t, g] + x["D"][ch] * x["u"][b, t, ch]
                want[b, t, ch] = out * silu(x["z"][b, t, ch])
            state[b, ch] = h
    np.testing.assert_allclose(y["y"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y["state"], state, rtol=1e-5, atol=1e-6)


def test_the_grouped_packed_gated_delta_net_example():
    rng = np.random.default_rng(6)
    cu = np.array([0, 2, 5])
    x, y = run("gated_delta_net-gva-varlen", cu_seqlens=cu, g=-np.abs(rng.standard_normal((1, 5, 2))),
               beta=rng.uniform(0.1, 0.9, (1, 5, 2)))
    unit = lambda u: u / np.sqrt(np.sum(u * u) + 1e-6)  # noqa: E731
    want, state = np.zeros((1, 5, 2, 2)), x["state"].copy()
    for seq in range(2):
        for j in range(2):  # value head j uses key head j // 2 = 0
            S = state[seq, j]  # [K, V]
            for t in range(cu[seq], cu[seq + 1]):
                q, k = unit(x["q"][0, t, 0]), unit(x["k"][0, t, 0])
                S *= np.exp(x["g"][0, t, j])
                u = (x["v"][0, t, j] - S.T @ k) * x["beta"][0, t, j]
                S += np.outer(k, u)
                want[0, t, j] = 0.5 * S.T @ q
    np.testing.assert_allclose(y["o"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y["state"], state, rtol=1e-5, atol=1e-6)


def test_the_onnx_gru_example_skips_the_padding():
    lens = np.array([3, 1])
    x, y = run("gru-onnx-seq_lens", sequence_lens=lens)
    H = 2
    want, h_n = np.zeros((2, 3, 2 * H)), np.zeros((2, 2, H))
    for d in range(2):
        w = x["W"].reshape(2, 3 * H, 2)[d]
        r_w, b_ih, b_hh = x["R"][d], x["b_ih"][d], x["b_hh"][d]
        for b in range(2):
            h = x["h"][d, b].copy()
            steps = range(lens[b]) if d == 0 else range(lens[b] - 1, -1, -1)
            for t in steps:
                gi, gh = w @ x["X"][b, t] + b_ih, r_w @ h  # linear_before_reset = false: W_hn·(r ⊙ h)
                r = sigmoid(gi[:H] + gh[:H] + b_hh[:H])
                z = sigmoid(gi[H:2 * H] + gh[H:2 * H] + b_hh[H:2 * H])
                n = np.tanh(gi[2 * H:] + r_w[2 * H:] @ (r * h) + b_hh[2 * H:])
                h = (1 - z) * n + z * h
                want[b, t, d * H:(d + 1) * H] = h
            h_n[d, b] = h
    np.testing.assert_allclose(y["Y"], want, rtol=1e-5, atol=1e-6)  # row 1's steps 1, 2: zeros
    np.testing.assert_allclose(y["h"], h_n, rtol=1e-5, atol=1e-6)


def test_the_projected_lstm_example():
    x, y = run("lstm-proj-peepholes")
    H, P = 3, 2
    w_ih, w_hh, bias = x["w_ih"].reshape(4 * H, 2), x["w_hh"][0], x["bias"][0]
    p_i, p_o, p_f = x["P"][0, :H], x["P"][0, H:2 * H], x["P"][0, 2 * H:]
    clip = lambda v: np.clip(v, -2.0, 2.0)  # noqa: E731
    h, c = np.zeros(P), np.zeros(H)
    want = np.zeros((1, 3, P))
    for t in range(3):
        z = w_ih @ x["x"][0, t] + w_hh @ h + bias
        i = sigmoid(clip(z[:H] + p_i * c))
        f = sigmoid(clip(z[H:2 * H] + p_f * c))
        g = np.tanh(clip(z[2 * H:3 * H]))
        c = f * c + i * g
        o = sigmoid(clip(z[3 * H:] + p_o * c))
        h = x["w_hr"][0] @ (o * np.tanh(c))
        want[0, t] = h
    np.testing.assert_allclose(y["y"], want, rtol=1e-5, atol=1e-6)


def test_causal_conv1d_example_prefills_into_slots_then_decodes():
    cu, slots = np.array([0, 3, 4]), np.array([2, 0])
    x, y = run("causal_conv1d-prefill-decode", cu_seqlens=cu, slots=slots)
    silu = lambda u: u * sigmoid(u)  # noqa: E731
    w, bias, pool = x["weight"], x["bias"], x["state"].copy()

    def step(e: np.ndarray) -> np.ndarray:  # e [3, 2]: the window of one token, oldest first
        return silu(bias + np.sum(w.T * e, axis=0))

    want = np.zeros((1, 4, 2))
    for seq, slot in enumerate(slots):
        e = np.concatenate([pool[slot].T, x["x"][0, cu[seq]:cu[seq + 1]]])
        for k in range(cu[seq + 1] - cu[seq]):
            want[0, cu[seq] + k] = step(e[k:k + 3])
        pool[slot] = e[-2:].T
    want_next = np.zeros((2, 1, 2))
    for row, slot in enumerate(slots):
        e = np.concatenate([pool[slot].T, x["x_next"][row]])
        want_next[row, 0] = step(e)
        pool[slot] = e[-2:].T
    np.testing.assert_allclose(y["y"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y["y_next"], want_next, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y["state"], pool, rtol=1e-6)
    assert np.array_equal(y["state"][1], x["state"][1])  # entry 1 is not named


def _sections() -> dict[str, str]:
    """The text under each ``### ...`` heading, by the op names the heading spells in backticks."""
    out: dict[str, str] = {}
    parts = re.split(r"^### (.*)$", TEXT, flags=re.M)
    for heading, body in zip(parts[1::2], parts[2::2]):
        for op in re.findall(r"`(\w+)`", heading):
            out[op] = body
    return out


@pytest.mark.parametrize("op", list(OPS))
def test_every_field_of_every_op_is_documented(op):
    sections = _sections()
    assert op in sections, f"docs/abi.md has no ### heading for {op}"
    body = sections[op]
    # a section may define its fields as another op's plus some ("the fields of `scan_backward` ...")
    for other in re.findall(r"the fields of `(\w+)`", body, re.I):
        body += sections[other]
    words = set(re.findall(r"\w+", " ".join(re.findall(r"`([^`]*)`", body))))
    missing = [f for f in OPS[op].field_names if f not in words]
    assert not missing, f"docs/abi.md, section {op}: fields {missing} are not named"


def test_the_limits_table_is_the_one_in_code():
    limits = pytest.importorskip("rlx_gpu.schedule.limits", reason="the limits table arrives with #9 (untrusted)")
    section = TEXT.split("## 7. Limits")[1].split("\n## ")[0]
    rows = re.findall(r"^\| (?!limit|---)(.*?) \| (\S+) \|$", section, re.M)
    values = [2 ** int(v[2:]) if v.startswith("2^") else int(v) for _, v in rows]
    assert values == [limit.value for limit in limits.TABLE]


def test_the_state_size_every_backend_supports_is_the_kernels():
    from rlx_gpu.launches.limits import TUNING

    STATE_MAX = min(tuning["STATE_MAX"] for tuning in TUNING.values())  # per target since gpukern
    assert f"`state_size` up to {STATE_MAX} is supported by every backend" in TEXT
