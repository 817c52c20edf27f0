"""``Graph.mamba3`` (ABI.md §11): Mamba-3 SISO in the builder, with its build-time checks.

A mixin of ``builder.Graph`` beside ``SequenceOps`` (whose ``_expect``/``_packed`` it uses); its backward is
``SequenceOps.backward``, as every fused op's.
"""
from __future__ import annotations

from typing import Any, Sequence

from host_fallback.abi.mamba3 import STATES, state_dtype_default

from ..errors import GraphError
from .nodes import Tensor
from .registry import BUILDERS
from .sequence_ops import SequenceOps


class Mamba3Ops(SequenceOps):
    """The ``mamba3`` op for ``Graph``."""

    @BUILDERS.register("mamba3")
    def mamba3(self, q: Any, k: Any, v: Any, adt: Any, dt: Any, trap: Any, angles: Any, *, q_bias: Any = None,
               k_bias: Any = None, D: Any = None, z: Any = None, initial_states: Sequence[Any] | None = None,
               cu_seqlens: Any = None, state_slots: Any = None, name: str | None = None) -> Any:
        """Mamba-3 SISO, mamba_ssm's ``mamba3_siso_combined`` in token-major layout: per head, with
        ``λ = σ(trap)``, the angle ``θ += π·tanh(angles)·dt``, ``q̃, k̃`` the biased q, k turned pairwise by θ,
        ``S = e^{adt}·S + (1−λ)·dt·e^{adt}·v̄⊗k̄ + λ·dt·v⊗k̃``, ``y = S·q̃``, then ``y = (y + D·v)⊙silu(z)``,
        and ``k̄, v̄ = k̃, v``.

        ``q, k [B,S,G,N]`` (head ``h`` reads group ``h // (H/G)``), ``v, z [B,S,H,P]``, ``adt, dt, trap [B,S,H]``
        and ``angles [B,S,H,A]`` (one element type, f32 or f64 beside 16-bit activations), ``q_bias, k_bias
        [H,N]`` and ``D [H]`` (one element type). ``initial_states``: ``(angle [R,H,A], ssm [R,H,P,N], k [R,H,N],
        v [R,H,P])`` in f32 or f64 (one type; f32 default, f64 for f64), starting each row; the final states
        are returned too, ``(y, states)``, and output ``{name}.angle_state`` ... ``{name}.v_state``.
        ``cu_seqlens`` (i32 ``[R+1]``, batch 1) packs R sequences along S; ``state_slots`` (i32 ``[R]``) makes
        the states pools of entries, row ``r`` using entry ``state_slots[r]``.
        """
        op = "mamba3"
        q, k, v, adt = (self._t(a) for a in (q, k, v, adt))
        dt, trap, angles = (self._t(a, adt.dtype) for a in (dt, trap, angles))
        if len(q.shape) != 4 or len(v.shape) != 4 or len(angles.shape) != 4:
            raise GraphError(f"{op}: q {q!r} must be [B,S,G,N], v {v!r} [B,S,H,P] and angles {angles!r} [B,S,H,A]")
        (bt, s, h, p), (groups, n), a = v.shape, q.shape[2:], angles.shape[3]
        if groups < 1 or h % groups:
            raise GraphError(f"{op}: {groups} groups of q {q!r} do not divide the {h} heads of v")
        for field, t, shape in (("k", k, q.shape), ("adt", adt, (bt, s, h))):
            self._expect(op, field, t, shape, q.dtype if field == "k" else adt.dtype)
        for field, t in (("dt", dt), ("trap", trap)):
            self._expect(op, field, t, (bt, s, h), adt.dtype)
        self._expect(op, "v", v, (bt, s, h, p), q.dtype)
        self._expect(op, "angles", angles, (bt, s, h, a), adt.dtype)
        fields: dict[str, Any] = {} if adt.dtype == q.dtype else {"dt_dtype": adt.dtype}
        fields.update(self._mamba3_params(q, h, n, q_bias, k_bias, D))
        if z is not None:
            fields["z"] = self._t(z, q.dtype)
            self._expect(op, "z", fields["z"], v.shape, q.dtype)
        if h != groups:
            fields["groups"] = groups
        packed, rows = self._packed(op, v, bt, cu_seqlens)
        fields.update(packed)
        finals = self._mamba3_states(q.dtype, rows, (h, a, p, n), initial_states, state_slots, fields)
        y = self._new(v.shape, q.dtype)
        self._emit(op, q.dtype, {"q": q, "k": k, "v": v, "adt": adt, "dt": dt, "trap": trap, "angles": angles,
                                 "dst": y, "batch": bt, "seq": s, "heads": h, "head_dim": p, "state_size": n,
                                 "num_angles": a, **fields}, y, *finals)
        if not finals:
            return y
        label = name or f"mamba3_{next(self._ids)}"
        for field, final in zip(STATES, finals):
            self.output(f"{label}.{field}", final)
        return y, tuple(finals)

    def _mamba3_params(self, q: Tensor, heads: int, n: int, q_bias: Any, k_bias: Any, d: Any) -> dict[str, Any]:
        """The per-head parameters given, in one element type (``param_dtype`` where it is not q's)."""
        given = {f: v for f, v in (("q_bias", q_bias), ("k_bias", k_bias), ("d", d)) if v is not None}
        fields: dict[str, Any] = {}
        dtype = None
        for field, value in given.items():
            t = fields[field] = self._t(value, dtype)
            dtype = dtype or t.dtype
            self._expect("mamba3", field, t, (heads,) if field == "d" else (heads, n), dtype)
        if dtype is not None and dtype != q.dtype:
            fields["param_dtype"] = dtype
        return fields

    def _mamba3_states(self, dtype: str, rows: int, sizes: tuple[int, int, int, int], initial: Sequence[Any] | None,
                       state_slots: Any, fields: dict[str, Any]) -> list[Tensor]:
        """The four carried states as copies the thunk updates in place (none without ``initial``), and their
        fields (``carry_state``, the slots, ``state_dtype`` where not the default) added to ``fields``."""
        if initial is None:
            if state_slots is not None:
                raise GraphError("mamba3: state_slots needs initial_states, the pools the slots index")
            return []
        if len(initial) != 4:
            raise GraphError(f"mamba3: initial_states holds {len(initial)} tensors, expected 4 (angle, ssm, k, v)")
        h, a, p, n = sizes
        default = state_dtype_default({"dtype": dtype})
        states = [self._t(value, default) for value in initial]
        pool = states[0].shape[0] if state_slots is not None and states[0].shape else rows
        for field, t, shape in zip(STATES, states, ((h, a), (h, p, n), (h, n), (h, p))):
            self._expect("mamba3", f"initial_states ({field})", t, (pool, *shape), states[0].dtype)
        if state_slots is not None:
            slots = self._t(state_slots, "i32")
            self._expect("mamba3", "state_slots", slots, (rows,), "i32")
            fields.update(state_slots=slots, num_slots=pool)
        if states[0].dtype != default:
            fields["state_dtype"] = states[0].dtype
        finals = [self.copy(t) for t in states]
        fields.update(carry_state=True, **dict(zip(STATES, finals)))
        return finals
