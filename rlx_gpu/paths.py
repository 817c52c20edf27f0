"""Where the data folders are: inside the installed package (wheel), or beside it in a checkout."""
from __future__ import annotations

from pathlib import Path

DATA_DIRS = ("configs", "kernels", "kernels_opencl", "kernels_cuda")


def data_dir(name: str) -> Path:
    """The folder ``configs``, ``kernels``, ``kernels_opencl`` or ``kernels_cuda``."""
    if name not in DATA_DIRS:
        raise ValueError(f"unknown data folder {name!r}; known: {', '.join(DATA_DIRS)}")
    package = Path(__file__).resolve().parent
    for candidate in (package / name, package.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"data folder {name!r} is missing beside {package}: reinstall rlx_gpu")
