"""Schedules and inputs the call-plan tests of every device share: a one-thunk schedule naming each tensor
by its field, and random inputs of a packed Mamba-2 step."""
from __future__ import annotations

import numpy as np

import rlx_gpu
from host_fallback.abi import regions
from rlx_gpu.conformance.cases import lay_out, schedule_of


def named(op: str, dtype: str = "f32", **params) -> rlx_gpu.Schedule:
    """A one-thunk schedule of ``op`` naming each tensor by its field: what it reads are the inputs,
    what it writes the outputs (a state updated in place is both)."""
    thunk, nbytes = lay_out(op, dtype, params)
    regs = regions(thunk)
    return rlx_gpu.load_schedule(schedule_of(thunk, nbytes) | {
        "tensors": {r.field: {"offset": r.offset, "dtype": r.dtype, "shape": list(r.shape)} for r in regs},
        "inputs": [r.field for r in regs if r.reads], "outputs": [r.field for r in regs if r.writes]})


def mamba2_inputs(sched: rlx_gpu.Schedule, seed: int, cu_seqlens=(0, 3, 7)) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    values = {name: rng.uniform(-1, 1, sched.tensors[name].shape) for name in sched.inputs if name != "cu_seqlens"}
    values["a"] = -np.abs(values["a"])
    return values | {"cu_seqlens": np.asarray(cu_seqlens, np.int64)}
