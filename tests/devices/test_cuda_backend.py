"""The CUDA backend where no GPU is: unavailable with its reason, device records, and its cubins.

What needs a GPU runs in tools/gpu_check.py on a lent machine; the CuPy calls of the backend run here
through the CuPy contract double (tests/devices/test_cuda_session.py). This file checks the rest for real: CuPy
is absent here, NVRTC and ptxas are present.
"""
from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from rlx_gpu.runtime import registry
from rlx_gpu.backends.base import BackendUnavailable
from rlx_gpu.runtime.config import load_config

H200 = {"name": b"NVIDIA H200", "major": 9, "minor": 0, "totalGlobalMem": 150_000_000_000, "multiProcessorCount": 132,
        "maxThreadsPerBlock": 1024, "maxGridSize": (2147483647, 65535, 65535), "sharedMemPerBlock": 49152,
        "sharedMemPerBlockOptin": 232448, "warpSize": 32}


@pytest.fixture
def fresh_registry():
    """The registry probes once per process; these tests change what it would find."""
    registry.status.cache_clear()
    registry.backend_module.cache_clear()
    yield
    registry.status.cache_clear()
    registry.backend_module.cache_clear()


def _cupy_importable() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(_cupy_importable(), reason="CuPy is installed here; this checks the machine without it")
def test_without_cupy_the_backend_is_unavailable_and_auto_moves_on(fresh_registry, capsys):
    st = registry.status("cuda")
    assert not st.available and "cupy is not importable" in st.reason and 'pip install -e ".[cuda13]"' in st.reason
    config = dataclasses.replace(load_config(None), device="auto", priority=("cuda", "opencl", "host"))
    chosen = registry.resolve("auto", config)
    gpus = [info for info in registry.status("opencl").devices if not info.cpu]  # auto passes CPU devices over
    assert chosen == (gpus[0] if gpus else registry.status("host").devices[0])
    from rlx_gpu.cli import main

    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "cuda: unavailable" in out and "cupy is not importable" in out


class CUDARuntimeError(RuntimeError):
    """What CuPy raises when the runtime finds no driver (cudaErrorInsufficientDriver = 35)."""


def _cupy_without_driver() -> types.ModuleType:
    """A module standing in for CuPy whose runtime answers as on a machine without an NVIDIA driver."""
    def no_driver():
        raise CUDARuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version")

    cupy = types.ModuleType("cupy")
    cupy.__version__ = "14.0.0"
    cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=no_driver))
    return cupy


def test_cupy_without_a_driver_is_unavailable_with_the_runtime_error(fresh_registry, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _cupy_without_driver())
    from rlx_gpu.backends import cuda

    with pytest.raises(BackendUnavailable, match="CUDARuntimeError: cudaErrorInsufficientDriver") as info:
        cuda.probe()
    assert "CuPy 14.0.0 is installed but CUDA cannot be used" in str(info.value)
    st = registry.status("cuda")
    assert not st.available and "cudaErrorInsufficientDriver" in st.reason
    config = dataclasses.replace(load_config(None), device="auto", priority=("cuda", "host"))
    assert registry.resolve("auto", config).backend == "host"


def test_device_record_and_limits_from_the_runtime_properties():
    from rlx_gpu.backends import cuda, cuda_primitives

    info = cuda.device_info(0, H200)
    assert (info.backend, info.spec, info.name, info.fp64) == ("cuda", "cuda:0", "NVIDIA H200 (sm_90)", True)
    assert info.details["compute_capability"] == "9.0" and info.details["multiprocessors"] == 132
    limits = cuda_primitives.device_limits(info)
    assert (limits.max_work_group, limits.local_mem_bytes, limits.target) == (1024, 49152, "gpu")
    assert (limits.sub_group, limits.compute_units, limits.max_grid) == (32, 132, (2147483647, 65535, 65535))


# ---------------------------------------------------------------- cubins with the backend's exact options
pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings with NVRTC is not installed")


def _cache(tmp_path, compile=None, arch="sm_90", version=None):
    from rlx_gpu.backends import nvrtc
    from rlx_gpu.backends.cubin_cache import CubinCache, nvrtc_version

    return CubinCache(arch, nvrtc.OPTIONS, compile or nvrtc.build, version or nvrtc_version(), tmp_path)


def test_every_program_builds_to_an_sm90_cubin_through_the_backend_cache():
    """Every program a CUDA device (gpu target) builds is an sm_90 cubin in the session's cache
    (``cuda_builds``), its PTX and ptxas's report beside it, which a cache with the backend's options
    then reads back without compiling."""
    from support import cuda_builds

    from rlx_gpu.backends import nvrtc

    progs = nvrtc.programs("gpu")
    cubins = cuda_builds.gpu_cubins()
    assert len(cubins) == len(progs) and all(c.startswith(b"\x7fELF") for c in cubins)
    again = _cache(cuda_builds.directory(), compile=lambda prog, arch: pytest.fail(f"rebuilt {prog.label} despite the disk cache"))
    assert [again.get(p) for p in progs] == list(cubins) and again.compiled == 0
    assert all(".target sm_90" in again.ptx(p) for p in progs)  # a program may hold no kernel (compiled out)
    assert all(again.path(p).with_suffix(".log").is_file() for p in progs)


def test_cache_keys_and_damaged_entries(tmp_path):
    from rlx_gpu.backends import programs

    prog = programs.program("cuda", "body", "f32")
    built = []

    def counting(p, arch):  # the session's build of the program: what is checked is what the cache does with it
        from support import cuda_builds

        assert arch == cuda_builds.cache().arch
        built.append(arch)
        return cuda_builds.build(p)

    first = _cache(tmp_path, counting)
    cubin = first.get(prog)
    assert first.get(prog) is cubin and built == ["sm_90"]  # memory hit
    assert _cache(tmp_path, counting, arch="sm_80").key(prog) != first.key(prog)
    assert _cache(tmp_path, counting, version="0.0").key(prog) != first.key(prog)
    first.path(prog).write_bytes(b"truncated")  # a damaged entry is rebuilt, never loaded
    assert _cache(tmp_path, counting).get(prog).startswith(b"\x7fELF") and len(built) == 2
    first.path(prog).with_suffix(".ptx").unlink()  # a cubin without its PTX too
    assert ".entry" in _cache(tmp_path, counting).ptx(prog) and len(built) == 3
    first.path(prog).with_suffix(".log").unlink()  # and one without ptxas's report
    assert "registers" in _cache(tmp_path, counting).built(prog).log and len(built) == 4
    assert not list(tmp_path.glob("*.tmp")), "the atomic write leaves no temporary file"


def test_build_failure_names_log_options_and_source(tmp_path):
    from rlx_gpu.backends import programs
    from rlx_gpu.errors import KernelBuildError

    prog = programs.program("cuda", "gdn", "f32")
    broken = dataclasses.replace(prog, source=prog.source + "\nKERNEL oops(int x) { undefined_name(x); }\n")
    with pytest.raises(KernelBuildError) as info:
        _cache(tmp_path).get(broken)
    err = info.value
    assert "undefined_name" in err.log and "--ftz=false" in err.options and "undefined_name(x)" in str(err)
    assert not list(tmp_path.glob("*.cubin"))


def test_cublas_data_types_are_the_cuda_header_values():
    from cuda.bindings import runtime

    from rlx_gpu.backends import cuda_primitives

    dt = runtime.cudaDataType
    assert cuda_primitives._DATA_TYPES == {"f32": int(dt.CUDA_R_32F), "f64": int(dt.CUDA_R_64F),
                                           "f16": int(dt.CUDA_R_16F), "bf16": int(dt.CUDA_R_16BF)}
