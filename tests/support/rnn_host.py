"""The host recurrent-op harness: a ``build`` lays an lstm / gru / rnn thunk out in an arena filled with a
byte pattern, with gaps between the tensors (``dst`` starts as NaN, so a slot left unwritten fails the
comparison); ``run_host`` runs it on a copy and asserts that no byte outside ``dst``/``h0``/``c0`` changed;
``check`` compares with the float64 reference (rlx_gpu/conformance/reference_rnn.py)."""
from __future__ import annotations

import ml_dtypes
import numpy as np

import host_fallback
from rlx_gpu.conformance.reference_rnn import GATES, reference

STORAGE = {"f32": np.float32, "f64": np.float64, "f16": np.float16, "bf16": ml_dtypes.bfloat16}

# Allowed |host - reference| <= ATOL + RTOL*|reference|, the reference run in float64 on the stored
# (already rounded) inputs. 16-bit: only dst/h0/c0 are rounded, once, so the bound is half an ulp of
# the storage type relative to the value (f16 2^-11, bf16 2^-8) plus a little for the f32 inside.
# Worst measured over the flag matrix (3 seeds, |v| up to 1.36): f16 4.86e-4 abs / 4.84e-4 rel,
# bf16 3.78e-3 abs / 3.89e-3 rel, f32 1.5e-7 abs, f64 2.5e-16 abs.
TOL = {  # (rtol, atol)
    "f64": (1e-13, 1e-14),
    "f32": (2e-6, 1e-6),
    "f16": (2 ** -11, 1e-5),
    "bf16": (2 ** -8, 1e-4),
}

CANARY = 0xFF  # NaN in every float type: an unwritten dst element cannot match the reference


def build(op, dtype, *, batch, seq, input_size, hidden, num_layers, bidirectional, carry, relu=False, seed=0,
          **v2):
    """A thunk, its arena, and the stored inputs as float64 arrays.

    ``v2``: ABI.md §8's fields: ``seq_lens`` (a list of ints), ``peepholes=True`` and ``proj_size``
    (their tensors drawn here, ``w_hr`` with ``proj_size``), and the plain ones as they are."""
    rng = np.random.default_rng(seed)
    G, D, H = GATES[op], 2 if bidirectional else 1, hidden
    W = v2.get("proj_size") or H
    k = 1 / np.sqrt(H)
    w_ih_count = sum(D * G * H * (input_size if layer == 0 else D * W) for layer in range(num_layers))
    values = {
        "x": rng.uniform(-1, 1, (batch, seq, input_size)),
        "w_ih": rng.uniform(-k, k, (w_ih_count,)),
        "w_hh": rng.uniform(-k, k, (num_layers * D, G * H, W)),
    }
    for f in ("b_ih", "b_hh") if op == "gru" else ("bias",):
        values[f] = rng.uniform(-k, k, (num_layers * D, G * H))
    if v2.get("peepholes"):
        values["peepholes"] = rng.uniform(-1, 1, (num_layers * D, 3 * H))
    if v2.get("proj_size"):
        values["w_hr"] = rng.uniform(-k, k, (num_layers * D, W, H))
    if carry:
        values["h0"] = rng.uniform(-1, 1, (num_layers * D, batch, W))
        if op == "lstm":
            values["c0"] = rng.uniform(-1, 1, (num_layers * D, batch, H))
    storage = np.dtype(STORAGE[dtype])
    stored = {f: v.astype(storage) for f, v in values.items()}
    if v2.get("seq_lens") is not None:
        stored["seq_lens"] = np.asarray(v2["seq_lens"], "<i4")
    stored["dst"] = np.zeros((batch, seq, D * W), storage)

    offsets, cursor = {}, 40  # a pattern before the first tensor and 24..88 bytes between tensors
    for f, a in stored.items():
        offsets[f] = cursor
        cursor = -(-(cursor + a.nbytes + 24) // 64) * 64
    arena = rng.integers(0, 256, cursor + 40, dtype=np.uint8)
    for f, a in stored.items():
        arena[offsets[f]: offsets[f] + a.nbytes] = CANARY if f == "dst" else a.view(np.uint8).ravel()

    fields = {"lstm": ("x", "w_ih", "w_hh", "bias", "h0", "c0", "dst"),
              "gru": ("x", "w_ih", "w_hh", "b_ih", "b_hh", "h0", "dst"),
              "rnn": ("x", "w_ih", "w_hh", "bias", "h0", "dst")}[op]
    thunk = {"op": op, "dtype": dtype, "batch": batch, "seq": seq, "input_size": input_size, "hidden": hidden,
             "num_layers": num_layers, "bidirectional": bidirectional, "carry": carry}
    thunk.update({f: offsets.get(f, 0) for f in fields})
    if op == "rnn":
        thunk["relu"] = relu
    thunk.update({f: v for f, v in v2.items() if f not in ("seq_lens", "peepholes")})
    thunk.update({f: offsets[f] for f in ("seq_lens", "peepholes", "w_hr") if f in offsets})
    writes = [(offsets[f], stored[f].nbytes) for f in ("dst", "h0", "c0") if f in offsets]
    inputs = {f: a.astype(np.float64) for f, a in stored.items() if f != "dst"}
    return thunk, arena, inputs, writes


def read(arena, thunk, field, shape):
    storage = np.dtype(STORAGE[thunk["dtype"]])
    n = int(np.prod(shape))
    return arena[thunk[field]: thunk[field] + n * storage.itemsize].view(storage).reshape(shape).astype(np.float64)


def run_host(thunk, arena, writes, **options):
    """Execute on a copy; assert every byte outside the write footprint is untouched; return the copy."""
    out = arena.copy()
    host_fallback.execute(thunk, out, **options)
    outside = np.ones(arena.size, bool)
    for off, n in writes:
        outside[off: off + n] = False
    changed = np.flatnonzero((out != arena) & outside)
    assert changed.size == 0, f"bytes outside the write footprint changed, first at {changed[:8]}"
    return out


def want_of(op, inp, relu=False, **shape):
    """The float64 reference's ``(dst, h, c)`` of a ``build`` case."""
    v2 = {f: shape[f] for f in ("reverse", "clip", "activations", "linear_before_reset", "input_forget",
                                "proj_size") if f in shape}
    biases = {f: inp[f] for f in ("bias", "b_ih", "b_hh") if f in inp}
    return reference(op, inp["x"], inp["w_ih"], inp["w_hh"], biases, hidden=shape["hidden"],
                     num_layers=shape["num_layers"], bidirectional=shape["bidirectional"], h0=inp.get("h0"),
                     c0=inp.get("c0"), relu=relu, seq_lens=inp.get("seq_lens"), peepholes=inp.get("peepholes"),
                     w_hr=inp.get("w_hr"), **v2)


def check(op, dtype, relu=False, options=None, **shape):
    thunk, arena, inp, writes = build(op, dtype, relu=relu, **shape)
    out = run_host(thunk, arena, writes, **(options or {}))
    want, h_want, c_want = want_of(op, inp, relu, **shape)
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(read(out, thunk, "dst", want.shape), want, rtol=rtol, atol=atol, err_msg="dst")
    if shape["carry"]:
        np.testing.assert_allclose(read(out, thunk, "h0", h_want.shape), h_want, rtol=rtol, atol=atol, err_msg="h0")
        if op == "lstm":
            np.testing.assert_allclose(read(out, thunk, "c0", c_want.shape), c_want, rtol=rtol, atol=atol,
                                       err_msg="c0")
    return out, thunk
