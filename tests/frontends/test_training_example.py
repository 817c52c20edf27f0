"""configs/examples/train_lstm_lm.py: the models trained with rlx_gpu.torch (the LSTM, the gated-delta-net
block) follow the loss curves of the same models in plain torch (a short run of the example's 200 steps)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

PATH = Path(__file__).resolve().parents[2] / "configs" / "examples" / "train_lstm_lm.py"
spec = importlib.util.spec_from_file_location("train_lstm_lm", PATH)
train_lstm_lm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train_lstm_lm)
#: Steps per model: the delta rule in plain torch takes a step of torch ops per token, the slowest run here.
STEPS = {"lstm": 20, "gdn": 12}


@pytest.fixture
def one_thread():
    """torch's intra-op threads contend with the host backend's on a small machine: one keeps it quick."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", list(STEPS))
def test_the_loss_curves_of_rlx_gpu_and_plain_torch_agree(kind, monkeypatch, one_thread):
    monkeypatch.setenv("RLX_DEVICE", "host")
    data = train_lstm_lm.batches(STEPS[kind])
    curves = {name: train_lstm_lm.train(model, data) for name, model in train_lstm_lm.models(kind).items()}
    reference, ours = curves.values()
    assert max(abs(a - b) for a, b in zip(reference, ours)) < train_lstm_lm.TOLERANCE
    assert ours[-1] < 0.85 * ours[0]  # it learns: the curves agreeing is no sign of two idle models
