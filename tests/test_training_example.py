"""configs/examples/train_lstm_lm.py: the LSTM language model trained with rlx_gpu.torch.LSTM follows the
torch.nn.LSTM run's loss curve (a short run of the example's 200 steps)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

PATH = Path(__file__).resolve().parents[1] / "configs" / "examples" / "train_lstm_lm.py"
spec = importlib.util.spec_from_file_location("train_lstm_lm", PATH)
train_lstm_lm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train_lstm_lm)
STEPS = 20


@pytest.fixture
def one_thread():
    """torch's intra-op threads contend with the host backend's on a small machine: one keeps it quick."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_loss_curves_of_rlx_gpu_and_torch_nn_agree(monkeypatch, one_thread):
    monkeypatch.setenv("RLX_DEVICE", "host")
    data = train_lstm_lm.batches(STEPS)
    curves = {name: train_lstm_lm.train(model, data) for name, model in train_lstm_lm.models().items()}
    reference, ours = curves.values()
    assert max(abs(a - b) for a, b in zip(reference, ours)) < train_lstm_lm.TOLERANCE
    assert ours[-1] < 0.75 * ours[0]  # it learns: the curves agreeing is no sign of two idle models

