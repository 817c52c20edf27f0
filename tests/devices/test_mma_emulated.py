"""The tensor-core variants' kernel text, run: every conformance case of the chunked mamba2, gated_delta_net and
mamba3 at 16-bit dtypes passes on an OpenCL CPU device with the variant planned (``RLX_MMA`` 1) and its tensor-core
words emulated (tests/support/mma_emulation.cl: warp tiles, operands rounded to the 16-bit type, f32
accumulation), against the float64 reference and host_fallback, the NaN/Inf cases among them. This checks
what no NVRTC build can: the variants' tiling, staging, triangular masks and output stores compute the op.
The same at f32 with TF32 operands (``RLX_MMA`` 2) against the bf16 bounds (TF32 keeps 10 mantissa bits
to bf16's 7), which f32's own bounds are too tight for by design. And mamba3 at shapes the catalog leaves out
(state rows and columns past one tile, every field through packed sequences and slots, a NaN or a reset inside a
chunk); gated_delta_net with per-channel gates at such shapes too, each against the float64 reference and against
the portable FMA kernels run on the same device. No GPU is involved.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

opencl = pytest.importorskip("rlx_gpu.backends.opencl")
from rlx_gpu import launches  # noqa: E402
from rlx_gpu.backends import programs  # noqa: E402
from rlx_gpu.conformance import catalog, runner  # noqa: E402
from rlx_gpu.conformance.catalog import Case  # noqa: E402
from rlx_gpu.conformance.cases import schedule_of  # noqa: E402
from rlx_gpu.conformance.compare import nmse, non_finite_mismatch  # noqa: E402
from rlx_gpu.conformance.devices import find, open_device  # noqa: E402
from rlx_gpu.launches.mma import MMA_16BIT, MMA_TF32  # noqa: E402
from rlx_gpu.runtime.config import default_config_path, load_config  # noqa: E402
from rlx_gpu.runtime.executor import Device  # noqa: E402
from rlx_gpu.runtime.options import RunOptions  # noqa: E402
from rlx_gpu.runtime.registry import open_session, status  # noqa: E402
from support.conformance_devices import KERNEL_OPENCL, SPECS  # noqa: E402

pytestmark = pytest.mark.skipif(not KERNEL_OPENCL, reason=f"no OpenCL device among {SPECS}: {status('opencl').reason}")

CONFIG = load_config(default_config_path())
EMULATION = (Path(__file__).parent.parent / "support" / "mma_emulation.cl").read_text()
#: per op, the kernels that take the variant (mamba2's backward recomputes the forward's chunk states with its split
#: form, M2_SPLIT_STATES)
CHUNK_KERNELS = {"mamba2": {"mamba2_chunk_state", "mamba2_chunk_scan"},
                 "gated_delta_net": {"gated_delta_net_chunk_prep", "gated_delta_net_state_pass",
                                     "gated_delta_net_chunk_out"},
                 "mamba3": {"mamba3_chunk_state", "mamba3_chunk_scan"},
                 "mamba2_backward": {"mamba2_chunk_state", "mamba2_backward_dstate", "mamba2_backward_chunk"},
                 "mamba3_backward": {"mamba3_cb_chunk"},
                 "gated_delta_net_backward": {"gdn_chunk_back_pass", "gdn_chunk_back_grads"}}
CHUNKED_OPS = tuple(CHUNK_KERNELS)
#: the variant and the dtypes it runs, and the dtype whose bounds they are held to
VARIANTS = {MMA_16BIT: (("f16", "bf16"), None), MMA_TF32: (("f32",), "bf16")}


def _emulated(original):
    """``programs.program`` with the tensor-core words emulated in every OpenCL program of an RLX_MMA launch."""
    prelude = programs._text(programs.prelude_path("opencl"))

    def program(dialect, family, dtype, src_dtype=None, target="cpu", extra=()):
        if dialect != "opencl" or "RLX_MMA" not in dict(extra):
            return original(dialect, family, dtype, src_dtype, target, extra)
        prog = original(dialect, family, dtype, src_dtype, target, tuple(extra) + (("RLX_MMA_EMULATED", 1),))
        assert prelude in prog.source
        return dataclasses.replace(prog, source=prog.source.replace(prelude, prelude + EMULATION, 1))
    return program


def _config(bounds):
    """The test configuration, its f32 bounds of the chunked ops those of dtype ``bounds`` (None: as they are)."""
    return CONFIG if bounds is None else dataclasses.replace(CONFIG, tolerances={
        **CONFIG.tolerances, **{op: {"f32": CONFIG.tolerance(op, bounds)} for op in CHUNKED_OPS}})


def _chunked_cases(dtypes):
    """The catalog's cases of the chunked ops at ``dtypes`` (the gpu target chunks them where ``ssm_kernel``
    says so or the sequence is long enough)."""
    return [c for c in catalog.cases() if c.op in CHUNKED_OPS and c.dtype in dtypes]


@pytest.fixture(scope="module")
def host():
    return open_session(status("host").devices[0])


@pytest.fixture(scope="module")
def session():
    return open_device(find(KERNEL_OPENCL[0]), "gpu")


@pytest.mark.parametrize("variant", sorted(VARIANTS), ids=["16-bit", "tf32"])
def test_chunked_cases_pass_with_the_tensor_core_words_emulated(monkeypatch, session, host, variant):
    dtypes, bounds = VARIANTS[variant]
    monkeypatch.setattr(session, "limits", dataclasses.replace(session.limits, mma=variant))
    monkeypatch.setattr(programs, "program", _emulated(programs.program))
    config = _config(bounds)
    ran, failed = set(), []
    for case in _chunked_cases(dtypes):
        thunk = runner.lay_out(case).thunk
        plan = launches.plan(thunk, session.limits, **case.options) if session.unsupported(thunk) is None else None
        chunked = [item for item in (plan.launches if plan else ()) if item.kernel in CHUNK_KERNELS[case.op]]
        if not chunked:
            continue
        assert all(dict(item.defines).get("RLX_MMA") == variant for item in chunked), case.id
        outcome = runner.check(session, case, config, host)
        ran.add((case.op, case.dtype, bool(case.params.get("gate_per_channel"))))
        if outcome.status != "pass":
            failed.append(f"{case.id}: {outcome.status} {outcome.message}")
    assert ran == {(op, dt, gates) for op, gates in (("mamba2", False), ("gated_delta_net", False),
                                                     ("gated_delta_net", True), ("mamba3", False),
                                                     ("mamba2_backward", False), ("mamba3_backward", False),
                                                     ("gated_delta_net_backward", False),
                                                     ("gated_delta_net_backward", True))
                   for dt in dtypes}, ran
    assert not failed, "\n".join(failed)


CARRIED = dict(carry_state=True, angle_state=True, state=True, k_state=True, v_state=True)
VARLEN = dict(batch=1, seq=150, cu_seqlens=[0, 70, 70, 71, 150], num_seqs=4, state_slots=[2, 0, 4, 1], num_slots=5)
#: mamba3 shapes the catalog's cases leave out, chunked at the gpu target (M3C_Q 64, M3C_PT 16; 128 state columns
#: per pass of mamba3_chunk_state's variant): state rows past one tile, state columns past one 16-column slice and
#: past one pass, every field with packed sequences (an empty one, a one-token one) through slots, and a NaN or a
#: reset (adt of -inf) inside the second chunk of a packed sequence, where the diagonal tiles' select is what keeps
#: it from the earlier tokens
MAMBA3_CASES = [
    Case("mamba3", "bf16", dict(batch=2, seq=100, heads=2, head_dim=70, state_size=40, num_angles=16, d=True, z=True),
         options={"ssm_kernel": "chunked"}, seed=11),
    Case("mamba3", "f16", dict(batch=1, seq=130, heads=1, head_dim=18, state_size=144, num_angles=20, **CARRIED),
         options={"ssm_kernel": "chunked"}, seed=12),
    Case("mamba3", "bf16", dict(heads=4, head_dim=20, state_size=16, num_angles=5, groups=2, q_bias=True, k_bias=True,
                                d=True, z=True, **VARLEN, **CARRIED), options={"ssm_kernel": "chunked"}, seed=13),
] + [Case("mamba3", dtype, dict(heads=2, head_dim=5, state_size=8, num_angles=2, **VARLEN, **CARRIED),
          options={"ssm_kernel": "chunked"}, poison=field, poison_step=step, poison_value=value, seed=2)
     for dtype, field, step, value in (("bf16", "k", 100, float("nan")), ("f16", "q", 68, float("nan")),
                                       ("bf16", "adt", 90, -float("inf")))]


def test_mamba3_shapes_past_one_tile_pass_with_the_tensor_core_words_emulated(monkeypatch, session, host):
    monkeypatch.setattr(session, "limits", dataclasses.replace(session.limits, mma=MMA_16BIT))
    monkeypatch.setattr(programs, "program", _emulated(programs.program))
    failed = []
    for case in MAMBA3_CASES:
        plan = launches.plan(runner.lay_out(case).thunk, session.limits, **case.options)
        assert {dict(item.defines).get("RLX_MMA") for item in plan.launches} == {MMA_16BIT}, case.id
        outcome = runner.check(session, case, CONFIG, host)
        if outcome.status != "pass":
            failed.append(f"{case.id}: {outcome.status} {outcome.message}")
    assert not failed, "\n".join(failed)


CHUNKED = {"ssm_kernel": "chunked"}
#: gated_delta_net with per-channel gates, chunked at the gpu target (GDN_Q 64: four 16-step blocks a chunk, whose
#: Gram tiles below the diagonal chunk_prep's variant takes as tile products of decay-weighed operands): key
#: channels past two 16-channel slices and not a multiple of 16, a partial last chunk, packed sequences (an empty
#: one, a one-token one) through slots with grouped value heads and q/k norms, and a NaN in k or g, or a reset
#: (g of -inf), inside the second chunk, where only the diagonal tiles' f32 sums over s <= t keep it from the
#: earlier tokens of its block
GDN_CASES = [
    Case("gated_delta_net", "bf16", dict(batch=2, seq=130, heads=2, state_size=40, gate_per_channel=True,
                                         carry_state=True), options=CHUNKED, seed=21),
    Case("gated_delta_net", "f16", dict(batch=1, seq=150, heads=2, state_size=24, gate_per_channel=True,
                                        carry_state=True, value_heads=4, value_size=20, scale=0.3, qk_l2norm=True,
                                        cu_seqlens=[0, 70, 70, 71, 150], state_slots=[2, 0, 4, 1], num_slots=5),
         options=CHUNKED, seed=22),
] + [Case("gated_delta_net", dtype, dict(batch=1, seq=140, heads=1, state_size=20, gate_per_channel=True,
                                         carry_state=True), options=CHUNKED, poison=field, poison_step=step,
          poison_value=value, seed=23)
     for dtype, field, step, value in (("bf16", "k", 100, float("nan")), ("f16", "g", 90, float("nan")),
                                       ("bf16", "g", 83, -float("inf")))]


def _dst(session, case: Case) -> np.ndarray:
    """``case``'s output run on ``session`` as planned for its limits, as float64."""
    laid = runner.lay_out(case)
    device = Device(session, CONFIG, RunOptions.build(CONFIG, **case.options))
    return laid.view(device.run(schedule_of(dict(laid.thunk), laid.arena.size), laid.arena), "dst")


@pytest.mark.parametrize("variant", sorted(VARIANTS), ids=["16-bit", "tf32"])
def test_gdn_per_channel_shapes_pass_with_the_tensor_core_words_emulated(monkeypatch, session, host, variant):
    """The variant's per-channel Gram (tiles below the diagonal from decay-split operands rounded to the operand
    type) against the float64 reference, and its output against the portable FMA kernels' within the bound; TF32
    runs the cases in f32 against the bf16 bounds."""
    dtypes, bounds = VARIANTS[variant]
    config = _config(bounds)
    monkeypatch.setattr(programs, "program", _emulated(programs.program))
    failed = []
    for case in GDN_CASES if bounds is None else [dataclasses.replace(c, dtype=dtypes[0]) for c in GDN_CASES]:
        monkeypatch.setattr(session, "limits", dataclasses.replace(session.limits, mma=0))
        fma = _dst(session, case)
        monkeypatch.setattr(session, "limits", dataclasses.replace(session.limits, mma=variant))
        plan = launches.plan(runner.lay_out(case).thunk, session.limits, **case.options)
        assert {dict(item.defines).get("RLX_MMA") for item in plan.launches if item.kernel in CHUNK_KERNELS[case.op]} \
            == {variant}, case.id
        outcome = runner.check(session, case, config, host)
        if outcome.status != "pass":
            failed.append(f"{case.id}: {outcome.status} {outcome.message}")
        mma = _dst(session, case)
        bound = config.tolerance(case.op, case.dtype)
        if non_finite_mismatch(mma, fma) is not None or not nmse(mma, fma) <= bound:
            failed.append(f"{case.id}: vs the FMA kernels, NMSE {nmse(mma, fma):.3g} (bound {bound:.3g}), "
                          f"non-finite {non_finite_mismatch(mma, fma)}")
    assert not failed, "\n".join(failed)


#: gated_delta_net_backward, chunked at the gpu target, past one tile of gdn_chunk_back_grads' state products and of
#: gdn_chunk_back_pass' dS0 tiles (16 key channels by 16 columns): K 40 and V 20 (partial slices), a partial last
#: chunk, grouped value heads, q/k norms, a carried state, both gates; K = V = 64 with a carried state, where U and
#: dS_L rounded once to 16 bits cost d_g ~6x the FMA kernels' error (NMSE 2.3e-7 against 2.4e-8 at f16) and the
#: split operands keep it theirs; and 8 chunks of it (S 256), the state's gradient carried through the pass's
#: tensor-core dS0 (its operands rounded once, d_state ~2x the FMA kernels' error vs the float64 reference, NMSE
#: vs them 7e-6 at bf16 past a tenth of the bound: split, theirs)
GDN_WIDE = dict(batch=1, seq=100, heads=2, value_heads=4, state_size=40, value_size=20, qk_l2norm=True, scale=0.3,
                carry_state=True)
GDN_SQUARE = dict(batch=1, seq=96, heads=1, value_heads=2, state_size=64, value_size=64, qk_l2norm=True,
                  carry_state=True, gate_per_channel=False)
GDN_BACKWARD_CASES = [Case("gated_delta_net_backward", dtype, dict(GDN_WIDE, gate_per_channel=gates), seed=31)
                      for dtype, gates in (("bf16", False), ("f16", True))] + [
    Case("gated_delta_net_backward", dtype, GDN_SQUARE, seed=32) for dtype in ("f16", "bf16")] + [
    Case("gated_delta_net_backward", "bf16", dict(GDN_SQUARE, seq=256), seed=33)]


def _gradients(session, case: Case) -> dict[str, np.ndarray]:
    """``case``'s gradients run on ``session`` as planned for its limits, as float64, by field."""
    laid = runner.lay_out(case)
    device = Device(session, CONFIG, RunOptions.build(CONFIG, **case.options))
    got = device.run(schedule_of(dict(laid.thunk), laid.arena.size), laid.arena)
    return {r.field: laid.view(got, r.field) for r in laid.regions if r.writes and r.field.startswith("d_")}


def _failures_against_reference_and_fma(monkeypatch, session, host, variant, cases, bounds, launched, divisor):
    """For each backward case: the variant planned for its ``launched(case)`` chunk kernels, the case against the float64
    reference, and every gradient against the portable FMA kernels' within the bound divided by
    ``divisor(field)``, their non-finite positions the same. The failures, each a line."""
    config = _config(bounds)
    monkeypatch.setattr(programs, "program", _emulated(programs.program))
    failed = []
    for case in cases:
        monkeypatch.setattr(session, "limits", dataclasses.replace(session.limits, mma=0))
        fma = _gradients(session, case)
        monkeypatch.setattr(session, "limits", dataclasses.replace(session.limits, mma=variant))
        plan = launches.plan(runner.lay_out(case).thunk, session.limits, **case.options)
        assert [dict(item.defines).get("RLX_MMA") for item in plan.launches
                if item.kernel in CHUNK_KERNELS[case.op]] == [variant] * launched(case), case.id
        outcome = runner.check(session, case, config, host)
        if outcome.status != "pass":
            failed.append(f"{case.id}: {outcome.status} {outcome.message}")
        for field, value in _gradients(session, case).items():
            bound = config.tolerance(case.op, case.dtype) / divisor(field)
            if non_finite_mismatch(value, fma[field]) is not None or not nmse(value, fma[field]) <= bound:
                failed.append(f"{case.id} {field}: vs the FMA kernels, NMSE {nmse(value, fma[field]):.3g} (bound "
                              f"{bound:.3g}), non-finite {non_finite_mismatch(value, fma[field])}")
    return failed


@pytest.mark.parametrize("variant", sorted(VARIANTS), ids=["16-bit", "tf32"])
def test_gdn_backward_shapes_pass_with_the_tensor_core_words_emulated(monkeypatch, session, host, variant):
    """gdn_chunk_back_grads' variant (its state products on the tensor cores, U dS_L^T from split operands at 16 bits)
    and gdn_chunk_back_pass' (dS0's products, split operands at 16 bits) against the float64 reference, and every
    gradient against the portable FMA kernels' within a tenth of the bound (TF32, whose operands are not split:
    within the bf16 bound)."""
    dtypes, bounds = VARIANTS[variant]
    cases = GDN_BACKWARD_CASES if bounds is None else [dataclasses.replace(c, dtype=dtypes[0])
                                                      for c in GDN_BACKWARD_CASES[:2]]
    failed = _failures_against_reference_and_fma(monkeypatch, session, host, variant, cases, bounds, lambda case: 2,
                                                 lambda field: 10 if bounds is None else 1)
    assert not failed, "\n".join(failed)


#: mamba2_backward, chunked at the gpu target (M2_Q 64), past one tile of mamba2_backward_chunk's state products (32
#: steps by 16 columns, sums in slices of 16) and scores C·Bᵀ (16 x 16 tiles on and below the diagonal): P 20 and N 40
#: (partial slices), a full chunk and a partial one, every field with a carried state; from a saved forward
#: (SSM_RESERVE: no S_in·c, the saved scores); a NaN in c inside the second chunk, whose diagonal tile's entries
#: above the diagonal are dropped. Rounded once to 16 bits (or TF32) the states in D·b and S_in·c cost d_a and
#: d_dt_bias past the bounds (f16 d_a NMSE 1.1e-6 against 5e-7), as do the recomputed chunk states' weighted x (and
#: b at TF32) in mamba2_chunk_state's product (d_a against the reference f16 3.2e-6, bf16 4.2e-4, TF32 1.5e-4);
#: split, the FMA kernels' error
M2B_WIDE = dict(batch=1, seq=100, heads=2, head_dim=20, state_size=40, carry_state=True, state=True, d_state=True,
                dt_bias=True, d_dt_bias=True, dt_softplus=True, d=True, d_d=True, z=True, d_z=True)
M2B_CASES = [Case("mamba2_backward", dtype, M2B_WIDE, seed=41) for dtype in ("f16", "bf16")] + [
    Case("mamba2_backward", "bf16", dict(batch=2, seq=100, heads=2, head_dim=20, state_size=40, reserve=True,
                                         reserve_bytes=1 << 19), seed=42)] + [
    Case("mamba2_backward", "bf16", dict(batch=1, seq=100, heads=2, head_dim=20, state_size=40), poison="c",
         poison_step=90, poison_value=float("nan"), seed=43)]


@pytest.mark.parametrize("variant", sorted(VARIANTS), ids=["16-bit", "tf32"])
def test_mamba2_backward_shapes_pass_with_the_tensor_core_words_emulated(monkeypatch, session, host, variant):
    """mamba2_backward_chunk's variant (its state products D·b, S_in·c, x·D, gy·S_in on the tensor cores from split
    operands, and the scores C·Bᵀ) against the float64 reference, and every gradient against the portable FMA
    kernels' within the bound, their non-finite positions the same (TF32: the bf16 bound)."""
    dtypes, bounds = VARIANTS[variant]
    cases = M2B_CASES if bounds is None else [dataclasses.replace(c, dtype=dtypes[0]) for c in M2B_CASES[1:]]
    failed = _failures_against_reference_and_fma(monkeypatch, session, host, variant, cases, bounds,
                                                 lambda case: 2 if case.params.get("reserve") else 3, lambda field: 1)
    assert not failed, "\n".join(failed)


#: mamba3_backward, chunked at the gpu target (M3C_Q 64), past one tile of mamba3_cb_chunk's state products (64 steps
#: by 32 output columns, sums in slices of 16): P 40 and N 24 (partial slices and passes), full chunks and a partial
#: one, every carried field and gradient, d and z. Rounded once to the operand type, q~, k~, gy and the states in
#: those products move d_angle_state (whose score terms cancel exactly, the states' not) far from the FMA kernels'
#: (NMSE against them f16 3.6e-8, bf16 1.1e-5, TF32 2.0e-7: past a thousandth of the bound); split, 1.5e-12,
#: 1.3e-11, 2.1e-12
M3B_WIDE = dict(batch=1, seq=150, heads=2, head_dim=40, state_size=24, num_angles=4, d=True, z=True, d_d=True,
                d_z=True, **CARRIED, d_angle_state=True, d_state=True, d_k_state=True, d_v_state=True)
M3B_CASES = [Case("mamba3_backward", dtype, M3B_WIDE, options=CHUNKED, seed=51) for dtype in ("f16", "bf16")]


@pytest.mark.parametrize("variant", sorted(VARIANTS), ids=["16-bit", "tf32"])
def test_mamba3_backward_shapes_pass_with_the_tensor_core_words_emulated(monkeypatch, session, host, variant):
    """mamba3_cb_chunk's variant (its state products D·k̃, S_in·q̃, S_inᵀ·gy, Dᵀ·v on the tensor cores from split
    operands, and the scores) against the float64 reference, and every gradient against the portable FMA kernels'
    within the bound, their non-finite positions the same, d_angle_state within a thousandth of it (TF32: the
    bf16 case in f32 against the bf16 bound)."""
    dtypes, bounds = VARIANTS[variant]
    cases = M3B_CASES if bounds is None else [dataclasses.replace(M3B_CASES[1], dtype=dtypes[0])]
    failed = _failures_against_reference_and_fma(monkeypatch, session, host, variant, cases, bounds, lambda case: 1,
                                                 lambda field: 1000 if field == "d_angle_state" else 1)
    assert not failed, "\n".join(failed)
