"""The tensor-core variants' kernel text, run: every conformance case of the chunked mamba2, gated_delta_net and
mamba3 at 16-bit dtypes passes on an OpenCL CPU device with the variant planned (``RLX_MMA`` 1) and its tensor-core
words emulated (tests/support/mma_emulation.cl: warp tiles, operands rounded to the 16-bit type, f32
accumulation), against the float64 reference and host_fallback, the NaN/Inf cases among them. This checks
what no NVRTC build can: the variants' tiling, staging, triangular masks and output stores compute the op.
The same at f32 with TF32 operands (``RLX_MMA`` 2) against the bf16 bounds (TF32 keeps 10 mantissa bits
to bf16's 7), which f32's own bounds are too tight for by design. No GPU is involved.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

opencl = pytest.importorskip("rlx_gpu.backends.opencl")
from rlx_gpu import launches  # noqa: E402
from rlx_gpu.backends import programs  # noqa: E402
from rlx_gpu.conformance import catalog, runner  # noqa: E402
from rlx_gpu.conformance.devices import find, open_device  # noqa: E402
from rlx_gpu.launches.mma import MMA_16BIT, MMA_TF32  # noqa: E402
from rlx_gpu.runtime.config import default_config_path, load_config  # noqa: E402
from rlx_gpu.runtime.registry import open_session, status  # noqa: E402
from support.conformance_devices import KERNEL_OPENCL, SPECS  # noqa: E402

pytestmark = pytest.mark.skipif(not KERNEL_OPENCL, reason=f"no OpenCL device among {SPECS}: {status('opencl').reason}")

CONFIG = load_config(default_config_path())
EMULATION = (Path(__file__).parent.parent / "support" / "mma_emulation.cl").read_text()
CHUNK_KERNELS = {"mamba2_chunk_state", "mamba2_chunk_scan", "gated_delta_net_chunk_prep", "gated_delta_net_state_pass",
                 "gated_delta_net_chunk_out", "mamba3_chunk_state", "mamba3_chunk_scan"}
CHUNKED_OPS = ("mamba2", "gated_delta_net", "mamba3")
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
    config = CONFIG if bounds is None else dataclasses.replace(CONFIG, tolerances={
        **CONFIG.tolerances, **{op: {"f32": CONFIG.tolerance(op, bounds)} for op in CHUNKED_OPS}})
    ran, failed = set(), []
    for case in _chunked_cases(dtypes):
        thunk = runner.lay_out(case).thunk
        plan = launches.plan(thunk, session.limits, **case.options) if session.unsupported(thunk) is None else None
        chunked = [item for item in (plan.launches if plan else ()) if item.kernel in CHUNK_KERNELS]
        if not chunked:
            continue
        assert all(dict(item.defines).get("RLX_MMA") == variant for item in chunked), case.id
        outcome = runner.check(session, case, config, host)
        ran.add((case.op, case.dtype, bool(case.params.get("gate_per_channel"))))
        if outcome.status != "pass":
            failed.append(f"{case.id}: {outcome.status} {outcome.message}")
    assert ran == {(op, dt, gates) for op, gates in (("mamba2", False), ("gated_delta_net", False),
                                                     ("gated_delta_net", True), ("mamba3", False))
                   for dt in dtypes}, ran
    assert not failed, "\n".join(failed)
