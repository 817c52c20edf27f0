"""OpenCL runtimes installed as Python wheels, registered with the ICD loader that pyopencl bundles.

pyopencl's wheel carries its own ocl-icd loader, which finds PoCL and Oclgrind beside itself
(``pyopencl/.libs/*.icd``) and the system's runtimes in ``/etc/OpenCL/vendors``, or in
``$OCL_ICD_VENDORS`` instead when that names a folder. Intel's OpenCL CPU runtime
(``intel-opencl-rt``) installs ``libintelocl.so`` into the environment's ``lib``, but its ``.icd``
file names the path of the machine it was built on, so no loader finds it. Before the first platform
query, :func:`register` writes a vendors folder (in the user's cache, one per set of contents) holding
an ``.icd`` naming each such library where it really is, beside a copy of every system ``.icd``, and
points ``OCL_ICD_VENDORS`` at it. A user's own ``OCL_ICD_VENDORS`` is left as it is.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import tempfile
from pathlib import Path

VENDORS_ENV = "OCL_ICD_VENDORS"
SYSTEM_VENDORS = Path("/etc/OpenCL/vendors")
_MARK = "RLX_ICD_VENDORS_WRITTEN"  # the folder register() set, so a child process knows the setting was ours
CACHE_ENV = "RLX_ICD_DIR"  # where the vendors folders are written (default ~/.cache/rlx_gpu/opencl-vendors)

#: distribution -> (the ICD library it installs, the name of the platform that library reports)
WHEEL_RUNTIMES = {"intel-opencl-rt": ("libintelocl.so", "Intel(R) OpenCL")}


def wheel_libraries() -> dict[str, Path]:
    """The ICD library of every runtime of ``WHEEL_RUNTIMES`` installed in this environment, by distribution."""
    found = {}
    for dist_name, (library, _) in WHEEL_RUNTIMES.items():
        try:
            files = importlib.metadata.distribution(dist_name).files or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for file in files:
            if file.name == library:
                path = Path(str(file.locate())).resolve()
                if path.is_file():
                    found[dist_name] = path
                    break
    return found


def registered_platforms() -> frozenset[str]:
    """The platform names of the runtimes :func:`register` registered (none when it left the loader alone)."""
    if os.environ.get(VENDORS_ENV) != os.environ.get(_MARK):
        return frozenset()
    return frozenset(WHEEL_RUNTIMES[d][1] for d in wheel_libraries())


def vendors_files(libraries: dict[str, Path]) -> dict[str, str]:
    """The ``.icd`` files of the vendors folder: one per wheel runtime, and a copy of each system one."""
    files = {f"{dist}.icd": f"{path}\n" for dist, path in sorted(libraries.items())}
    if SYSTEM_VENDORS.is_dir():
        for icd in sorted(SYSTEM_VENDORS.glob("*.icd")):
            try:
                files[f"system-{icd.name}"] = icd.read_text()
            except OSError:
                continue  # an unreadable system entry is one the loader could not read either
    return files


def _write_folder(files: dict[str, str]) -> Path:
    """The vendors folder holding exactly ``files``, written atomically (a temporary folder renamed into place)."""
    digest = hashlib.sha256(repr(sorted(files.items())).encode()).hexdigest()[:16]
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "rlx_gpu" / "opencl-vendors")
    folder = root / digest
    if folder.is_dir():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=root))
    for name, text in files.items():
        (staging / name).write_text(text)
    try:
        staging.rename(folder)
    except OSError:  # another process renamed its identical folder first
        for name in files:
            (staging / name).unlink()
        staging.rmdir()
    return folder


def register() -> Path | None:
    """Point ``OCL_ICD_VENDORS`` at a vendors folder naming every wheel runtime installed here (and every
    system one); the folder, or ``None`` when there is no wheel runtime, the user set the variable, or the
    cache cannot be written (then the wheel runtimes stay unregistered, as without this module)."""
    if os.environ.get(VENDORS_ENV) and os.environ.get(VENDORS_ENV) != os.environ.get(_MARK):
        return None
    libraries = wheel_libraries()
    if not libraries:
        return None
    try:
        folder = _write_folder(vendors_files(libraries))
    except OSError:
        return None
    os.environ[VENDORS_ENV] = os.environ[_MARK] = str(folder)
    return folder
