"""CUDA-graph bookkeeping as pure logic: when a sequence is captured, replayed, dropped."""
from __future__ import annotations

import pytest

from rlx_gpu.backends.graph_cache import GraphCache, GraphKey, Generations


class Recorder:
    """A GraphDriver that records what the cache asks of it; a "graph" is the list of launches captured."""

    def __init__(self, fail_capture: bool = False):
        self.fail_capture = fail_capture
        self.log: list[tuple[str, object]] = []
        self.live: set[int] = set()

    def capture(self, record):
        if self.fail_capture:
            raise RuntimeError("operation not permitted when stream is capturing")
        launched: list[str] = []
        self.sink = launched
        record()
        self.sink = None
        graph = (len(self.log), tuple(launched))
        self.live.add(graph[0])
        self.log.append(("capture", graph))
        return graph

    def replay(self, graph):
        assert graph[0] in self.live, "replayed a released graph"
        self.log.append(("replay", graph))

    def release(self, graph):
        self.live.remove(graph[0])
        self.log.append(("release", graph))


def sequence(driver, name, n=8):
    """A record function that enqueues ``n`` launches (into the capture when capturing, else eagerly)."""
    def record():
        for i in range(n):
            (driver.sink if getattr(driver, "sink", None) is not None else driver.log).append(f"{name}{i}")
    return record


def test_eager_then_capture_then_replay():
    d = Recorder()
    cache = GraphCache(d)
    key = GraphKey("lstm-steps", (1, 2))
    assert cache.run(key, sequence(d, "step"), 8) == "eager"
    assert d.log[:8] == [f"step{i}" for i in range(8)]
    assert cache.run(key, sequence(d, "step"), 8) == "captured"
    captured = d.log[8]
    assert captured[0] == "capture" and captured[1][1] == tuple(f"step{i}" for i in range(8))
    assert d.log[9] == ("replay", captured[1])  # the captured launches run once, by replay
    assert cache.run(key, sequence(d, "step"), 8) == "replayed"
    assert len(d.log) == 11 and cache.counts == {"eager": 1, "captured": 1, "replayed": 1}


def test_short_or_uncapturable_sequences_stay_eager():
    d = Recorder()
    cache = GraphCache(d, min_launches=4)
    for _ in range(3):
        assert cache.run(GraphKey("short", (1,)), sequence(d, "s", 3), 3) == "eager"
        assert cache.run(GraphKey("host-fallback-inside", (1,)), sequence(d, "h"), 8, capturable=False) == "eager"
    assert len(cache) == 0 and not any(entry[0] == "capture" for entry in d.log if isinstance(entry, tuple))


def test_reallocation_invalidates():
    d = Recorder()
    gens = Generations()
    arena, scratch = gens.new(), gens.new()
    cache = GraphCache(d)
    key = GraphKey("body", (arena, scratch))
    for _ in range(3):
        cache.run(key, sequence(d, "b"), 5)
    assert len(cache) == 1
    new_scratch = gens.new()  # the scratch grew: a new allocation, a new generation
    assert new_scratch not in (arena, scratch)
    assert cache.forget_generation(scratch) == 1 and len(cache) == 0 and not d.live
    new_key = GraphKey("body", (arena, new_scratch))
    assert cache.run(new_key, sequence(d, "b"), 5) == "eager"  # seen afresh: the old pointers are gone
    assert cache.run(new_key, sequence(d, "b"), 5) == "captured"


def test_schedule_change_is_a_new_key_and_capacity_bounds_the_cache():
    d = Recorder()
    cache = GraphCache(d, capacity=2)
    keys = [GraphKey(("schedule", i), (1,)) for i in range(3)]
    for key in keys:
        cache.run(key, sequence(d, "x"), 6)
        assert cache.run(key, sequence(d, "x"), 6) == "captured"
    assert len(cache) == 2 and len(d.live) == 2
    assert cache.run(keys[0], sequence(d, "x"), 6) == "captured"  # the least recently used was released
    assert cache.run(keys[2], sequence(d, "x"), 6) == "replayed"
    cache.clear()
    assert not d.live and len(cache) == 0


def test_a_failed_capture_runs_eagerly_and_is_not_retried():
    d = Recorder(fail_capture=True)
    cache = GraphCache(d)
    key = GraphKey("uncapturable", (1,))
    cache.run(key, sequence(d, "u"), 6)
    assert cache.run(key, sequence(d, "u"), 6) == "eager"
    assert "not permitted" in cache.refused(key)
    d.fail_capture = False
    assert cache.run(key, sequence(d, "u"), 6) == "eager"
    assert d.log.count("u0") == 3  # every run did enqueue its launches


@pytest.mark.parametrize("gen_used", [True, False])
def test_forget_only_touches_graphs_using_the_generation(gen_used):
    d = Recorder()
    cache = GraphCache(d)
    a, b = GraphKey("a", (1, 2)), GraphKey("b", (3, 4))
    for key in (a, b, a, b):
        cache.run(key, sequence(d, key.sequence), 4)
    assert cache.forget_generation(2 if gen_used else 9) == (1 if gen_used else 0)
    assert cache.run(b, sequence(d, "b"), 4) == "replayed"
