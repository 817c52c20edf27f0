"""torch autograd of mamba_ssm's ``selective_scan_ref`` math, rewritten in float64 torch (channel-major, as mamba_ssm
lays it out): the independent reference of the host's selective_scan_backward, on either of its paths
(test_selective_scan_backward, test_host_jit_ssm_backward)."""
from __future__ import annotations

import numpy as np
import torch

from host_fallback.abi import forward_thunk, gradient


def selective_scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial=None):
    """mamba_ssm's ``selective_scan_ref`` math in torch: ``u, delta, z [batch, dim, L]``, ``A [dim, N]``,
    ``B, C [batch, N, L]`` or ``[batch, groups, N, L]``; plus an initial state ``[batch, dim, N]``.
    Returns ``(out, last_state)``."""
    if delta_bias is not None:
        delta = delta + delta_bias[..., None]
    if delta_softplus:
        delta = torch.nn.functional.softplus(delta)
    batch, dim, length = u.shape
    if B.dim() == 4:  # one group's B and C serve dim / groups consecutive channels
        B, C = (m.repeat_interleave(dim // m.shape[1], dim=1) for m in (B, C))
    else:
        B, C = B[:, None], C[:, None]
    decay = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    inputs = torch.einsum("bdl,bdnl,bdl->bdln", delta, B.expand(batch, dim, -1, -1), u)
    state = torch.zeros(batch, dim, A.shape[1], dtype=u.dtype) if initial is None else initial
    ys = []
    for i in range(length):
        state = decay[:, :, i] * state + inputs[:, :, i]
        ys.append(torch.einsum("bdn,bdn->bd", state, C.expand(batch, dim, -1, -1)[..., i]))
    out = torch.stack(ys, dim=2)
    if D is not None:
        out = out + u * D[:, None]
    if z is not None:
        out = out * torch.nn.functional.silu(z)
    return out, state


def torch_grads(thunk: dict, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``gradient_check.loss`` through ``selective_scan_ref`` in float64, and the gradient of every input."""
    t = forward_thunk(thunk)
    leaves = {f: torch.tensor(values[f], requires_grad=True) for f in values if not f.startswith("d_")}
    channel_major = lambda v: v.transpose(1, 2)  # noqa: E731  [B, S, H] -> [B, H, S]
    bc = lambda v: v.reshape(*v.shape[:2], t["groups"], -1).permute(0, 2, 3, 1) if t["groups"] > 1 \
        else v.transpose(1, 2)  # noqa: E731  [B, S, (G,) N] -> [B, (G,) N, S]
    get = lambda f: leaves.get(f) if t[f] is not None else None  # noqa: E731
    out, last = selective_scan_ref(
        channel_major(leaves["x"]), channel_major(leaves["delta"]), leaves["a"], bc(leaves["b"]), bc(leaves["c"]),
        D=get("d"), z=None if t["z"] is None else channel_major(leaves["z"]), delta_bias=get("delta_bias"),
        delta_softplus=t["delta_softplus"], initial=leaves["state"] if t["carry_state"] else None)
    loss = (channel_major(out) * torch.tensor(values["d_dst"])).sum()
    if t["carry_state"]:
        loss = loss + (last * torch.tensor(values["d_state"])).sum()
    loss.backward()
    return {gradient(f): leaf.grad.numpy() for f, leaf in leaves.items()}
