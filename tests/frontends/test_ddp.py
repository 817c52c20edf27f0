"""rlx_gpu.torch under torch.distributed: two processes on loopback (gloo, CPU tensors, the host backend)
training the example's LSTM language model with DistributedDataParallel end with the parameters of one
process training on the global batch."""
from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

PATH = Path(__file__).resolve().parents[2] / "configs" / "examples" / "train_lstm_lm.py"
spec = importlib.util.spec_from_file_location("train_lstm_lm", PATH)
train_lstm_lm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train_lstm_lm)
STEPS, WORLD = 20, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ddp_processes_match_one_process_on_the_global_batch(tmp_path, monkeypatch):
    saved = tmp_path / "params.pt"
    # what torchrun sets for each process, on loopback
    env = {**os.environ, "RLX_DEVICE": "host", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(WORLD)}
    ranks = [subprocess.Popen([sys.executable, str(PATH), "--distributed", "--steps", str(STEPS), "--save", str(saved)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
    # each rank imports torch and compiles the host kernels: minutes on a loaded 2-core machine, seconds quiet
    logs = [p.communicate(timeout=600)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0] * WORLD, "\n".join(logs)

    monkeypatch.setenv("RLX_DEVICE", "host")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = train_lstm_lm.models()["rlx_gpu.torch.LSTM"]
        start = {k: v.clone() for k, v in alone.state_dict().items()}
        train_lstm_lm.train(alone, train_lstm_lm.batches(STEPS))
    finally:
        torch.set_num_threads(threads)
    distributed = torch.load(saved)
    assert list(distributed) == list(alone.state_dict())
    for name, value in alone.state_dict().items():
        assert (value - start[name]).abs().max() > 1e-2, name  # every parameter trained
        torch.testing.assert_close(distributed[name], value, rtol=1e-4, atol=1e-5, msg=name)
