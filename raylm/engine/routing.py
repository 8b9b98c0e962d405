"""Routing a request to one of the supervisor's engine cores: pure functions of
the cores' loads, and a bounded table of prompt prefixes for affinity.

A request goes to the core with the lowest load score

    score = in_flight + 2 * waiting + kv_cache_usage

where `in_flight` counts the requests the supervisor sent it that have not
finished (exact and immediate), `waiting` is the core's own count of queued
requests at its last report (queued work costs more than running work: it
waits for a batch slot), and `kv_cache_usage` (0..1) breaks ties towards the
emptier cache. With prefix affinity, a request whose prompt starts with the
same `AFFINITY_TOKENS` tokens as an earlier one goes to that one's core (its
prefix cache holds them) unless that core is busier than the least busy by
more than `AFFINITY_SLACK`.

Rebalancing (`plan_rebalance`) moves running requests, by live migration,
from the busiest core to the least busy when their scores differ by at least
`REBALANCE_MIN_GAP` and the busiest carries at least `REBALANCE_MIN_RATIO`
times the other's score (plus one): half the gap, so that the two meet in
the middle and nothing bounces back. The supervisor adds the hysteresis in
time (one move at a time, a pause after it, a request moved at most once
per cooldown).

`Router` is the supervisor's part that sends each request, new or sent again
after a failure, to a core and records it in the ledger (ledger.py). The
choice among the serving cores is its `RoutingPolicy`'s alone (least loaded,
or prefix affinity): a new policy, KV-aware routing say, is another
`choose` behind the same interface, and nothing else changes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from raylm.engine.core_channel import CoreChannel
from raylm.engine.ledger import Ledger
from raylm.engine.protocol import EngineCoreRequest

AFFINITY_TOKENS = 64
REBALANCE_MIN_GAP = 4
REBALANCE_MIN_RATIO = 1.5
AFFINITY_SLACK = 4
_AFFINITY_ENTRIES = 16384


@dataclass(frozen=True)
class CoreLoad:
    """What routing knows of one serving core."""

    index: int
    in_flight: int
    num_waiting: int = 0
    kv_cache_usage: float = 0.0

    @property
    def score(self) -> float:
        return self.in_flight + 2 * self.num_waiting + self.kv_cache_usage


def load_of(channel: CoreChannel) -> CoreLoad:
    """What routing knows of `channel`: its requests in flight and its last report."""
    stats = channel.stats
    return CoreLoad(channel.index, len(channel.in_flight), stats.num_waiting if stats else 0,
                    stats.kv_cache_usage if stats else 0.0)


def least_loaded(loads: list[CoreLoad]) -> CoreLoad | None:
    """The core with the lowest score (the lowest index among equals)."""
    return min(loads, key=lambda load: (load.score, load.index), default=None)


class RoutingPolicy(Protocol):
    """Chooses the core for a request among the serving ones (None: none serves)."""

    def choose(self, prompt_token_ids: list[int], loads: list[CoreLoad]) -> CoreLoad | None: ...


class LeastLoaded:
    def choose(self, prompt_token_ids: list[int], loads: list[CoreLoad]) -> CoreLoad | None:
        return least_loaded(loads)


class PrefixAffinity:
    """The core that last served each prompt prefix, the most recent
    `_AFFINITY_ENTRIES` prefixes only (least recently used leave first)."""

    def __init__(self, max_entries: int = _AFFINITY_ENTRIES):
        self._cores: OrderedDict[int, int] = OrderedDict()
        self._max_entries = max_entries

    def choose(self, prompt_token_ids: list[int], loads: list[CoreLoad]) -> CoreLoad | None:
        """The least loaded core, or the one that served this prompt's prefix
        if it is not much busier; remembers the choice."""
        best = least_loaded(loads)
        if best is None or len(prompt_token_ids) < AFFINITY_TOKENS:
            return best
        key = hash(tuple(prompt_token_ids[:AFFINITY_TOKENS]))
        by_index = {load.index: load for load in loads}
        preferred = by_index.get(self._cores.get(key, -1))
        if preferred is not None and preferred.score <= best.score + AFFINITY_SLACK:
            best = preferred
        self._cores[key] = best.index
        self._cores.move_to_end(key)
        if len(self._cores) > self._max_entries:
            self._cores.popitem(last=False)
        return best


def plan_rebalance(loads: list[CoreLoad]) -> tuple[int, int, int] | None:
    """(from core, to core, how many requests) when the load is uneven enough
    to be worth moving requests; None otherwise."""
    if len(loads) < 2:
        return None
    busiest = max(loads, key=lambda load: (load.score, -load.index))
    idlest = least_loaded(loads)
    gap = busiest.score - idlest.score
    if gap < REBALANCE_MIN_GAP or busiest.score < REBALANCE_MIN_RATIO * (idlest.score + 1):
        return None
    return busiest.index, idlest.index, max(1, int(gap // 2))


class Router:
    """Sends requests to cores: the serving core its policy chooses, or the
    rank its client asked for; a request no core can take waits in the
    ledger for one. Every send goes through `dispatch`, which records it."""

    def __init__(self, ledger: Ledger, policy: RoutingPolicy, encode):
        self.ledger = ledger
        self.policy = policy
        self._encode = encode

    def choose(self, request: EngineCoreRequest, rank: int | None) -> CoreChannel | None:
        """The core for `request`; ValueError for a rank that does not serve."""
        channels = self.ledger.channels
        if rank is not None:
            channel = channels.get(rank)
            if channel is None or channel.draining:
                raise ValueError(f"data_parallel_rank {rank} is not a serving replica "
                                 f"(serving: {sorted(c.index for c in self.ledger.serving())})")
            return channel
        best = self.policy.choose(request.prompt_token_ids, [load_of(c) for c in self.ledger.serving()])
        return None if best is None else channels[best.index]

    def add(self, request: EngineCoreRequest, frame: bytes, rank: int | None) -> None:
        """A new request (`frame`: it, encoded), into the ledger and to its core."""
        channel = self.choose(request, rank)
        self.ledger.add(request, pinned=rank is not None)
        if channel is None:
            self.ledger.wait(request.request_id)
            return
        self.dispatch(channel, request.request_id, frame)

    def dispatch(self, channel: CoreChannel, request_id: str, frame: bytes) -> None:
        self.ledger.assign(request_id, channel)
        channel.send(frame)

    def resubmit(self, request_id: str) -> None:
        """Send a request in the ledger again, after the tokens it already produced."""
        entry = self.ledger.get(request_id)
        if entry is None:
            return
        request = entry.continuation()
        channel = self.choose(request, None)
        if channel is None:
            self.ledger.wait(request_id)
            return
        self.dispatch(channel, request_id, self._encode(request))

    def send_waiting(self) -> None:
        """Housekeeping: the requests that waited go to a core, once one serves."""
        for request_id in self.ledger.take_waiting():
            self.resubmit(request_id)
