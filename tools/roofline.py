"""Print the roofline model's table (``rlx-gpu roofline``): per op and kernel at the GPU shapes, FLOPs by unit,
bytes, launches, the H200 floor and the time at 50% of peak beside the anchors' published times. On paper: it
reads the launch plans and each kernel's declared cost (``rlx_gpu/launches/*_cost.py``); no GPU is needed.

    python tools/roofline.py [--dtype bf16] [--shape NAME ...] [--tensor-cores 16bit|tf32|none]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlx_gpu.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["roofline", *sys.argv[1:]]))
