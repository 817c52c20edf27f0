"""A thunk a device's kernels cannot run, launched on that device's session directly (the placement that
would send it to the host bypassed), is refused with the device's reason before anything is built or run."""
import numpy as np
import pytest

from rlx_gpu.conformance import runner
from rlx_gpu.conformance.catalog import Case
from rlx_gpu.errors import DeviceError


@pytest.mark.parametrize("op, params", [
    ("mamba2", dict(batch=1, seq=40, heads=1, head_dim=4, state_size=512)),
    ("mamba3", dict(batch=1, seq=40, heads=1, head_dim=4, state_size=512, num_angles=2)),
])
def test_a_state_wider_than_the_kernels_hold_is_refused_naming_the_limit(cpu_session, op, params):
    laid = runner.lay_out(Case(op, "f32", params))
    arena = cpu_session.upload(laid.arena)
    with pytest.raises(DeviceError, match=rf"a {op} thunk cannot run on opencl:.*state_size=512.*at most 256"):
        cpu_session.launch(laid.thunk, arena)
    cpu_session.finish()
    assert np.array_equal(cpu_session.read(arena, 0, laid.arena.size), laid.arena)  # nothing was written
