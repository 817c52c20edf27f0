"""The wheel, as a user installs it: built from the checkout offline, holding every package and data file the
checkout has, installed non-editable into a fresh virtual environment, and run there.

Every other test runs the editable checkout, where a package missing from the wheel goes unnoticed. The fresh
environment reaches numpy, torch and the rest through a ``.pth`` line naming the test environment's
site-packages: a path line adds the folder without running its ``.pth`` files, so the checkout's editable
finder stays off and ``rlx_gpu`` can come from the wheel only.
"""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODE = ("rlx_gpu", "host_fallback")
#: the data folders beside the code, which install inside rlx_gpu (rlx_gpu.paths)
DATA = ("configs", "kernels", *sorted(p.name for p in ROOT.glob("kernels_*") if p.is_dir()))


def _files(top: str) -> list[str]:
    """Every file under ``ROOT/top`` as a POSIX path from ROOT, bytecode caches left out."""
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / top).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


def _source_tree(dst: Path) -> Path:
    """A copy of the checkout without its hidden folders and build outputs: the build writes build/ and
    *.egg-info beside the sources, and an old build/ would slip its stale files into the wheel."""
    def ignore(folder: str, names: list[str]) -> set[str]:
        top = Path(folder) == ROOT
        return {n for n in names if n == "__pycache__" or top and (n.startswith(".") or n.endswith(".egg-info")
                                                                     or n in ("build", "dist"))}

    return Path(shutil.copytree(ROOT, dst, ignore=ignore))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of the checkout, built with the test environment's setuptools (no index, no isolation)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = _source_tree(tmp / "src")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"pip wheel failed:\n{done.stdout}\n{done.stderr}"
    (built,) = (tmp / "dist").glob("rlx_gpu-*.whl")
    return built


def test_the_wheel_holds_every_module_and_data_file_of_the_checkout(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    code = [f for top in CODE for f in _files(top) if f.endswith(".py")]
    packages = sorted(str(Path(f).parent) for f in code if f.endswith("/__init__.py"))
    assert {"rlx_gpu/torch", "rlx_gpu/onnx", "host_fallback"} <= set(packages)
    missing = [f for f in code if f not in names]
    lost = [p for p in packages if f"{p}/__init__.py" in missing]
    assert not missing, f"modules missing from the wheel (whole subpackages: {lost}): {missing}"
    data = [f for top in DATA for f in _files(top)]
    # kernel texts, preludes, configs and examples: each kind the checkout has must be there to be checked
    for kind in (".cl", ".cuh", "kernels_opencl/prelude.cl", "configs/default.yaml", "configs/examples/demo.yaml",
                 "configs/examples/train_lstm_lm.py"):
        assert any(f.endswith(kind) for f in data), kind
    missing = [f for f in data if f"rlx_gpu/{f}" not in names]
    assert not missing, f"data files missing from the wheel (installed under rlx_gpu/): {missing}"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "rlx-gpu = rlx_gpu.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def _numba_cache_of_the_checkout(purelib: Path) -> None:
    """The host kernels the checkout's test processes compiled (Numba's cache in host_fallback/__pycache__, each
    entry keyed by its source file's mtime and size) copied beside the installed modules, whose mtimes are set to
    the checkout's (pip writes them at install time): the fresh venv loads the kernels compiled from the same text
    rather than compiling them again (about a minute of the test on a loaded 2-core machine, 4 s warm). The modules
    still come from the venv; the compile itself is every checkout process's (and this test's where the checkout
    has no cache yet)."""
    for source in (ROOT / "host_fallback").glob("*.py"):
        installed = purelib / "host_fallback" / source.name
        if installed.read_bytes() == source.read_bytes():
            stat = source.stat()
            os.utime(installed, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    (purelib / "host_fallback" / "__pycache__").mkdir(exist_ok=True)
    for entry in (ROOT / "host_fallback" / "__pycache__").glob("*.nb[ci]"):
        shutil.copyfile(entry, purelib / "host_fallback" / "__pycache__" / entry.name)


IMPORTS = """\
import sys
import host_fallback, rlx_gpu, rlx_gpu.onnx, rlx_gpu.torch
from rlx_gpu.paths import data_dir
for where in (host_fallback.__file__, rlx_gpu.__file__, rlx_gpu.onnx.__file__, rlx_gpu.torch.__file__,
              data_dir("configs"), data_dir("kernels"), data_dir("kernels_opencl")):
    print(where)
print("editable finders:", [m for m in sys.modules if m.startswith("__editable__")])
"""


def test_the_wheel_installed_in_a_fresh_venv_imports_and_runs_the_check(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           "-q", str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"pip install of the wheel failed:\n{done.stdout}\n{done.stderr}"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # after the install: pip must not take the test environment's editable rlx_gpu for this one
    parents = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    (Path(purelib) / "test_environment.pth").write_text("".join(f"{p}\n" for p in parents if Path(p).is_dir()))
    _numba_cache_of_the_checkout(Path(purelib))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "RLX_CONFIG")}
    env["RLX_DEVICE"] = "host"

    imported = subprocess.run([str(python), "-c", IMPORTS], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
    assert imported.returncode == 0, imported.stderr
    *places, finders = imported.stdout.splitlines()
    outside = [p for p in places if not Path(p).resolve().is_relative_to(Path(purelib).resolve())]
    assert not outside, f"imported from outside the fresh venv {venv}: {outside}"
    assert finders == "editable finders: []"

    ran = subprocess.run([str(venv / "bin" / "rlx-gpu"), "run", "--check"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, f"rlx-gpu run --check in the fresh venv:\n{ran.stdout}\n{ran.stderr}"
    assert "device host" in ran.stdout and "FAIL" not in ran.stdout and " ok" in ran.stdout
