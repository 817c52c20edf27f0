"""The OpenCL kernels of selective_scan and mamba2 take ABI.md §8's fields, at both kernel targets.

Each case switches on many fields at once (one compile-time variant of kernels/ssm.cl), runs through
the executor on every OpenCL test device at the cpu target and at the gpu target (lanes and chunked
forms, forced by ``ssm_kernel``), and is compared with the conformance suite's float64 step
recurrence (written from ABI.md §4 and §8): the output and the whole state pool (entries no row names
must stay as they were).
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("rlx_gpu.backends.opencl")
from host_fallback.abi import complete  # noqa: E402
from rlx_gpu.conformance import runner  # noqa: E402
from rlx_gpu.conformance.cases import schedule_of  # noqa: E402
from rlx_gpu.conformance.catalog import Case  # noqa: E402
from rlx_gpu.conformance.compare import nmse  # noqa: E402
from rlx_gpu.conformance.references import REFERENCES  # noqa: E402
from rlx_gpu.conformance.devices import find, open_device  # noqa: E402
from rlx_gpu.runtime.config import load_config  # noqa: E402
from rlx_gpu.runtime.executor import Device  # noqa: E402
from rlx_gpu.runtime.options import RunOptions  # noqa: E402
from support.conformance_devices import KERNEL_OPENCL as OPENCL  # noqa: E402


_CARRIED = dict(carry_state=True, state=True)
_PACKED = dict(batch=1, cu_seqlens=[0, 5, 5, 70], num_seqs=3, state_slots=[2, 0, 3], num_slots=4)  # one empty
CASES = [
    # every field of the op at once: varlen into slots, 16-bit thunk with f32 state and parameters
    Case("selective_scan", "bf16", dict(seq=70, hidden=6, state_size=4, groups=2, delta_bias=True, delta_softplus=True,
                                        d=True, z=True, state_dtype="f32", param_dtype="f32", **_CARRIED, **_PACKED)),
    Case("mamba2", "bf16", dict(seq=70, heads=4, head_dim=3, state_size=5, groups=2, dt_bias=True, dt_softplus=True,
                                dt_limit=[0.05, None], d=True, z=True, state_dtype="f32", param_dtype="f32",
                                **_CARRIED, **_PACKED)),
    # batch rows, state_size 16 (selective_scan's fixed-width path at the cpu target: a block of 8 steps, then
    # 3 single steps), slots without varlen
    Case("selective_scan", "f32", dict(batch=2, seq=11, hidden=4, state_size=16, groups=4, delta_bias=True, z=True,
                                       state_slots=[1, 0], num_slots=2, **_CARRIED)),
    Case("mamba2", "f16", dict(batch=2, seq=6, heads=2, head_dim=17, state_size=4, groups=1, dt_limit=[0.1, 0.3],
                               d=True, **_CARRIED)),
    # one token per row (mamba2's decode form at the cpu target): batch rows; packed sequences of 1, 0 and 3
    # tokens into slots; head_dim 17 (an item with a partial block of rows), odd state_size
    Case("mamba2", "f32", dict(batch=2, seq=1, heads=2, head_dim=17, state_size=5, groups=2, dt_bias=True,
                               dt_softplus=True, d=True, z=True, **_CARRIED)),
    Case("mamba2", "f32", dict(batch=1, seq=4, heads=2, head_dim=17, state_size=5, groups=1, dt_limit=[0.1, 0.3],
                               z=True, cu_seqlens=[0, 1, 1, 4], num_seqs=3, state_slots=[2, 0, 3], num_slots=4,
                               **_CARRIED)),
    Case("mamba2", "f32", dict(batch=2, seq=1, heads=2, head_dim=4, state_size=6, d=True)),  # no state carried
    # f64, state only
    Case("mamba2", "f64", dict(batch=2, seq=4, heads=2, head_dim=3, state_size=6, **_CARRIED)),
]


@pytest.fixture(scope="module", params=[(spec, target) for spec in OPENCL for target in ("cpu", "gpu")], ids=str)
def session(request):
    spec, target = request.param
    return open_device(find(spec), target)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.op}-{c.dtype}")
def test_version2_fields_match_the_float64_recurrence(session, case):
    laid = runner.lay_out(case)
    assert session.unsupported(laid.thunk) is None, session.unsupported(laid.thunk)
    regions = {r.field: r for r in laid.regions}

    def load(field):
        return laid.view(laid.arena, field).reshape(regions[field].shape)

    want = REFERENCES[case.op](complete(laid.thunk), load)
    config = load_config()
    kernels = ("lanes", "chunked") if session.limits.target == "gpu" else ("auto",)
    for kernel in kernels:
        if kernel == "chunked" and case.dtype == "f64" and case.op == "mamba2":
            continue  # f64 keeps the lanes kernel at the gpu target
        device = Device(session, config, RunOptions.build(config, ssm_kernel=kernel))
        with np.errstate(all="ignore"):
            got = device.run(schedule_of(dict(laid.thunk), laid.arena.size), laid.arena.copy())
        for field, value in want.items():
            err = nmse(laid.view(got, field).reshape(value.shape), value)
            assert err < config.tolerance(case.op, case.dtype), f"{kernel}: {field} nmse {err:.3g}"
