"""OpenCL runtimes installed as wheels (Intel's CPU runtime) are registered with pyopencl's ICD loader."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlx_gpu.backends import opencl, opencl_icd

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    monkeypatch.delenv(opencl_icd.VENDORS_ENV, raising=False)
    monkeypatch.delenv(opencl_icd._MARK, raising=False)
    monkeypatch.setenv(opencl_icd.CACHE_ENV, str(tmp_path / "cache"))
    system = tmp_path / "etc-vendors"
    system.mkdir()
    (system / "nvidia.icd").write_text("libnvidia-opencl.so.1\n")
    monkeypatch.setattr(opencl_icd, "SYSTEM_VENDORS", system)
    monkeypatch.setattr(opencl_icd, "wheel_libraries", lambda: {"intel-opencl-rt": tmp_path / "libintelocl.so"})
    return tmp_path


def test_the_vendors_folder_names_the_wheel_library_where_it_is_and_keeps_the_system_runtimes(clean_env):
    import os

    folder = opencl_icd.register()
    assert folder is not None and os.environ[opencl_icd.VENDORS_ENV] == str(folder)
    assert (folder / "intel-opencl-rt.icd").read_text() == f"{clean_env / 'libintelocl.so'}\n"
    # OCL_ICD_VENDORS replaces /etc/OpenCL/vendors: a GPU driver registered there must stay found
    assert (folder / "system-nvidia.icd").read_text() == "libnvidia-opencl.so.1\n"
    assert opencl_icd.register() == folder  # a second call (a child process) keeps the same folder


def test_a_user_s_own_ocl_icd_vendors_is_left_as_it_is(clean_env, monkeypatch):
    import os

    monkeypatch.setenv(opencl_icd.VENDORS_ENV, "/opt/my-vendors")
    assert opencl_icd.register() is None
    assert os.environ[opencl_icd.VENDORS_ENV] == "/opt/my-vendors"
    assert opencl_icd.registered_platforms() == frozenset()


@pytest.mark.skipif(not opencl_icd.wheel_libraries(), reason="intel-opencl-rt is not installed (the test extra installs it)")
def test_intel_s_runtime_installed_from_its_wheel_is_listed_after_the_other_real_devices():
    """Its wheel's own .icd names the machine it was built on; rlx_gpu registers the library where it is, and
    installing it does not change which device ``opencl`` names."""
    found = opencl.probe()
    platforms = [str(info.details["platform"]) for info in found]
    assert "Intel(R) OpenCL" in platforms
    real = [info for info in found if not info.details["simulator"]]
    assert real[-1].details["platform"] == "Intel(R) OpenCL" and real[-1].details["registered_by_rlx_gpu"]
    listed = subprocess.run([sys.executable, "-m", "rlx_gpu.cli", "devices"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert "(Intel(R) OpenCL)" in listed.stdout, listed.stdout + listed.stderr
