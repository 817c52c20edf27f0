"""The tensor-core section of tools/gpu_check.py (issue 38): the chunked mamba2, gated_delta_net and mamba3
forwards and backwards with their MMA variants against the portable FP32 FMA path and the anchors, in ``mma.md``.

Per shape, each event-timed through the CUDA session on a resident arena (``ssm_kernel="chunked"``): ours
in f32 on FP32 FMA (the portable twin), in bf16 on the tensor cores (``RLX_MMA`` 1), and in f32 with TF32
operands (``RLX_MMA`` 2, as ``RLX_CUDA_TF32=1`` gives it); the anchor in bf16 where its package is
installed: mamba_ssm's ``mamba_chunk_scan_combined`` (chunk 64), fla's ``chunk_gated_delta_rule`` and
mamba_ssm's Mamba-3 ``mamba3_siso_combined`` (chunk 64; where this mamba_ssm has none, the row has no anchor and
ours are held to the FMA run alone). The shapes are the ones the issue's anchors publish: mamba_ssm's B8 S4096
H32 P64 N128, mamba3 at that shape (num_angles N/4, what the Mamba3 layer's rope_fraction 0.5 gives; q/k biases,
which the anchor takes always; dt, the decay and the angles in f32 as the anchor computes them) and the fla /
FlashQLA H200 one (one sequence of 32768 tokens, 16 q/k heads, 64 value heads, d = 128). Each MMA result is also
compared with the FMA one (NMSE of each output over its power, the worst named): a variant that computes something
else fails the row, however fast it is. Speed is reported, not judged.

Each shape's backward op (ABI.md §9) is timed the same way, alone: ours recomputes what it needs of the forward
(no reserve), on the FMA path and with the backward variants (mamba2_backward_dstate / _chunk, gdn_chunk_back_grads
/ _pass, mamba3_cb_chunk); the anchor's backward is its autograd backward alone, the gradient of its output our
``d_dst`` in bf16, through the graph its forward kept (which saved what it needed: the two are not the same work).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from gpu_bench import RUNS, _fields, cuda_session, events_ms, torch_ms

#: (dtype, RLX_MMA variant the session allows) of each of our runs, by column
RUNS_OF = (("f32", 0), ("bf16", 1), ("f32", 2))
#: the largest NMSE of an MMA output against the FMA one: bf16 inputs alone cost ~(2^-8)^2/3 = 5e-6
AGREEMENT = 1e-3
#: and of a backward's gradient: a tile computing something else costs NMSE of order 1, while the gradients summed
#: over a whole sequence with cancelling terms (d_a, d_g, d_adt) move further with bf16 inputs than any output
#: (no small shape measures by how much: this bound separates the two and the table shows the worst field)
BACKWARD_AGREEMENT = 1e-2


def shapes() -> list[tuple[str, dict]]:
    mamba2 = dict(op="mamba2", batch=8, seq=4096, heads=32, head_dim=64, state_size=128)
    gdn = dict(op="gated_delta_net", batch=1, seq=32768, heads=16, value_heads=64, state_size=128, value_size=128,
               carry_state=False)
    mamba3 = dict(op="mamba3", batch=8, seq=4096, heads=32, head_dim=64, state_size=128, num_angles=32,
                  q_bias=True, k_bias=True, dt_dtype="f32")
    return [("mamba2 B8 S4096 H32 P64 N128", mamba2),
            ("gdn B1 S32768 H16 HV64 d128", dict(gdn, gate_per_channel=False)),
            ("gdn per-channel B1 S32768 H16 HV64 d128", dict(gdn, gate_per_channel=True)),
            ("mamba3 B8 S4096 H32 P64 N128 A32", mamba3)]


def backward_shapes() -> list[tuple[str, dict]]:
    """Each forward shape's backward op, at the same shape."""
    return [(f"{label} backward", dict(template, op=f"{template['op']}_backward")) for label, template in shapes()]


def lay_out(template: dict, dtype: str, seed: int) -> tuple[dict, np.ndarray]:
    """The thunk of ``template`` in ``dtype`` and its arena, inputs drawn as benchmarks/backends.py draws them
    (decays and log-decays negative, dt positive; gdn's keys of unit norm, which keep the delta rule stable);
    one ``seed`` draws the same values in every dtype, each rounded to it."""
    from host_fallback.abi import regions
    from host_fallback.arena import STORAGE

    from rlx_gpu.conformance import cases

    params = {k: v for k, v in template.items() if k != "op"}
    t, nbytes = cases.lay_out(template["op"], dtype, params)
    arena, rng = np.zeros(nbytes, np.uint8), np.random.default_rng(seed)
    for r in regions(t):
        if not r.reads or r.dtype in ("u8", "i32"):
            continue
        vals = rng.standard_normal(r.shape, dtype=np.float32) * 0.3
        if r.field == "dt":
            vals = np.abs(vals)
        if r.field in ("a", "g", "adt"):
            vals = -np.abs(vals)
        if r.field == "k":
            vals = vals / np.linalg.norm(vals, axis=-1, keepdims=True)
        arena[r.offset: r.offset + r.nbytes] = vals.astype(STORAGE[r.dtype]).reshape(-1).view(np.uint8)
    return t, arena


def _ours(session: Any, t: dict, host: np.ndarray, mma: int) -> tuple[float, dict[str, np.ndarray]]:
    """(median ms, each field ``t`` writes as f32: the output, or a backward's gradients) of ``t`` on a session
    allowed the ``mma`` variant."""
    from host_fallback.abi import regions

    from rlx_gpu.runtime.options import RunOptions

    base = session.limits
    session.limits = dataclasses.replace(base, mma=mma)
    arena = session.alloc(host.size)
    try:
        session.write(arena, 0, host)
        run = session.runner(t, RunOptions(ssm_kernel="chunked"))
        ms = events_ms(session.prims.stream, lambda: run(arena), RUNS)
        got = _fields(t, session.read(arena, 0, host.size))
        return ms, {r.field: got[r.field].astype(np.float32) for r in regions(t) if r.writes}
    finally:
        session.limits = base
        session.free(arena)


def _mamba3_anchor(cuda: Callable[..., Any]) -> tuple[str, Callable[[], Any]]:
    """mamba_ssm's Mamba-3 SISO forward on our mamba3 fields (``cuda(field, dtype)``: one on the GPU): q, k, v in
    bf16; adt, dt and trap, [B,S,H] here, as its [B,H,S], in f32 with the angle rates and the biases. Raises
    ImportError where this mamba_ssm has no Mamba-3."""
    import torch
    from mamba_ssm.ops.triton.mamba3.mamba3_siso_combined import mamba3_siso_combined

    q, k, v = (cuda(f) for f in ("q", "k", "v"))
    adt, dt, trap = (cuda(f, torch.float32).transpose(1, 2).contiguous() for f in ("adt", "dt", "trap"))
    angles, q_bias, k_bias = (cuda(f, torch.float32) for f in ("angles", "q_bias", "k_bias"))
    return "mamba_ssm mamba3_siso_combined", lambda: mamba3_siso_combined(q, k, v, adt, dt, trap, q_bias, k_bias,
                                                                          angles, chunk_size=64)


def _anchor(t: dict, fields: dict[str, np.ndarray], grad: bool = False) -> tuple[str, Callable[[], Any] | None]:
    """(name, a no-argument bf16 call of its forward on CUDA, its inputs leaves that take gradients where ``grad``
    says so) of the installed anchor of ``t``'s op (of a backward op: its forward's), or ("", None) (per-channel
    gates: fla's chunk_gated_delta_rule takes one gate per head; a mamba_ssm without Mamba-3, or none)."""
    import torch

    if t.get("gate_per_channel"):
        return "", None
    op = t["op"].removesuffix("_backward")

    def cuda(name: str, dtype: Any = torch.bfloat16) -> Any:
        return torch.from_numpy(np.ascontiguousarray(fields[name], np.float32)).cuda().to(dtype).requires_grad_(grad)
    try:
        if op == "mamba3":
            return _mamba3_anchor(cuda)
        if op == "mamba2":
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

            x, dt, b, c = (cuda(f) for f in ("x", "dt", "b", "c"))
            a = cuda("a", torch.float32)
            return "mamba_ssm mamba_chunk_scan_combined", lambda: mamba_chunk_scan_combined(x, dt, a, b, c, chunk_size=64)
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        q, k, v, g, beta = (cuda(f) for f in ("q", "k", "v", "g", "beta"))
        return "fla chunk_gated_delta_rule", lambda: chunk_gated_delta_rule(q, k, v, g.float(), beta)
    except ImportError:
        return "", None


def _anchor_ms(t: dict, fields: dict[str, np.ndarray]) -> tuple[str, float]:
    """(name, median ms in bf16, NaN where none ran) of the anchor of ``t``'s op: its forward, or for a backward op
    its backward alone, the gradient of its output ``fields["d_dst"]``, through the graph its forward kept."""
    backward = t["op"].endswith("_backward")
    name, forward = _anchor(t, fields, grad=backward)
    if forward is None:
        return name, float("nan")
    try:
        if not backward:
            return name, torch_ms(forward)
        import torch

        out = forward()
        out = out[0] if isinstance(out, tuple) else out  # fla's (o, final state)
        gy = torch.from_numpy(np.ascontiguousarray(fields["d_dst"], np.float32)).cuda().to(out.dtype)
        gy = gy.reshape(out.shape)
        return name, torch_ms(lambda: out.backward(gy, retain_graph=True))
    except Exception as err:  # an anchor that refuses the shape (e.g. value heads beyond q/k heads)
        return f"{name} ({type(err).__name__})", float("nan")


def _nmse(got: np.ndarray, want: np.ndarray) -> float:
    """The NMSE of ``got`` against ``want`` (over its power); infinite where it is not a number (a NaN or an Inf in
    either: the inputs are drawn to give none)."""
    got, want = got.astype(np.float64), want.astype(np.float64)
    err = float(np.mean((got - want) ** 2) / max(np.mean(want ** 2), 1e-300))
    return err if np.isfinite(err) else float("inf")


def worst(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> tuple[float, str]:
    """(the largest NMSE of a field of ``got`` against ``want``'s, that field)."""
    return max((_nmse(got[field], want[field]), field) for field in want)


def benchmarks(ck: Any, shared: dict) -> None:
    session = cuda_session()
    table = ["| shape | FMA f32 ms | MMA bf16 ms | MMA TF32 ms | anchor | anchor bf16 ms | bf16 / anchor | "
             "NMSE bf16, TF32 vs FMA (worst field) |", "|---|---|---|---|---|---|---|---|"]
    for seed, (label, template) in enumerate(shapes() + backward_shapes()):
        if ck.left() < 60:
            ck.add("mma", label, "fail", "not run: time budget spent")
            continue
        times, errs = [], []
        laid = {dtype: lay_out(template, dtype, seed) for dtype in dict(RUNS_OF)}  # FMA and TF32 share the f32 one
        for dtype, mma in RUNS_OF:
            t, host = laid[dtype]
            ms, out = _ours(session, t, host, mma)
            times.append(ms)
            if mma == 0:
                fields, fma = _fields(t, host), out
            else:
                errs.append(worst(out, fma))
        name, theirs = _anchor_ms(t, fields)
        bound = BACKWARD_AGREEMENT if t["op"].endswith("_backward") else AGREEMENT
        nmse = ", ".join(f"{err:.1e} ({field})" for err, field in errs)
        table.append(f"| {label} | {times[0]:.3f} | {times[1]:.3f} | {times[2]:.3f} | {name or '-'} | {theirs:.3f} | "
                     f"{times[1] / theirs:.2f} | {nmse} |")
        ck.write("mma.md", "\n".join(table) + "\n")
        ck.add("mma", label, "ok" if max(err for err, _ in errs) <= bound else "fail",
               f"FMA {times[0]:.3f} ms, MMA bf16 {times[1]:.3f} ms, TF32 {times[2]:.3f} ms, {name or 'no anchor'} "
               f"{theirs:.3f} ms; NMSE vs FMA {nmse} (bound {bound:g})")
        del fma, out, fields, host, laid
