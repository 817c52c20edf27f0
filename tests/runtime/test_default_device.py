"""The default device: ``auto`` takes a GPU or accelerator in the priority's order, else the host; a CPU-type
device of a backend (PoCL, a simulator) runs only when named; ``rlx-gpu devices`` marks the default and says why.

The backends' probes are replaced by made-up device lists, so each machine shape is tested on every machine.
"""
from __future__ import annotations

import pytest

from rlx_gpu.backends.base import DeviceInfo
from rlx_gpu.cli import main
from rlx_gpu.runtime import registry
from rlx_gpu.runtime.config import Config
from rlx_gpu.runtime.registry import BackendStatus, resolve

HOST = DeviceInfo("host", "host", "NumPy on the CPU", True, cpu=True)
POCL = DeviceInfo("opencl", "opencl:0:0", "pthread-Xeon (Portable Computing Language)", True, {"simulator": False},
                  cpu=True)
OCLGRIND = DeviceInfo("opencl", "opencl:1:0", "Oclgrind Simulator (Oclgrind)", True, {"simulator": True}, cpu=True)
IGPU = DeviceInfo("opencl", "opencl:2:0", "Intel(R) UHD Graphics (Intel(R) OpenCL Graphics)", False,
                  {"simulator": False})
H200 = DeviceInfo("cuda", "cuda:0", "NVIDIA H200 (sm_90)", True)
NO_CUDA = BackendStatus("cuda", (), "cupy is not importable")


@pytest.fixture
def machine(monkeypatch):
    """``machine(opencl=[...], cuda=[...])``: the registry sees these devices (none: unavailable)."""
    for name in ("RLX_DEVICE", "PYOPENCL_CTX", "RLX_CONFIG"):
        monkeypatch.delenv(name, raising=False)

    def make(opencl=(), cuda=()):
        found = {"host": (HOST,), "opencl": tuple(opencl), "cuda": tuple(cuda)}
        monkeypatch.setattr(registry, "status", lambda name: BackendStatus(
            name, found[name], None if found[name] else f"{name}: no device found"))

    return make


def test_auto_takes_the_host_over_an_opencl_cpu_device(machine):
    machine(opencl=[POCL])
    info, why = registry.choose(None, Config())
    assert info == HOST
    assert "the only opencl device, opencl:0:0 (pthread-Xeon (Portable Computing Language)), runs on the CPU" in why
    assert "--device opencl or RLX_DEVICE=opencl" in why
    machine(opencl=[POCL, OCLGRIND])
    info, why = registry.choose("auto", Config())
    assert info == HOST and "the opencl devices opencl:0:0" in why and "--device opencl:0:0" in why


def test_auto_takes_a_gpu_or_accelerator_in_priority_order(machine):
    machine(opencl=[POCL, IGPU])
    assert resolve("auto", Config()) == IGPU  # the GPU, though the CPU device was probed first
    machine(opencl=[POCL, IGPU], cuda=[H200])
    info, why = registry.choose(None, Config())
    assert info == H200 and "cuda:0, the first GPU or accelerator in the priority cuda, opencl, host" in why
    assert resolve("auto", Config(priority=("opencl", "cuda", "host"))) == IGPU
    assert resolve("auto", Config(priority=("host", "cuda", "opencl"))) == HOST  # the config's order stands


def test_a_priority_without_the_host_falls_back_to_a_cpu_device(machine):
    machine(opencl=[POCL])
    assert resolve("auto", Config(priority=("cuda", "opencl"))) == POCL


def test_a_named_cpu_device_runs(machine, monkeypatch):
    machine(opencl=[POCL, OCLGRIND])
    assert resolve("opencl", Config()) == POCL
    assert resolve("opencl:1:0", Config()) == OCLGRIND
    assert resolve(None, Config(device="opencl")) == POCL
    monkeypatch.setenv("PYOPENCL_CTX", "1")
    assert registry.choose(None, Config()) == (OCLGRIND, "opencl, named by PYOPENCL_CTX; PYOPENCL_CTX=1 picks which")
    monkeypatch.setenv("RLX_DEVICE", "opencl")
    assert registry.choose(None, Config()) == (OCLGRIND, "opencl, named by RLX_DEVICE; PYOPENCL_CTX=1 picks which")


def test_devices_marks_the_default_and_says_why(machine, monkeypatch, capsys):
    machine(opencl=[POCL])
    # the support matrix opens each device; this test is about the listing above it
    monkeypatch.setattr("rlx_gpu.cli.open_session", lambda info: registry.backend_module("host").open(HOST))
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "  host           NumPy on the CPU  ← default\n" in out
    assert "  opencl:0:0     pthread-Xeon (Portable Computing Language)  (a CPU device)\n" in out
    assert "\ndefault device: host\n  auto (device: in the config " in out
    assert "runs on the CPU, where the host runs most ops faster; name it to use it: --device opencl" in out
    machine(opencl=[POCL, OCLGRIND])
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "  opencl:1:0     Oclgrind Simulator (Oclgrind)  (a simulator)\n" in out and "name one to use it" in out
    monkeypatch.setenv("RLX_DEVICE", "opencl:5")
    assert main(["devices"]) == 0  # a default that cannot be found is said, not raised
    assert "default device: none\n  DeviceError: device 'opencl:5' (chosen by RLX_DEVICE) not found" in \
        capsys.readouterr().out


def test_cpu_tensors_of_the_torch_frontend_run_on_the_host(machine):
    torch = pytest.importorskip("torch")
    from rlx_gpu.torch import LSTM, bridge

    machine(opencl=[DeviceInfo("opencl", "opencl:9:0", "unopenable CPU device", True, {"simulator": False}, cpu=True)])
    bridge.clear_cache()
    try:
        lstm = LSTM(3, 4)
        y, _ = lstm(torch.randn(5, 2, 3))
        (exe,) = bridge._cache.values()
        assert exe.device.spec == "host" and y.shape == (5, 2, 4)
    finally:
        bridge.clear_cache()


def test_the_probe_marks_opencl_cpu_devices():
    st = registry.status("opencl")
    if not st.available:  # without pyopencl the made-up devices above are what can be tested
        pytest.skip(st.reason)
    import pyopencl as cl

    for info in st.devices:
        _, p, d = info.spec.split(":")
        kind = cl.get_platforms()[int(p)].get_devices()[int(d)].type
        assert info.cpu == (bool(kind & cl.device_type.CPU) or not kind & (cl.device_type.GPU | cl.device_type.ACCELERATOR))
    assert [info.cpu for info in st.devices if not info.details["simulator"]] == \
        sorted(info.cpu for info in st.devices if not info.details["simulator"]), "GPUs before CPU devices"
