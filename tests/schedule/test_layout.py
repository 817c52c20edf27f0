"""The arena layout: alignment, no overlap between buffers live at once, reuse, pinned buffers."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rlx_gpu.graph.layout import ALIGN, aligned, arena_layout


def _intervals(sizes, steps, live_in, live_out):
    """Live range of every buffer, computed independently of the layout."""
    n = len(steps)
    rng = {}
    for key in sizes:
        touched = [i for i, s in enumerate(steps) if key in s]
        lo = -1 if key in live_in else (min(touched) if touched else n)
        hi = n if key in live_in or key in live_out else (max(touched) if touched else n)
        rng[key] = (lo, hi)
    return rng


def _check(sizes, steps, live_in=(), live_out=()):
    p = arena_layout(sizes, steps, live_in, live_out)
    live = _intervals(sizes, steps, set(live_in), set(live_out))
    for key, off in p.offsets.items():
        assert off % ALIGN == 0
        assert off + sizes[key] <= p.arena_bytes
    keys = list(sizes)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            (a0, a1), (b0, b1) = live[a], live[b]
            if a0 <= b1 and b0 <= a1:  # live at a common step: bytes must be disjoint
                oa, ob = p.offsets[a], p.offsets[b]
                assert oa + aligned(sizes[a]) <= ob or ob + aligned(sizes[b]) <= oa, (a, b, p.offsets)
    return p


def test_chain_reuses_dead_space():
    # t0 -> t1 -> t2 -> t3: only two neighbours are ever live together.
    sizes = {k: 1000 for k in range(4)}
    p = _check(sizes, [[0, 1], [1, 2], [2, 3]])
    assert p.arena_bytes == 2 * aligned(1000)
    assert p.report.tensor_bytes == 4 * aligned(1000)
    assert p.report.ratio == 0.5
    assert "arena 2.0 KiB for 4.0 KiB" in str(p.report)


def test_pinned_inputs_and_outputs_stay_live():
    sizes = {"in": 300, "mid": 300, "mid2": 300, "out": 300}
    steps = [["in", "mid"], ["mid", "mid2"], ["mid2", "out"]]
    p = _check(sizes, steps, live_in=["in"], live_out=["out"])
    # Unpinned, "in" dies after step 0 and "mid2" can take its bytes; pinned, nothing can.
    assert p.offsets["in"] not in (p.offsets["mid2"], p.offsets["out"])
    unpinned = arena_layout(sizes, steps)
    assert unpinned.arena_bytes < p.arena_bytes


def test_untouched_buffer_still_placed():
    p = _check({"a": 10, "b": 10}, [["a"]])
    assert set(p.offsets) == {"a", "b"}


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_programs_never_overlap_live_buffers(data):
    n = data.draw(st.integers(1, 8))
    sizes = {k: data.draw(st.integers(0, 3000)) for k in range(n)}
    steps = data.draw(st.lists(st.lists(st.sampled_from(list(sizes)), max_size=4), max_size=8))
    live_in = data.draw(st.lists(st.sampled_from(list(sizes)), max_size=2, unique=True))
    live_out = data.draw(st.lists(st.sampled_from(list(sizes)), max_size=2, unique=True))
    p = _check(sizes, steps, live_in, live_out)
    assert p.arena_bytes <= p.report.tensor_bytes
