"""selective_scan and mamba2 cases with ABI.md §8's fields: a case's thunk and inputs (``make``), run on the
host beside the float64 reference (``run``), and the tolerance every output is held to (``check_close``)."""
from __future__ import annotations

import numpy as np

import host_fallback
from host_fallback.abi import complete
from rlx_gpu.conformance.reference_ssm import lay_out, read
from rlx_gpu.conformance.references import REFERENCES

#: Error allowed relative to the largest reference value, by the element type of the output.
TOL = {"f64": 1e-10, "f32": 3e-5, "f16": 3e-3, "bf16": 2e-2}
#: Five packed sequences of 37 tokens (one empty; with chunks of 8, two start inside chunk 2), and
#: the pool entries of the rows.
CU = [0, 5, 5, 18, 19, 37]
SLOTS = [6, 0, 3, 5, 1]
NUM_SLOTS = 7


def make(op: str, rng: np.random.Generator, fields: dict, batch: int = 2, seq: int = 37, h: int = 4) -> tuple[dict, dict]:
    """``(params, tensors)``: a thunk of ``op`` with the §8 ``fields`` (``varlen`` packs ``CU``,
    ``slots`` adds ``SLOTS``) and float64 inputs in the usual ranges."""
    fields = dict(fields)
    varlen, slots = fields.pop("varlen", False), fields.pop("slots", False)
    b = 1 if varlen else batch
    params = dict(batch=b, seq=seq, **fields)
    rows = b
    if varlen:
        params.update(cu_seqlens=list(CU), num_seqs=len(CU) - 1)
        rows = len(CU) - 1
    if slots:
        params.update(state_slots=list(SLOTS[:rows]), num_slots=NUM_SLOTS)
        rows = NUM_SLOTS
    soft = fields.get("delta_softplus") or fields.get("dt_softplus")
    step = rng.uniform(-3.0, 0.5, (b, seq, h)) if soft else rng.uniform(0.01, 0.5, (b, seq, h))
    if op == "selective_scan":
        n, g = 4, fields.get("groups", 1)
        params.update(hidden=h, state_size=n)
        bc = (b, seq, n) if g == 1 else (b, seq, g, n)
        tensors = {"x": rng.standard_normal((b, seq, h)), "delta": step, "a": -rng.uniform(0.05, 2.0, (h, n)),
                   "b": rng.standard_normal(bc), "c": rng.standard_normal(bc), "z": rng.standard_normal((b, seq, h)),
                   "delta_bias": rng.uniform(-0.5, 0.5, h), "state": rng.standard_normal((rows, h, n))}
        bias = "delta_bias"
    else:
        p, n, g = 3, 4, fields.get("groups", h)
        params.update(heads=h, head_dim=p, state_size=n)
        tensors = {"x": rng.standard_normal((b, seq, h, p)), "dt": step, "a": rng.uniform(-2.0, -0.05, h),
                   "b": rng.standard_normal((b, seq, g, n)) / 2, "c": rng.standard_normal((b, seq, g, n)),
                   "z": rng.standard_normal((b, seq, h, p)), "dt_bias": rng.uniform(-0.5, 0.5, h),
                   "state": rng.standard_normal((rows, h, p, n))}
        bias = "dt_bias"
    tensors["d"] = rng.standard_normal(h)
    for name in ("d", "z", bias):
        if fields.get(name):
            params[name] = True
    if fields.get("carry_state"):
        params["state"] = True
    return params, tensors


def outputs(thunk: dict) -> tuple[str, ...]:
    return ("dst", "state") if thunk.get("carry_state") else ("dst",)


def run(op: str, dtype: str, params: dict, tensors: dict, **options) -> tuple[dict, dict, dict]:
    """``(thunk, got, want)``: the host's outputs and the float64 reference's, on the stored inputs."""
    thunk, arena = lay_out(op, dtype, params, tensors)
    want = REFERENCES[op](complete(thunk), lambda f: read(thunk, arena, f))
    host_fallback.execute(thunk, arena, **options)
    return thunk, {f: read(thunk, arena, f) for f in outputs(thunk)}, want


def element_type(thunk: dict, field: str) -> str:
    return complete(thunk)["state_dtype"] if field == "state" else thunk["dtype"]


def check_close(thunk: dict, got: dict, want: dict, where: str = "") -> None:
    for field, values in got.items():
        assert np.all(np.isfinite(values)), f"{where} {field}: not finite"
        err = np.max(np.abs(values - want[field])) / max(np.max(np.abs(want[field])), 1e-30)
        tol = TOL[element_type(thunk, field)]
        assert err <= tol, f"{where} {field}: relative error {err:.3g} > {tol}"


SCAN_FIELDS = [
    {"d": True}, {"z": True}, {"delta_bias": True}, {"delta_softplus": True},
    {"delta_bias": True, "delta_softplus": True, "d": True, "z": True}, {"groups": 2}, {"groups": 4},
    {"carry_state": True}, {"varlen": True}, {"varlen": True, "carry_state": True},
    {"carry_state": True, "slots": True},
    {"varlen": True, "carry_state": True, "slots": True, "groups": 2, "delta_bias": True, "delta_softplus": True,
     "d": True, "z": True},
]
MAMBA2_FIELDS = [
    {"d": True}, {"z": True}, {"dt_bias": True}, {"dt_softplus": True}, {"dt_limit": [0.05, None]},
    {"dt_limit": [0.0, 0.2]}, {"dt_bias": True, "dt_softplus": True, "dt_limit": [0.0, None], "d": True, "z": True},
    {"groups": 1}, {"groups": 2}, {"carry_state": True}, {"varlen": True}, {"varlen": True, "carry_state": True},
    {"carry_state": True, "slots": True},
    {"varlen": True, "carry_state": True, "slots": True, "groups": 2, "dt_bias": True, "dt_softplus": True,
     "dt_limit": [0.0, None], "d": True, "z": True},
]
