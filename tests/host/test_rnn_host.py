"""host_fallback lstm / gru / rnn against the float64 reference (rlx_gpu/conformance/reference_rnn.py) and PyTorch.

Every run lays its tensors out in an arena filled with a byte pattern, with gaps between them, and
checks that no byte outside ``dst``/``h0``/``c0`` changed; ``dst`` starts as NaN, so a slot left
unwritten fails the comparison (the harness of ``support.rnn_host``).
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import host_fallback
from rlx_gpu.conformance.reference_rnn import reference
from rlx_gpu.graph.torch_weights import pack_recurrent
from support.rnn_host import STORAGE, TOL, build, check, read, run_host, want_of

CELLS = [("lstm", False), ("gru", False), ("rnn", False), ("rnn", True)]
CELL_IDS = ["lstm", "gru", "rnn-tanh", "rnn-relu"]


FLAGS = [pytest.param(layers, bidi, carry, par,
                      id=f"L{layers}-{'bi' if bidi else 'uni'}{'-carry' if carry else ''}"
                         f"{'' if par is None else '-threads' if par else '-serial'}")
         for layers, bidi, carry in itertools.product((1, 3), (False, True), (False, True))
         for par in ((False, True) if bidi else (None,))]


@pytest.mark.parametrize("dtype", list(STORAGE))
@pytest.mark.parametrize("cell", CELLS, ids=CELL_IDS)
@pytest.mark.parametrize("num_layers,bidirectional,carry,parallel", FLAGS)
def test_every_flag(cell, dtype, num_layers, bidirectional, carry, parallel):
    op, relu = cell
    check(op, dtype, relu, options={"parallel_directions": parallel}, batch=3, seq=5, input_size=4, hidden=6,
          num_layers=num_layers, bidirectional=bidirectional, carry=carry)


# seq=1, batch=1, hidden=1, input_size=1; time chunks of several steps (batch 40: 3 steps a chunk,
# batch 5: 15) and a prime seq (one chunk of 7).
SHAPES = [dict(batch=1, seq=1, input_size=1, hidden=1), dict(batch=1, seq=7, input_size=3, hidden=1),
          dict(batch=2, seq=1, input_size=1, hidden=5), dict(batch=40, seq=6, input_size=3, hidden=4),
          dict(batch=5, seq=30, input_size=2, hidden=3)]


@pytest.mark.parametrize("dtype", ["f32", "f64", "bf16"])
@pytest.mark.parametrize("cell", CELLS, ids=CELL_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{batch}s{seq}i{input_size}h{hidden}".format(**s))
def test_edge_shapes(cell, dtype, shape):
    op, relu = cell
    check(op, dtype, relu, num_layers=2, bidirectional=True, carry=True, **shape)


def test_options_for_other_kernels_are_ignored():
    check("lstm", "f32", options={"recompute": "treeverse"}, batch=2, seq=3, input_size=2, hidden=2, num_layers=1,
          bidirectional=False, carry=False)


def test_empty_sequence_keeps_the_state():
    thunk, arena, _, writes = build("lstm", "f32", batch=2, seq=0, input_size=3, hidden=4, num_layers=2,
                                    bidirectional=True, carry=True)
    np.testing.assert_array_equal(run_host(thunk, arena, writes), arena)


def test_blas_threads_are_restored_and_a_failing_thread_raises(monkeypatch):
    from host_fallback import rnn, threads

    before = threads.blas_threads()
    check("gru", "f32", options={"parallel_directions": True}, batch=2, seq=3, input_size=2, hidden=2,
          num_layers=2, bidirectional=True, carry=False)
    assert threads.blas_threads() == before

    real = rnn._layer_direction

    def reverse_fails(t, b, d, layer, dr, *rest):
        if dr == 1:
            raise RuntimeError("reverse direction failed")
        real(t, b, d, layer, dr, *rest)

    monkeypatch.setattr(rnn, "_layer_direction", reverse_fails)
    thunk, arena, _, _ = build("lstm", "f32", batch=2, seq=3, input_size=2, hidden=2, num_layers=1,
                               bidirectional=True, carry=False)
    with pytest.raises(RuntimeError, match="reverse direction failed"):
        host_fallback.execute(thunk, arena, parallel_directions=True)
    assert threads.blas_threads() == before


def test_bigger_than_a_chunk_in_parallel_and_serial_agree(monkeypatch):
    from host_fallback import lstm_sequence

    monkeypatch.setattr(lstm_sequence, "MAX_STEP", -1)  # serial too on the chunked route (not one call a sequence)
    thunk, arena, _, writes = build("lstm", "f32", batch=32, seq=12, input_size=16, hidden=16, num_layers=2,
                                    bidirectional=True, carry=True)
    a = run_host(thunk, arena, writes, parallel_directions=True)
    b = run_host(thunk, arena, writes, parallel_directions=False)
    np.testing.assert_array_equal(a, b)


# --- PyTorch as a second reference --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["f64", "f32"])
@pytest.mark.parametrize("cell", CELLS, ids=CELL_IDS)
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("carry", [False, True])
def test_matches_torch(cell, dtype, bidirectional, carry):
    torch = pytest.importorskip("torch")
    op, relu = cell
    B, S, I, H, L = 3, 6, 5, 4, 2
    D = 2 if bidirectional else 1
    torch.manual_seed(0)
    tdtype = torch.float64 if dtype == "f64" else torch.float32
    kind = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn": torch.nn.RNN}[op]
    extra = {"nonlinearity": "relu" if relu else "tanh"} if op == "rnn" else {}
    model = kind(I, H, num_layers=L, bidirectional=bidirectional, batch_first=True, dtype=tdtype, **extra)
    x = torch.randn(B, S, I, dtype=tdtype)
    h0 = torch.randn(L * D, B, H, dtype=tdtype)
    c0 = torch.randn(L * D, B, H, dtype=tdtype)

    tensors = {"x": x.numpy(), **pack_recurrent(model)}
    if carry:
        tensors["h0"] = h0.numpy()
        if op == "lstm":
            tensors["c0"] = c0.numpy()
    with torch.no_grad():
        state = ((h0, c0) if op == "lstm" else h0) if carry else None
        want, final = model(x, state)
    want_h, want_c = (final if op == "lstm" else (final, None))

    thunk, arena, _, writes = build(op, dtype, batch=B, seq=S, input_size=I, hidden=H, num_layers=L,
                                    bidirectional=bidirectional, carry=carry, relu=relu)
    for f, a in tensors.items():  # overwrite the random tensors with torch's
        raw = np.ascontiguousarray(a, STORAGE[dtype]).view(np.uint8).ravel()
        arena[thunk[f]: thunk[f] + raw.size] = raw
    out = run_host(thunk, arena, writes)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == "f64" else dict(rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(read(out, thunk, "dst", (B, S, D * H)), want.numpy(), **tol)
    if carry:
        np.testing.assert_allclose(read(out, thunk, "h0", (L * D, B, H)), want_h.numpy(), **tol)
        if op == "lstm":
            np.testing.assert_allclose(read(out, thunk, "c0", (L * D, B, H)), want_c.numpy(), **tol)


@pytest.mark.parametrize("op", ["lstm", "gru"])
@pytest.mark.parametrize("seq", [2, 20], ids=["stored-weights", "internal-copy"])
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_saturated_sigmoid_gates_reach_0_and_1_without_a_warning(op, dtype, seq):
    """Inputs scaled so pre-activations pass ±1000: exp(-z) overflows to inf (f32 and f64), which
    must give σ = 0 exactly as the reference does, and no RuntimeWarning may leak to the caller."""
    import warnings

    shape = dict(batch=2, seq=seq, input_size=3, hidden=4, num_layers=1, bidirectional=True, carry=True)
    thunk, arena, inp, writes = build(op, dtype, **shape)
    storage = np.dtype(STORAGE[dtype])
    inp["x"] = inp["x"] * 2e4
    arena[thunk["x"]: thunk["x"] + inp["x"].size * storage.itemsize] = inp["x"].astype(storage).view(np.uint8).ravel()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = run_host(thunk, arena, writes)
    biases = {f: inp[f] for f in ("bias", "b_ih", "b_hh") if f in inp}
    with np.errstate(over="ignore"):
        want = reference(op, inp["x"], inp["w_ih"], inp["w_hh"], biases, hidden=4, num_layers=1,
                         bidirectional=True, h0=inp["h0"], c0=inp.get("c0"))[0]
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(read(out, thunk, "dst", want.shape), want, rtol=rtol, atol=atol)


# --- version 2 (ABI.md §8) ------------------------------------------------------------------------------

ACTIVATIONS = ["sigmoid", "tanh", "relu", "affine", "leaky_relu", "thresholded_relu", "scaled_tanh",
               "hard_sigmoid", "elu", "softsign", "softplus"]
# Every field on each op it belongs to, alone and together; the lengths hold a row that never runs, a
# full one and two partial ones (clipped to seq), the bf16 row order differing from the length order.
LENGTHS = [20, 0, 2, 13]
FIELD_CASES = [
    *[(op, dict(seq_lens=LENGTHS)) for op in ("lstm", "gru", "rnn")],
    *[(op, dict(bidirectional=False, reverse=True, seq_lens=LENGTHS)) for op in ("lstm", "gru", "rnn")],
    *[(op, dict(bidirectional=False, reverse=True)) for op in ("lstm", "gru", "rnn")],
    *[(op, dict(clip=0.3)) for op in ("lstm", "gru", "rnn")],
    ("gru", dict(linear_before_reset=False)),
    ("gru", dict(linear_before_reset=False, clip=0.4, seq_lens=[1, 20, 3, 0])),
    ("lstm", dict(peepholes=True)),
    ("lstm", dict(input_forget=True)),
    ("lstm", dict(proj_size=3)),
    ("lstm", dict(peepholes=True, input_forget=True, proj_size=2, clip=0.5, seq_lens=[1, 20, 0, 3])),
    # every activation in every slot: the other direction keeps the defaults (bounded gates keep 20 steps finite)
    *[("rnn", dict(activations=[[a, 0.7, 0.2], ["tanh", 0, 0]])) for a in ACTIVATIONS],
    *[("gru", dict(activations=[["hard_sigmoid", 0.2, 0.5], [a, 0.6, 0.3], ["sigmoid", 0, 0], [a, 1.5, -0.1]]))
      for a in ACTIVATIONS],
    *[("lstm", dict(activations=[["sigmoid", 0, 0], [a, 0.8, 0.4], [a, 1.3, 0.2], ["hard_sigmoid", 0.2, 0.5],
                                 ["tanh", 0, 0], [a, 0.5, -0.3]])) for a in ACTIVATIONS],
]


def test_the_cases_cover_every_activation_of_the_abi():
    from host_fallback.abi.rnn import ACTIVATIONS as ABI_ACTIVATIONS

    assert sorted(ACTIVATIONS) == sorted(ABI_ACTIVATIONS)


def _case_id(case):
    op, v2 = case  # activations: named by the function under test (rnn's slot f, else slot g)
    return op + "-" + "-".join(f"{k}={v[0 if op == 'rnn' else 1][0]}" if k == "activations" else f"{k}={v}"
                               for k, v in v2.items())


@pytest.mark.parametrize("seq,dtype", [(5, "f64"), (20, "f32"), (20, "bf16")],
                         ids=["decode-path-f64", "prefill-f32", "prefill-bf16"])
@pytest.mark.parametrize("case", FIELD_CASES, ids=[_case_id(c) for c in FIELD_CASES])
def test_version2_fields_match_the_reference(case, seq, dtype):
    """seq 5 in f64 reads the weights where they are stored, seq 20 runs the reordered, negated copy."""
    op, v2 = case
    v2 = dict(v2)
    if "seq_lens" in v2:
        v2["seq_lens"] = [min(n, seq) for n in v2["seq_lens"]]
    shape = dict(batch=4, seq=seq, input_size=3, hidden=5, num_layers=2, bidirectional=True, carry=True)
    shape.update(v2)
    out, thunk = check(op, dtype, options={"parallel_directions": seq == 20}, **shape)
    if "seq_lens" in v2:  # exactly 0 past each row's length
        dst = read(out, thunk, "dst", (4, seq, (2 if shape["bidirectional"] else 1) * (v2.get("proj_size") or 5)))
        for row, n in enumerate(v2["seq_lens"]):
            assert not dst[row, n:].any()


# A step's block of at least EXP_TANH_MIN_ELEMENTS (batch x hidden) stores the tanh gates' rows at -2z
# and takes every tanh through exp: the plain ops in each precision, and the fields that touch the scaled
# rows (clip bounds, peepholes, the coupled gate, lengths, the other GRU form).
WIDE = dict(batch=16, seq=18, input_size=3, hidden=128, num_layers=2, bidirectional=True, carry=True)
WIDE_CASES = [
    *[(op, {}, dtype) for op in ("lstm", "gru") for dtype in ("f32", "f64", "bf16")],
    *[(op, dict(clip=0.3), "f32") for op in ("lstm", "gru")],
    ("lstm", dict(peepholes=True, clip=0.5, seq_lens=[18, 0, 5, 17] * 4), "f32"),
    ("lstm", dict(input_forget=True, proj_size=24), "f32"),
    ("gru", dict(linear_before_reset=False, clip=0.4, seq_lens=[3, 18, 0, 9] * 4), "f32"),
]


@pytest.mark.parametrize("op,v2,dtype", WIDE_CASES, ids=[f"{op}-{'-'.join(v2) or 'plain'}-{dtype}"
                                                          for op, v2, dtype in WIDE_CASES])
def test_wide_blocks_take_tanh_through_exp_and_match_the_reference(op, v2, dtype):
    from host_fallback.activations import stored_scale

    assert stored_scale("tanh", WIDE["batch"] * WIDE["hidden"]) == -2.0  # the route under test
    check(op, dtype, options={"parallel_directions": True}, **WIDE, **v2)


@pytest.mark.parametrize("op", ["lstm", "gru", "rnn"])
def test_rows_of_length_0_keep_their_state_and_write_zeros(op):
    thunk, arena, inp, writes = build(op, "f32", batch=2, seq=20, input_size=3, hidden=4, num_layers=2,
                                      bidirectional=True, carry=True, seq_lens=[0, 0])
    out = run_host(thunk, arena, writes)
    assert not read(out, thunk, "dst", (2, 20, 8)).any()
    for f in ("h0", "c0") if op == "lstm" else ("h0",):
        np.testing.assert_array_equal(read(out, thunk, f, inp[f].shape), inp[f])


@pytest.mark.parametrize("op", ["lstm", "gru"])
def test_padding_is_never_read(op):
    """NaN in x past each row's length must reach nothing: the padding is skipped, not masked after."""
    lens = [7, 3, 0, 20]
    shape = dict(batch=4, seq=20, input_size=3, hidden=4, num_layers=2, bidirectional=True, carry=True, seq_lens=lens)
    thunk, arena, inp, writes = build(op, "f32", **shape)
    x = inp["x"].astype(np.float32)
    for row, n in enumerate(lens):
        x[row, n:] = np.nan
    arena[thunk["x"]: thunk["x"] + x.nbytes] = x.view(np.uint8).ravel()
    out = run_host(thunk, arena, writes)
    inp["x"] = np.nan_to_num(x.astype(np.float64), nan=0.0)
    want, h_want, _ = want_of(op, inp, **shape)
    np.testing.assert_allclose(read(out, thunk, "dst", want.shape), want, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(read(out, thunk, "h0", h_want.shape), h_want, rtol=2e-6, atol=1e-6)


def _load_torch(arena, thunk, tensors, dtype="f32"):
    for f, a in tensors.items():  # overwrite the random tensors with torch's
        raw = np.ascontiguousarray(a, "<i4" if f == "seq_lens" else STORAGE[dtype]).view(np.uint8).ravel()
        arena[thunk[f]: thunk[f] + raw.size] = raw


@pytest.mark.parametrize("op", ["lstm", "gru", "rnn"])
def test_packed_sequences_match_torch(op):
    """pack_padded_sequence(enforce_sorted=False) through a bidirectional 2-layer module, with h0 (c0)."""
    torch = pytest.importorskip("torch")
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    from rlx_gpu.graph.torch_weights import unpack_sequence

    B, S, I, H, L = 4, 7, 3, 5, 2
    torch.manual_seed(1)
    model = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn": torch.nn.RNN}[op](
        I, H, num_layers=L, bidirectional=True, batch_first=True)
    lengths = torch.tensor([3, 7, 1, 5])
    packed = pack_padded_sequence(torch.randn(B, S, I), lengths, batch_first=True, enforce_sorted=False)
    h0, c0 = torch.randn(2 * L, B, H), torch.randn(2 * L, B, H)
    with torch.no_grad():
        out, final = model(packed, (h0, c0) if op == "lstm" else h0)
    want = pad_packed_sequence(out, batch_first=True, total_length=S)[0].numpy()
    x, lens = unpack_sequence(packed)
    np.testing.assert_array_equal(lens, lengths.numpy())
    tensors = {"x": x, **pack_recurrent(model), "h0": h0.numpy(), "seq_lens": lens}
    if op == "lstm":
        tensors["c0"] = c0.numpy()
    thunk, arena, _, writes = build(op, "f32", batch=B, seq=S, input_size=I, hidden=H, num_layers=L,
                                    bidirectional=True, carry=True, seq_lens=[0] * B)
    _load_torch(arena, thunk, tensors)
    got = run_host(thunk, arena, writes)
    np.testing.assert_allclose(read(got, thunk, "dst", want.shape), want, rtol=2e-5, atol=2e-6)
    finals = final if op == "lstm" else (final,)
    for f, t in zip(("h0", "c0"), finals):
        np.testing.assert_allclose(read(got, thunk, f, tuple(t.shape)), t.numpy(), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_lstm_projections_match_torch(bidirectional):
    torch = pytest.importorskip("torch")
    B, S, I, H, P, L = 3, 20, 4, 6, 3, 2
    D = 2 if bidirectional else 1
    torch.manual_seed(2)
    model = torch.nn.LSTM(I, H, num_layers=L, bidirectional=bidirectional, batch_first=True, proj_size=P)
    x, h0, c0 = torch.randn(B, S, I), torch.randn(L * D, B, P), torch.randn(L * D, B, H)
    with torch.no_grad():
        want, (h_n, c_n) = model(x, (h0, c0))
    thunk, arena, _, writes = build("lstm", "f32", batch=B, seq=S, input_size=I, hidden=H, num_layers=L,
                                    bidirectional=bidirectional, carry=True, proj_size=P)
    _load_torch(arena, thunk, {"x": x.numpy(), **pack_recurrent(model), "h0": h0.numpy(), "c0": c0.numpy()})
    got = run_host(thunk, arena, writes)
    np.testing.assert_allclose(read(got, thunk, "dst", (B, S, D * P)), want.numpy(), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(read(got, thunk, "h0", (L * D, B, P)), h_n.numpy(), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(read(got, thunk, "c0", (L * D, B, H)), c_n.numpy(), rtol=2e-5, atol=2e-6)


# --- the builder's version-2 arguments ------------------------------------------------------------------


def test_builder_takes_a_packed_sequence_and_projections_and_labels_version_2_only_then():
    torch = pytest.importorskip("torch")
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    from rlx_gpu.graph.builder import Graph

    B, S, I, H, P, L = 3, 6, 3, 5, 2, 2
    torch.manual_seed(3)
    model = torch.nn.LSTM(I, H, num_layers=L, bidirectional=True, batch_first=True, proj_size=P)
    packed = pack_padded_sequence(torch.randn(B, S, I), torch.tensor([2, 6, 4]), batch_first=True,
                                  enforce_sorted=False)
    h0, c0 = torch.randn(2 * L, B, P), torch.randn(2 * L, B, H)
    with torch.no_grad():
        out, (h_n, c_n) = model(packed, (h0, c0))
    g = Graph()
    y, h, c = g.lstm(packed, **pack_recurrent(model), hidden=H, num_layers=L, bidirectional=True, proj_size=P,
                     h0=h0.numpy(), c0=c0.numpy(), name="enc")
    g.output("y", y)
    exe = g.compile("host")
    assert exe.schedule.abi == "rlx-thunks/2"
    got = exe.run()
    tol = dict(rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(got["y"], pad_packed_sequence(out, batch_first=True, total_length=S)[0].numpy(), **tol)
    np.testing.assert_allclose(got["enc.h_n"], h_n.numpy(), **tol)
    np.testing.assert_allclose(got["enc.c_n"], c_n.numpy(), **tol)

    plain = Graph()  # no version-2 argument, or one at its default: a version-1 schedule
    x = plain.input("x", (B, S, I))
    plain.output("y", plain.gru(x, *pack_recurrent(torch.nn.GRU(I, H)).values(), hidden=H, clip=0.0,
                                linear_before_reset=True))
    assert plain.compile("host").schedule.abi == "rlx-thunks/1"


def test_builder_lengths_as_an_input_and_its_errors():
    from rlx_gpu.errors import GraphError
    from rlx_gpu.graph.builder import Graph

    thunk, _, inp, _ = build("gru", "f32", batch=3, seq=4, input_size=2, hidden=3, num_layers=1,
                             bidirectional=True, carry=False, linear_before_reset=False)
    g = Graph()
    x, lengths = g.input("x", (3, 4, 2)), g.input("lengths", (3,), "i32")
    weights = {f: inp[f] for f in ("w_ih", "w_hh", "b_ih", "b_hh")}
    g.output("y", g.gru(x, **weights, hidden=3, bidirectional=True, lengths=lengths, linear_before_reset=False))
    exe = g.compile("host")
    for lens in ([4, 0, 2], [1, 3, 4]):
        want = want_of("gru", {**inp, "seq_lens": lens}, batch=3, seq=4, hidden=3, num_layers=1,
                       bidirectional=True, linear_before_reset=False)[0]
        np.testing.assert_allclose(exe.run(x=inp["x"], lengths=np.array(lens, np.int32))["y"], want,
                                   rtol=2e-6, atol=1e-6)
    with pytest.raises(GraphError, match=r"lengths .* must be i32 \[batch=3\]"):
        g.gru(x, **weights, hidden=3, bidirectional=True, lengths=[1, 2])
    with pytest.raises(GraphError, match="proj_size=2 needs w_hr"):
        g.lstm(x, np.zeros(4 * 3 * 2), np.zeros((1, 12, 2)), np.zeros((1, 12)), hidden=3, proj_size=2)
    with pytest.raises(GraphError, match="w_hr was given without proj_size"):
        g.lstm(x, np.zeros(4 * 3 * 2), np.zeros((1, 12, 3)), np.zeros((1, 12)), hidden=3, w_hr=np.zeros((1, 2, 3)))


@pytest.mark.parametrize("op", ["lstm", "gru", "rnn"])
def test_a_sequence_too_long_for_memory_is_refused_before_the_packing(op, monkeypatch):
    """A sequence whose arena fits but whose working memory does not (the issue's lstm with seq 2**28 took
    26 s to be refused): refused before ``prepare`` builds the packing, whose Python tables grow with seq."""
    import time

    import rlx_gpu
    from host_fallback import rnn_packing
    from rlx_gpu.backends.host import physical_memory
    from rlx_gpu.conformance.cases import SMALL, lay_out, schedule_of

    params = dict(SMALL[op], batch=1, num_layers=2, bidirectional=False, carry=False, input_size=1, hidden=1)
    seq = physical_memory() // 10  # per step 8 bytes of arena (f32 x, dst) fit, 12 of working memory do not
    thunk, nbytes = lay_out(op, "f32", dict(params, seq=seq))
    sched = schedule_of(thunk, nbytes)

    def no_packing(*_):
        raise AssertionError("the packing was built for a thunk the machine cannot hold")
    monkeypatch.setattr(rnn_packing, "_chunks", no_packing)
    started = time.perf_counter()
    with pytest.raises(rlx_gpu.DeviceError, match=rf"thunk 0 \({op}\)'s working memory .* more than the .* memory"):
        rlx_gpu.get_device("host").run(sched)
    assert time.perf_counter() - started < 10  # generous: the refusal takes milliseconds
