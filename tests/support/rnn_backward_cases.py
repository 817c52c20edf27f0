"""Recurrent backward thunks with random inputs (with a reserve, and the forward thunk that writes it), and torch
autograd's gradients of the same loss: the references of the host's recurrent backward tests (test_rnn_backward,
test_rnn_reserve, test_host_jit_lstm_sequence, test_host_jit_rnn_sequence)."""
from __future__ import annotations

import numpy as np
import torch

import host_fallback
import rlx_gpu
from host_fallback.abi import complete, forward_thunk, gradient, regions
from support.gradient_check import laid, with_gradients

BASE = dict(batch=3, seq=5, input_size=3, hidden=4, num_layers=2, bidirectional=True, carry=True)


def backward_params(op: str, **extra) -> dict:
    """The params of ``op``'s backward thunk: the BASE shape with ``extra`` fields and every gradient."""
    return with_gradients(op, {**BASE, **({"relu": False} if op == "rnn" else {}), **extra})


def sample(field: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Standard normal values, halved for the weights (``w_*``) so the recurrence stays in range."""
    return rng.standard_normal(shape) * (0.5 if field.startswith("w_") else 1.0)


def laid_backward(op: str, dtype: str, params: dict, seed: int = 0, sampler=sample) -> tuple[dict, np.ndarray]:
    """A backward thunk of ``op`` and its arena with every input (forward inputs, d_dst, d_h0 ...) random
    (``sampler(field, shape, rng)``'s values)."""
    return laid(f"{op}_backward", dtype, params, sampler, seed)


def laid_with_reserve(op: str, dtype: str, params: dict, seed: int = 0, sampler=sample
                      ) -> tuple[dict, np.ndarray, dict]:
    """A backward thunk of ``op`` with a reserve (``params`` as ``backward_params`` gives them), its arena, and the
    forward thunk sharing its inputs and reserve, whose ``dst`` lies past the backward's arena (``run_forward``)."""
    need = rlx_gpu.reserve_bytes({"op": op, "dtype": dtype, **params})
    thunk, arena = laid_backward(op, dtype, {**params, "reserve": True, "reserve_bytes": need}, seed, sampler)
    forward = {k: v for k, v in thunk.items() if not k.startswith("d_")}
    forward.update(op=op, dst=-(-arena.size // 16) * 16)
    return thunk, arena, forward


def run_forward(forward: dict, arena: np.ndarray) -> np.ndarray:
    """A longer copy of ``arena`` that the forward thunk of ``laid_with_reserve`` ran on (it updates carried
    states in place)."""
    dst = next(r for r in regions(forward) if r.field == "dst")
    longer = np.zeros(dst.offset + dst.nbytes, np.uint8)
    longer[:arena.size] = arena
    host_fallback.execute(forward, longer)
    return longer


MODULES = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn": torch.nn.RNN}


def torch_gradients(op: str, thunk: dict, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same loss as ``gradient_check.loss`` through torch.nn in float64, and the gradient of every input."""
    t = complete(forward_thunk(thunk))
    H, L, dirs, proj = t["hidden"], t["num_layers"], 2 if t["bidirectional"] else 1, t.get("proj_size", 0)
    kwargs = dict(proj_size=proj) if proj else {}
    if op == "rnn":
        kwargs["nonlinearity"] = "relu" if t["relu"] else "tanh"
    module = MODULES[op](t["input_size"], H, num_layers=L, bidirectional=t["bidirectional"], batch_first=True,
                          dtype=torch.float64, **kwargs)
    leaves = {f: torch.tensor(values[f], requires_grad=True) for f in values if not f.startswith("d_")
              and f != "seq_lens"}
    w_ih = leaves["w_ih"]
    offset, width = 0, proj or H
    params = dict(module.named_parameters())
    for ld in range(L * dirs):
        layer, dr = divmod(ld, dirs)
        suffix = f"l{layer}{'_reverse' if dr else ''}"
        in_l = t["input_size"] if layer == 0 else dirs * width
        rows = params[f"weight_ih_{suffix}"].shape[0]
        block = w_ih[offset: offset + rows * in_l].reshape(rows, in_l)
        offset += rows * in_l
        fixed = {f"weight_ih_{suffix}": block, f"weight_hh_{suffix}": leaves["w_hh"][ld]}
        if op == "gru":
            fixed.update({f"bias_ih_{suffix}": leaves["b_ih"][ld], f"bias_hh_{suffix}": leaves["b_hh"][ld]})
        else:  # one merged bias stream: torch's two are its halves (the hidden one zero)
            fixed.update({f"bias_ih_{suffix}": leaves["bias"][ld],
                          f"bias_hh_{suffix}": torch.zeros(rows, dtype=torch.float64)})
        if proj:
            fixed[f"weight_hr_{suffix}"] = leaves["w_hr"][ld]
        params.update(fixed)
    x = leaves["x"]
    state = (leaves["h0"], leaves["c0"]) if op == "lstm" else leaves["h0"]
    lens = values.get("seq_lens")
    if lens is not None:
        x = torch.nn.utils.rnn.pack_padded_sequence(x, torch.tensor(lens, dtype=torch.int64), batch_first=True,
                                                    enforce_sorted=False)
    dst, final = torch.func.functional_call(module, params, (x, state))
    if lens is not None:
        dst = torch.nn.utils.rnn.pad_packed_sequence(dst, batch_first=True, total_length=t["seq"])[0]
    finals = final if op == "lstm" else (final,)
    loss = (dst * torch.tensor(values["d_dst"])).sum()
    for name, value in zip(("h0", "c0"), finals):
        loss = loss + (value * torch.tensor(values[gradient(name)])).sum()
    loss.backward()
    return {gradient(f): leaf.grad.numpy() for f, leaf in leaves.items()}
