"""``selective_scan``'s paths (``ssm`` chooses one): the step recurrence, and the blocked form that
precomputes a block of steps' decays and inputs in bulk and runs a two-operation loop over it, packed
sequences side by side in lanes where that pays."""
from __future__ import annotations

import numpy as np

from .chunked import scratch, swap
from .sequences import step_spans

#: The padding a packed selective_scan may add to run its sequences in lanes side by side (a fraction of
#: its tokens): each lane step costs about its share of the work, so lanes pay only where they pad little.
LANE_PADDING = 0.1
#: Channels x state size of a block below which packed sequences run in lanes (see ``_scan_blocked``).
LANE_STATE = 4096


def _scan_step(x, delta, a, b, c, state, seqs, block):
    """The recurrence step by step: ``x, delta [B, S, H]``, ``a [H, N]``, ``b, c [B, S, G, N]``, ``state
    [R, H, N]`` (the rows' starting states, updated in place to their final ones); returns ``y``."""
    bsz, seq, hidden = x.shape
    groups, n = b.shape[2], a.shape[-1]
    lanes = (bsz, groups, hidden // groups, 1)
    a = a.reshape(groups, -1, n)  # [G, H/G, N]: channel ch reads group ch // (H/G)
    rows = state.reshape(state.shape[0], groups, -1, n)
    y = np.empty_like(x)
    term = scratch("ss.term", (bsz, *rows.shape[1:]), x.dtype)  # reused: a fresh state-sized array page-faults
    for row, lo, hi in step_spans(seq, seqs):
        h = rows if row is None else rows[row : row + 1].copy()
        for t in range(lo, hi):
            d = delta[:, t].reshape(lanes)
            h *= np.exp(np.multiply(d, a, out=term), out=term)
            h += np.multiply(d * x[:, t].reshape(lanes), b[:, t, :, None, :], out=term)
            y[:, t] = (h @ c[:, t, :, :, None]).reshape(bsz, hidden)
        if row is not None:
            rows[row] = h[0]
    if not np.shares_memory(rows, state):  # the reshape copied a strided block: hand the states back
        np.copyto(state, rows.reshape(state.shape))
    return y


def _scan_blocked(x, delta, a, b, c, state, seqs, block, keep=None):
    """``_scan_step`` with the decays and inputs of ``block`` steps formed in bulk, then a two-operation
    loop per step over every lane at once. Packed sequences are dealt into lanes run side by side
    (``Sequences.lanes``), each lane restarting at its sequences' starts, so a packed batch takes about
    as many steps as a batch of equal rows of as many tokens (one long row would take them all). ``keep [B, C,
    H, N]`` (no packed sequences): where a saved forward keeps the state after each block."""
    if seqs is None:
        return _scan_lanes(x, delta, a, b, c, state, block, {}, {}, keep)
    # lanes pay for their padding and copies only where a step's arrays are small enough for the per-step
    # overhead to matter (a thread's block of channels: 2x1024 tokens H256 N16, packed / equal batch, one
    # thread 1.01 without lanes and 1.16 with; two threads, 128 channels each, 1.31 and 1.07)
    small = x.shape[2] * a.shape[-1] < LANE_STATE
    lanes = seqs.lanes(LANE_PADDING) if small else [list(seqs.runs())]
    width = max(sum(hi - lo for _, lo, hi in lane) for lane in lanes)
    starts: dict[int, list[tuple[int, int]]] = {}
    ends: dict[int, list[tuple[int, int]]] = {}
    spans = []  # (lane, lane step, token lo, token hi): where each sequence's tokens go
    for k, lane in enumerate(lanes):
        step = 0
        for row, lo, hi in lane:
            spans.append((k, step, lo, hi))
            starts.setdefault(step, []).append((k, row))
            step += hi - lo
            ends.setdefault(step - 1, []).append((k, row))
    if len(lanes) == 1:  # the row itself, its tokens in order
        return _scan_lanes(x, delta, a, b, c, state, block, starts, ends)

    def pack(t: np.ndarray) -> np.ndarray:  # [1, S, ...] -> [lanes, width, ...], zero past a lane's end
        out = np.zeros((len(lanes), width, *t.shape[2:]), t.dtype)
        for k, step, lo, hi in spans:
            out[k, step : step + hi - lo] = t[0, lo:hi]
        return out

    y = _scan_lanes(pack(x), pack(delta), a, pack(b), pack(c), state, block, starts, ends)
    out = np.empty_like(x)
    for k, step, lo, hi in spans:
        out[0, lo:hi] = y[k, step : step + hi - lo]
    return out


def _scan_lanes(x, delta, a, b, c, state, block, starts, ends, keep=None):
    """The blocked scan of ``_scan_blocked`` over lanes ``x [K, S, H]``. Without ``starts`` the lanes are
    the state rows (``state [K, H, N]`` in and out); else ``starts``/``ends`` map a step to the
    ``(lane, state row)`` pairs whose sequence starts (from that row's state) or ends (into it) there.

    The states are group- and state-major, ``[K, G, N, H/G]``, so every broadcast runs along the
    contiguous channels of a group (with H innermost a multiply broadcasts over only N values per
    inner loop)."""
    count, seq, hidden = x.shape
    groups, n = b.shape[2], a.shape[-1]
    width = hidden // groups
    at = np.ascontiguousarray(swap(a.reshape(groups, width, n)))  # [G, N, H/G]
    dt = np.ascontiguousarray(np.moveaxis(delta, 1, 0)).reshape(seq, count, groups, 1, width)
    dx = dt * np.moveaxis(x, 1, 0).reshape(seq, count, groups, 1, width)  # delta * x
    bt = np.moveaxis(b, 1, 0)[..., None]  # [S, K, G, N, 1]
    ct = np.moveaxis(c, 1, 0)[:, :, :, None, :]  # [S, K, G, 1, N]
    rows = np.ascontiguousarray(swap(state.reshape(state.shape[0], groups, width, n)))  # [R, G, N, H/G]
    prev = rows if not starts else np.zeros((count, groups, n, width), x.dtype)
    y = np.empty((seq, count, groups, 1, width), x.dtype)
    for t0 in range(0, seq, block):
        steps = slice(t0, min(seq, t0 + block))
        decay = np.multiply(dt[steps], at)
        np.exp(decay, out=decay)
        states = dx[steps] * bt[steps]  # [T, K, G, N, H/G]
        for i in range(decay.shape[0]):
            if starts and t0 + i in starts:  # sequences start here, each from its own row's state
                prev = prev.copy()  # the last step's states stay as they are for its outputs
                for lane, row in starts[t0 + i]:
                    prev[lane] = rows[row]
            np.multiply(decay[i], prev, out=decay[i])
            np.add(states[i], decay[i], out=states[i])
            prev = states[i]
            if ends and t0 + i in ends:
                for lane, row in ends[t0 + i]:
                    rows[row] = prev[lane]
        y[steps] = ct[steps] @ states
        if keep is not None:
            keep[:, t0 // block] = swap(prev).reshape(count, hidden, n)
    np.copyto(state, swap(rows if starts else prev).reshape(state.shape))
    return np.moveaxis(y.reshape(seq, count, hidden), 0, 1)
