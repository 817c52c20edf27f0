"""A recurrent module's latest path (``nn._RlxRecurrent._rlx_latest``, ``recurrent_hot.latest_path``): after a
call of a signature took the hot path, the module's next calls of that signature go straight to it from the
module's ``__call__``. They must stay torch.nn's calls: torch.nn.LSTM's results (float64, the same parameters),
outputs in memory of their own call after call, hooks run, autograd recording a call with grad, every change of
the module (an attribute set, a parameter swapped through ``.data``, ``clear_cache()``) seen, and the module
still pickled and copied.
"""
from __future__ import annotations

import copy
import pickle
import sys
import threading

import pytest
import torch

from support.torch_devices import host  # noqa: F401  (fixture)

import rlx_gpu.torch as rt
from rlx_gpu.runtime.executor import RunReport
from rlx_gpu.torch import bridge

F64 = torch.float64


def pair(seed: int = 0, **kwargs) -> tuple[torch.nn.LSTM, rt.LSTM]:
    """torch.nn.LSTM(4, 5, batch_first=True) in float64 and ours with its state_dict."""
    torch.manual_seed(seed)
    theirs = torch.nn.LSTM(4, 5, batch_first=True, dtype=F64, **kwargs)
    ours = rt.LSTM(4, 5, batch_first=True, dtype=F64, **kwargs)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def steps(theirs: torch.nn.Module, ours: torch.nn.Module, count: int, hc=None) -> tuple:
    """``count`` decode steps of both from the same state, each output checked; the states after."""
    hc_theirs = hc_ours = hc if hc is not None else (torch.randn(1, 1, 5, dtype=F64), torch.randn(1, 1, 5, dtype=F64))
    for _ in range(count):
        x = torch.randn(1, 1, 4, dtype=F64)
        y, hc_ours = ours(x, hc_ours)
        expected, hc_theirs = theirs(x, hc_theirs)
        assert torch.allclose(y, expected, atol=1e-12)
        for mine, torchs in zip(hc_ours, hc_theirs):
            assert torch.allclose(mine, torchs, atol=1e-12)
    return hc_theirs, hc_ours


def test_decode_steps_take_the_latest_path_and_hand_out_outputs_of_their_own(host):
    theirs, ours = pair()
    with torch.no_grad():
        steps(theirs, ours, 2)
        assert ours._rlx_latest is not None
        x = torch.randn(1, 1, 4, dtype=F64)
        y1, (h1, c1) = ours(x, (torch.zeros(1, 1, 5, dtype=F64), torch.zeros(1, 1, 5, dtype=F64)))
        kept = [t.clone() for t in (y1, h1, c1)]
        y2, (h2, c2) = ours(x, (h1, c1))  # the next step from the outputs of the one before
        first = [y1, h1, c1]
        second = [y2, h2, c2]
    addresses = {t.data_ptr() for t in first + second}
    assert len(addresses) == 6  # no output shares memory with another, of its call or the one before
    assert all(torch.equal(t, k) for t, k in zip(first, kept))  # the second call wrote nothing of the first's
    assert not torch.equal(y1, y2)


def test_hooks_an_attribute_set_and_a_call_with_grad_leave_the_latest_path(host):
    theirs, ours = pair(1)
    with torch.no_grad():
        hc_theirs, hc_ours = steps(theirs, ours, 2)
        calls = []
        handle = ours.register_forward_hook(lambda *a: calls.append("module"))
        steps(theirs, ours, 1, hc_ours)
        handle.remove()
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda module, *a: calls.append("global") if module is ours else None)
        steps(theirs, ours, 1, hc_ours)
        handle.remove()
        assert calls == ["module", "global"]
        ours.weight_hh_l0.data = ours.weight_hh_l0.data * 0.5  # swapped through .data: a new address
        theirs.weight_hh_l0.data = theirs.weight_hh_l0.data * 0.5
        steps(theirs, ours, 2, hc_ours)
        ours.train(False)  # an attribute set drops the module's latest path
        assert ours._rlx_latest is None
        steps(theirs, ours, 2, hc_ours)
    y, _ = ours(torch.randn(1, 1, 4, dtype=F64), hc_ours)  # grad enabled, parameters requiring it
    assert y.grad_fn is not None


def test_another_signature_and_clear_cache_after_the_latest_path_run_as_torch_nn(host):
    theirs, ours = pair(2)
    with torch.no_grad():
        hc_theirs, hc_ours = steps(theirs, ours, 3)
        prompt = torch.randn(1, 3, 4, dtype=F64)  # three steps at once: another signature
        y, _ = ours(prompt, hc_ours)
        expected, _ = theirs(prompt, hc_theirs)
        assert torch.allclose(y, expected, atol=1e-12)
        steps(theirs, ours, 2, hc_ours)
        for mine, torchs in zip(ours.parameters(), theirs.parameters()):
            mine.data.mul_(0.5)  # through .data: no new version, seen after clear_cache()
            torchs.data.mul_(0.5)
        rt.clear_cache()
        assert ours._rlx_latest is None
        steps(theirs, ours, 2, hc_ours)


def test_a_module_with_a_latest_path_pickles_and_copies(host):
    theirs, ours = pair(3)
    with torch.no_grad():
        steps(theirs, ours, 2)
        assert ours._rlx_latest is not None
        for other in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))):
            assert other._rlx_latest is None
            steps(theirs, other, 3)


@pytest.mark.parametrize("batch_first, loss", [(True, "all"), (False, "all"), (True, "final cell")])
def test_gradients_of_an_eager_call_that_autograd_records_match_torch_nn(batch_first, loss, host):
    """The call goes to the op's Autograd kernel itself (``library.direct``), its backward op too; an output the
    loss does not read has no gradient (None, not zeros autograd made: ``set_materialize_grads(False)``)."""
    torch.manual_seed(4)
    theirs = torch.nn.LSTM(3, 4, num_layers=2, batch_first=batch_first, dtype=F64)
    ours = rt.LSTM(3, 4, num_layers=2, batch_first=batch_first, dtype=F64)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(*((2, 5) if batch_first else (5, 2)), 3, dtype=F64, requires_grad=True)  # batch 2, 5 steps
    h0, c0 = (torch.randn(2, 2, 4, dtype=F64, requires_grad=True) for _ in range(2))
    grads = []
    for module in (theirs, ours):
        y, (h, c) = module(x, (h0, c0))
        (y.square().sum() + h.sum() + 2 * c.sum() if loss == "all" else c.square().sum()).backward()
        grads.append([t.grad.clone() for t in (x, h0, c0, *module.parameters())])
        for t in (x, h0, c0, *module.parameters()):
            t.grad = None
    for expected, got in zip(*grads):
        assert torch.allclose(got, expected, atol=1e-10)


# export puts its own parameters in _parameters; the forward makes _flat_weights of them, as torch.nn.LSTM's does
# (torch warns of the attribute for both)
@pytest.mark.filterwarnings("ignore:The tensor attributes self._flat_weights:UserWarning")
def test_a_module_with_a_latest_path_compiles_fullgraph_and_exports_to_its_eager_outputs(host):
    """Dynamo traces nn.Module's call of a module whose latest path is set (``torch.compiler.is_compiling()``
    first: nothing of the path is read), with the op in the graph."""
    theirs, ours = pair(5)
    with torch.no_grad():
        hc_theirs, hc_ours = steps(theirs, ours, 2)
        assert ours._rlx_latest is not None
        x = torch.randn(1, 1, 4, dtype=F64)
        compiled = torch.compile(lambda x, hc: ours(x, hc), fullgraph=True, backend="eager")
        for got, expected in zip(compiled(x, hc_ours), ours(x, hc_ours)):
            torch.testing.assert_close(got, expected)
        exported = torch.export.export(ours, (x, hc_ours))
        assert any(n.op == "call_function" and str(n.target).startswith("rlx_gpu.") for n in exported.graph.nodes)
        y, _ = exported.module()(x, hc_ours)
        torch.testing.assert_close(y, theirs(x, hc_theirs)[0])


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_modules_of_one_signature_decoding_from_four_threads_match_torch_nn(kind, host):
    """Two modules of one signature share its call plan (its arena holds one module's weight streams at a time);
    four threads each decode with one of them, their steps interleaved: each step's output is torch.nn's, each
    module's latest path its own."""
    mods = []
    for seed in (6, 7):
        torch.manual_seed(seed)
        theirs = getattr(torch.nn, kind)(4, 5, batch_first=True, dtype=F64)
        ours = getattr(rt, kind)(4, 5, batch_first=True, dtype=F64)
        ours.load_state_dict(theirs.state_dict())
        mods.append((theirs, ours))
    g = torch.Generator().manual_seed(8)
    xs = [torch.randn(1, 1, 4, generator=g, dtype=F64) for _ in range(30)]
    first = (torch.zeros(1, 1, 5, dtype=F64),) * (2 if kind == "LSTM" else 1)
    first = first if kind == "LSTM" else first[0]
    wanted = []
    with torch.no_grad():
        for theirs, _ in mods:
            hx, ys = first, []
            for x in xs:
                y, hx = theirs(x, hx)
                ys.append(y)
            wanted.append(ys)
    got: dict[int, list] = {}

    def decode(k: int) -> None:
        ours, hx, ys = mods[k % 2][1], first, []
        with torch.no_grad():
            for x in xs:
                y, hx = ours(x, hx)
                ys.append(y)
        got[k] = ys

    threads = [threading.Thread(target=decode, args=(k,)) for k in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads switched every few bytecodes: their steps interleave
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert all(m[1]._rlx_latest is not None for m in mods) and mods[0][1]._rlx_latest is not mods[1][1]._rlx_latest
    for k in range(4):
        for mine, torchs in zip(got[k], wanted[k % 2]):
            assert torch.allclose(mine, torchs, atol=1e-12)


def test_a_decode_steps_report_is_made_when_read_and_names_its_one_thunk(host):
    """The latest path's run keeps its report unmade (``executor.LastReport``): read, it is the plan's and the
    device's ``RunReport`` of the step's one host thunk, the same object read after read."""
    theirs, ours = pair(9)
    with torch.no_grad():
        steps(theirs, ours, 3)
        plan = bridge._last.plan
        before = plan.device.thunks_run
        steps(theirs, ours, 1)
    report = bridge.last_report()
    assert isinstance(report, RunReport) and report is bridge.last_report() is plan.last_report
    (record,) = report.records
    assert record.backend == "host" and record.op == "lstm" and 0 < record.seconds == report.seconds
    assert plan.device.last_report.records == [record] and plan.device.thunks_run == before + 1



def test_plain_tensors_set_for_parameters_after_decode_steps_are_the_steps_weights(host):
    """A parameter deleted and set again as a plain tensor (no stamp: its packing is made and written on every call)
    after decode steps of the module's own parameters: the steps read it, not the streams the plan holds."""
    theirs, ours = pair(10)
    with torch.no_grad():
        hc_theirs, hc_ours = steps(theirs, ours, 3)
        for module in (theirs, ours):
            plain = module.weight_hh_l0.detach() * 0.5
            del module.weight_hh_l0
            module.weight_hh_l0 = plain
        steps(theirs, ours, 3, hc_ours)


@pytest.mark.parametrize("form", ["decode", "sequence"])
def test_functional_call_runs_the_parameters_it_is_given_and_leaves_the_modules_own(form, host):
    """``torch.func.functional_call`` puts its parameters into ``_parameters`` without ``__setattr__``: the calls
    inside it (after the module's own calls made a latest path, and with grad) run those, as torch.nn.LSTM's do,
    and the module's own calls after it run its own again."""
    theirs, ours = pair(11)
    hc = (torch.randn(1, 1, 5, dtype=F64), torch.randn(1, 1, 5, dtype=F64))
    x = torch.randn(1, 1, 4, dtype=F64) if form == "decode" else torch.randn(3, 6, 4, dtype=F64)
    args = (x, hc) if form == "decode" else (x,)
    with torch.no_grad():
        steps(theirs, ours, 3, hc)
        assert ours._rlx_latest is not None or form == "sequence"
        given = {name: p * 1.5 for name, p in theirs.named_parameters()}
        inside = [torch.func.functional_call(m, given, args)[0] for m in (theirs, ours)]
        assert torch.allclose(inside[1], inside[0], atol=1e-12)
        assert not torch.allclose(inside[1], ours(*args)[0], atol=1e-6)  # the given parameters made a difference
        steps(theirs, ours, 2, hc)
    grads = []
    for module in (theirs, ours):
        leaves = {name: p.detach().clone().requires_grad_() for name, p in given.items()}
        torch.func.functional_call(module, leaves, args)[0].square().sum().backward()
        grads.append([leaves[name].grad for name in sorted(leaves)])
        assert all(p.grad is None for p in module.parameters())
    for mine, torchs in zip(grads[1], grads[0]):
        assert torch.allclose(mine, torchs, atol=1e-10)
