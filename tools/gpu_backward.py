"""The backward section of tools/gpu_check.py: a training step's two thunks against the anchors' backward.

For each op at a training shape, ours is the forward thunk and then its ABI.md §9 backward thunk (which
recomputes what it needs of the forward), event-timed through the CUDA session on resident arenas.
The anchor is the same step under torch autograd on the same GPU: cuDNN's RNN backward for lstm/gru
(``torch.nn.LSTM``/``GRU`` in training mode), and for the state-space ops mamba_ssm's
``selective_scan_fn`` / ``mamba_chunk_scan_combined`` and fla's ``chunk_gated_delta_rule`` where those
packages are installed, else the torch chunked twins of ``benchmarks/ssm.py``; the table names which.
Ratios are reported, not judged against a target. mamba2's backward is also timed alone, chunked (what the gpu
target runs) against the step walk (``ssm_kernel="lanes"``).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from gpu_bench import RUNS, _fields, cuda_session, events_ms, torch_ms


def shapes() -> list[tuple[str, dict]]:
    from backends import gdn, recurrent

    def one_layer(op: str) -> dict:
        return dict(recurrent(op, 64, 512, 1024, 1024), num_layers=1, bidirectional=False, carry=False)

    return [
        ("lstm B64 S512 I=H=1024", one_layer("lstm")),
        ("gru B64 S512 I=H=1024", one_layer("gru")),
        ("selective_scan B4 S2048 D2048 N16", dict(op="selective_scan", batch=4, seq=2048, hidden=2048,
                                                  state_size=16, x=0, delta=0, a=0, b=0, c=0, dst=0)),
        ("mamba2 B4 S2048 H32 P64 N128", dict(op="mamba2", batch=4, seq=2048, heads=32, head_dim=64, state_size=128,
                                             x=0, dt=0, a=0, b=0, c=0, dst=0)),
        ("gdn B4 S4096 H16 N128", gdn(4, 4096, 16, 128, per_channel=False, carry=False)),
    ]


def backward_template(forward: dict) -> dict:
    """The ``OP_backward`` thunk of a forward template (offsets are placed by ``lay_out``)."""
    params = {k: v for k, v in forward.items() if k not in ("op", "dst")}
    return {"op": f"{forward['op']}_backward", **params}


def _anchor_fields(op: str) -> tuple[str, ...]:
    from ssm import TORCH

    return TORCH[op][1]


def saved_reserve_bytes(output: Any) -> int | None:
    """The bytes of the reserve space cuDNN's RNN forward handed its backward, found among what autograd saved for
    ``output`` (a training ``torch.nn.LSTM``/``GRU`` output on CUDA: ``_cudnn_rnn``'s fourth result, kept by its
    backward node as ``_saved_result3``, the node at most a few views below ``output``); None where no node saved
    one (the CPU's RNN, whose oneDNN node saves a workspace of its own; another release's names). cuDNN publishes no formula for its size: this is its figure."""
    node, hops = output.grad_fn, 0
    while node is not None and hops < 4:
        reserve = getattr(node, "_saved_result3", None) if node.name().startswith("CudnnRnn") else None
        if reserve is not None and hasattr(reserve, "element_size"):
            return int(reserve.numel()) * int(reserve.element_size())
        node, hops = (node.next_functions[0][0] if node.next_functions else None), hops + 1
    return None


def _anchor(t: dict, fields: dict[str, np.ndarray]) -> tuple[str, Callable[[], Any]]:
    """(name, a no-argument callable running the anchor's forward and backward on CUDA)."""
    import torch
    from ssm import TORCH

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    op = t["op"]
    if op in ("lstm", "gru"):
        net = (torch.nn.LSTM if op == "lstm" else torch.nn.GRU)(t["input_size"], t["hidden"], batch_first=True).cuda()
        x = torch.from_numpy(np.ascontiguousarray(fields["x"])).cuda().requires_grad_()
        dy = torch.randn(t["batch"], t["seq"], t["hidden"], device="cuda")

        def cudnn():
            net(x)[0].backward(dy)
        return "cuDNN", cudnn
    args = [torch.from_numpy(np.ascontiguousarray(fields[f], np.float32)).cuda().requires_grad_()
            for f in _anchor_fields(op)]
    name, fn = _installed_anchor(op) or ("torch twin", TORCH[op][0])
    dy = torch.randn_like(fn(*args))

    def step():
        fn(*args).backward(dy)
    return name, step


def _installed_anchor(op: str) -> tuple[str, Callable[..., Any]] | None:
    """The anchor's own GPU kernels in our batch-major layout, where its package is installed."""
    try:
        if op == "selective_scan":
            from mamba_ssm.ops.selective_scan_interface import selective_scan_fn

            def mamba1(x, delta, a, b, c):  # mamba_ssm is channel-major: [B, D, L] and [B, N, L]
                t = lambda v: v.transpose(1, 2)  # noqa: E731
                return t(selective_scan_fn(t(x), t(delta), a, t(b), t(c)))
            return "mamba_ssm selective_scan_fn", mamba1
        if op == "mamba2":
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

            return "mamba_ssm mamba_chunk_scan_combined", lambda x, dt, a, b, c: mamba_chunk_scan_combined(
                x, dt, a, b, c, chunk_size=64)
        if op == "gated_delta_net":
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            return "fla chunk_gated_delta_rule", lambda q, k, v, g, beta: chunk_gated_delta_rule(q, k, v, g, beta)[0]
    except ImportError:
        return None
    return None


def reserve_line(forward: dict, fields: dict[str, np.ndarray]) -> str:
    """Bytes per token of our reserve for the recurrent ``forward`` (``rlx_gpu.reserve_bytes``) and of cuDNN's
    for the same layer in torch's training forward on the GPU."""
    import torch

    import rlx_gpu

    tokens = forward["batch"] * forward["seq"]
    ours = rlx_gpu.reserve_bytes(forward) / tokens
    net = (torch.nn.LSTM if forward["op"] == "lstm" else torch.nn.GRU)(
        forward["input_size"], forward["hidden"], batch_first=True).cuda()
    x = torch.from_numpy(np.ascontiguousarray(fields["x"])).cuda().requires_grad_()
    theirs = saved_reserve_bytes(net(x)[0])
    told = "cuDNN saved none that torch names" if theirs is None else f"cuDNN {theirs / tokens:.0f} B/token"
    return f"ours {ours:.0f} B/token (f32, H={forward['hidden']}), {told}"


def benchmarks(ck: Any, shared: dict) -> None:
    import cupy as cp
    from backends import lay_out

    from rlx_gpu.runtime.options import RunOptions

    session = cuda_session()
    stream = session.prims.stream
    rng = np.random.default_rng(0)
    table = ["| op | ours fwd ms | ours fwd+bwd ms | anchor | anchor fwd+bwd ms | ours/anchor |", "|---|---|---|---|---|---|"]
    for label, template in shapes():
        if ck.left() < 60:
            ck.add("backward", label, "fail", "not run: time budget spent")
            continue
        forward, host_f = lay_out(template, rng)
        backward, host_b = lay_out(backward_template(template), rng)
        fields = _fields(forward, host_f)
        if forward["op"] == "gated_delta_net":  # unit keys keep the delta rule stable
            for host, t in ((host_f, forward), (host_b, backward)):
                k = _fields(t, host)["k"]
                k[...] = k / np.linalg.norm(k.astype(np.float64), axis=-1, keepdims=True)
        arenas = [session.alloc(host_f.size), session.alloc(host_b.size)]
        try:
            session.write(arenas[0], 0, host_f)
            session.write(arenas[1], 0, host_b)
            run_f, run_b = session.runner(forward, RunOptions()), session.runner(backward, RunOptions())
            fwd = events_ms(stream, lambda: run_f(arenas[0]), RUNS)
            both = events_ms(stream, lambda: (run_f(arenas[0]), run_b(arenas[1])), RUNS)
            if backward["op"] == "mamba2_backward":  # its chunked form against the step walk (a few runs: seconds)
                run_w = session.runner(backward, RunOptions(ssm_kernel="lanes"))
                chunked = events_ms(stream, lambda: run_b(arenas[1]), RUNS)
                walk = events_ms(stream, lambda: run_w(arenas[1]), 2, 1)
                ck.add("backward", f"{label} chunked backward", "ok",
                       f"{chunked:.3f} ms, the step walk {walk:.3f} ms ({walk / chunked:.1f}x)")
        finally:
            for arena in arenas:
                session.free(arena)
        name, anchor = _anchor(forward, fields)
        theirs = torch_ms(anchor)
        if forward["op"] in ("lstm", "gru"):  # the saved forward's size per token beside cuDNN's (issue 36)
            ck.add("backward", f"{label} reserve", "ok", reserve_line(forward, fields))
        table.append(f"| {label} | {fwd:.3f} | {both:.3f} | {name} | {theirs:.3f} | {both / theirs:.2f} |")
        ck.write("backward.md", "\n".join(table) + "\n")
        ck.add("backward", label, "ok", f"ours fwd+bwd {both:.3f} ms, {name} {theirs:.3f} ms ({both / theirs:.2f}x)")
        del host_f, host_b, fields
    cp.get_default_memory_pool().free_all_blocks()
