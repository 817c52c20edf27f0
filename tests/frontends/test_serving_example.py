"""configs/examples/serve_mamba2.py: three prompts prefilled packed into state slots, then decoded
through them, equal to each prompt run alone — on the host and on OpenCL, without falling back."""
from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest

from rlx_gpu.runtime.registry import status

PATH = Path(__file__).resolve().parents[2] / "configs" / "examples" / "serve_mamba2.py"
spec = importlib.util.spec_from_file_location("serve_mamba2", PATH)
serve_mamba2 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serve_mamba2)


@pytest.mark.parametrize("device", ["host", "opencl"])
def test_served_prompts_equal_each_prompt_alone(device):
    if device == "opencl" and not status("opencl").available:
        pytest.fail(f"OpenCL is unavailable: {status('opencl').reason}")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*fall back to the host.*")  # every thunk on the device
        worst = serve_mamba2.serve(device, steps=2)
    assert worst["outputs"] < 1e-4 and worst["states"] < 1e-4, worst
    assert worst["untouched"] == 0.0  # pool entries no prompt names keep their bytes
