"""Bad run-time data inside a scan body (ABI.md §8's integer tensors, fed to a body thunk): the cases of the
issue and a scan schedule with an outer arena holding the rows the body reads; the body-data tests and
their child process share them."""
from __future__ import annotations

import numpy as np

from rlx_gpu.conformance.cases import SMALL, body_case

SLOTS = dict(SMALL["selective_scan"], batch=3, carry_state=True, state=True, state_slots=[0, 1, 2], num_slots=4)
CU = dict(SMALL["mamba2"], batch=1, cu_seqlens=[0, 3, 7])
LENS = dict(SMALL["lstm"], seq_lens=[5, 2])
#: (op, params with good values, bad values, field, index, value) — the issue's cases.
BAD = [
    ("selective_scan", SLOTS, [1, 3, 2**31 - 1], "state_slots", 2, 2**31 - 1),
    ("selective_scan", SLOTS, [1, 1, 2], "state_slots", 1, 1),
    ("mamba2", CU, [0, -2**31, 7], "cu_seqlens", 1, -2**31),
    ("mamba2", CU, [0, 2**31 - 1, 7], "cu_seqlens", 2, 7),
    ("lstm", LENS, [3, 99], "seq_lens", 1, 99),
]
IDS = [f"{op}.{field}={bad}" for op, _, bad, field, _, _ in BAD]


def body_data_case(scan_op: str, op: str, params: dict, feed: str, rows: list[list[int]]) -> tuple[dict, np.ndarray]:
    """The schedule of ``body_case`` and an outer arena holding ``rows`` (one per step, or the initial carry)."""
    field = next(f for f in ("state_slots", "cu_seqlens", "seq_lens") if isinstance(params.get(f), list))
    sched, places = body_case(scan_op, op, {**params, field: rows[0]} if feed == "init" else params, feed,
                              length=len(rows) if feed in ("xs", "computed") else 3)
    arena = np.random.default_rng(0).uniform(-1, 1, sched["arena_bytes"] // 4).astype(np.float32).view(np.uint8)
    for name, offset in places.items():
        data = np.asarray(rows, "<i4").reshape(-1).view(np.uint8)
        arena[offset: offset + data.size] = data
    return sched, arena
