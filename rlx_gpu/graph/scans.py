"""The scan family in the builder: ``scan`` fields (ABI.md §6) and ``scan_grad`` from one body.

``scan_grad`` runs the forward scan saving its trajectory (every step, or ``num_checkpoints`` rows
that the backward thunks recompute from with ``forward_body``), then one ``scan_backward`` for the
gradient of the initial carry and one ``scan_backward_xs`` per per-step input. A broadcast input has
no per-step slot in the backward thunks, so it is tiled to ``[length, ...]`` there and its gradient is
the sum of the per-step ones.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from host_fallback.abi import ELEM_SIZE

from ..errors import GraphError
from .autodiff import vjp
from .nodes import BodyGraph, Slot, Tensor


def _body_io(body: BodyGraph, n_inputs: int) -> tuple[list[Tensor], Tensor]:
    """The body's inputs (carry first) and its one output, checked against what the scan passes."""
    ins = list(body.inputs.values())
    if len(ins) != n_inputs:
        raise GraphError(f"scan: the body declares {len(ins)} inputs ({', '.join(body.inputs)}), the scan passes "
                         f"{n_inputs} (the carry, one row of each xs input, each bcast input)")
    if len(body.outputs) != 1:
        raise GraphError(f"scan: the body must have one output (the next carry), it has {list(body.outputs)}")
    (out,) = body.outputs.values()
    if (out.shape, out.dtype) != (ins[0].shape, ins[0].dtype):
        raise GraphError(f"scan: the body's output {out!r} must match its carry input {ins[0]!r}")
    return ins, out


def scan_fields(g: BodyGraph, body: BodyGraph, init: Any, xs: Sequence[Any], bcast: Sequence[Any], length: int | None,
                save_trajectory: bool, num_checkpoints: int) -> tuple[dict[str, Any], int]:
    """A scan node's fields (all but ``outer_final_off``) and the rows of its trajectory."""
    init, xs, bcast = g._t(init), [g._t(x) for x in xs], [g._t(b) for b in bcast]
    ins, out = _body_io(body, 1 + len(xs) + len(bcast))
    if length is None:
        if not xs:
            raise GraphError("scan: without xs inputs, give length")
        length = xs[0].shape[0]
    if length < 1:
        raise GraphError(f"scan: length must be >= 1, got {length}")
    checks = [("init", init, ins[0].shape, ins[0])]
    checks += [(f"xs[{i}]", x, (length, *s.shape), s) for i, (x, s) in enumerate(zip(xs, ins[1:]))]
    checks += [(f"bcast[{i}]", b, s.shape, s) for i, (b, s) in enumerate(zip(bcast, ins[1 + len(xs):]))]
    for what, t, shape, slot in checks:
        if t.shape != shape or t.dtype != slot.dtype:
            raise GraphError(f"scan: {what} {t!r} must be {list(shape)} {slot.dtype} for body input {slot!r}")
    k = num_checkpoints
    if not 0 <= k <= length:
        raise GraphError(f"scan: num_checkpoints {k} must lie in 0..length ({length})")
    if 0 < k < length and not save_trajectory:
        raise GraphError(f"scan: {k} checkpoints of {length} steps need save_trajectory=True")
    fields = {
        "body": body, "body_input_off": Slot(body, ins[0]), "body_output_off": Slot(body, out),
        "outer_init_off": init, "length": length, "carry_bytes": init.nbytes,
        "save_trajectory": bool(save_trajectory),
        "xs_inputs": [[Slot(body, s), x, s.nbytes] for x, s in zip(xs, ins[1:])],
        "bcast_inputs": [[Slot(body, s), b, b.nbytes] for b, s in zip(bcast, ins[1 + len(xs):])],
        "num_checkpoints": k,
    }
    return fields, k if 0 < k < length else length


def scan(g: BodyGraph, body: BodyGraph, init: Any, xs: Sequence[Any] = (), bcast: Sequence[Any] = (), *,
         length: int | None = None, save_trajectory: bool = False, num_checkpoints: int = 0) -> Tensor:
    """Emit a scan thunk into ``g`` and return its result: see ``Graph.scan``."""
    fields, rows = scan_fields(g, body, init, xs, bcast, length, save_trajectory, num_checkpoints)
    carry = fields["outer_init_off"]
    out = g._new((rows, *carry.shape) if save_trajectory else carry.shape, carry.dtype)
    fields["outer_final_off"] = out
    g._emit("scan", carry.dtype, fields, out)
    return out


class ScanGrads(NamedTuple):
    """Gradients of a scan's result with respect to its inputs, and the forward trajectory."""

    d_init: Tensor
    d_xs: tuple[Tensor, ...]
    d_bcast: tuple[Tensor, ...]
    trajectory: Tensor


def scan_grad(g: BodyGraph, body: BodyGraph, init: Any, xs: Sequence[Any] = (), bcast: Sequence[Any] = (), *,
              d_final: Any = None, d_traj: Any = None, num_checkpoints: int = 0,
              length: int | None = None) -> ScanGrads:
    """Pull back ``d_final`` (the final carry's gradient) or ``d_traj`` (every step's) through a scan.

    Returns the gradients of ``init``, every xs input and every bcast input. Outputs the caller does
    not mark are pruned at lowering, with the backward thunks that would compute them.
    """
    init, xs, bcast = g._t(init), [g._t(x) for x in xs], [g._t(b) for b in bcast]
    if length is None and not xs:
        raise GraphError("scan_grad: without xs inputs, give length")
    length = xs[0].shape[0] if length is None else length
    traj = scan(g, body, init, xs, bcast, length=length, save_trajectory=True, num_checkpoints=num_checkpoints)
    if (d_final is None) == (d_traj is None):
        raise GraphError("scan_grad: give exactly one of d_final (the final carry's gradient) and d_traj")
    upstream = g._t(d_final if d_traj is None else d_traj)
    want = init.shape if d_traj is None else (length, *init.shape)
    if upstream.shape != want or upstream.dtype != init.dtype:
        raise GraphError(f"scan_grad: the upstream gradient {upstream!r} must be {list(want)} {init.dtype}")
    per_step = xs + [g.broadcast_to(b, (length, *b.shape)) for b in bcast]
    ins, out = _body_io(body, 1 + len(per_step))
    k = num_checkpoints
    recompute = 0 < k < length
    common = {
        "outer_init_off": init, "outer_traj_off": traj, "outer_upstream_off": upstream,
        "outer_xs_offs": [[x, x.nbytes // length] for x in per_step], "length": length,
        "carry_bytes": init.nbytes, "carry_elem_size": ELEM_SIZE[init.dtype],
        "save_trajectory": d_traj is not None, "num_checkpoints": k,
        "forward_body": body if recompute else None,
        "forward_body_carry_in_off": Slot(body, ins[0]) if recompute else 0,
        "forward_body_output_off": Slot(body, out) if recompute else 0,
        "forward_body_x_offs": [Slot(body, s) for s in ins[1:]] if recompute else [],
    }

    def vjp_fields(wrt: int | None) -> dict[str, Any]:
        vg = vjp(body, wrt)
        vin = list(vg.inputs.values())
        fields = {"body_vjp": vg, "body_carry_in_off": Slot(vg, vin[0]),
                  "body_x_offs": [Slot(vg, s) for s in vin[1:-1]], "body_d_output_off": Slot(vg, vin[-1]),
                  "body_dcarry_out_off": Slot(vg, vg.outputs["dcarry"]), **common}
        return fields if wrt is None else {**fields, "body_dxs_out_off": Slot(vg, vg.outputs["dx"])}

    d_init = g._new(init.shape, init.dtype)
    g._emit("scan_backward", init.dtype, {**vjp_fields(None), "outer_dinit_off": d_init}, d_init)
    grads = []
    for j, x in enumerate(per_step):
        dx = g._new(x.shape, x.dtype)
        g._emit("scan_backward_xs", init.dtype, {**vjp_fields(j), "xs_idx": j, "outer_dxs_off": dx,
                                                 "per_step_bytes": x.nbytes // length}, dx)
        grads.append(dx)
    d_bcast = tuple(g.reduce_sum(d, 0) for d in grads[len(xs):])
    return ScanGrads(d_init, tuple(grads[:len(xs)]), d_bcast, traj)
