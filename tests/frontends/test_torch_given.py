"""Host calls whose kernel reads and writes the caller's memory (``runtime.given``): a decode step's large
inputs (a state, Mamba-1's ``A``) handed to the compiled kernel where they lie, a carried state updated in the
caller's tensor where the op updates it in place (``selective_state_update``) and in a new tensor where it
does not (``fused_recurrent_gated_delta_rule``'s final state). The results must be the same bits as the
copying path's, no tensor the caller did not hand over as an output may change, and every aliasing or layout
the kernel cannot take must fall back to the copying path with the same results.
"""
from __future__ import annotations

import pytest
import torch

from support.torch_devices import host  # noqa: F401  (fixture)

import rlx_gpu.torch as rt
from rlx_gpu.runtime import given
from rlx_gpu.torch import bridge, state_update

pytest.importorskip("numba")


def mamba2_step(heads: int = 4, dim: int = 64, dstate: int = 64) -> dict[str, torch.Tensor]:
    """A Mamba-2 heads-form step (B1, per-head dt, A, D, dt bias broadcast along ``dim``), its state 64 KiB."""
    return dict(x=torch.randn(1, heads, dim), dt=torch.randn(1, heads, 1).expand(1, heads, dim),
                A=(-torch.rand(heads) - 0.5)[:, None, None].expand(heads, dim, dstate),
                B=torch.randn(1, 1, dstate), C=torch.randn(1, 1, dstate),
                D=torch.randn(heads)[:, None].expand(heads, dim), z=torch.randn(1, heads, dim),
                dt_bias=torch.randn(heads)[:, None].expand(heads, dim))


def mamba1_step(dim: int = 1024, dstate: int = 16) -> dict[str, torch.Tensor]:
    """A Mamba-1 step (B1 D1024 N16): its state and ``A`` 64 KiB each."""
    return dict(x=torch.randn(1, dim), dt=torch.randn(1, dim), A=-torch.rand(dim, dstate) - 0.5,
                B=torch.randn(1, dstate), C=torch.randn(1, dstate), D=torch.randn(dim), z=torch.randn(1, dim),
                dt_bias=torch.randn(dim))


def decode(state: torch.Tensor, steps: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """``selective_state_update`` over ``steps`` from ``state`` (updated in place): every step's output."""
    return [rt.selective_state_update(state, s["x"], s["dt"], s["A"], s["B"], s["C"], D=s["D"], z=s["z"],
                                      dt_bias=s["dt_bias"], dt_softplus=True) for s in steps]


def copying(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call from here on copies through the arena, as before ``runtime.given``."""
    monkeypatch.setattr(given, "GIVEN_BYTES", 1 << 62)
    fresh()


def fresh() -> None:
    """No compiled signature kept (nor a state update's routes, which hold their bound calls)."""
    rt.clear_cache()
    state_update._step_routes.clear()


@pytest.mark.parametrize("make, shape", [(mamba2_step, (1, 4, 64, 64)), (mamba1_step, (1, 1024, 16))])
def test_a_state_update_decode_hands_its_state_over_and_gives_the_copying_paths_bits(make, shape, host,
                                                                                   monkeypatch):
    torch.manual_seed(0)
    steps, initial = [make() for _ in range(4)], torch.randn(*shape) * 0.1
    fresh()
    with torch.no_grad():
        state = initial.clone()
        outs = decode(state, steps)
        assert bridge._last.plan._given is not None  # the kernel took the caller's arrays
        copying(monkeypatch)
        state_copied = initial.clone()
        outs_copied = decode(state_copied, steps)
    assert torch.equal(state, state_copied)
    assert all(torch.equal(a, b) for a, b in zip(outs, outs_copied))
    assert len({o.data_ptr() for o in outs}) == len(outs)  # each step's output a tensor of its own


def test_a_kept_output_is_not_overwritten_and_inputs_stay_as_they_were(host):
    torch.manual_seed(1)
    steps, state = [mamba1_step() for _ in range(3)], torch.randn(1, 1024, 16) * 0.1
    before = [{k: t.clone() for k, t in s.items()} for s in steps]
    with torch.no_grad():
        first = decode(state, steps[:1])[0]
        kept = first.clone()
        decode(state, steps[1:])
    assert torch.equal(first, kept)
    assert all(torch.equal(s[k], b[k]) for s, b in zip(steps, before) for k in s)  # A (handed over) unchanged


def test_a_state_aliasing_an_input_or_laid_out_apart_falls_back_with_the_same_results(host, monkeypatch):
    torch.manual_seed(2)
    s = mamba1_step()
    initial = torch.randn(1, 1024, 16) * 0.1

    def run(aliased: bool, strided: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if strided:  # a state laid out apart: not handed over
            room = torch.zeros(1, 1536, 32)
            state, A_room = room[:, 512:, :16], room[0, :1024, 16:]
        else:
            room = torch.zeros(1536 * 16)
            state, A_room = room[512 * 16:].view(1, 1024, 16), room[:1024 * 16].view(1024, 16)
        state.copy_(initial)
        # A read from the memory the step updates: channel d's A is channel d - 512's state, which the kernel
        # (channel after channel) would have updated already where it read it in place
        A = A_room if aliased else s["A"]
        with torch.no_grad():
            out = rt.selective_state_update(state, s["x"], s["dt"], A, s["B"], s["C"], D=s["D"], z=s["z"],
                                            dt_bias=s["dt_bias"], dt_softplus=True)
        return out, state.clone()

    cases = [(aliased, strided) for aliased in (False, True) for strided in (False, True)]
    fresh()
    handed = {case: run(*case) for case in cases}
    copying(monkeypatch)
    for case in cases:
        want = run(*case)
        assert torch.equal(handed[case][0], want[0]) and torch.equal(handed[case][1], want[1]), case


def test_the_gated_delta_rules_final_state_is_new_and_its_initial_state_unchanged(host, monkeypatch):
    torch.manual_seed(3)
    heads, size = 4, 64  # the state 64 KiB
    q, k = (torch.nn.functional.normalize(torch.randn(1, 1, heads, size), dim=-1) for _ in range(2))
    v, g, beta = torch.randn(1, 1, heads, size), -torch.rand(1, 1, heads), torch.rand(1, 1, heads)

    def loop() -> list[tuple[torch.Tensor, torch.Tensor]]:
        state, seen = torch.randn(1, heads, size, size, generator=torch.Generator().manual_seed(4)) * 0.1, []
        with torch.no_grad():
            for _ in range(3):
                kept = state.clone()
                o, final = rt.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state,
                                                               output_final_state=True)
                assert torch.equal(state, kept) and final.data_ptr() != state.data_ptr()
                seen.append((o, final))
                state = final
        return seen

    fresh()
    handed = loop()
    assert bridge._last.plan._given is not None
    copying(monkeypatch)
    for (o, final), (o_copied, final_copied) in zip(handed, loop()):
        assert torch.equal(o, o_copied) and torch.equal(final, final_copied)


def test_two_states_taking_turns_on_one_signature_each_evolve_as_on_the_copying_path(host, monkeypatch):
    torch.manual_seed(5)
    steps = [mamba2_step() for _ in range(6)]
    initial = [torch.randn(1, 4, 64, 64) * 0.1 for _ in range(2)]

    def interleaved() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        states, outs = [s.clone() for s in initial], []
        with torch.no_grad():
            for i, step in enumerate(steps):  # two sequences, one plan: each call hands its own state over
                outs += decode(states[i % 2], [step])
        return states, outs

    fresh()
    states, outs = interleaved()
    assert bridge._last.plan._given is not None
    copying(monkeypatch)
    states_copied, outs_copied = interleaved()
    assert all(torch.equal(a, b) for a, b in zip(states + outs, states_copied + outs_copied))
    assert not torch.equal(states[0], states[1])


def test_an_lstm_training_step_hands_its_reserve_over_and_gives_the_copying_paths_gradients(host, monkeypatch):
    """The forward writes its saved forward into the tensor autograd keeps, the backward reads it there: the
    backward plan's arena never holds it (its bytes stay zero), and the gradients are the copying path's bits."""
    torch.manual_seed(5)
    model = rt.LSTM(16, 32, num_layers=2, batch_first=True)
    x = torch.randn(8, 24, 16)

    def step() -> list[torch.Tensor]:
        model.zero_grad()
        model(x)[0].square().sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    fresh()
    handed = step()
    reserve = next(s for s in bridge._last.plan._slots if s.name == "reserve")  # the backward's plan
    assert bridge._last.plan._given is not None and not reserve.raw.any()
    copying(monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(handed, step()))
    assert next(s for s in bridge._last.plan._slots if s.name == "reserve").raw.any()  # copied in, this time


@pytest.mark.parametrize("make, shape", [(mamba2_step, (6, 4, 64, 64)), (mamba1_step, (6, 1024, 16))])
def test_a_pooled_state_update_hands_the_whole_pool_over_and_touches_only_the_named_entries(make, shape, host,
                                                                                          monkeypatch):
    """With ``state_batch_indices`` (a serving engine's pool of states) the op reads and writes the named entries
    of the whole pool itself (``state_slots``, its integer tensor checked before the kernel runs): the caller's
    pool handed over, no entry gathered or scattered, the copying path's bits, the other entries untouched."""
    torch.manual_seed(2)
    rows = torch.tensor([4, 1], dtype=torch.int32)

    def pooled(pool: torch.Tensor, steps: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        return [rt.selective_state_update(pool, torch.cat([s["x"]] * 2), torch.cat([s["dt"]] * 2), s["A"],
                                          torch.cat([s["B"]] * 2), torch.cat([s["C"]] * 2), D=s["D"],
                                          z=torch.cat([s["z"]] * 2), dt_bias=s["dt_bias"], dt_softplus=True,
                                          state_batch_indices=rows) for s in steps]

    steps, initial = [make() for _ in range(3)], torch.randn(*shape) * 0.1
    fresh()
    with torch.no_grad():
        pool = initial.clone()
        outs = pooled(pool, steps)
        assert bridge._last.plan._given is not None and "state_slots" in bridge._last.plan.inputs
        copying(monkeypatch)
        pool_copied = initial.clone()
        outs_copied = pooled(pool_copied, steps)
    assert torch.equal(pool, pool_copied)
    assert all(torch.equal(a, b) for a, b in zip(outs, outs_copied))
    others = [e for e in range(shape[0]) if e not in rows.tolist()]
    assert torch.equal(pool[others], initial[others]) and not torch.equal(pool[rows.long()], initial[rows.long()])


def test_a_plan_handed_a_pool_still_checks_its_slots_before_the_kernel_runs(host):
    """The given path runs a one-thunk schedule's early data checks itself: a slot outside the pool is refused
    naming the thunk and field, the caller's pool (handed over) and the arena untouched."""
    import numpy as np
    import rlx_gpu

    g = rlx_gpu.Graph(dtype="f32")
    x, dt, b, c = g.input("x", (2, 1, 4, 64)), g.input("dt", (2, 1, 4)), g.input("b", (2, 1, 1, 64)), \
        g.input("c", (2, 1, 1, 64))
    a, pool, slots = g.input("a", (4,)), g.input("pool", (6, 4, 64, 64)), g.input("slots", (2,), "i32")
    y, _ = g.mamba2(x, dt, a, b, c, initial_state=pool, state_slots=slots)  # the final pool: an output of its own
    g.output("y", y)
    exe = g.compile("host")
    rng = np.random.default_rng(0)
    values = {"x": rng.standard_normal((2, 1, 4, 64), np.float32), "dt": rng.random((2, 1, 4), np.float32),
              "a": -rng.random(4, dtype=np.float32), "b": rng.standard_normal((2, 1, 1, 64), np.float32),
              "c": rng.standard_normal((2, 1, 1, 64), np.float32),
              "pool": rng.standard_normal((6, 4, 64, 64), np.float32)}
    plan = exe.plan
    order = list(plan.inputs)
    good = plan.call([{**values, "slots": np.array([4, 1], np.int32)}[n] for n in order])
    assert plan._given is not None and good[plan.outputs.index("y")].shape == (2, 1, 4, 64)
    kept = values["pool"].copy()
    with pytest.raises(rlx_gpu.RlxError, match=r"field 'state_slots'\[1\] = 6"):
        plan.call([{**values, "slots": np.array([4, 6], np.int32)}[n] for n in order])
    assert np.array_equal(values["pool"], kept)


def test_a_pooled_conv_update_hands_the_pool_over_and_touches_only_the_named_entries(host, monkeypatch):
    """``causal_conv1d_update`` with ``conv_state_indices`` on a pool (a serving engine's): the prepared decode
    step reads and writes the named entries of the caller's pool where it lies, the copying path's bits."""
    torch.manual_seed(3)
    rows = torch.tensor([5, 0, 2], dtype=torch.int32)
    weight, bias, initial = torch.randn(1536, 4), torch.randn(1536), torch.randn(8, 1536, 3)
    tokens = [torch.randn(3, 1536) for _ in range(3)]

    def decode_pool(pool: torch.Tensor) -> list[torch.Tensor]:
        return [rt.causal_conv1d_update(x, pool, weight, bias, "silu", conv_state_indices=rows) for x in tokens]

    fresh()
    with torch.no_grad():
        pool = initial.clone()
        outs = decode_pool(pool)
        assert bridge._last.plan._given is not None and "state_slots" in bridge._last.plan.inputs
        copying(monkeypatch)
        pool_copied = initial.clone()
        outs_copied = decode_pool(pool_copied)
    assert torch.equal(pool, pool_copied)
    assert all(torch.equal(a, b) for a, b in zip(outs, outs_copied))
    others = [e for e in range(8) if e not in rows.tolist()]
    assert torch.equal(pool[others], initial[others])
