"""Where the data folders are: inside the installed package (wheel), or beside it in a checkout."""
from __future__ import annotations

from pathlib import Path

DATA_DIRS = ("configs", "kernels")
#: the head of a kernel dialect's prelude folder (``kernels_opencl``), which its backend module names
DIALECT_DIR = "kernels_"


def data_dir(name: str) -> Path:
    """The folder ``configs``, ``kernels``, or a dialect's ``kernels_<dialect>``."""
    if name not in DATA_DIRS and not (name.startswith(DIALECT_DIR) and name[len(DIALECT_DIR):].isidentifier()):
        raise ValueError(f"unknown data folder {name!r}; known: {', '.join(DATA_DIRS)} and {DIALECT_DIR}<dialect>")
    package = Path(__file__).resolve().parent
    for candidate in (package / name, package.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"data folder {name!r} is missing beside {package}: reinstall rlx_gpu")
