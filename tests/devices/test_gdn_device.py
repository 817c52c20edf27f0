"""gated_delta_net's version-2 fields (ABI.md §8) on the OpenCL device at both kernel targets: the catalog's
combined-field cases (``rlx_gpu.conformance.combined.GDN``: grouped value heads, value_size != state_size,
scale, q/k L2-norm, carried state (f32 for 16-bit thunks), varlen batches and state slots, and their
combinations), which tests/conformance/test_conformance.py runs on every device, reach the device in every kernel form
(cpu recurrence and decode step, gpu lanes and chunked, varlen sequences ending inside a chunk); a thunk
without a field that changes what a kernel reads keeps the version-1 programs.
"""
from __future__ import annotations

import pytest

opencl = pytest.importorskip("rlx_gpu.backends.opencl")
from rlx_gpu import launches  # noqa: E402
from rlx_gpu.conformance import runner  # noqa: E402
from rlx_gpu.conformance.catalog import Case  # noqa: E402
from rlx_gpu.conformance.combined import GDN, gdn_params  # noqa: E402
from rlx_gpu.conformance.devices import find, open_device  # noqa: E402
from rlx_gpu.launches.limits import TARGETS  # noqa: E402
from rlx_gpu.runtime.registry import status  # noqa: E402
from support.conformance_devices import KERNEL_OPENCL, SPECS  # noqa: E402  (RLX_TEST_DEVICES, or every available device)

OPENCL = KERNEL_OPENCL
pytestmark = pytest.mark.skipif(not OPENCL, reason=f"no OpenCL device among {SPECS}: {status('opencl').reason}")


def _form(params: dict, lim) -> str:
    """The kernel that must run ``params`` at ``lim``'s target (so that the cases cover every form)."""
    if lim.target == "gpu":
        return "gated_delta_net_chunk_prep" if params["seq"] >= lim.tune("GDN_MIN_SEQ") else "gated_delta_net_lanes"
    return "gated_delta_net_step" if params["seq"] == 1 else "gated_delta_net"


@pytest.fixture(scope="module", params=[(spec, target) for spec in OPENCL for target in TARGETS], ids=str)
def session(request):
    spec, target = request.param
    return open_device(find(spec), target)


@pytest.mark.parametrize("dtype,params", [(d, p) for _, d, p in GDN], ids=[c[0] for c in GDN])
def test_each_combined_case_reaches_the_device_in_the_form_it_stands_for(session, dtype, params):
    thunk, lim = runner.lay_out(Case("gated_delta_net", dtype, params)).thunk, session.limits
    assert session.unsupported(thunk) is None, "the device gate sent a v2 case to the host"
    assert _form(params, lim) in {item.kernel for item in launches.plan(thunk, lim).launches}


def test_version_one_thunks_keep_the_version_one_programs(session):
    """A thunk without a version-2 field that changes what a kernel reads builds no GDN_V2 variant; GVA,
    value_size and scale alone keep it too (they are sizes and a factor)."""
    for params in (gdn_params(), gdn_params(value_heads=4, value_size=12, scale=0.3), gdn_params(seq=1),
                   gdn_params(seq=70)):
        thunk = runner.lay_out(Case("gated_delta_net", "f32", params)).thunk
        plan = launches.plan(thunk, session.limits)
        assert all(("GDN_V2", 1) not in item.defines for item in plan.launches), plan
    slotted = runner.lay_out(Case("gated_delta_net", "f32", gdn_params(state_slots=[1, 0], num_slots=2))).thunk
    assert all(("GDN_V2", 1) in item.defines for item in launches.plan(slotted, session.limits).launches)
