"""configs/examples/serve_mamba2.py: a Mamba-2 layer's convolution and scan, three prompts prefilled packed
into the slots of both state pools, then decoded through them, equal to each prompt run alone — on the host
and on OpenCL, without falling back, and nothing but the strided views of xBC between the two ops."""
from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import numpy as np
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


@pytest.mark.parametrize("lengths", [(7, 19, 2), (1, 1, 1)], ids=["prefill", "decode step"])
def test_the_convolution_feeds_the_scan_in_one_schedule(lengths):
    params = serve_mamba2.layer(np.random.default_rng(0))
    schedule = serve_mamba2.compiled(params, lengths, serve_mamba2.POOL, "host").plan.schedule
    assert [t.op for t in schedule.thunks] == ["causal_conv1d", "binary", "binary", "binary", "mamba2"]
    conv, *views, scan = schedule.thunks
    assert conv["state_slots"] is not None and scan["state_slots"] is not None  # both pools through the slots
