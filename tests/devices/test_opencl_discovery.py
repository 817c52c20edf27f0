"""OpenCL discovery: a device whose compiler cannot build a trivial kernel is listed with the reason and
never chosen; every device that is used builds it."""
from __future__ import annotations

import pytest

cl = pytest.importorskip("pyopencl")
from rlx_gpu.backends import opencl  # noqa: E402
from rlx_gpu.errors import DeviceError  # noqa: E402
from rlx_gpu.runtime import registry  # noqa: E402
from rlx_gpu.runtime.config import load_config  # noqa: E402


class _RefusingProgram:
    """A compiler that refuses every program as PoCL 3.0 (LLVM 14) does on a CPU its LLVM does not know."""

    def __init__(self, context, source):
        pass

    def _build(self, options, devices):
        raise cl.RuntimeError("clBuildProgram failed: BUILD_PROGRAM_FAILURE")

    def get_build_info(self, device, param):
        return "error: unknown target CPU 'generic'\nDevice pthread-AMD EPYC failed to build the program\n"


def test_a_device_whose_compiler_builds_nothing_is_listed_with_the_reason_and_never_chosen(monkeypatch):
    monkeypatch.setattr(cl._cl, "_Program", _RefusingProgram)  # the raw program the probe builds
    registry.status.cache_clear()
    try:
        st = registry.status("opencl")
        assert not st.available and not st.devices and st.refused
        assert all("unknown target CPU 'generic'" in d.details["unusable"] for d in st.refused)
        assert "unknown target CPU 'generic'" in st.reason
        with pytest.raises(DeviceError, match=r"cannot run here: its compiler builds no kernel: error: unknown target"):
            registry.resolve(st.refused[0].spec, load_config())
    finally:
        registry.status.cache_clear()


def test_every_usable_opencl_device_builds_the_probe_kernel():
    assert registry.status("opencl").available, registry.status("opencl").reason
    for info in registry.status("opencl").devices:
        _, pi, di = info.spec.split(":")
        assert opencl._compile_failure(cl, cl.get_platforms()[int(pi)].get_devices()[int(di)]) is None


def test_matrix_extensions_are_read_from_the_extension_string_and_listed(monkeypatch, capsys):
    """Detected, never assumed: the extension string alone says so; ``rlx-gpu devices`` names them. No device
    here offers one (PoCL, Intel's CPU runtime, Oclgrind), so a device's string is rewritten to name one."""
    assert opencl.matrix_extensions("cl_khr_fp64 cl_khr_cooperative_matrix cl_khr_subgroups") == (
        "cl_khr_cooperative_matrix",)
    assert opencl.matrix_extensions("cl_intel_subgroup_matrix_multiply_accumulate_tf32") == ()  # names, not prefixes
    assert all(info.details["matrix_extensions"] == opencl.matrix_extensions(
        cl.get_platforms()[int(info.spec.split(":")[1])].get_devices()[int(info.spec.split(":")[2])].extensions)
        for info in registry.status("opencl").devices)
    from rlx_gpu.cli import main

    extensions = cl.Device.extensions
    monkeypatch.setattr(cl.Device, "extensions", property(
        lambda dev: extensions.__get__(dev) + " cl_intel_subgroup_matrix_multiply_accumulate"))
    registry.status.cache_clear()
    try:
        assert main(["devices"]) == 0
        # the devices that can run kernels (one refused here, its compiler failing, is listed with the reason)
        listed = [line for line in capsys.readouterr().out.splitlines()
                  if line.startswith("  opencl:") and "cannot run here" not in line]
        assert listed and all("(matrix units: cl_intel_subgroup_matrix_multiply_accumulate)" in line for line in listed)
    finally:
        registry.status.cache_clear()


def test_a_matrix_extension_changes_nothing_a_launch_carries(monkeypatch):
    """Detected, never used: a device naming both matrix extensions gets the limits it gets without them (no
    tensor-core variant: mma 0), so its gpu target's chunked plans are the portable ones and their absence costs
    nothing."""
    from rlx_gpu import launches
    from rlx_gpu.conformance import cases

    monkeypatch.setenv("RLX_TARGET", "gpu")
    info = registry.status("opencl").devices[0]
    _, pi, di = info.spec.split(":")
    device = cl.get_platforms()[int(pi)].get_devices()[int(di)]
    plain = opencl.device_limits(cl, device, info.fp64)
    extensions = cl.Device.extensions
    monkeypatch.setattr(cl.Device, "extensions", property(
        lambda dev: extensions.__get__(dev) + " " + " ".join(opencl.MATRIX_EXTENSIONS)))
    assert opencl.matrix_extensions(device.extensions) == opencl.MATRIX_EXTENSIONS
    offered = opencl.device_limits(cl, device, info.fp64)
    assert offered == plain and offered.mma == 0
    for op, chunk in (("mamba2", "mamba2_chunk_scan"), ("gated_delta_net", "gated_delta_net_chunk_out"),
                      ("mamba3_backward", "mamba3_cb_chunk")):
        thunk, _ = cases.lay_out(op, "bf16", dict(cases.SMALL[op], seq=64))
        plan = launches.plan(thunk, offered, ssm_kernel="chunked")
        assert chunk in {i.kernel for i in plan.launches}
        assert not any("RLX_MMA" in dict(i.defines) for i in plan.launches)
