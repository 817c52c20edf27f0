"""Damaged schedules for fuzzing the border: every op family, every kind of damage.

``make_case(seed)`` builds one case deterministically: a valid small schedule of a random op
(``cases.lay_out`` with guard bytes around every tensor), sometimes given named views, init blocks
or a nest of scans around it, then damaged by zero to three mutations (deletions, wrong types,
huge and wrapping integers, moved and overlapping offsets, NaN/inf, extra fields, aliased thunks)
and sent as a mapping, JSON or YAML text — text that may be truncated, salted with random bytes,
given duplicate keys, or replaced by random bytes, deep brackets or an alias bomb.

Some cases (``make_data_case``) are valid schedules with damaged run-time data (ABI.md §8): a
version-2 thunk whose ``seq_lens``/``cu_seqlens``/``state_slots`` hold wrapping, out-of-range or
repeated values, at top level (in the caller's arena, or written by an earlier thunk) or inside a
scan body (in its ``init``, rows of an ``xs`` input, bytes a body thunk computes, or the carry), or
whose bounded knobs (``clip``, ``scale``, ``dt_limit``, activation α/β) are NaN or ±inf.

``check_case`` loads it and, when it validates, runs it: the outcome is acceptable when it is a
``ScheduleError``/``DeviceError``/``RunError``, or a clean run that left the caller's arena unchanged
and wrote no byte outside the union of the thunks' write footprints.
"""
from __future__ import annotations

import base64
import copy
import json
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import yaml

from host_fallback.abi import DTYPES, OPS, footprint, regions

from ..errors import DeviceError, RunError, ScheduleError, brief
from ..schedule.io import load_schedule
from ..schedule.model import ABI_V2, Schedule
from .cases import FEEDS, SMALL, body_case, lay_out, schedule_of

#: Integers that wrap, overflow, sit on a limit or are merely wrong.
INTERESTING = (-1, 0, 1, 2, 3, 4, 7, 8, 16, 255, 4096, 2**31 - 1, 2**31, 2**32, 2**32 + 1, 2**48, 2**48 + 1,
               2**53, 2**62, 2**63 - 1, 2**63, 2**64, 2**64 + 1, 10**30, -2**63)
#: Values of the wrong type (or out of every range).
WRONG = (None, True, False, "x", "12", "", 1.5, float("nan"), float("inf"), -float("inf"), [], {}, [1], [[1, 2]],
         {"a": 1}, 10**400, "é" * 3)
#: A clean run is attempted only below these sizes, body arenas included (larger valid schedules are
#: counted, not run: refusing an arena the machine cannot hold is the device's DeviceError).
RUN_ARENA_BYTES = 1 << 20
RUN_SCAN_STEPS = 1 << 12


@dataclass(frozen=True)
class Case:
    """One fuzz case: ``source`` is what ``load_schedule`` gets; ``mutations`` says what was done."""

    seed: int
    op: str
    source: Any
    mutations: tuple[str, ...]
    data: tuple[tuple[int, bytes], ...] = ()  # (offset, bytes) written into the caller's arena before the run


#: The share of seeds ``make_case`` gives to ``make_data_case``.
DATA_SHARE = 0.2


def make_case(seed: int) -> Case:
    """The case of ``seed`` (the same seed always gives the same case)."""
    rng = random.Random(seed)
    if rng.random() < DATA_SHARE:
        return make_data_case(seed)
    op = rng.choice(list(OPS))
    dtype = rng.choice(OPS[op].dtypes)
    thunk, arena_bytes = lay_out(op, dtype, guard=16)
    sched = copy.deepcopy(schedule_of(thunk, arena_bytes))  # lay_out shares its parameter lists
    done: list[str] = [f"{op} {dtype}"]
    if rng.random() < 0.25:
        _add_views(rng, sched, done)
    if rng.random() < 0.2:
        _add_init(rng, sched, done)
    if rng.random() < 0.12:
        sched = _nest(rng, sched, rng.choice((1, 2, 3, 31, 32, 33, 40)), done)
    for _ in range(rng.choice((0, 1, 1, 1, 2, 2, 3))):
        _mutate(rng, sched, done)
    form = rng.random()
    if form < 0.5:
        return Case(seed, op, sched, tuple(done))
    text = yaml.safe_dump(sched, sort_keys=False) if form < 0.7 else json.dumps(sched)
    done.append("yaml" if form < 0.7 else "json")
    if rng.random() < 0.5:
        return Case(seed, op, _damage_text(rng, text, done), tuple(done))
    return Case(seed, op, text, tuple(done))


#: The ops with integer tensors, and the parameters that give them (lists: their valid values).
_INT_OPS: dict[str, Any] = {
    "selective_scan": lambda rng: rng.choice((_slots, _packed))("selective_scan", rng),
    "mamba2": lambda rng: rng.choice((_slots, _packed))("mamba2", rng),
    "gated_delta_net": lambda rng: rng.choice((_slots, _packed))("gated_delta_net", rng),
    "lstm": lambda rng: _lengths("lstm", rng), "gru": lambda rng: _lengths("gru", rng),
    "rnn": lambda rng: _lengths("rnn", rng),
}
#: Bounded knobs of ABI.md §8 (a fill value is data, not a knob) and how each is given a value.
_KNOBS: dict[str, tuple[tuple[str, Any], ...]] = {
    "lstm": (("clip", lambda v: v), ("activations", lambda v: [["affine", v, 0.5]] * 6),
             ("activations", lambda v: [["scaled_tanh", 1.0, v]] * 6)),
    "gru": (("clip", lambda v: v),), "rnn": (("clip", lambda v: v),),
    "gated_delta_net": (("scale", lambda v: v),),
    "mamba2": (("dt_limit", lambda v: [v, None]), ("dt_limit", lambda v: [0.0, v])),
}
_NON_FINITE = (float("nan"), float("inf"), -float("inf"))


def _slots(op: str, rng: random.Random) -> dict[str, Any]:
    batch = rng.choice((1, 2, 3))
    slots = rng.sample(range(batch + 2), batch)
    state = {} if op == "gated_delta_net" else {"state": True}  # gdn's state is a version-1 offset, always placed
    return dict(SMALL[op], batch=batch, carry_state=True, state_slots=slots, num_slots=batch + 2, **state)


def _packed(op: str, rng: random.Random) -> dict[str, Any]:
    seq = SMALL[op]["seq"]
    cuts = sorted(rng.randint(0, seq) for _ in range(rng.choice((0, 1, 2))))
    return dict(SMALL[op], batch=1, cu_seqlens=[0, *cuts, seq])


def _lengths(op: str, rng: random.Random) -> dict[str, Any]:
    return dict(SMALL[op], seq_lens=[rng.randint(0, SMALL[op]["seq"]) for _ in range(SMALL[op]["batch"])])


def _damage_values(rng: random.Random, values: list[int], params: dict[str, Any], done: list[str]) -> list[int]:
    """``values`` with zero to two entries replaced: wrapping, out of range, repeated, or one off."""
    values = list(values)
    for _ in range(rng.choice((0, 1, 1, 2))):
        i = rng.randrange(len(values))
        bound = params.get("num_slots") or params["seq"]
        value = rng.choice((2**31 - 1, -2**31, -1, bound, bound + 1, values[rng.randrange(len(values))],
                            values[i] + rng.choice((-1, 1))))
        values[i] = (value + 2**31) % 2**32 - 2**31  # as an int32 holds it: 2**31 wraps to -2**31
        done.append(f"value [{i}] = {values[i]}")
    return values


def make_data_case(seed: int) -> Case:
    """A valid schedule of a version-2 thunk with damaged run-time data or a non-finite knob (see the module)."""
    rng = random.Random(seed)
    forward = rng.choice(list(_INT_OPS))
    op = forward + "_backward" if rng.random() < 0.25 else forward
    params = _INT_OPS[forward](rng)
    field = next(f for f in ("state_slots", "cu_seqlens", "seq_lens") if isinstance(params.get(f), list))
    done = [f"{op} {field}"]
    if forward in _KNOBS and rng.random() < 0.3:
        name, given = rng.choice(_KNOBS[forward])
        params[name] = given(rng.choice(_NON_FINITE + (0.5,)))
        done.append(f"knob {name} = {params[name]}")
    rows = [_damage_values(rng, params[field], params, done) for _ in range(3)]
    where = rng.choice(("top", "late") + FEEDS)
    done.append(where)
    if where in FEEDS:
        scan_op = "scan" if where == "carry" else rng.choice(("scan", "scan_backward", "scan_backward_xs"))
        sched, places = body_case(scan_op, op, {**params, field: rows[0]}, where, length=3)
        per_step = 4 * len(rows[0])
        data = tuple((offset + step * per_step, _i32(row)) for offset in places.values()
                     for step, row in enumerate(rows[:1] if where == "carry" else rows))
        return Case(seed, op, sched, tuple(done), data)
    thunk, nbytes = lay_out(op, "f32", params)
    r = next(r for r in regions(thunk) if r.field == field)
    if where == "top":
        return Case(seed, op, dict(schedule_of(thunk, nbytes), abi=ABI_V2), tuple(done), ((r.offset, _i32(rows[0])),))
    source = nbytes  # late: a copy thunk writes the values from an init block just before the thunk reads them
    copy_thunk = dict(op="copy", dtype="f32", src=source, dst=r.offset, nbytes=r.nbytes)
    sched = {"abi": ABI_V2, "arena_bytes": nbytes + r.nbytes, "thunks": [copy_thunk, thunk],
             "init": [{"offset": source, "b64": base64.b64encode(_i32(rows[0])).decode()}]}
    return Case(seed, op, sched, tuple(done))


def _i32(values: list[int]) -> bytes:
    return np.asarray(values, "<i4").tobytes()


def _add_views(rng: random.Random, sched: dict, done: list[str]) -> None:
    thunk = sched["thunks"][0]
    views = {r.field: {"offset": r.offset, "dtype": r.dtype, "shape": list(r.shape)}
             for r in regions(thunk) if r.dtype in DTYPES}
    sched["tensors"] = views
    names = list(views)
    sched["inputs"] = rng.sample(names, k=min(len(names), 2))
    sched["outputs"] = names[-1:]
    done.append("views")


def _add_init(rng: random.Random, sched: dict, done: list[str]) -> None:
    offset = rng.choice((0, 16, 32, sched["arena_bytes"] - 8, sched["arena_bytes"]))
    data = bytes(rng.randrange(256) for _ in range(rng.choice((0, 1, 8, 24))))
    sched["init"] = [{"offset": offset, "b64": base64.b64encode(data).decode()}]
    done.append("init")


def _nest(rng: random.Random, sched: dict, depth: int, done: list[str]) -> dict:
    """Wrap ``sched`` in ``depth`` scans of length 1 whose carry sits in place at byte 0."""
    for _ in range(depth):
        body = dict(sched)
        body.pop("abi")
        scan = dict(op="scan", dtype="f32", body=body, body_input_off=0, body_output_off=0, outer_init_off=0,
                    outer_final_off=0, length=1, carry_bytes=8, save_trajectory=False, xs_inputs=[],
                    bcast_inputs=[], num_checkpoints=0)
        sched = schedule_of(scan, 64)
    done.append(f"nested {depth}")
    return sched


def _containers(node: Any, out: list, depth: int = 0) -> list:
    """Every (container, key) below ``node``, bodies included (to a bounded depth)."""
    if depth > 48:
        return out
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in list(items):
        out.append((node, key))
        if isinstance(value, (dict, list)):
            _containers(value, out, depth + 1)
    return out


def _mutate(rng: random.Random, sched: dict, done: list[str]) -> None:
    slots = _containers(sched, [])
    container, key = rng.choice(slots)
    value = container[key]
    kind = rng.choice(("delete", "wrong", "int", "int", "int", "overlap", "overlap", "extra", "arena", "alias"))
    if kind == "delete" and isinstance(container, dict):
        del container[key]
    elif kind == "wrong":
        container[key] = rng.choice(WRONG)
    elif kind == "int" or (kind == "delete" and isinstance(value, int)):
        ints = [(c, k) for c, k in slots if isinstance(c[k], int) and not isinstance(c[k], bool)]
        if not ints:
            return
        container, key = rng.choice(ints)
        old = container[key]
        if abs(old) > 2**64:  # a 10**400 from WRONG: keep it
            return
        container[key] = rng.choice((rng.choice(INTERESTING), old + rng.randint(-64, 64), old * 2, old // 2,
                                     old + rng.choice((1, 2, 4, 8)), -old))
    elif kind == "overlap":
        offsets = [(c, k) for c, k in slots if isinstance(k, str) and (k in ("x", "dst", "src", "a", "b", "c", "q", "k",
                   "v", "g", "beta", "state", "h0", "c0", "delta", "dt", "w_ih", "w_hh", "bias", "b_ih", "b_hh")
                   or k.endswith("_off")) and isinstance(c[k], int)]
        if len(offsets) < 2:
            return
        (c1, k1), (c2, k2) = rng.sample(offsets, 2)
        c1[k1] = c2[k2] + rng.choice((0, 0, 2, 4, 8, -4))
    elif kind == "extra" and isinstance(container, dict):
        container[rng.choice(("colour", "op", "dtype", "meta", "abi"))] = rng.choice(WRONG + INTERESTING)
    elif kind == "arena":
        old = sched.get("arena_bytes")
        smaller = old - rng.randint(1, 64) if isinstance(old, int) else 0
        sched["arena_bytes"] = rng.choice((rng.choice(INTERESTING), smaller))
    elif kind == "alias" and isinstance(sched.get("thunks"), list) and sched["thunks"]:
        sched["thunks"] = sched["thunks"] + [sched["thunks"][0]] * rng.choice((1, 2, 100))
    done.append(f"{kind} {brief(key, 30)}")


def _alias_bomb(levels: int = 9) -> list:
    node: list = ["xxxxxxxx"] * 6
    for _ in range(levels):
        node = [node] * 9
    return node


def _damage_text(rng: random.Random, text: str, done: list[str]) -> Any:
    kind = rng.choice(("truncate", "salt", "duplicate", "bytes", "brackets", "bomb"))
    done.append(kind)
    if kind == "truncate":
        return text[: rng.randrange(len(text) + 1)]
    if kind == "salt":
        at = rng.randrange(len(text) + 1)
        return text[:at] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 8))).decode("latin-1") + text[at:]
    if kind == "duplicate":
        if text.startswith("{"):
            text = text.replace('"op": ', '"dtype": "f32", "op": ', 1)
            return text.replace("{", '{"thunks": [], ', rng.randint(0, 1))
        return "arena_bytes: 64\n" + text
    if kind == "bytes":
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 600)))
    if kind == "brackets":
        return rng.choice(("[", "{\"a\":", "- ", "{")) * rng.choice((100, 1000, 5000, 100_000))
    return yaml.safe_dump({"abi": "rlx-thunks/1", "arena_bytes": 64, "meta": _alias_bomb(),
                           "thunks": [{"op": "fill", "dtype": "f32", "dst": _alias_bomb(), "n": 1, "value": 0}]})


def _bodies(schedule: Schedule) -> list[tuple[int, Schedule]]:
    """``(length, body)`` of every scan body directly inside ``schedule``."""
    return [(t["length"], body) for t in schedule.thunks for body in
            (t.fields.get(name) for name in ("body", "body_vjp", "forward_body")) if isinstance(body, Schedule)]


def _scan_steps(schedule: Schedule) -> int:
    return sum(length * (1 + _scan_steps(body)) for length, body in _bodies(schedule))


def _arena_bytes(schedule: Schedule) -> int:
    """The outer arena plus the largest body arena held with it, at every level."""
    return schedule.arena_bytes + max((_arena_bytes(body) for _, body in _bodies(schedule)), default=0)


def check_case(case: Case, device: Any) -> tuple[str, str | None]:
    """``(outcome, problem)``: outcome is ``refused``, ``ran`` or ``not run`` (valid but over the run
    sizes); ``problem`` is ``None`` when the outcome is acceptable, else what went wrong."""
    try:
        schedule = load_schedule(copy.deepcopy(case.source) if isinstance(case.source, dict) else case.source)
    except ScheduleError as err:
        message = str(err)
        return "refused", None if len(message) < 1200 else f"a {len(message)}-character message"
    except Exception as err:  # noqa: BLE001 - any other exception is the finding
        return "crashed", f"load_schedule raised {type(err).__name__}: {brief(str(err), 200)}"
    if _arena_bytes(schedule) > RUN_ARENA_BYTES or _scan_steps(schedule) > RUN_SCAN_STEPS:
        return "not run", None
    arena = np.random.default_rng(case.seed).integers(0, 256, schedule.arena_bytes, dtype=np.uint8)
    for offset, data in case.data:
        arena[offset: offset + len(data)] = np.frombuffer(data, np.uint8)
    before = arena.copy()
    try:
        with np.errstate(all="ignore"):
            out = device.run(schedule, arena)
    except (ScheduleError, DeviceError, RunError):
        if not np.array_equal(arena, before):
            return "refused", "the caller's arena changed"
        return "refused", None
    except Exception as err:  # noqa: BLE001
        return "crashed", f"run raised {type(err).__name__}: {brief(str(err), 200)}"
    if not np.array_equal(arena, before):
        return "ran", "the caller's arena changed"
    expected = before.copy()
    schedule.apply_init(expected)
    outside = np.ones(schedule.arena_bytes, dtype=bool)
    for thunk in schedule.thunks:
        for r in footprint(thunk)[1]:
            outside[r.offset: r.offset + r.nbytes] = False
    wrong = np.flatnonzero(outside & (out != expected))
    if wrong.size:
        return "ran", f"{wrong.size} bytes written outside the write footprint (first at {wrong[0]})"
    return "ran", None
