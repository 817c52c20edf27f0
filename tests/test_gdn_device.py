"""gated_delta_net's version-2 fields (ABI.md §8) on the OpenCL device at both kernel targets, in every
kernel form (cpu recurrence and decode step, gpu lanes and chunked, varlen sequences ending inside a
chunk): grouped value heads, value_size != state_size, scale, q/k L2-norm, carried state (f32 for 16-bit
thunks), varlen batches and state slots, and their combinations, which the catalog's one-field cases
(small shapes, one form per target) leave out.

Each case runs through the conformance harness (executor, validation, guard bytes, the config's
tolerances) against the conformance float64 reference.
"""
from __future__ import annotations

import pytest

opencl = pytest.importorskip("rlx_gpu.backends.opencl")
from rlx_gpu import launches  # noqa: E402
from rlx_gpu.conformance import runner  # noqa: E402
from rlx_gpu.conformance.catalog import Case  # noqa: E402
from rlx_gpu.conformance.devices import find, open_device  # noqa: E402
from rlx_gpu.launches.limits import TARGETS  # noqa: E402
from rlx_gpu.runtime.config import default_config_path, load_config  # noqa: E402
from rlx_gpu.runtime.registry import status  # noqa: E402
from support.conformance_devices import KERNEL_OPENCL, SPECS  # noqa: E402  (RLX_TEST_DEVICES, or every available device)

OPENCL = KERNEL_OPENCL
pytestmark = pytest.mark.skipif(not OPENCL, reason=f"no OpenCL device among {SPECS}: {status('opencl').reason}")


def _gdn(**params) -> dict:
    base = dict(batch=2, seq=7, heads=2, state_size=8, gate_per_channel=False, carry_state=True)
    return {**base, **params}


_V2 = dict(value_heads=4, value_size=12, scale=0.3, qk_l2norm=True)
#: (id, dtype, params): every field, in the cpu recurrence (seq > 1), the cpu decode step (seq 1), the gpu
#: lanes (short) and chunked (seq >= GDN_MIN_SEQ) forms
CASES = [
    ("gva-kv-scale-norm", "f32", _gdn(**_V2)),
    ("gva-kv-scale-norm-channel-chunked", "f32", _gdn(seq=70, gate_per_channel=True, **_V2)),
    ("gva-kv-nocarry-chunked", "f32", _gdn(seq=66, carry_state=False, value_heads=4, value_size=20, state_size=16)),
    ("decode-slots-gva-norm-tail", "f32", _gdn(batch=3, seq=1, gate_per_channel=True, state_slots=[1, 3, 0],
                                                num_slots=4, **{**_V2, "value_size": 40})),
    ("varlen-slots-channel", "f32", _gdn(batch=1, seq=9, cu_seqlens=[0, 4, 4, 9], state_slots=[2, 0, 3], num_slots=4,
                                         gate_per_channel=True, value_heads=4)),
    ("varlen-nocarry", "f32", _gdn(batch=1, seq=9, cu_seqlens=[0, 4, 4, 9], carry_state=False, qk_l2norm=True)),
    ("varlen-chunked-boundaries", "f32", _gdn(batch=1, seq=150, cu_seqlens=[0, 50, 52, 130, 150], state_slots=[4, 1, 0, 2],
                                              num_slots=5, value_heads=4, value_size=12)),
    ("varlen-decode", "f32", _gdn(batch=1, seq=1, cu_seqlens=[0, 0, 1], state_slots=[1, 0], num_slots=2)),
    ("state-f32-bf16", "bf16", _gdn(seq=70, state_dtype="f32", value_size=20, state_size=16)),
    ("state-f32-bf16-decode", "bf16", _gdn(batch=3, seq=1, state_dtype="f32", gate_per_channel=True, value_size=40)),
    ("state-f32-f16-varlen-channel", "f16", _gdn(batch=1, seq=9, cu_seqlens=[0, 5, 9], state_dtype="f32",
                                                 gate_per_channel=True, qk_l2norm=True, state_slots=[1, 0], num_slots=2)),
    ("wide-value", "f32", _gdn(batch=1, seq=3, heads=1, state_size=40, value_size=256, scale=0.1)),
    ("wide-key", "f32", _gdn(batch=1, seq=2, heads=1, state_size=256, value_size=24, gate_per_channel=True)),
]

CONFIG = load_config(default_config_path())


def _form(params: dict, lim) -> str:
    """The kernel that must run ``params`` at ``lim``'s target (so that the cases cover every form)."""
    if lim.target == "gpu":
        return "gated_delta_net_chunk_prep" if params["seq"] >= lim.tune("GDN_MIN_SEQ") else "gated_delta_net_lanes"
    return "gated_delta_net_step" if params["seq"] == 1 else "gated_delta_net"


@pytest.fixture(scope="module", params=[(spec, target) for spec in OPENCL for target in TARGETS], ids=str)
def session(request):
    spec, target = request.param
    return open_device(find(spec), target)


@pytest.mark.parametrize("dtype,params", [(d, p) for _, d, p in CASES], ids=[c[0] for c in CASES])
def test_v2_case_matches_the_float64_reference(session, dtype, params):
    case = Case("gated_delta_net", dtype, params)
    thunk, lim = runner.lay_out(case).thunk, session.limits
    assert session.unsupported(thunk) is None, "the device gate sent a v2 case to the host"
    assert _form(params, lim) in {item.kernel for item in launches.plan(thunk, lim).launches}
    outcome = runner.check(session, case, CONFIG)
    assert outcome.status == "pass", f"{session.info.spec}@{session.limits.target}: {outcome.message}"


def test_version_one_thunks_keep_the_version_one_programs(session):
    """A thunk without a version-2 field that changes what a kernel reads builds no GDN_V2 variant; GVA,
    value_size and scale alone keep it too (they are sizes and a factor)."""
    for params in (_gdn(), _gdn(value_heads=4, value_size=12, scale=0.3), _gdn(seq=1), _gdn(seq=70)):
        thunk = runner.lay_out(Case("gated_delta_net", "f32", params)).thunk
        plan = launches.plan(thunk, session.limits)
        assert all(("GDN_V2", 1) not in item.defines for item in plan.launches), plan
    slotted = runner.lay_out(Case("gated_delta_net", "f32", _gdn(state_slots=[1, 0], num_slots=2))).thunk
    assert all(("GDN_V2", 1) in item.defines for item in launches.plan(slotted, session.limits).launches)
