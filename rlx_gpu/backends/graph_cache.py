"""When to capture a repeated launch sequence as a CUDA graph, which graph to replay, when to drop it.

Pure bookkeeping over a :class:`GraphDriver` (the CUDA backend implements it with CuPy's stream
capture): a sequence — the step loop of one recurrent thunk, one step of a scan body that runs wholly
on the device — is keyed by what it launches plus the allocations it touches (arena, scratch: each
allocation gets a new *generation*, so a reallocated buffer never meets a graph holding its old
pointer). The first sighting of a key runs eagerly (it loads modules and may grow scratch, neither of
which a capture may do); the second captures and replays; later ones replay. Releasing an
allocation drops the graphs that point into it; the cache keeps at most ``capacity`` graphs (least
recently used go first), so changing schedules cannot grow it without bound.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Generic, Hashable, Protocol, TypeVar

G = TypeVar("G")


@dataclass(frozen=True)
class GraphKey:
    """What a captured graph replays: the launch sequence and the generations of the buffers it uses."""

    sequence: Hashable
    generations: tuple[int, ...]


class GraphDriver(Protocol[G]):
    """The three operations the cache needs from a graph API."""

    def capture(self, record: Callable[[], None]) -> G:
        """Run ``record`` (which enqueues the launches) under stream capture; the instantiated graph."""

    def replay(self, graph: G) -> None:
        """Launch ``graph`` on the session's stream."""

    def release(self, graph: G) -> None:
        """Free ``graph``."""


class GraphCache(Generic[G]):
    """Decides eager / capture / replay per key and owns the captured graphs."""

    def __init__(self, driver: GraphDriver[G], capacity: int = 64, min_launches: int = 4):
        self.driver = driver
        self.capacity = capacity
        self.min_launches = min_launches  # below this, a replay saves less than a capture costs
        self._graphs: OrderedDict[GraphKey, G] = OrderedDict()
        self._seen: set[GraphKey] = set()
        self._refused: dict[GraphKey, str] = {}  # keys whose capture failed, with the reason (never retried)
        self.counts = {"eager": 0, "captured": 0, "replayed": 0}

    def run(self, key: GraphKey, record: Callable[[], None], launches: int, capturable: bool = True,
            min_launches: int | None = None) -> str:
        """Run the sequence ``record`` enqueues, through a graph when that pays; says which way it ran.

        ``min_launches`` replaces the cache's threshold for this sequence: a scan body's step passes 1,
        since its replay saves the driver's per-step host work besides the launches.
        """
        how = self._decide(key, launches, capturable, self.min_launches if min_launches is None else min_launches)
        if how == "replayed":
            self._graphs.move_to_end(key)
            self.driver.replay(self._graphs[key])
        elif how == "captured":
            try:
                graph = self.driver.capture(record)
            except Exception as err:  # noqa: BLE001 - any capture failure means: run this key eagerly from now on
                self._refused[key] = f"{type(err).__name__}: {err}"
                record()
                how = "eager"
            else:
                self._graphs[key] = graph
                self._evict()
                self.driver.replay(graph)
        else:
            record()
        self._seen.add(key)
        self.counts[how] += 1
        return how

    def _decide(self, key: GraphKey, launches: int, capturable: bool, min_launches: int) -> str:
        if key in self._graphs:
            return "replayed"
        if not capturable or launches < min_launches or key in self._refused or key not in self._seen:
            return "eager"
        return "captured"

    def _evict(self) -> None:
        while len(self._graphs) > self.capacity:
            _, graph = self._graphs.popitem(last=False)
            self.driver.release(graph)

    def forget_generation(self, generation: int) -> int:
        """Drop every graph and record that uses the allocation ``generation`` (it is being freed or
        reallocated); the number of graphs released."""
        stale = [k for k in self._graphs if generation in k.generations]
        for key in stale:
            self.driver.release(self._graphs.pop(key))
        self._seen = {k for k in self._seen if generation not in k.generations}
        self._refused = {k: v for k, v in self._refused.items() if generation not in k.generations}
        return len(stale)

    def refused(self, key: GraphKey) -> str | None:
        """Why ``key`` runs eagerly for good (its capture failed), or None."""
        return self._refused.get(key)

    def clear(self) -> None:
        """Release every graph (the session is closing)."""
        while self._graphs:
            self.driver.release(self._graphs.popitem()[1])
        self._seen.clear()
        self._refused.clear()

    def __len__(self) -> int:
        return len(self._graphs)


class Generations:
    """Hands out allocation generations: a fresh number for every allocation, never reused."""

    def __init__(self) -> None:
        self._next = 0

    def new(self) -> int:
        self._next += 1
        return self._next
