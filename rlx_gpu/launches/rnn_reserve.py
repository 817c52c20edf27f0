"""The recurrent ops' saved forward (ABI.md §9.1, docs/abi.md 6a.1) as the launches see it: where its arrays lie
in the arena (``reserve_slots``, the host's layout), the step kernels' arguments naming them, and rnn_reorder, which
moves rows between the batch-major order of the kernels' buffers and the reserve's time-major one."""
from __future__ import annotations

from host_fallback.abi.rnn import reserve_slots

from .arguments import kernel_launch
from .core import ARENA, Buf, Launch, Thunk, linear_local, strided_grid
from .limits import DeviceLimits


def saved_forward(t: Thunk) -> dict[tuple[str, int], tuple[Buf, int]]:
    """The arena places of the saved forward's arrays (ABI.md §9.1, ``reserve_slots``) by ``(name, index)``: a
    layer-direction's block starts at its ``y``, its clip's mask at ``mask``, a layer's output at ``out``. Empty
    without a reserve."""
    if t.get("reserve") is None:
        return {}
    return {(s.name, s.index): (ARENA, t["reserve"] + s.offset) for s in reserve_slots(t)}


def saved_args(saved: dict[tuple[str, int], tuple[Buf, int]], ld: int) -> dict[str, tuple[Buf, int]]:
    """The step kernels' saved-forward arguments from layer-direction ``ld`` on (``sv``: its block, ``mk``: its
    mask; unread without a reserve)."""
    none = (ARENA, 0)
    return {"svb": saved.get(("y", ld), none), "mkb": saved.get(("mask", ld), none)}


def add_reorder(launches: list[Launch], t: Thunk, lim: DeviceLimits, defines: tuple, width: int, to_time: bool,
                batch: int, src: tuple[tuple[Buf, int], int], dst: tuple[tuple[Buf, int], int]) -> None:
    """Append rnn_reorder (kernels/rnn.cl, the forward program ``defines``) of the completed thunk ``t`` (forward
    or backward) to ``launches``: ``batch`` blocks of rows of ``width`` reals, batch-major to time-major
    (``to_time``) or back; ``src``, ``dst``: ``((buffer, offset), block stride in reals)``."""
    local = (linear_local(width, 64), 1, 1)
    size = strided_grid((width, t["batch"], batch), local, lim.max_grid)
    launches.append(kernel_launch("rnn", "rnn_reorder", t["dtype"], size, local,
                                  dict(B=t["batch"], S=t["seq"], w=width, to_time=to_time, batch=batch, sb=src[0],
                                       s_bs=src[1], db=dst[0], d_bs=dst[1], lb=(ARENA, t["seq_lens"] or 0)),
                                  target=lim.target, defines=defines))
