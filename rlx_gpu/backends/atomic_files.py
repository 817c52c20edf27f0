"""Files of the compile caches on disk (``cubin_cache``, ``opencl_binaries``), written so that a process reading one
beside a process writing it never reads half of it: the bytes go to a temporary file in the same folder, which is
then renamed into place (a rename within a file system is atomic)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` into ``path``, whole or not at all (the folder is made if missing); raises ``OSError``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
