"""The roofline model's counts (``launches.cost``, ``conformance.roofline``) against counts taken independently.

Each count here comes from a float64 loop written in this file from ABI.md §4 (the step recurrences) or from the
chunked WY algorithm (gated_delta_net), which counts its own arithmetic as it runs: the loop's outputs must
match ``conformance.reference_ssm`` (so the counted loop is the op), and its count the model's count of the
launches the planner gives for the same thunk. And the unit rule: a launch built with ``RLX_MMA`` moves its
GEMM-shaped FLOPs to the tensor cores, every other FLOP stays on the FMA units.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from host_fallback.abi.gdn import RESERVE_CHUNK
from rlx_gpu import launches
from rlx_gpu.conformance import reference_conv, reference_mamba3, reference_ssm, roofline
from rlx_gpu.conformance.cases import lay_out
from rlx_gpu.launches.cost import Cost, launch_cost
from rlx_gpu.launches.limits import REFERENCE_GPU, DeviceLimits
from rlx_gpu.launches.mma import MMA_16BIT, MMA_TF32, MMA_TILE

CPU = DeviceLimits(1024, 1 << 20, True)


def _plan_cost(op: str, params: dict, lim: DeviceLimits, **options) -> Cost:
    thunk, _ = lay_out(op, "f32", params)
    total = Cost()
    for launch in launches.plan(thunk, lim, **options).launches:
        cost = launch_cost(launch)
        assert cost is not None, f"kernel {launch.kernel} declares no cost"
        total += cost
    return total


class Counter:
    """FLOPs of matrix products counted as a loop runs, 2 per multiply-add."""

    def __init__(self) -> None:
        self.gemm = 0

    def product(self, a: np.ndarray, b: np.ndarray, used: np.ndarray | None = None) -> np.ndarray:
        """a·b, counting the entries of a that ``used`` (0/1 over a) keeps, or all of them."""
        self.gemm += 2 * int(a.size if used is None else used.sum()) * b.shape[1]
        return (a if used is None else a * used) @ b

    def gram(self, a: np.ndarray, b: np.ndarray, wanted: np.ndarray) -> np.ndarray:
        """The entries of a·bᵀ that ``wanted`` (0/1 over the result) keeps, counting only those."""
        self.gemm += 2 * int(wanted.sum()) * a.shape[1]
        return (a @ b.T) * wanted


def _mamba2_counted(x, dt, a, b, c) -> tuple[np.ndarray, int]:
    """ABI.md §4's mamba2 step by step in scalars, one FLOP counted per multiply, add and exp."""
    bsz, seq, heads, p = x.shape
    n = b.shape[-1]
    y, flops = np.zeros(x.shape), 0
    for r in range(bsz):
        for h in range(heads):
            s = np.zeros((p, n))
            for t in range(seq):
                decay = np.exp(dt[r, t, h] * a[h])
                flops += 2
                for i in range(p):
                    dx = dt[r, t, h] * x[r, t, h, i]
                    flops += 1
                    for j in range(n):
                        s[i, j] = decay * s[i, j] + dx * b[r, t, h, j]
                        y[r, t, h, i] += s[i, j] * c[r, t, h, j]
                        flops += 5
    return y, flops


@pytest.mark.parametrize("lim, kernel", [(CPU, "auto"), (REFERENCE_GPU, "lanes")])
def test_the_mamba2_recurrence_counts_the_flops_of_a_counted_step_loop(lim, kernel):
    rng = np.random.default_rng(0)
    bsz, seq, heads, p, n = 2, 5, 3, 4, 6
    x = rng.normal(size=(bsz, seq, heads, p))
    b, c = rng.normal(size=(bsz, seq, heads, n)), rng.normal(size=(bsz, seq, heads, n))
    dt, a = rng.uniform(0.1, 1.0, (bsz, seq, heads)), -rng.uniform(0.5, 2.0, heads)
    y, flops = _mamba2_counted(x, dt, a, b, c)
    np.testing.assert_allclose(y, reference_ssm.mamba2(x, dt, a, b, c), rtol=1e-12, atol=1e-12)
    cost = _plan_cost("mamba2", dict(batch=bsz, seq=seq, heads=heads, head_dim=p, state_size=n), lim,
                      ssm_kernel=kernel)
    assert (cost.gemm, cost.other) == (0, flops)


def _selective_scan_counted(x, delta, a, b, c) -> tuple[np.ndarray, int]:
    """ABI.md §4's selective_scan step by step in scalars, one FLOP counted per multiply, add and exp."""
    bsz, seq, hidden = x.shape
    n = a.shape[1]
    y, flops = np.zeros(x.shape), 0
    for r in range(bsz):
        for ch in range(hidden):
            h = np.zeros(n)
            for t in range(seq):
                dx = delta[r, t, ch] * x[r, t, ch]
                flops += 1
                for j in range(n):
                    h[j] = np.exp(delta[r, t, ch] * a[ch, j]) * h[j] + dx * b[r, t, 0, j]
                    y[r, t, ch] += c[r, t, 0, j] * h[j]
                    flops += 7
    return y, flops


@pytest.mark.parametrize("lim, kernel", [(CPU, "auto"), (REFERENCE_GPU, "lanes")])
def test_selective_scan_counts_the_flops_of_a_counted_step_loop(lim, kernel):
    rng = np.random.default_rng(3)
    bsz, seq, hidden, n = 2, 6, 3, 4
    x, b, c = rng.normal(size=(bsz, seq, hidden)), rng.normal(size=(bsz, seq, 1, n)), rng.normal(size=(bsz, seq, 1, n))
    delta, a = rng.uniform(0.1, 1.0, (bsz, seq, hidden)), -rng.uniform(0.5, 2.0, (hidden, n))
    y, flops = _selective_scan_counted(x, delta, a, b, c)
    np.testing.assert_allclose(y, reference_ssm.selective_scan(x, delta, a, b, c), rtol=1e-12, atol=1e-12)
    cost = _plan_cost("selective_scan", dict(batch=bsz, seq=seq, hidden=hidden, state_size=n, groups=1), lim,
                      ssm_kernel=kernel)
    assert (cost.gemm, cost.other) == (0, flops)


def _selective_scan_chunks_counted(x, delta, a, b, c, lanes: int, per_lane: int) -> tuple[np.ndarray, int]:
    """selective_scan as chunks of ``lanes * per_lane`` steps (kernels/ssm.cl's selective_scan_chunked): each lane
    composes its steps into h_out = A h_in + B, forms its entering state from the chunk's by the earlier lanes'
    (A, B), reruns its steps adding c·h; one FLOP counted per multiply, add and exp. Whole chunks only."""
    bsz, seq, hidden = x.shape
    n = a.shape[1]
    y, flops = np.zeros(x.shape), 0
    for r in range(bsz):
        for ch in range(hidden):
            dx = delta[r, :, ch] * x[r, :, ch]
            flops += seq
            for j in range(n):
                h = 0.0
                for c0 in range(0, seq, lanes * per_lane):
                    parts = []
                    for lane in range(lanes):
                        steps = range(c0 + lane * per_lane, c0 + (lane + 1) * per_lane)
                        decay = [np.exp(delta[r, t, ch] * a[ch, j]) for t in steps]
                        inputs = [dx[t] * b[r, t, 0, j] for t in steps]
                        big_a, big_b = 1.0, 0.0
                        for da, db in zip(decay, inputs):
                            big_a, big_b = big_a * da, da * big_b + db
                        parts.append((big_a, big_b, steps, decay, inputs))
                        flops += 6 * per_lane
                    for lane, (_, _, steps, decay, inputs) in enumerate(parts):
                        state = h
                        for big_a, big_b, *_ in parts[:lane]:
                            state = big_a * state + big_b
                            flops += 2
                        for t, da, db in zip(steps, decay, inputs):
                            state = da * state + db
                            y[r, t, ch] += c[r, t, 0, j] * state
                            flops += 4
                    h = state
    return y, flops


def test_the_chunked_selective_scan_counts_the_flops_of_a_counted_chunk_loop():
    rng = np.random.default_rng(4)
    lanes, per_lane = REFERENCE_GPU.tune("SSC_SL"), REFERENCE_GPU.tune("SSC_T")
    bsz, seq, hidden, n = 1, 2 * lanes * per_lane, 2, 2
    x, b, c = rng.normal(size=(bsz, seq, hidden)), rng.normal(size=(bsz, seq, 1, n)), rng.normal(size=(bsz, seq, 1, n))
    delta, a = rng.uniform(0.01, 0.1, (bsz, seq, hidden)), -rng.uniform(0.5, 2.0, (hidden, n))
    y, flops = _selective_scan_chunks_counted(x, delta, a, b, c, lanes, per_lane)
    np.testing.assert_allclose(y, reference_ssm.selective_scan(x, delta, a, b, c), rtol=1e-9, atol=1e-9)
    cost = _plan_cost("selective_scan", dict(batch=bsz, seq=seq, hidden=hidden, state_size=n, groups=1), REFERENCE_GPU,
                      ssm_kernel="chunked")
    assert (cost.gemm, cost.other) == (0, flops)


def _mamba2_ssd_counted(x, dt, a, b, c, chunk: int, rows: int, count: Counter) -> np.ndarray:
    """Mamba-2 as SSD chunks (kernels/ssm.cl's gpu block): per head and chunk of ``chunk`` steps, per tile of ``rows``
    rows of P (each tile computes what it needs itself, as each work-group does): the chunk's own state Xwᵀ·B,
    then y = exp(L)·(C·S_inᵀ) + ((C·Bᵀ over the whole tile) ∘ decays, lower triangle)·X; the state carried
    from chunk to chunk. Its matrix products counted in ``count``. Whole chunks only."""
    bsz, seq, heads, p = x.shape
    y = np.zeros(x.shape)
    for r in range(bsz):
        for h in range(heads):
            s = np.zeros((p, b.shape[-1]))
            for t0 in range(0, seq, chunk):
                d, xs = dt[r, t0:t0 + chunk, h], x[r, t0:t0 + chunk, h]
                bs, cs = b[r, t0:t0 + chunk, h], c[r, t0:t0 + chunk, h]
                logs = np.cumsum(d * a[h])
                lower = np.tril(np.ones((chunk, chunk)))
                own = np.zeros_like(s)
                for p0 in range(0, p, rows):
                    tile = slice(p0, p0 + rows)
                    weights = (np.exp(logs[-1] - logs) * d)[:, None] * xs[:, tile]
                    own[tile] = count.product(weights.T, bs)
                    gram = count.gram(cs, bs, np.ones((chunk, chunk)))
                    masked = gram * np.exp(logs[:, None] - logs[None, :]) * d[None, :]
                    y[r, t0:t0 + chunk, h, tile] = (np.exp(logs)[:, None] * count.product(cs, s[tile].T)
                                                    + count.product(masked, xs[:, tile], lower))
                s = np.exp(logs[-1]) * s + own
    return y


def test_the_chunked_mamba2_counts_the_gemm_flops_of_a_counted_ssd_loop():
    rng = np.random.default_rng(5)
    chunk, rows = REFERENCE_GPU.tune("M2_Q"), REFERENCE_GPU.tune("M2_PT")
    bsz, seq, heads, p, n = 1, 2 * chunk, 2, 2 * rows, REFERENCE_GPU.tune("M2_NT")
    x = rng.normal(size=(bsz, seq, heads, p))
    b, c = rng.normal(size=(bsz, seq, heads, n)) / 3, rng.normal(size=(bsz, seq, heads, n)) / 3
    dt, a = rng.uniform(0.01, 0.1, (bsz, seq, heads)), -rng.uniform(0.5, 2.0, heads)
    count = Counter()
    y = _mamba2_ssd_counted(x, dt, a, b, c, chunk, rows, count)
    np.testing.assert_allclose(y, reference_ssm.mamba2(x, dt, a, b, c), rtol=1e-9, atol=1e-9)
    params = dict(batch=bsz, seq=seq, heads=heads, head_dim=p, state_size=n)
    assert _plan_cost("mamba2", params, REFERENCE_GPU, ssm_kernel="chunked").gemm == count.gemm


def _gdn_inputs(rng, bsz, seq, heads, value_heads, k, v, per_channel):
    q, kk = rng.normal(size=(bsz, seq, heads, k)) / 3, rng.normal(size=(bsz, seq, heads, k)) / 3
    g = rng.uniform(-0.5, 0.0, (bsz, seq, value_heads) + ((k,) if per_channel else ()))
    return q, kk, rng.normal(size=(bsz, seq, value_heads, v)), g, rng.uniform(0.2, 0.9, (bsz, seq, value_heads))


def _gdn_steps_counted(q, k, v, g, beta) -> tuple[np.ndarray, int]:
    """ABI.md §4's delta rule step by step in scalars, one FLOP counted per multiply, add and exp."""
    bsz, seq, heads, kd = q.shape
    value_heads, vd = v.shape[2:]
    per_channel, scale = g.ndim == 4, 1 / np.sqrt(kd)
    out, flops = np.zeros(v.shape), 0
    for r in range(bsz):
        for j in range(value_heads):
            h, s = j // (value_heads // heads), np.zeros((kd, vd))
            for t in range(seq):
                decays = np.exp(g[r, t, j]) if per_channel else np.full(kd, np.exp(g[r, t, j]))
                flops += kd if per_channel else 1
                for col in range(vd):
                    ks = 0.0
                    for i in range(kd):
                        s[i, col] *= decays[i]
                        ks += k[r, t, h, i] * s[i, col]
                    u = (v[r, t, j, col] - ks) * beta[r, t, j]
                    y = 0.0
                    for i in range(kd):
                        s[i, col] += k[r, t, h, i] * u
                        y += q[r, t, h, i] * s[i, col]
                    out[r, t, j, col] = scale * y
                    flops += 7 * kd + 3
    return out, flops


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("lim, kernel", [(CPU, "auto"), (REFERENCE_GPU, "lanes")])
def test_the_gated_delta_net_recurrence_counts_the_flops_of_a_counted_step_loop(lim, kernel, per_channel):
    rng = np.random.default_rng(1)
    shape = dict(bsz=2, seq=4, heads=1, value_heads=2, k=3, v=5)
    q, k, v, g, beta = _gdn_inputs(rng, *shape.values(), per_channel)
    out, flops = _gdn_steps_counted(q, k, v, g, beta)
    np.testing.assert_allclose(out, reference_ssm.gated_delta_net(q, k, v, g, beta)[0], rtol=1e-12, atol=1e-12)
    params = dict(batch=2, seq=4, heads=1, value_heads=2, state_size=3, value_size=5, gate_per_channel=per_channel,
                  carry_state=False)
    cost = _plan_cost("gated_delta_net", params, lim, ssm_kernel=kernel)
    assert (cost.gemm, cost.other) == (0, flops)


def _gdn_wy_counted(q, k, v, g, beta, chunk: int, count: Counter) -> np.ndarray:
    """The chunked WY form of gated_delta_net with per-head gates (docs/kernels.md, kernels/gdn.cl's gpu block):
    per chunk G = cumsum(g), the Gram products on the lower triangle, T = (I + M)^-1, W = T·(β exp(G) K),
    U0 = T·(βV), U = U0 - W·S0, out = scale ((exp(G) Q)·S0 + (P∘D)·U),
    S = exp(G_last) S0 + (K exp(G_last - G))ᵀ·U.
    Its matrix products counted in ``count`` (a triangular operand: only the entries it uses)."""
    bsz, seq, heads, kd = q.shape
    value_heads, vd = v.shape[2:]
    out, scale = np.zeros(v.shape), 1 / np.sqrt(kd)
    for r in range(bsz):
        for j in range(value_heads):
            h, s = j // (value_heads // heads), np.zeros((kd, vd))
            for t0 in range(0, seq, chunk):
                kc, qc, vc = k[r, t0:t0 + chunk, h], q[r, t0:t0 + chunk, h], v[r, t0:t0 + chunk, j]
                gc, bc = np.cumsum(g[r, t0:t0 + chunk, j]), beta[r, t0:t0 + chunk, j]
                steps = len(gc)
                lower, strict = np.tril(np.ones((steps, steps))), np.tril(np.ones((steps, steps)), -1)
                decay = np.exp(gc[:, None] - gc[None, :]) * lower
                gram, pq = count.gram(kc, kc, lower), count.gram(qc, kc, lower)
                m = bc[:, None] * decay * gram * strict
                tri = np.linalg.inv(np.eye(steps) + m)  # unit lower triangular: its diagonal stays implicit
                off = tri - np.eye(steps)
                bk = bc[:, None] * np.exp(gc)[:, None] * kc
                w = bk + count.product(off, bk, strict)
                u0 = bc[:, None] * vc + count.product(off, bc[:, None] * vc, strict)
                u = u0 - count.product(w, s)
                y = count.product(np.exp(gc)[:, None] * qc, s) + count.product(pq * decay, u, lower)
                out[r, t0:t0 + chunk, j] = scale * y
                s = np.exp(gc[-1]) * s + count.product((kc * np.exp(gc[-1] - gc)[:, None]).T, u)
    return out


def test_the_chunked_gated_delta_net_counts_the_gemm_flops_of_a_counted_wy_loop():
    rng = np.random.default_rng(2)
    chunk = REFERENCE_GPU.tune("GDN_Q")
    bsz, seq, heads, value_heads, kd, vd = 2, 2 * chunk, 1, 2, 16, 2 * REFERENCE_GPU.tune("GDN_OT")
    q, k, v, g, beta = _gdn_inputs(rng, bsz, seq, heads, value_heads, kd, vd, False)
    count = Counter()
    out = _gdn_wy_counted(q, k, v, g, beta, chunk, count)
    np.testing.assert_allclose(out, reference_ssm.gated_delta_net(q, k, v, g, beta)[0], rtol=1e-9, atol=1e-9)
    params = dict(batch=bsz, seq=seq, heads=heads, value_heads=value_heads, state_size=kd, value_size=vd,
                  gate_per_channel=False, carry_state=False)
    assert _plan_cost("gated_delta_net", params, REFERENCE_GPU, ssm_kernel="chunked").gemm == count.gemm


def _gdn_channel_gram_counted(rows, k, g, chunk: int, count: Counter) -> np.ndarray:
    """rows·D·kᵀ of one chunk, s <= t, with per-channel decays D[t][s] = diag exp(G[t] - G[s]) (G = cumsum(g) per
    key channel), as gated_delta_net_chunk_prep's MMA variant sums it: each tile below the diagonal a product of
    operands weighed from its row block's first step m (rows[t] exp(G[t] - G[m]), k[s] exp(G[m] - G[s])),
    counted; the diagonal tiles entry by entry (FMA, not counted). Past a partial chunk the tiles run on zeros."""
    steps, kd = k.shape
    rz, kz, gz = np.zeros((chunk, kd)), np.zeros((chunk, kd)), np.zeros((chunk, kd))
    rz[:steps], kz[:steps], gz[:steps] = rows, k, np.cumsum(g, axis=0)
    out = np.zeros((chunk, chunk))
    for m in range(0, chunk, MMA_TILE):
        block = slice(m, m + MMA_TILE)
        out[block, :m] = count.gram(rz[block] * np.exp(gz[block] - gz[m]), kz[:m] * np.exp(gz[m] - gz[:m]),
                                    np.ones((MMA_TILE, m)))
        for t in range(m, m + MMA_TILE):
            for s in range(m, t + 1):
                out[t, s] = np.sum(rz[t] * kz[s] * np.exp(gz[t] - gz[s]))
    return out[:steps, :steps]


def test_the_mma_variant_counts_the_per_channel_gram_tiles_below_the_diagonal_as_gemm_flops():
    """Per-channel gates: the variant's tile products are the Gram (against an einsum over the channels), and they
    are what its plan counts as GEMM-shaped beyond the portable plan's W, U and output products."""
    rng = np.random.default_rng(3)
    chunk, value_heads, kd = REFERENCE_GPU.tune("GDN_Q"), 2, 20
    seq = chunk + 20  # a full chunk and a partial one
    q, k, _, g, _ = _gdn_inputs(rng, 1, seq, 1, 1, kd, 1, True)
    count = Counter()
    for _head in range(value_heads):
        for t0 in range(0, seq, chunk):
            at = slice(t0, t0 + chunk)
            big_g = np.cumsum(g[0, at, 0], axis=0)
            decay = np.exp(big_g[:, None, :] - big_g[None, :, :])
            for rows in (k, q):  # K·Kᵀ and Q·Kᵀ
                got = _gdn_channel_gram_counted(rows[0, at, 0], k[0, at, 0], g[0, at, 0], chunk, count)
                want = np.einsum("ti,si,tsi->ts", rows[0, at, 0], k[0, at, 0], decay)
                np.testing.assert_allclose(np.tril(got), np.tril(want), rtol=1e-12, atol=1e-12)
    params = dict(batch=1, seq=seq, heads=1, value_heads=value_heads, state_size=kd, value_size=8,
                  gate_per_channel=True, carry_state=False)
    variant = _plan_cost("gated_delta_net", params, dataclasses.replace(REFERENCE_GPU, mma=MMA_TF32),
                         ssm_kernel="chunked")
    portable = _plan_cost("gated_delta_net", params, REFERENCE_GPU, ssm_kernel="chunked")
    assert variant.gemm - portable.gemm == count.gemm > 0


def _mamba3_turned(q, k, dt, angles) -> tuple[np.ndarray, np.ndarray]:
    """ABI.md §11 steps 2-3 for one row and head (no biases): θ advanced by π·tanh(angles)·dt, the adjacent pairs
    i < A of q and k turned by it."""
    theta = np.cumsum(np.pi * np.tanh(angles) * dt[:, None], axis=0)
    c, s, a = np.cos(theta), np.sin(theta), angles.shape[1]
    out = []
    for x in (q, k):
        x = x.copy()
        even, odd = x[:, 0:2 * a:2].copy(), x[:, 1:2 * a:2].copy()
        x[:, 0:2 * a:2], x[:, 1:2 * a:2] = even * c - odd * s, even * s + odd * c
        out.append(x)
    return out[0], out[1]


def _mamba3_steps_counted(q, k, v, adt, dt, trap, angles) -> tuple[np.ndarray, int]:
    """ABI.md §11's six steps token by token in scalars (no biases, d, z or carried state), one FLOP counted per
    multiply, add, exp, division, floor, sin and cos, as the step kernels compute them: tanh as 1 - 2/(1 + exp(2u)),
    the angle reduced mod 2π after every step (only its cos and sin enter), y in two partial sums joined."""
    bsz, seq, heads, p = v.shape
    n, a = q.shape[-1], angles.shape[-1]
    y, flops = np.zeros(v.shape), 0
    for r in range(bsz):
        for h in range(heads):
            theta, s, k_bar, v_bar = np.zeros(a), np.zeros((p, n)), np.zeros(n), np.zeros(p)
            for t in range(seq):
                lam = 1 / (1 + np.exp(-trap[r, t, h]))
                alpha = np.exp(adt[r, t, h])
                beta, gamma = (1 - lam) * dt[r, t, h] * alpha, lam * dt[r, t, h]
                flops += 3 + 1 + 3 + 1
                qr, kr = q[r, t, h].copy(), k[r, t, h].copy()
                for i in range(a):
                    tanh = 1 - 2 / (1 + np.exp(2 * angles[r, t, h, i]))
                    theta[i] += np.pi * tanh * dt[r, t, h]
                    theta[i] -= 2 * np.pi * np.floor(theta[i] / (2 * np.pi))
                    c, sn = np.cos(theta[i]), np.sin(theta[i])
                    for x in (qr, kr):
                        x[2 * i], x[2 * i + 1] = x[2 * i] * c - x[2 * i + 1] * sn, x[2 * i] * sn + x[2 * i + 1] * c
                    flops += 5 + 3 + 3 + 2 + 12
                for i in range(p):
                    bv, gv, halves = beta * v_bar[i], gamma * v[r, t, h, i], [0.0, 0.0]
                    flops += 2
                    for j in range(n):
                        s[i, j] = alpha * s[i, j] + bv * k_bar[j] + gv * kr[j]
                        halves[j % 2] += s[i, j] * qr[j]
                        flops += 7
                    y[r, t, h, i] = halves[0] + halves[1]
                    flops += 1
                k_bar, v_bar = kr, v[r, t, h].copy()
    return y, flops


def test_the_mamba3_step_kernel_counts_the_flops_of_a_counted_step_loop():
    rng = np.random.default_rng(8)
    bsz, seq, heads, p, n, a = 2, 3, 2, CPU.tune("M3_PB"), 6, 2  # one work-item of M3_PB rows per head
    q, k = rng.normal(size=(bsz, seq, heads, n)) / 3, rng.normal(size=(bsz, seq, heads, n)) / 3
    v, trap, angles = rng.normal(size=(bsz, seq, heads, p)), rng.normal(size=(bsz, seq, heads)), \
        rng.normal(size=(bsz, seq, heads, a))
    adt, dt = -rng.uniform(0.01, 0.2, (bsz, seq, heads)), rng.uniform(0.01, 0.1, (bsz, seq, heads))
    y, flops = _mamba3_steps_counted(q, k, v, adt, dt, trap, angles)
    np.testing.assert_allclose(y, reference_mamba3.mamba3(q, k, v, adt, dt, trap, angles), rtol=1e-12, atol=1e-12)
    params = dict(batch=bsz, seq=seq, heads=heads, head_dim=p, state_size=n, num_angles=a)
    cost = _plan_cost("mamba3", params, CPU, ssm_kernel="lanes")
    assert (cost.gemm, cost.other) == (0, flops)


def _mamba3_chunks_counted(q, k, v, adt, dt, trap, angles, chunk: int, rows: int, count: Counter) -> np.ndarray:
    """mamba3 as ABI.md §11's informative chunk form (kernels/mamba3.cl's gpu blocks), no carried state (S⁰ = 0):
    per head and chunk of ``chunk`` steps, with c the chunk's running sum of adt, w_s = γ_s + β'_{s+1}; per tile of
    ``rows`` rows of P (each tile computes what it needs itself, as each work-group does) the chunk's own state
    (e^{c_last - c_s}·w_s·v_s)ᵀ·k̃, then y_t = e^{c_t}·S_in·q̃_t + Σ_{s<t} e^{c_t - c_s}·w_s·(q̃_t·k̃_s)·v_s
    + γ_t·(q̃_t·k̃_t)·v_t with Q̃·K̃ᵀ over the whole tile; S_in carried from chunk to chunk. Its matrix products
    counted in ``count``. Whole chunks only."""
    bsz, seq, heads, p = v.shape
    y = np.zeros(v.shape)
    lam = 1 / (1 + np.exp(-trap))
    gamma, bprime = lam * dt, (1 - lam) * dt
    weight = gamma + np.concatenate([bprime[:, 1:], np.zeros((bsz, 1, heads))], axis=1)  # β' = 0 past the end
    lower = np.tril(np.ones((chunk, chunk)))
    for r in range(bsz):
        for h in range(heads):
            qr, kr = _mamba3_turned(q[r, :, h], k[r, :, h], dt[r, :, h], angles[r, :, h])
            s = np.zeros((p, q.shape[-1]))
            for t0 in range(0, seq, chunk):
                span = slice(t0, t0 + chunk)
                cum, w, vs = np.cumsum(adt[r, span, h]), weight[r, span, h], v[r, span, h]
                qs, ks = qr[span], kr[span]
                mask = np.exp(cum[:, None] - cum[None, :]) * w[None, :] * np.tril(np.ones((chunk, chunk)), -1)
                mask += np.diag(gamma[r, span, h])
                own = np.zeros_like(s)
                for p0 in range(0, p, rows):
                    tile = slice(p0, p0 + rows)
                    own[tile] = count.product(((np.exp(cum[-1] - cum) * w)[:, None] * vs[:, tile]).T, ks)
                    gram = count.gram(qs, ks, np.ones((chunk, chunk)))
                    y[r, span, h, tile] = (np.exp(cum)[:, None] * count.product(qs, s[tile].T)
                                           + count.product(gram * mask, vs[:, tile], lower))
                s = np.exp(cum[-1]) * s + own
    return y


def test_the_chunked_mamba3_counts_the_gemm_flops_of_a_counted_chunk_loop():
    rng = np.random.default_rng(6)
    chunk, rows = REFERENCE_GPU.tune("M3C_Q"), REFERENCE_GPU.tune("M3C_PT")
    bsz, seq, heads, p, n = 1, 2 * chunk, 2, 2 * rows, 2 * REFERENCE_GPU.tune("M3C_NT")
    q, k = rng.normal(size=(bsz, seq, heads, n)) / 3, rng.normal(size=(bsz, seq, heads, n)) / 3
    v, trap = rng.normal(size=(bsz, seq, heads, p)), rng.normal(size=(bsz, seq, heads))
    adt, dt = -rng.uniform(0.01, 0.2, (bsz, seq, heads)), rng.uniform(0.01, 0.1, (bsz, seq, heads))
    angles = rng.normal(size=(bsz, seq, heads, n // 4))
    count = Counter()
    y = _mamba3_chunks_counted(q, k, v, adt, dt, trap, angles, chunk, rows, count)
    np.testing.assert_allclose(y, reference_mamba3.mamba3(q, k, v, adt, dt, trap, angles), rtol=1e-9, atol=1e-9)
    params = dict(batch=bsz, seq=seq, heads=heads, head_dim=p, state_size=n, num_angles=n // 4)
    plan = launches.plan(lay_out("mamba3", "f32", params)[0], REFERENCE_GPU, ssm_kernel="chunked")
    assert [launch.kernel for launch in plan.launches] == list(launches.mamba3.CHUNKED_KERNELS)
    assert _plan_cost("mamba3", params, REFERENCE_GPU, ssm_kernel="chunked").gemm == count.gemm


def _conv_counted(x, weight, bias, silu: bool) -> tuple[np.ndarray, int]:
    """ABI.md §10's causal_conv1d token by token in scalars (no carried state: zeros before the first token), one
    FLOP counted per multiply, add, exp and division."""
    bsz, seq, dim = x.shape
    width = weight.shape[1]
    y, flops = np.zeros(x.shape), 0
    for r in range(bsz):
        for t in range(seq):
            for c in range(dim):
                u = bias[c]
                for w in range(width):
                    tap = t - (width - 1) + w
                    u += weight[c, w] * (x[r, tap, c] if tap >= 0 else 0.0)
                    flops += 2
                if silu:
                    u = u / (1 + np.exp(-u))
                    flops += 3
                y[r, t, c] = u
    return y, flops


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("lim", [CPU, REFERENCE_GPU])
def test_causal_conv1d_counts_the_flops_of_a_counted_window_loop(lim, silu):
    rng = np.random.default_rng(7)
    bsz, seq, dim, width = 2, 40, 3, 4
    x, weight, bias = rng.normal(size=(bsz, seq, dim)), rng.normal(size=(dim, width)), rng.normal(size=dim)
    activation = "silu" if silu else "none"
    y, flops = _conv_counted(x, weight, bias, silu)
    np.testing.assert_allclose(y, reference_conv.causal_conv1d(x, weight, bias=bias, activation=activation),
                               rtol=1e-12, atol=1e-12)
    params = dict(batch=bsz, seq=seq, dim=dim, width=width, bias=True, activation=activation)
    cost = _plan_cost("causal_conv1d", params, lim)
    assert (cost.gemm, cost.other) == (0, flops)


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_every_kernel_the_roofline_shapes_launch_declares_its_cost(dtype):
    for shape in roofline.SHAPES:
        row = roofline.op_row(shape, dtype)
        assert not row.undeclared, f"{shape}: a kernel of {[p.name for p in row.parts]} declares no cost"
        assert row.launches and row.read > 0 and row.written > 0, shape
        assert all(p.read + p.written > 0 for p in row.parts), shape


def _chunked_gdn_plan(dtype: str):
    thunk, _ = lay_out("gated_delta_net", dtype, dict(batch=1, seq=256, heads=2, state_size=32, value_size=32,
                                                      gate_per_channel=False, carry_state=False))
    return launches.plan(thunk, REFERENCE_GPU, ssm_kernel="chunked")


@pytest.mark.parametrize("mma, unit", [(1, "mma16"), (2, "tf32")])
def test_rlx_mma_moves_a_launchs_gemm_flops_to_the_tensor_cores(mma, unit):
    for launch in _chunked_gdn_plan("bf16").launches:
        cost = launch_cost(launch)
        assert cost.gemm > 0, launch.kernel
        assert roofline.units(launch, cost) == {"fma": cost.other + cost.gemm}
        marked = dataclasses.replace(launch, defines=launch.defines + (("RLX_MMA", mma),))
        assert roofline.units(marked, launch_cost(marked)) == {"fma": cost.other, unit: cost.gemm}


def _variant_and_portable(op: str, kernel: str, dtype: str, params: dict, mma: int, **options) -> tuple[tuple, tuple]:
    """``(launch, cost)`` of ``kernel`` in ``op``'s plan for ``params`` (and the planner's ``options``) on an H200
    with the tensor-core variants ``mma``, then the same on one without (the portable launch)."""
    thunk, _ = lay_out(op, dtype, params)

    def planned(lim: DeviceLimits) -> tuple:
        (launch,) = [x for x in launches.plan(thunk, lim, **options).launches if x.kernel == kernel]
        return launch, launch_cost(launch)
    return planned(dataclasses.replace(REFERENCE_GPU, mma=mma)), planned(REFERENCE_GPU)


@pytest.mark.parametrize("dtype, mma, unit, split", [("bf16", MMA_16BIT, "mma16", True), ("f32", MMA_TF32, "tf32", False)])
def test_the_gdn_backward_variant_counts_its_state_products_on_the_tensor_cores(dtype, mma, unit, split):
    """gdn_chunk_back_grads' RLX_MMA variant: its tensor-core FLOPs are the state products Y·S0ᵀ, dO·S0ᵀ and U·dS_Lᵀ of
    every (chunk, value head) slot, counted on matrices of their shapes (at 16 bits U·dS_Lᵀ three times: split
    operands, hi·hi + hi·lo + lo·hi); the rest runs on FMA: the portable launch's FLOPs less the state products
    once, plus the split's subtractions (a value of U and of dS_L each, staged per 16 key channels)."""
    chunk, kd, vd, value_heads = RESERVE_CHUNK, 32, 16, 2
    params = dict(batch=1, seq=chunk + 5, heads=1, value_heads=value_heads, state_size=kd, value_size=vd,
                  gate_per_channel=False, carry_state=False)
    rng, count, once, subtractions = np.random.default_rng(5), Counter(), Counter(), 0
    for _slot in range(2 * value_heads):  # a full chunk and a partial one (counted whole) per value head
        y, d_out, u = (rng.standard_normal((chunk, vd)) for _ in range(3))
        s0, d_sl = rng.standard_normal((kd, vd)), rng.standard_normal((kd, vd))
        for counter in (count, once):
            for rows, state in ((y, s0), (d_out, s0), (u, d_sl)):
                counter.product(rows, state.T)
        for _part in range(2 if split else 0):
            count.product(u, d_sl.T)
        subtractions += (kd // MMA_TILE) * (chunk + MMA_TILE) * vd if split else 0
    (launch, cost), (portable_launch, portable) = _variant_and_portable(
        "gated_delta_net_backward", "gdn_chunk_back_grads", dtype, params, mma)
    assert roofline.units(launch, cost) == {"fma": cost.other, unit: count.gemm}
    assert roofline.units(portable_launch, portable) == {"fma": portable.flops}
    assert cost.other == portable.flops - once.gemm + subtractions


@pytest.mark.parametrize("dtype, unit", [("bf16", "mma16"), ("f16", "mma16"), ("f32", "fma"), ("f64", "fp64")])
def test_a_gemm_runs_where_cublas_runs_it(dtype, unit):
    thunk, _ = lay_out("matmul", dtype, dict(batch=2, m=64, k=32, n=48, trans_a=False, trans_b=False,
                                             a_batch_stride=64 * 32, b_batch_stride=32 * 48))
    (launch,) = [x for x in launches.plan(thunk, REFERENCE_GPU).launches if x.kernel == "gemm"]
    cost = launch_cost(launch)
    assert cost.gemm == 2 * 2 * 64 * 32 * 48
    counts = roofline.units(launch, cost)
    assert cost.other == 0 and counts[unit] == cost.gemm and sum(counts.values()) == cost.gemm


def test_the_tensor_cores_take_the_chunk_products_of_a_16_bit_plan_and_the_floor_is_the_larger_bound():
    """An H200 taking the 16-bit variants (the default) against one taking none: the same kernels, the chunk
    products moved to the tensor cores; f64 stays on the FP64 units either way."""
    shape = "gdn B4 S8192 H16 N128 per-head"
    mma = roofline.op_row(shape, "bf16").parts
    fma = roofline.op_row(shape, "bf16", tensor_cores=0).parts
    assert [r.name for r in fma] == [r.name for r in mma]
    for before, after in zip(fma, mma):
        assert after.flops["mma16"] > 0 and after.flops["fma"] < before.flops["fma"]
        assert before.floor_s() == max(before.compute_s(), before.memory_s())
        assert before.predicted_s() == max(2 * before.compute_s(), before.memory_s())
    assert all(set(r.flops) == {"fp64"} for r in roofline.op_row(shape, "f64").parts)


@pytest.mark.parametrize("op, gates", [("lstm", 4), ("gru", 3), ("rnn", 1)])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_the_recurrent_ops_gemm_flops_are_their_gate_products(op, gates, bidirectional):
    """ABI.md §3: per step, row and direction the gate pre-activations W_ih·x + W_hh·h, G·H rows of I + H
    multiply-adds (gru without linear_before_reset sums r∘h for its third gate: the same count)."""
    bsz, seq, inputs, hidden, dirs = 3, 5, 6, 8, 2 if bidirectional else 1
    for fields in ({}, {"linear_before_reset": False} if op == "gru" else {}):
        params = dict(batch=bsz, seq=seq, input_size=inputs, hidden=hidden, num_layers=1,
                      bidirectional=bidirectional, carry=False, **fields)
        cost = _plan_cost(op, params, REFERENCE_GPU, rnn_kernel="step")
        assert cost.gemm == 2 * bsz * seq * dirs * gates * hidden * (inputs + hidden)


@pytest.mark.parametrize("dtype, mma, unit, split", [("bf16", MMA_16BIT, "mma16", True), ("f32", MMA_TF32, "tf32", False)])
def test_the_gdn_backward_pass_variant_counts_its_products_on_the_tensor_cores(dtype, mma, unit, split):
    """gdn_chunk_back_pass' RLX_MMA variant: its tensor-core FLOPs are dU's diag(end) K·dS_L and dS0's two products,
    [scale γQ | -γβK]ᵀ·[dO; Y], per chunk of every (batch row, value head), counted on matrices of their shapes as
    tiled (16 x 16 outputs, sums in blocks of 2L; three times at 16 bits: split operands); the rest (qkᵀ·dO on the
    triangle among it) runs on FMA: the portable launch's FLOPs less those products once, plus the split's
    subtractions (a value of each operand as staged, per tile and block)."""
    chunk, kd, vd, value_heads = RESERVE_CHUNK, 40, 20, 2
    kp, vp, sums = -(-kd // MMA_TILE) * MMA_TILE, -(-vd // MMA_TILE) * MMA_TILE, 2 * chunk  # K in one block
    params = dict(batch=1, seq=chunk + 5, heads=1, value_heads=value_heads, state_size=kd, value_size=vd,
                  gate_per_channel=False, carry_state=False)
    rng, count, once, subtractions = np.random.default_rng(6), Counter(), Counter(), 0
    for _chunk in range(2 * value_heads):  # a full chunk and a partial one (counted whole) per value head
        k_end, d_sl = rng.standard_normal((chunk, kd)), rng.standard_normal((kd, vd))
        a, rows = rng.standard_normal((kd, 2 * chunk)), rng.standard_normal((2 * chunk, vd))
        once.product(k_end, d_sl)
        once.product(a, rows)
        for _part in range(3 if split else 1):
            count.product(np.zeros((chunk, sums)), np.zeros((sums, vp)))
            count.product(np.pad(a, ((0, kp - kd), (0, 0))), np.pad(rows, ((0, 0), (0, vp - vd))))
        tiles = (vp // MMA_TILE) * (chunk // MMA_TILE * sums // (2 * chunk) + kp // MMA_TILE)
        subtractions += tiles * 2 * MMA_TILE * 2 * chunk if split else 0
    (launch, cost), (portable_launch, portable) = _variant_and_portable(
        "gated_delta_net_backward", "gdn_chunk_back_pass", dtype, params, mma)
    assert launch.local_size == (32,) and portable_launch.local_size == (vd,)
    assert roofline.units(launch, cost) == {"fma": cost.other, unit: count.gemm}
    assert roofline.units(portable_launch, portable) == {"fma": portable.flops}
    # the FMA part's per-lane rows' scalars run on the variant's 32 lanes where the portable launch has V
    lanes = 2 * value_heads * (chunk * (chunk + 1) // 2 + 4 * chunk) * (32 - vd)
    assert cost.other == portable.flops - once.gemm + subtractions + lanes


@pytest.mark.parametrize("dtype, mma, unit", [("bf16", MMA_16BIT, "mma16"), ("f32", MMA_TF32, "tf32")])
@pytest.mark.parametrize("reserve", [False, True], ids=["recomputed", "saved"])
def test_the_mamba2_backward_chunk_variant_counts_its_state_products_on_the_tensor_cores(dtype, mma, unit, reserve):
    """mamba2_backward_chunk's RLX_MMA variant: its tensor-core FLOPs are the state products D·b, S_in·c (not from a
    saved forward), x·D and gy·S_in of every (head, chunk), counted tile by tile as run (passes of 32 steps, 16
    output columns, sums in slices of 16; hi·hi and hi·lo, and lo·hi where the rows are split too: gy, and every
    operand at TF32), and (not from a saved forward) the scores C·Bᵀ, their 16 x 16 tiles on and below the
    diagonal (three products at TF32); the rest runs on FMA: the portable launch's FLOPs less those products once
    (at their own shapes, C·Bᵀ on its lower triangle), plus the split's subtractions (a value of each split operand
    as staged)."""
    heads, p, n, chunk = 2, 20, 40, 64
    params = dict(batch=1, seq=chunk + 5, heads=heads, head_dim=p, state_size=n, **(
        dict(reserve=True, reserve_bytes=1 << 20) if reserve else {}))
    tile, count, once, subtractions = MMA_TILE, Counter(), Counter(), 0
    rng = np.random.default_rng(7)
    for _head in range(heads):
        for steps in (chunk, 5):
            d, s_in = rng.standard_normal((p, n)), rng.standard_normal((p, n))
            x, gy, b, c = (rng.standard_normal((steps, w)) for w in (p, p, n, n))
            products = [(b, d.T, dtype == "f32"), (x, d, dtype == "f32"), (gy, s_in, True)]
            if not reserve:
                products.insert(1, (c, s_in.T, dtype == "f32"))
            for rows, right, split_rows in products:
                once.product(rows, right)
                for _pass in range(-(-steps // 32)):
                    for _c0 in range(0, right.shape[1], tile):
                        for _k0 in range(0, right.shape[0], tile):
                            for _part in range(3 if split_rows else 2):
                                count.product(np.zeros((32, tile)), np.zeros((tile, tile)))
                            subtractions += tile * tile + (32 * tile if split_rows else 0)
            if not reserve:  # C·Bᵀ: its tiles on and below the diagonal, over N by slices of 16 (TF32: split)
                once.gram(c, b, np.tril(np.ones((steps, steps))))
                row_tiles = -(-steps // tile)
                for _tile in range(row_tiles * (row_tiles + 1) // 2):
                    for _k0 in range(0, n, tile):
                        for _part in range(3 if dtype == "f32" else 1):
                            count.product(np.zeros((tile, tile)), np.zeros((tile, tile)))
                        subtractions += 2 * tile * tile if dtype == "f32" else 0
    (launch, cost), (portable_launch, portable) = _variant_and_portable(
        "mamba2_backward", "mamba2_backward_chunk", dtype, params, mma, ssm_kernel="chunked")
    assert dict(launch.defines).get("SSM_RESERVE", 0) == reserve
    assert roofline.units(launch, cost) == {"fma": cost.other, unit: count.gemm}
    assert roofline.units(portable_launch, portable) == {"fma": portable.flops}
    assert cost.other == portable.flops - once.gemm + subtractions


@pytest.mark.parametrize("dtype, mma, unit", [("bf16", MMA_16BIT, "mma16"), ("f32", MMA_TF32, "tf32")])
def test_the_recomputed_chunk_states_of_mamba2s_backward_count_their_split_products_on_the_tensor_cores(dtype, mma,
                                                                                                        unit):
    """mamba2_chunk_state as mamba2's backward launches it (M2_SPLIT_STATES): its tensor-core FLOPs are Xwᵀ·B of every
    (head, chunk, 16 rows of P), tile by tile as run (16-step slices, 16 columns a warp), from split operands: hi·b and
    lo·b, and hi·b_lo at TF32; the rest runs on FMA: the portable launch's FLOPs less the product once, plus the
    split's subtractions (each xw value, and at TF32 each staged b value per tile of P)."""
    heads, p, n, chunk = 2, 32, 128, 64
    params = dict(batch=1, seq=2 * chunk, heads=heads, head_dim=p, state_size=n)
    tile, count, once, subtractions = MMA_TILE, Counter(), Counter(), 0
    for _head in range(heads):
        for _chunk in range(2):
            for _p_tile in range(p // tile):
                once.product(np.zeros((tile, chunk)), np.zeros((chunk, n)))
                subtractions += chunk * tile
                for _slice in range(chunk // tile):
                    subtractions += tile * n if dtype == "f32" else 0
                    for _column in range(n // tile):
                        for _part in range(3 if dtype == "f32" else 2):
                            count.product(np.zeros((tile, tile)), np.zeros((tile, tile)))
    (launch, cost), (portable_launch, portable) = _variant_and_portable(
        "mamba2_backward", "mamba2_chunk_state", dtype, params, mma, ssm_kernel="chunked")
    assert dict(launch.defines).get("M2_SPLIT_STATES") == 1
    assert roofline.units(launch, cost) == {"fma": cost.other, unit: count.gemm}
    assert roofline.units(portable_launch, portable) == {"fma": portable.flops}
    assert cost.other == portable.flops - once.gemm + subtractions


@pytest.mark.parametrize("dtype, mma, unit", [("bf16", MMA_16BIT, "mma16"), ("f32", MMA_TF32, "tf32")])
def test_the_mamba3_backward_chunk_variant_counts_its_state_products_on_the_tensor_cores(dtype, mma, unit):
    """mamba3_cb_chunk's RLX_MMA variant: its tensor-core FLOPs are the scores q̃·k̃ᵀ and gy·vᵀ on the lower triangle
    (as the portable launch counts them) and the state products D·k̃, S_in·q̃, S_inᵀ·gy and Dᵀ·v of every (head,
    chunk), counted tile by tile as run (a pass of the chunk's 64 steps per 32 output columns, sums in slices of 16;
    hi·hi and hi·lo, and lo·hi where the rows are split too: q̃, k̃, gy, and v at TF32); the rest runs on FMA: the
    portable launch's FMA FLOPs less those products once (at their own shapes), plus the split's subtractions (a
    value of each split operand as staged)."""
    heads, p, n, chunk = 2, 40, 24, 64
    params = dict(batch=1, seq=chunk + 5, heads=heads, head_dim=p, state_size=n, num_angles=2)
    tile, count, once, scores, subtractions = MMA_TILE, Counter(), Counter(), Counter(), 0
    rng = np.random.default_rng(8)
    for _head in range(heads):
        for steps in (chunk, 5):
            d, s_in = rng.standard_normal((p, n)), rng.standard_normal((p, n))
            q, k, gy, v = (rng.standard_normal((steps, w)) for w in (n, n, p, p))
            scores.gram(q, k, np.tril(np.ones((steps, steps))))
            scores.gram(gy, v, np.tril(np.ones((steps, steps))))
            for rows, right, split_rows in ((k, d.T, True), (q, s_in.T, True), (gy, s_in, True),
                                            (v, d, dtype == "f32")):
                once.product(rows, right)
                for _c0 in range(0, right.shape[1], 2 * tile):
                    for _k0 in range(0, right.shape[0], tile):
                        for _part in range(3 if split_rows else 2):
                            count.product(np.zeros((chunk, tile)), np.zeros((tile, 2 * tile)))
                        subtractions += tile * 2 * tile + (chunk * tile if split_rows else 0)
    (launch, cost), (portable_launch, portable) = _variant_and_portable(
        "mamba3_backward", "mamba3_cb_chunk", dtype, params, mma, ssm_kernel="chunked")
    assert roofline.units(launch, cost) == {"fma": cost.other, unit: scores.gemm + count.gemm}
    assert roofline.units(portable_launch, portable) == {"fma": portable.flops}
    assert portable.gemm == scores.gemm
    assert cost.other == portable.flops - scores.gemm - once.gemm + subtractions
