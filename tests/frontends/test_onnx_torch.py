"""Models exported by ``torch.onnx.export`` from nn.LSTM/GRU/RNN, imported by rlx_gpu.onnx, reproduce torch.

Multi-layer and bidirectional, with initial states given (the exporter slices them per layer), batch-first
(the exporter transposes), packed sequences of different lengths (``sequence_lens``), and classifiers
(a recurrent model, a Linear and a Softmax-like head) at the exporter's default opset and at 11.
"""
from __future__ import annotations

import io
import warnings

import onnx
import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import rlx_gpu
import rlx_gpu.onnx
from support.onnx_cases import run_imported, run_onnxruntime
from rlx_gpu.conformance.compare import nmse
from rlx_gpu.conformance.devices import find, open_device
from rlx_gpu.runtime.config import load_config
from rlx_gpu.runtime.executor import Device

F32_BOUND = 1e-7  # the conformance suite's f32 bound
KINDS = {"LSTM": dict(cls=torch.nn.LSTM), "GRU": dict(cls=torch.nn.GRU),
         "RNN_tanh": dict(cls=torch.nn.RNN, nonlinearity="tanh"),
         "RNN_relu": dict(cls=torch.nn.RNN, nonlinearity="relu")}
SEQ, BATCH, INPUT, HIDDEN, LAYERS = 6, 3, 4, 5, 2


def _module(kind: str, batch_first: bool = False) -> torch.nn.Module:
    torch.manual_seed(len(kind))
    spec = dict(KINDS[kind])
    cls = spec.pop("cls")
    return cls(INPUT, HIDDEN, num_layers=LAYERS, bidirectional=True, batch_first=batch_first, **spec).eval()


def _export(module: torch.nn.Module, args: tuple, input_names: list[str], output_names: list[str]) -> bytes:
    stream = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer notes
        torch.onnx.export(module, args, stream, dynamo=False, input_names=input_names, output_names=output_names)
    return stream.getvalue()


def _check(got: dict, want: dict) -> None:
    for name, ref in want.items():
        ref = ref.detach().numpy()
        assert got[name].shape == ref.shape, name
        assert nmse(got[name], ref) <= F32_BOUND, name


class _WithStates(torch.nn.Module):
    def __init__(self, rnn: torch.nn.Module):
        super().__init__()
        self.rnn = rnn

    def forward(self, x, *states):
        y, final = self.rnn(x, states if len(states) > 1 else states[0])
        return (y, *final) if isinstance(final, tuple) else (y, final)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_an_exported_bidirectional_two_layer_module_with_initial_states_reproduces_torch(kind):
    module = _WithStates(_module(kind))
    x = torch.randn(SEQ, BATCH, INPUT)
    states = [torch.randn(LAYERS * 2, BATCH, HIDDEN) * 0.5 for _ in range(2 if kind == "LSTM" else 1)]
    state_names = ["h0", "c0"][:len(states)]
    out_names = ["y", "h_n", "c_n"][:1 + len(states)]
    model = _export(module, (x, *states), ["x", *state_names], out_names)
    schedule = rlx_gpu.onnx.import_model(model)
    assert schedule["abi"] == "rlx-thunks/1"  # torch's modules need nothing of version 2
    with torch.no_grad():
        want = dict(zip(out_names, module(x, *states)))
    _check(run_imported(model, {"x": x.numpy(), **{n: s.numpy() for n, s in zip(state_names, states)}}), want)


def test_an_exported_batch_first_module_reproduces_torch():
    rnn = _module("GRU", batch_first=True)
    x = torch.randn(BATCH, SEQ, INPUT)
    model = _export(rnn, (x,), ["x"], ["y", "h_n"])
    with torch.no_grad():
        y, h_n = rnn(x)
    _check(run_imported(model, {"x": x.numpy()}), {"y": y, "h_n": h_n})


class _Packed(torch.nn.Module):
    """A recurrent module over a padded batch of the given lengths (sorted longest first)."""

    def __init__(self, rnn: torch.nn.Module, lengths: list[int]):
        super().__init__()
        self.rnn = rnn
        self.register_buffer("lengths", torch.tensor(lengths))

    def forward(self, x):
        y, final = self.rnn(pack_padded_sequence(x, self.lengths))
        y, _ = pad_packed_sequence(y, total_length=x.shape[0])
        return (y, *final) if isinstance(final, tuple) else (y, final)


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN_tanh"])
def test_an_exported_packed_sequence_module_reproduces_torch(kind):
    module = _Packed(_module(kind), [SEQ, 4, 1])
    x = torch.randn(SEQ, BATCH, INPUT)
    out_names = ["y", "h_n", "c_n"][:3 if kind == "LSTM" else 2]
    model = _export(module, (x,), ["x"], out_names)
    thunks = [t for t in rlx_gpu.onnx.import_model(model)["thunks"] if t["op"] in ("lstm", "gru", "rnn")]
    assert len(thunks) == LAYERS and all("seq_lens" in t for t in thunks)
    with torch.no_grad():
        want = dict(zip(out_names, module(x)))
    _check(run_imported(model, {"x": x.numpy()}), want)


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_an_exported_module_reproduces_torch_on_opencl_at_each_target(target):
    """The imported schedule (the recurrent thunks and their glue) on PoCL, with both targets' kernels."""
    device = Device(open_device(find("opencl"), target), load_config())
    assert device.session.limits.target == target
    module = _WithStates(_module("LSTM"))
    x = torch.randn(SEQ, BATCH, INPUT)
    states = [torch.randn(LAYERS * 2, BATCH, HIDDEN) * 0.5 for _ in range(2)]
    model = _export(module, (x, *states), ["x", "h0", "c0"], ["y", "h_n", "c_n"])
    schedule = rlx_gpu.onnx.load(model)
    arena = schedule.pristine_arena()
    for name, value in (("x", x), ("h0", states[0]), ("c0", states[1])):
        schedule.tensors[name].write(arena, value.numpy())
    out = device.run(schedule, arena)
    with torch.no_grad():
        want = dict(zip(["y", "h_n", "c_n"], module(x, *states)))
    _check({n: schedule.tensors[n].read(out) for n in schedule.outputs}, want)


class _Classifier(torch.nn.Module):
    """A batch-first recurrent model with a Linear head and one of the heads torch classifiers end with."""

    HEADS = ("softmax", "log_softmax", "sigmoid_of_mean", "tanh_of_final_state", "softmax_per_step")

    def __init__(self, kind: str, head: str):
        super().__init__()
        spec = dict(KINDS[kind])
        self.rnn = spec.pop("cls")(INPUT, HIDDEN, num_layers=LAYERS, bidirectional=True, batch_first=True, **spec)
        self.fc = torch.nn.Linear(2 * HIDDEN, 3)
        self.drop = torch.nn.Dropout(0.3)
        self.head = head

    def forward(self, x):
        y, final = self.rnn(x)
        h = final[0] if isinstance(final, tuple) else final
        if self.head == "softmax":
            return torch.softmax(self.fc(self.drop(y[:, -1])), dim=-1)
        if self.head == "log_softmax":
            return torch.log_softmax(torch.relu(self.fc(y[:, -1])), dim=1)
        if self.head == "sigmoid_of_mean":
            return torch.sigmoid(self.fc(y.mean(1)))
        if self.head == "tanh_of_final_state":
            return torch.tanh(self.fc(torch.flatten(h[-2:].transpose(0, 1), 1))).unsqueeze(-1)
        return self.fc(y).softmax(-1)


@pytest.mark.parametrize("opset", [None, 11])
@pytest.mark.parametrize("kind,head", [("LSTM", "softmax"), ("GRU", "log_softmax"), ("RNN_tanh", "sigmoid_of_mean"),
                                       ("LSTM", "tanh_of_final_state"), ("GRU", "softmax_per_step")])
def test_an_exported_classifier_reproduces_torch_and_onnxruntime(kind, head, opset):
    torch.manual_seed(len(head))
    module = _Classifier(kind, head).eval()
    x = torch.randn(BATCH, SEQ, INPUT)
    stream = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), stream, dynamo=False, input_names=["x"], output_names=["p"],
                          **({"opset_version": opset} if opset else {}))
    model = stream.getvalue()
    with torch.no_grad():
        want = {"p": module(x)}
    got = run_imported(model, {"x": x.numpy()})
    _check(got, want)
    _check(got, {"p": torch.from_numpy(run_onnxruntime(onnx.load_from_string(model), {"x": x.numpy()})["p"])})
