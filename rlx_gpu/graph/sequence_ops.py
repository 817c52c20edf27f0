"""The recurrent and state-space ops of the Graph builder (ABI.md §3-§4), with their build-time checks: the
state-space ops and every fused op's backward here, lstm, gru and rnn in ``recurrent_ops``.

A mixin of ``builder.Graph``: it uses the graph's ``_t``/``_new``/``_emit``/``copy``/``output``.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from host_fallback.abi import BACKWARD, ELEM_SIZE, FORWARD_OPS, OPS, gradient

from ..errors import GraphError
from .nodes import Node, Tensor
from .recurrent_ops import RecurrentOps
from .registry import BUILDERS


#: The carried-state fields of each differentiable op (its definition's ``states``), whose gradients a
#: backward op reads and writes in place.
STATE_FIELDS: dict[str, tuple[str, ...]] = {op: OPS[op].states for op in FORWARD_OPS}


class SequenceOps(RecurrentOps):
    """The fused sequence ops for ``Graph``: lstm, gru and rnn (``RecurrentOps``), selective_scan, mamba2 and
    gated_delta_net, and the backward op of each."""

    def _expect(self, op: str, field: str, t: Tensor, shape: Sequence[int], dtype: str) -> None:
        if t.shape != tuple(shape):
            raise GraphError(f"{op}: {field} {t!r} has shape {list(t.shape)}, expected {list(shape)}")
        if t.dtype != dtype:
            raise GraphError(f"{op}: {field} {t!r} is {t.dtype}, expected {dtype} like the op's other tensors")

    def _state_space(self, op: str, x: Tensor, rows: int, params: dict[str, Any], z: Any, initial_state: Any,
                     state_shape: tuple[int, ...], cu_seqlens: Any, state_slots: Any, state_dtype: str | None,
                     name: str | None) -> tuple[dict[str, Any], Tensor | None]:
        """The ABI.md §8 fields of a selective_scan or mamba2 thunk that the caller uses, and the final
        state tensor (``None`` without ``initial_state``). A field left at its default is left out, so a
        graph without them lowers to version 1.

        ``params`` are the per-channel (per-head) parameters, ``a`` first: their element type is ``a``'s,
        the thunk's ``param_dtype``. ``rows`` is the batch, or the sequence count with ``cu_seqlens``.
        """
        fields: dict[str, Any] = {}
        a = params.pop("a")
        if a.dtype != x.dtype:
            fields["param_dtype"] = a.dtype
        for field, value in params.items():
            if value is not None:
                fields[field] = self._t(value, a.dtype)
                self._expect(op, field, fields[field], a.shape[:1], a.dtype)
        if z is not None:
            fields["z"] = self._t(z, x.dtype)
            self._expect(op, "z", fields["z"], x.shape, x.dtype)
        packed, rows = self._packed(op, x, rows, cu_seqlens)
        fields.update(packed)
        carried, final = self._carried(op, x, rows, initial_state, state_shape, state_slots, state_dtype)
        fields.update(carried)
        if final is not None:
            fields.update(carry_state=True, state=final)
            self.output(f"{name or f'{op}{next(self._ids)}'}.state", final)
        return fields, final

    def _packed(self, op: str, x: Tensor, rows: int, cu_seqlens: Any) -> tuple[dict[str, Any], int]:
        """``cu_seqlens`` and ``num_seqs`` when sequences are packed (``x`` of batch 1), and the state rows:
        the sequences, else ``rows`` (the batch)."""
        if cu_seqlens is None:
            return {}, rows
        cu = self._t(cu_seqlens, "i32")
        if x.shape[0] != 1 or len(cu.shape) != 1 or cu.shape[0] < 2 or cu.dtype != "i32":
            raise GraphError(f"{op}: cu_seqlens {cu!r} must be i32 [num_seqs+1] with {x!r} of batch 1; "
                             f"pack the sequences along the sequence axis")
        return {"cu_seqlens": cu, "num_seqs": cu.shape[0] - 1}, cu.shape[0] - 1

    def _carried(self, op: str, x: Tensor, rows: int, initial_state: Any, state_shape: tuple[int, ...],
                 state_slots: Any, state_dtype: str | None) -> tuple[dict[str, Any], Tensor | None]:
        """The slot and ``state_dtype`` fields of a carried ``initial_state`` (``[rows, *state_shape]``, or a
        pool of entries with ``state_slots``), and the tensor the thunk updates in place: a copy, so the
        caller's stays intact (``None`` without a state)."""
        if initial_state is None:
            if state_slots is not None:
                raise GraphError(f"{op}: state_slots needs initial_state, the pool the slots index")
            return {}, None
        state = self._t(initial_state, state_dtype or x.dtype)
        if state_dtype is not None and state.dtype != state_dtype:
            raise GraphError(f"{op}: initial_state {state!r} is {state.dtype}, but state_dtype={state_dtype!r}")
        pool = state.shape[0] if state_slots is not None and state.shape else rows
        self._expect(op, "initial_state", state, (pool, *state_shape), state.dtype)
        fields: dict[str, Any] = {}
        if state_slots is not None:
            slots = self._t(state_slots, "i32")
            self._expect(op, "state_slots", slots, (rows,), "i32")
            fields.update(state_slots=slots, num_slots=pool)
        if state.dtype != x.dtype:
            fields["state_dtype"] = state.dtype
        return fields, self.copy(state)

    @BUILDERS.register("selective_scan")
    def selective_scan(self, x: Any, delta: Any, a: Any, b: Any, c: Any, *, D: Any = None, z: Any = None,
                       delta_bias: Any = None, delta_softplus: bool = False, initial_state: Any = None,
                       cu_seqlens: Any = None, state_slots: Any = None, state_dtype: str | None = None,
                       param_dtype: str | None = None, name: str | None = None) -> Any:
        """Mamba-1, mamba_ssm's ``selective_scan_fn`` in batch-major layout: per channel
        ``h = exp(delta·a)⊙h + delta·b·x``, ``y = Σ_n c·h``, then ``y = (y + D⊙x)⊙silu(z)``.

        ``x, delta [B,S,H]``, ``a [H,N]``; ``b, c [B,S,N]``, or ``[B,S,G,N]`` for ``G`` groups of
        channels (channel ``ch`` reads group ``ch // (H/G)``). ``D``, ``delta_bias [H]`` and ``a`` share
        one element type (``param_dtype`` for arrays given as NumPy values; f32 beside bf16 activations,
        as mamba_ssm keeps them); ``delta`` is biased, then softplus-ed with ``delta_softplus``.
        ``initial_state [R,H,N]`` (in ``state_dtype``, default ``x``'s) starts each row and the final
        states are returned too, ``(y, state)``, and output ``{name}.state``. ``cu_seqlens`` (i32
        ``[R+1]``, batch 1) packs R sequences along S, each from its own state; ``state_slots`` (i32
        ``[R]``) makes ``initial_state`` a pool of entries, row ``r`` using entry ``state_slots[r]``.
        """
        x, delta, b, c = (self._t(v) for v in (x, delta, b, c))
        a = self._t(a, param_dtype)
        if len(x.shape) != 3 or len(a.shape) != 2 or len(b.shape) not in (3, 4):
            raise GraphError(f"selective_scan: x {x!r} must be [B,S,H], a {a!r} [H,N] and b {b!r} [B,S,N] or "
                             f"[B,S,G,N]")
        (bt, s, h), n = x.shape, a.shape[1]
        groups = b.shape[2] if len(b.shape) == 4 else 1
        if h % groups:
            raise GraphError(f"selective_scan: {groups} groups of b {b!r} do not divide the {h} channels of x")
        bc = (bt, s, n) if len(b.shape) == 3 else (bt, s, groups, n)
        for field, t, shape in (("delta", delta, (bt, s, h)), ("b", b, bc), ("c", c, bc)):
            self._expect("selective_scan", field, t, shape, x.dtype)
        self._expect("selective_scan", "a", a, (h, n), param_dtype or a.dtype)
        extra, final = self._state_space("selective_scan", x, bt, {"a": a, "d": D, "delta_bias": delta_bias}, z,
                                         initial_state, (h, n), cu_seqlens, state_slots, state_dtype, name)
        if groups > 1:
            extra["groups"] = groups
        if delta_softplus:
            extra["delta_softplus"] = True
        y = self._new(x.shape, x.dtype)
        self._emit("selective_scan", x.dtype, {"x": x, "delta": delta, "a": a, "b": b, "c": c, "dst": y,
                                               "batch": bt, "seq": s, "hidden": h, "state_size": n, **extra},
                   y, *([final] if final is not None else []))
        return y if final is None else (y, final)

    @BUILDERS.register("mamba2")
    def mamba2(self, x: Any, dt: Any, a: Any, b: Any, c: Any, *, D: Any = None, z: Any = None, dt_bias: Any = None,
               dt_softplus: bool = False, dt_limit: Sequence[float | None] | None = None, initial_state: Any = None,
               cu_seqlens: Any = None, state_slots: Any = None, state_dtype: str | None = None,
               param_dtype: str | None = None, name: str | None = None) -> Any:
        """Mamba-2 SSD, mamba_ssm's ``mamba_chunk_scan_combined``: per head ``S = exp(dt·a)·S + (dt·x)⊗b``,
        ``y = S·c``, then ``y = (y + D·x)⊙silu(z)``.

        ``x, z [B,S,H,P]``, ``dt [B,S,H]``, ``a, D, dt_bias [H]`` (one element type, see
        ``selective_scan``); ``b, c [B,S,G,N]``, head ``h`` reading group ``h // (H/G)`` (``G = H``: one
        per head). ``dt`` is biased, softplus-ed with ``dt_softplus`` and clamped to ``dt_limit = (lo,
        hi)`` (``hi`` None or inf: no upper bound; mamba_ssm's default is ``(0, inf)``).
        ``initial_state [R,H,P,N]``, ``cu_seqlens`` and ``state_slots`` as in ``selective_scan``.
        """
        x, dt, b, c = (self._t(v) for v in (x, dt, b, c))
        a = self._t(a, param_dtype)
        if len(x.shape) != 4 or len(b.shape) != 4:
            raise GraphError(f"mamba2: x {x!r} must be [B,S,H,P] and b {b!r} [B,S,G,N]")
        (bt, s, h, p), (groups, n) = x.shape, b.shape[2:]
        if groups < 1 or h % groups:
            raise GraphError(f"mamba2: {groups} groups of b {b!r} do not divide the {h} heads of x")
        for field, t, shape in (("dt", dt, (bt, s, h)), ("b", b, (bt, s, groups, n)), ("c", c, (bt, s, groups, n))):
            self._expect("mamba2", field, t, shape, x.dtype)
        self._expect("mamba2", "a", a, (h,), param_dtype or a.dtype)
        extra, final = self._state_space("mamba2", x, bt, {"a": a, "d": D, "dt_bias": dt_bias}, z, initial_state,
                                         (h, p, n), cu_seqlens, state_slots, state_dtype, name)
        if groups != h:
            extra["groups"] = groups
        if dt_softplus:
            extra["dt_softplus"] = True
        if dt_limit is not None:
            low, high = (float(v) if v is not None else None for v in dt_limit)
            extra["dt_limit"] = [low, None if high is None or high == float("inf") else high]
        y = self._new(x.shape, x.dtype)
        self._emit("mamba2", x.dtype, {"x": x, "dt": dt, "a": a, "b": b, "c": c, "dst": y, "batch": bt,
                                       "seq": s, "heads": h, "head_dim": p, "state_size": n, **extra},
                   y, *([final] if final is not None else []))
        return y if final is None else (y, final)

    @BUILDERS.register("gated_delta_net")
    def gated_delta_net(self, q: Any, k: Any, v: Any, g: Any, beta: Any, *, gate_per_channel: bool = False,
                        scale: float | None = None, initial_state: Any = None, state: Any = None,
                        use_qk_l2norm: bool = False, cu_seqlens: Any = None, state_slots: Any = None,
                        state_dtype: str | None = None, name: str | None = None) -> Any:
        """Gated delta rule, fla's ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``
        (``chunk_kda`` with ``gate_per_channel``) in the ``[K,V]`` state layout: per value head
        ``S *= exp(g)``, ``S += k⊗((v - Sᵀk)·beta)``, ``out = scale·Sᵀq``.

        ``q, k [B,S,H,K]``; ``v [B,S,HV,V]`` (``HV`` a multiple of ``H``: value head ``j`` reads key head
        ``j // (HV/H)``; ``V`` may differ from ``K``); ``beta [B,S,HV]``; ``g [B,S,HV]``, or
        ``[B,S,HV,K]`` with ``gate_per_channel``. ``scale`` defaults to ``1/sqrt(K)``; ``use_qk_l2norm``
        divides q and k by their L2 norms first (fla's ``use_qk_l2norm_in_kernel``). ``initial_state
        [R,HV,K,V]`` (``state`` is the same argument), in ``state_dtype`` (default q's; e.g. f32 beside
        bf16 activations), starts each row; the final states are returned too, ``(out, state)``, and
        output ``{name}.state``. ``cu_seqlens`` (i32 ``[R+1]``, batch 1) packs R sequences along S, each
        from its own state; ``state_slots`` (i32 ``[R]``) makes ``initial_state`` a pool of entries,
        row ``r`` using entry ``state_slots[r]``. A field left at its default is left out of the thunk,
        so a graph without these lowers to version 1.
        """
        op = "gated_delta_net"
        if state is not None and initial_state is not None:
            raise GraphError(f"{op}: state and initial_state name the same argument; pass one of them")
        initial_state = state if initial_state is None else initial_state
        q, k, v, g, beta = (self._t(t) for t in (q, k, v, g, beta))
        if len(q.shape) != 4 or len(v.shape) != 4:
            raise GraphError(f"{op}: q {q!r} must be [B,S,H,K] and v {v!r} [B,S,HV,V]")
        (bt, s, h, n), (hv, width) = q.shape, v.shape[2:]
        if hv < 1 or hv % h:
            raise GraphError(f"{op}: the {hv} value heads of v {v!r} are no multiple of the {h} heads of q")
        gate = (bt, s, hv, n) if gate_per_channel else (bt, s, hv)
        for field, t, shape in (("k", k, q.shape), ("v", v, (bt, s, hv, width)), ("g", g, gate),
                                ("beta", beta, (bt, s, hv))):
            self._expect(op, field, t, shape, q.dtype)
        fields: dict[str, Any] = {}
        if hv != h:
            fields["value_heads"] = hv
        if width != n:
            fields["value_size"] = width
        # fla's default, ``K ** -0.5``, is 1/sqrt(K) up to the last bit: it stays the (version-1) default
        if scale is not None and not math.isclose(float(scale), 1.0 / math.sqrt(n), rel_tol=1e-12):
            fields["scale"] = float(scale)
        if use_qk_l2norm:
            fields["qk_l2norm"] = True
        packed, rows = self._packed(op, q, bt, cu_seqlens)
        carried, final = self._carried(op, q, rows, initial_state, (hv, n, width), state_slots, state_dtype)
        fields.update(packed, **carried)
        y = self._new((bt, s, hv, width), q.dtype)
        self._emit(op, q.dtype, {
            "q": q, "k": k, "v": v, "g": g, "beta": beta, "state": 0 if final is None else final, "dst": y,
            "batch": bt, "seq": s, "heads": h, "state_size": n, "gate_per_channel": bool(gate_per_channel),
            "carry_state": initial_state is not None, **fields}, y, *([final] if initial_state is not None else []))
        if initial_state is None:
            return y
        self.output(f"{name or f'gdn{next(self._ids)}'}.state", final)
        return y, final

    @BUILDERS.register("causal_conv1d")
    def causal_conv1d(self, x: Any, weight: Any, *, bias: Any = None, activation: str | None = None,
                      initial_state: Any = None, cu_seqlens: Any = None, state_slots: Any = None,
                      state_dtype: str | None = None, name: str | None = None) -> Any:
        """The short depthwise causal convolution before a Mamba / GDN scan (ABI.md §10), Dao-AILab's
        ``causal_conv1d_fn`` in token-major layout: ``y[t,d] = bias[d] + Σ_w weight[d,w]·x[t-W+1+w, d]``, then
        silu with ``activation="silu"`` (or ``"swish"``).

        ``x [B,S,D]``, ``weight [D,W]`` (``2 <= W <= 8``), ``bias [D]``. ``initial_state [R,D,W-1]`` (in
        ``state_dtype``, default x's) holds the ``W-1`` inputs before each row's first (oldest first); the
        final states are returned too, ``(y, state)``, and output ``{name}.state``. ``cu_seqlens`` (i32
        ``[R+1]``, batch 1) packs R sequences along S; ``state_slots`` (i32 ``[R]``) makes ``initial_state`` a
        pool of entries, row ``r`` using entry ``state_slots[r]``. A decode step is ``S = 1`` with a state.
        """
        op = "causal_conv1d"
        x, weight = self._t(x), self._t(weight)
        if len(x.shape) != 3 or len(weight.shape) != 2 or not 2 <= weight.shape[1] <= 8:
            raise GraphError(f"{op}: x {x!r} must be [B,S,D] and weight {weight!r} [D,W] with 2 <= W <= 8")
        (bt, s, dim), width = x.shape, weight.shape[1]
        self._expect(op, "weight", weight, (dim, width), x.dtype)
        if activation not in (None, "none", "silu", "swish"):
            raise GraphError(f"{op}: activation={activation!r}, expected None, 'silu' or 'swish'")
        fields: dict[str, Any] = {"activation": "silu"} if activation in ("silu", "swish") else {}
        if bias is not None:
            fields["bias"] = self._t(bias, x.dtype)
            self._expect(op, "bias", fields["bias"], (dim,), x.dtype)
        packed, rows = self._packed(op, x, bt, cu_seqlens)
        carried, final = self._carried(op, x, rows, initial_state, (dim, width - 1), state_slots, state_dtype)
        fields.update(packed, **carried)
        if final is not None:
            fields.update(carry_state=True, state=final)
        y = self._new(x.shape, x.dtype)
        self._emit(op, x.dtype, {"x": x, "weight": weight, "dst": y, "batch": bt, "seq": s, "dim": dim,
                                 "width": width, **fields}, y, *([final] if final is not None else []))
        if final is None:
            return y
        self.output(f"{name or f'conv{next(self._ids)}'}.state", final)
        return y, final

    # ----------------------------------------------------------------- gradients
    @BUILDERS.register(*BACKWARD)
    def backward(self, y: Tensor, d_y: Any, d_state: dict[str, Any] | None = None, *,
                 recompute: bool = False) -> dict[str, Tensor]:
        """Emit the ``OP_backward`` thunk (ABI.md §9) of the fused op that returned ``y``.

        ``y`` is the output (``dst``) of an ``lstm``, ``gru``, ``rnn``, ``selective_scan``, ``mamba2``
        or ``gated_delta_net`` call of this graph and ``d_y`` the gradient of the loss with respect to
        it. ``d_state`` holds the gradients of the call's final states by the forward's state field
        (``{"h0": ..., "c0": ...}`` for an lstm, ``{"h0": ...}`` for a gru or rnn, ``{"state": ...}``
        for the others); a state left out has gradient zero. It applies only to a call given initial
        states.

        An lstm, gru, rnn or mamba2 call (mamba2 without ``cu_seqlens``) gets a saved forward (ABI.md §9.1's ``reserve``, ``rlx_gpu.reserve_bytes``
        bytes): the forward thunk also writes what its backward reads instead of running the forward again
        (cuDNN's reserve space; faster, and the arena holds it from the forward to the backward).
        ``recompute=True`` gives none: the backward recomputes the forward, trading speed for memory.

        Returns
        -------
        dict of str to Tensor
            The gradient of every floating-point input of the call, keyed by the forward's field
            name (``x``, ``w_ih``, ``a``, ``d`` for D, ``delta_bias``, ``z``, ``q``, ...), the initial
            states' under their state fields (``h0``, ``c0``, ``state``); each is shaped and typed
            like the input it belongs to.
        """
        node = self._forward_node(y)
        op, bop = node.op, f"{node.op}_backward"
        d_y = self._t(d_y, y.dtype)
        self._expect(bop, "d_y", d_y, y.shape, y.dtype)
        carried = [f for f in STATE_FIELDS[op] if isinstance(node.fields.get(f), Tensor)]
        given = dict(d_state or {})
        if set(given) - set(carried):
            have = f"its carried states are {', '.join(carried)}" if carried else "it was given no initial state"
            raise GraphError(f"{bop}: d_state names {', '.join(sorted(set(given) - set(carried)))}, but {have}")
        if not recompute:
            self._saved_forward(node)
        fields = {k: v for k, v in node.fields.items() if k != "dst"}
        fields["d_dst"] = d_y
        grads: dict[str, Tensor] = {}
        for name, v in node.fields.items():
            if name in ("dst", "reserve") or not isinstance(v, Tensor) or v.dtype == "i32":
                continue
            if name in carried:
                # the thunk holds the initial state (the tensor the call was given) and updates the
                # final state's gradient in place into the initial state's
                v = fields[name] = self._initial_state(node, name)
                g = (self.fill(v.shape, 0.0, v.dtype) if given.get(name) is None
                     else self.copy(self._t(given[name], v.dtype)))
                self._expect(bop, f"d_state[{name!r}]", g, v.shape, v.dtype)
            else:
                g = self._new(v.shape, v.dtype)
            fields[gradient(name)] = grads[name] = g
        # an unused state field is written 0 and so is its gradient's; an absent one (the version-2
        # state of selective_scan and mamba2 without carry_state) has no gradient field either
        fields.update({gradient(f): 0 for f in STATE_FIELDS[op] if f not in carried and f in node.fields})
        self._emit(bop, node.dtype, fields, *grads.values())
        return grads

    def _forward_node(self, y: Tensor) -> Node:
        """The fused-op node of this graph whose ``dst`` is ``y``."""
        y = self._t(y)
        for node in reversed(self.nodes):  # the node that wrote y's buffer (a reshape only views it)
            dst = node.fields.get("dst")
            if isinstance(dst, Tensor) and dst.buf == y.buf and node.op != "reshape":
                if node.op not in FORWARD_OPS:
                    break
                return node
        raise GraphError(f"backward: {y!r} is no output of a {', '.join(FORWARD_OPS)} call of this graph; "
                         f"pass the tensor the call returned (its first value)")

    def saved_forward(self, y: Tensor, given: Tensor | None = None) -> Tensor | None:
        """The saved forward (ABI.md §9.1's ``reserve``) of the recurrent or state-space call that returned ``y``:
        a buffer of ``rlx_gpu.reserve_bytes`` bytes its forward thunk writes and its ``backward`` reads (made on
        the first ask); ``None`` for an op without one (or a state-space call of packed sequences). ``given``: a
        tensor holding the reserve a forward run before wrote (a frontend kept it from its forward call): the
        backward reads it, and the forward thunk, whose outputs nothing then needs, is pruned."""
        node = self._forward_node(y)
        if given is not None and not _has_reserve(node):
            having = ", ".join(op for op in FORWARD_OPS if OPS[op].reserve_size is not None)
            raise GraphError(f"{node.op}: this call has no saved forward (reserve); the ops with one are {having} "
                             f"(the state-space ops without cu_seqlens)")
        if given is not None:
            nbytes = OPS[node.op].reserve_size({"op": node.op, "dtype": node.dtype, **node.fields})
            given = self._t(given, node.dtype)
            self._expect(node.op, "reserve", given, (nbytes // ELEM_SIZE[node.dtype],), node.dtype)
            node.fields.update(reserve=given, reserve_bytes=nbytes)
        return self._saved_forward(node)

    def _saved_forward(self, node: Node) -> Tensor | None:
        """The reserve of the forward ``node``, given one first if its op has one and it has none yet (a second
        backward of the same call reads the same): a buffer of its dtype's elements it writes besides ``dst``."""
        size = OPS[node.op].reserve_size
        if not _has_reserve(node) or isinstance(node.fields.get("reserve"), Tensor):
            return node.fields.get("reserve")
        nbytes = size({"op": node.op, "dtype": node.dtype, **node.fields})
        reserve = self._new((nbytes // ELEM_SIZE[node.dtype],), node.dtype)
        node.fields.update(reserve=reserve, reserve_bytes=nbytes)
        node.writes = (*node.writes, reserve)
        return reserve

    def _initial_state(self, node: Node, field: str) -> Tensor:
        """The tensor a call was given as state ``field``: the source of the copy its thunk updates."""
        final = node.fields[field]
        for other in self.nodes:
            if other.op == "copy" and other.fields["dst"].buf == final.buf:
                return other.fields["src"]
        raise GraphError(f"{node.op}_backward: the initial {field} of {node.fields['dst']!r} is not in this graph")


def _has_reserve(node: Node) -> bool:
    """Whether the forward ``node`` can save its forward (ABI.md §9.1): its op has a reserve, and it is no
    state-space call of packed sequences (``cu_seqlens``), whose saved forward the ABI refuses for now."""
    return OPS[node.op].reserve_size is not None and not isinstance(node.fields.get("cu_seqlens"), Tensor)
