"""ABI.md §8's carried state, shared by selective_scan, mamba2 and gated_delta_net: its fields, its
regions and its cross-field rules (packed sequences, a pool of state slots, the state's element type)."""
from __future__ import annotations

from . import int_tensors
from .model import ELEM_SIZE, Region, Thunk, fail, newer, same

#: The §8 fields of every state op (``state`` itself aside: gated_delta_net has it in version 1).
STATE_FIELDS = (newer("state_dtype", "dtype", same("dtype")), newer("cu_seqlens", "opt_offset", None),
                newer("num_seqs", "pos", 0), newer("state_slots", "opt_offset", None), newer("num_slots", "pos", 0))
#: selective_scan and mamba2: a state carried only when asked (``carry_state``), and the parameters' type.
CARRIED_FIELDS = (newer("carry_state", "bool", False), newer("state", "opt_offset", None),
                  newer("param_dtype", "dtype", same("dtype")))
#: The run-time data rules of the state ops' integer tensors.
DATA_RULES = {"cu_seqlens": int_tensors.cu_seqlens, "state_slots": int_tensors.state_slots}


def state_rows(t: Thunk) -> int:
    """Rows of a carried state tensor: the slot pool, else one per sequence (varlen), else one per batch row."""
    if t.get("state_slots") is not None:
        return t["num_slots"]
    if t.get("cu_seqlens") is not None:
        return t["num_seqs"]
    return t["batch"]


def state_regions(t: Thunk, shape: tuple[int, ...]) -> list[Region]:
    """The §8 runtime-data and carried-state regions of a completed thunk; ``shape``: one row of the state."""
    return carried_regions(t, {"state": shape})


def carried_regions(t: Thunk, shapes: dict[str, tuple[int, ...]]) -> list[Region]:
    """The §8 runtime-data regions of a completed thunk, then (with ``carry_state``) one read-write region per
    carried state field of ``shapes`` (field -> one row of it), all in ``state_dtype``."""
    out = []
    if t["cu_seqlens"] is not None:
        out.append(Region("cu_seqlens", t["cu_seqlens"], (t["num_seqs"] + 1,), "i32", "r"))
    if t["state_slots"] is not None:
        rows = t["num_seqs"] if t["cu_seqlens"] is not None else t["batch"]
        out.append(Region("state_slots", t["state_slots"], (rows,), "i32", "r"))
    if t["carry_state"]:
        out += [Region(field, t[field], (state_rows(t),) + shape, t["state_dtype"], "rw")
                for field, shape in shapes.items()]
    return out


def optional_regions(t: Thunk, fields: tuple[str, ...], shape: tuple[int, ...], dtype: str) -> list[Region]:
    """The optional inputs of ``fields`` a thunk gives, each of ``shape``."""
    return [Region(f, t[f], shape, dtype, "r") for f in fields if t[f] is not None]


def divides(t: Thunk, field: str, whole: str) -> None:
    if field in t and t[whole] % t[field]:
        raise fail(t, field, f"{t[field]} does not divide {whole} = {t[whole]}")


def wide_enough(t: Thunk, field: str) -> None:
    """``state_dtype`` / ``param_dtype``: the thunk's dtype, f32 or f64, at least as wide as the thunk's."""
    if field not in t:
        return
    chosen, dtype = t[field], t["dtype"]
    if chosen not in (dtype, "f32", "f64") or ELEM_SIZE[chosen] < ELEM_SIZE[dtype]:
        allowed = ", ".join(dict.fromkeys(d for d in (dtype, "f32", "f64") if ELEM_SIZE[d] >= ELEM_SIZE[dtype]))
        raise fail(t, field, f"{chosen} cannot hold a {dtype} thunk's values; expected one of {allowed}")


def _paired(t: Thunk, tensor: str, count: str) -> None:
    """An integer tensor and its count come together (``cu_seqlens`` + ``num_seqs``, ``state_slots`` + ``num_slots``)."""
    has_tensor, has_count = t.get(tensor) is not None, count in t
    if has_tensor and not has_count:
        raise fail(t, count, f"missing: {tensor} needs {count}")
    if has_count and not has_tensor:
        raise fail(t, count, f"given without {tensor}")


def check_state(t: Thunk) -> None:
    """The §8 rules shared by selective_scan, mamba2 and gated_delta_net (on the fields given)."""
    _paired(t, "cu_seqlens", "num_seqs")
    _paired(t, "state_slots", "num_slots")
    if t.get("cu_seqlens") is not None and t["batch"] != 1:
        raise fail(t, "cu_seqlens", f"packed sequences need batch = 1, got batch = {t['batch']}")
    if t.get("state_slots") is not None and not t.get("carry_state"):
        raise fail(t, "state_slots", "state slots need carry_state = true (a pool of carried states)")
    wide_enough(t, "state_dtype")


def check_carried(t: Thunk) -> None:
    """selective_scan and mamba2: ``state`` is present exactly when ``carry_state`` is true."""
    carry, state = t.get("carry_state", False), t.get("state")
    if carry and state is None:
        raise fail(t, "state", "missing: carry_state = true needs the state offset")
    if state is not None and not carry:
        raise fail(t, "state", "given without carry_state = true")
    wide_enough(t, "param_dtype")
    check_state(t)


