"""What only the OpenCL backend has: its reasons for refusing a thunk and its build cache and errors.

The conformance cases (every op x dtype x shape, guard bytes, float64 references, host parity) run on
every device, OpenCL included, in ``test_conformance.py``.
"""
from __future__ import annotations

import dataclasses

import pytest

opencl = pytest.importorskip("rlx_gpu.backends.opencl")
from rlx_gpu.backends import programs  # noqa: E402
from rlx_gpu.errors import KernelBuildError  # noqa: E402
from rlx_gpu.conformance.devices import find, open_device  # noqa: E402
from rlx_gpu.launches.limits import TARGETS  # noqa: E402
from rlx_gpu.runtime.registry import status  # noqa: E402
from support.conformance_devices import KERNEL_OPENCL, SPECS  # noqa: E402  (RLX_TEST_DEVICES, or every available device)

OPENCL = KERNEL_OPENCL
pytestmark = pytest.mark.skipif(not OPENCL, reason=f"no OpenCL device among {SPECS}: {status('opencl').reason}")


@pytest.fixture(scope="module", params=[(spec, target) for spec in OPENCL for target in TARGETS], ids=str)
def session(request):
    """Each OpenCL test device at each target: the gpu target (forced through RLX_TARGET) runs the
    GPU-shaped kernels on it, so they are checked here too."""
    spec, target = request.param
    opened = open_device(find(spec), target)
    assert opened.limits.target == target
    return opened


def test_registry_reasons(session):
    f64 = dict(op="unary", fn="exp", n=4, x=0, dst=0, dtype="f64")
    assert session.unsupported(f64) is None
    no_fp64 = opencl.open(dataclasses.replace(session.info, fp64=False))
    assert "cl_khr_fp64" in no_fp64.unsupported(f64)
    assert "cl_khr_fp64" in no_fp64.unsupported(dict(op="cast", n=4, src=0, dst=0, dtype="f32", src_dtype="f64"))
    assert no_fp64.unsupported(dict(f64, dtype="f32")) is None
    big = dict(op="gated_delta_net", dtype="f32", batch=1, seq=1, heads=1, state_size=257, gate_per_channel=False,
               carry_state=False, q=0, k=0, v=0, g=0, beta=0, state=0, dst=0)
    assert "257" in session.unsupported(big) and "256" in session.unsupported(big)


def test_build_cache_and_error(session):
    prog = programs.program("opencl", "body", "f32", None, session.limits.target)
    assert session.program(prog) is session.program(prog)
    broken = dataclasses.replace(prog, source=prog.source.replace("return exp(x);", "return exp(x) +;"))
    with pytest.raises(KernelBuildError) as info:
        session.program(broken)
    err = info.value
    assert "error" in err.log.lower() and err.options == list(opencl.BUILD_OPTIONS)
    assert "return exp(x) +;" in str(err) and "    1  /* rlx_gpu body kernels" in str(err)


def test_the_launch_limits_are_read_from_the_device(session):
    """Work-group size, local memory, compute units, fp64 and the SIMD width come from the device at either
    target (the gpu target on a CPU implementation plans within that implementation's real limits)."""
    dev, lim = session.prims.device, session.limits
    assert (lim.max_work_group, lim.local_mem_bytes, lim.compute_units) == (
        dev.max_work_group_size, dev.local_mem_size, dev.max_compute_units)
    assert lim.fp64 == ("cl_khr_fp64" in dev.extensions.split())
    assert lim.sub_group == dev.preferred_work_group_size_multiple  # not a warp of 32 assumed at the gpu target


def test_a_kernel_whose_local_arrays_pass_the_device_s_local_memory_is_a_device_error(session):
    import numpy as np

    from rlx_gpu.errors import DeviceError
    from rlx_gpu.launches import ARENA
    from rlx_gpu.launches.core import Launch

    prims = session.prims
    prog = programs.program("opencl", "ssm", "f32", None, "gpu")  # mamba2_chunk_scan's tiles: ~31 KiB of LOCAL
    kernel = prims.get_kernel(session.program(prog), "mamba2_chunk_scan")
    need = kernel.get_work_group_info(prims.cl.kernel_work_group_info.LOCAL_MEM_SIZE, prims.device)
    assert need > 16 * 1024
    prims.limits = dataclasses.replace(prims.limits, local_mem_bytes=16 * 1024)  # a device with 16 KiB
    launch = Launch("ssm", "mamba2_chunk_scan", "f32", (256,), (256,), (ARENA, np.int64(0)), target="gpu")
    with pytest.raises(DeviceError, match=r"mamba2_chunk_scan .*needs .* of local memory; .* has 16.0 KiB"):
        prims.enqueue(kernel, launch, launch.args)
