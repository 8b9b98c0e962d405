"""Routing a request to one of the supervisor's engine cores: pure functions of
the cores' loads and of what their prefix caches hold, behind one interface
(`RoutingPolicy`, chosen by `--routing-policy`).

The load score of a core is

    score = in_flight + 2 * waiting + kv_cache_usage

where `in_flight` counts the requests the supervisor sent it that have not
finished (exact and immediate), `waiting` is the core's own count of queued
requests at its last report (queued work costs more than running work: it
waits for a batch slot), and `kv_cache_usage` (0..1) breaks ties towards the
emptier cache.

- `load`: the lowest score.
- `vllm`: vLLM's data-parallel balancer, `4 * waiting + running`, for
  comparison (it ignores the caches).
- `kv_aware` (the default): the lowest cost counted in prompt tokens, the
  work the core would do before this request's first token: the prompt
  tokens of its queue not computed yet, an estimate for its running
  decodes, a KV-usage term, and the prompt tokens this request would
  compute there (its length less the prefix the core holds; less, at a
  fraction of their cost, those a pull could bring from another core),
  less a credit where the core holds the request's LoRA adapter
  (`kv_aware_cost`; its weights, in tokens, are named below). So the holder
  of a long prefix wins unless its queue holds more work than recomputing
  that prefix elsewhere, and a multi-turn session follows its cache: the
  next turn's prompt extends the last one's, whose blocks the index saw
  stored (the supervisor's exact index, prefix_index.py).

Rebalancing (`plan_rebalance`) moves running requests, by live migration,
from the busiest core to the least busy when their scores differ by at least
`REBALANCE_MIN_GAP` and the busiest carries at least `REBALANCE_MIN_RATIO`
times the other's score (plus one): half the gap, so that the two meet in
the middle and nothing bounces back. The supervisor adds the hysteresis in
time (one move at a time, a pause after it, a request moved at most once
per cooldown).

`Router` is the supervisor's part that sends each request, new or sent again
after a failure, to a core and records it in the ledger (ledger.py); a new
request whose chosen core holds less of its prompt's prefix than another
core waits for that prefix to be pulled there first (prefix_pull.py). The
choice among the serving cores is its `RoutingPolicy`'s alone: a new policy
is another `choose` behind the same interface, and nothing else changes.
"""

from __future__ import annotations

import collections
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from raylm.engine.core_channel import CoreChannel
from raylm.engine.ledger import Ledger
from raylm.engine.prefix_index import PrefixIndex, prompt_block_hashes
from raylm.engine.prefix_pull import Pulls
from raylm.engine.protocol import EngineCoreRequest
from raylm.engine.tier_loads import TierLoads

REBALANCE_MIN_GAP = 4
REBALANCE_MIN_RATIO = 1.5


@dataclass(frozen=True)
class CoreLoad:
    """What routing knows of one serving core."""

    index: int
    in_flight: int
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    # Content digests of the LoRA adapters it holds (filled only when the
    # request being routed has one: `adapters_on`).
    adapters: frozenset[str] = frozenset()
    # Of its requests in flight, those whose first token has not come back
    # (`prefilling`), and the prompt tokens they still have to compute
    # there (`prefill_tokens`), from the ledger (`load_of`).
    prefilling: int = 0
    prefill_tokens: int = 0

    @property
    def score(self) -> float:
        return self.in_flight + 2 * self.num_waiting + self.kv_cache_usage

    @property
    def decoding(self) -> int:
        return max(self.in_flight - self.prefilling, 0)


def load_of(channel: CoreChannel, adapters: frozenset[str] = frozenset(), ledger: Ledger | None = None) -> CoreLoad:
    """What routing knows of `channel`: its requests in flight and its last
    report; with `ledger`, the prompt tokens its requests have yet to compute.

    Those are counted from what routing estimated when it sent each request
    (`LedgerEntry.prefill_tokens`: its prompt's length, exact, less the
    prefix its core held or was pulled, as the index said then) until its
    first token comes back. Estimated, not exact: a prefix evicted before
    the core schedules the request is computed but not counted, a prompt
    half computed by chunked prefill counts whole, and a preempted request's
    recompute is not seen. No core message is needed for it, and it moves the
    moment a request is routed, unlike the cores' periodic stats."""
    stats = channel.stats
    prefilling = prefill_tokens = 0
    if ledger is not None:
        for request_id in channel.in_flight:
            entry = ledger.get(request_id)
            if entry is not None and entry.prefill_tokens > 0:
                prefilling += 1
                prefill_tokens += entry.prefill_tokens
    return CoreLoad(
        channel.index,
        len(channel.in_flight),
        stats.num_waiting if stats else 0,
        stats.kv_cache_usage if stats else 0.0,
        adapters,
        prefilling,
        prefill_tokens,
    )


def adapters_on(channel: CoreChannel, ledger: Ledger) -> frozenset[str]:
    """The LoRA adapters `channel`'s core holds: those its slots held at its
    last report, and those of the requests sent to it since (exact and
    immediate: a burst for a new adapter follows the first of its requests)."""
    held = set(channel.stats.lora_slots) if channel.stats else set()
    for request_id in channel.in_flight:
        entry = ledger.get(request_id)
        if entry is not None and entry.request.lora_request is not None:
            held.add(entry.request.lora_digest)
    return frozenset(held)


def least_loaded(loads: list[CoreLoad]) -> CoreLoad | None:
    """The core with the lowest score (the lowest index among equals)."""
    return min(loads, key=lambda load: (load.score, load.index), default=None)


class RoutingPolicy(ABC):
    """Chooses the core for a new request among the serving ones."""

    name: str
    # Whether its choice reads each core's pending prompt tokens (CoreLoad's
    # prefilling / prefill_tokens), which the router then counts from the
    # ledger for every serving core: only for the policies that use them.
    counts_pending_prompt_tokens = False

    @abstractmethod
    def choose(self, request: EngineCoreRequest, loads: list[CoreLoad]) -> CoreLoad | None:
        """The core for `request` (None: no core serves)."""

    def tokens_to_compute(self, request: EngineCoreRequest, core: int) -> int:
        """The prompt tokens `request` is expected to compute on `core` (the
        ledger's count of each core's pending prompt work): all of them,
        unless the policy knows the core's cache."""
        return len(request.prompt_token_ids)


class LoadRouting(RoutingPolicy):
    name = "load"

    def choose(self, request: EngineCoreRequest, loads: list[CoreLoad]) -> CoreLoad | None:
        return least_loaded(loads)


class VllmRouting(RoutingPolicy):
    """vLLM's internal data-parallel balancer: the lowest `4 * waiting +
    running` (for comparison; it does not look at the caches)."""

    name = "vllm"

    def choose(self, request: EngineCoreRequest, loads: list[CoreLoad]) -> CoreLoad | None:
        def cost(load: CoreLoad) -> tuple[int, int]:
            running = max(load.in_flight - load.num_waiting, 0)
            return 4 * load.num_waiting + running, load.index

        return min(loads, key=cost, default=None)


# kv_aware's weights, all in prompt tokens (the one unit its cost counts in:
# a core's time to a request's first token is, on a CPU, mostly the prompt
# tokens it computes before and for it).
# A decoding request on the core: it adds a token to each of the core's
# steps (batched, so cheap alone) and holds a batch slot; counted as this
# many prompt tokens of work (an estimate, not measured per model).
DECODE_REQUEST_TOKENS = 64
# A full KV cache (usage 1.0) counts as this much more work: a request sent
# there evicts other prefixes, recomputed later, or waits for room. A
# tie-breaker among cores with little queued.
KV_USAGE_TOKENS = 256
# A prompt token a pull brings from another core (prefix_pull.py) costs this
# fraction of computing it: the copy itself is ~a tenth of the recompute on
# one node, but it waits for the holder's step to end and may time out into
# a recompute (pull_estimate.py), so it is weighted more than its copy.
PULL_TOKEN_WEIGHT = 0.25
# A core holding the request's LoRA adapter counts as this many tokens less
# loaded for it: another core would read the adapter's files and fill a
# slot (a step's worth of work or more), and take a slot another adapter
# may hold.
ADAPTER_CREDIT_TOKENS = 1024
# A prompt is hashed for routing up to this many blocks (the supervisor's
# CPU per request stays bounded).
MAX_ROUTING_BLOCKS = 1024


def kv_aware_cost(load: CoreLoad, prompt_tokens: int, cached_tokens: int, pulled_tokens: int, adapter: bool) -> float:
    """The work, in prompt tokens, that `load`'s core does before a request's
    first token if sent there: the prompt tokens its queue has yet to
    compute, its decodes and KV usage (weighted above), and the request's
    own `prompt_tokens`, less the `cached_tokens` the core holds and less
    the `pulled_tokens` a pull brings (which cost PULL_TOKEN_WEIGHT each);
    less ADAPTER_CREDIT_TOKENS where it holds the request's adapter."""
    queued = load.prefill_tokens + DECODE_REQUEST_TOKENS * load.decoding + KV_USAGE_TOKENS * load.kv_cache_usage
    own = prompt_tokens - cached_tokens - (1 - PULL_TOKEN_WEIGHT) * pulled_tokens
    return queued + own - (ADAPTER_CREDIT_TOKENS if adapter else 0)


class KVAwareRouting(RoutingPolicy):
    """The lowest `kv_aware_cost`: each core's pending work plus what the
    request would compute there, given the prompt's leading blocks each core
    holds (exact, from the supervisor's prefix index); `pulls`: whether
    prefix pulls bring the longest cached prefix to the core chosen."""

    name = "kv_aware"
    counts_pending_prompt_tokens = True

    def __init__(self, index: PrefixIndex, block_size: int, pulls: bool = False):
        self.index = index
        self.block_size = block_size
        self.pulls = pulls
        self.last_matched: dict[int, int] = {}  # the last choice's cached blocks per core (metrics, tests)
        self._most_matched = 0  # of those, the longest (what a pull brings to any core)
        self.last_hashes: tuple[str, list[bytes]] = ("", [])  # (request id, its prompt's block hashes)

    def _reused_tokens(self, core: int) -> tuple[int, int]:
        """(cached on `core`, pulled there from the best holder) for the last
        request chosen for, in tokens."""
        here = self.last_matched.get(core, 0)
        best = self._most_matched if self.pulls else here
        return here * self.block_size, max(best - here, 0) * self.block_size

    def choose(self, request: EngineCoreRequest, loads: list[CoreLoad]) -> CoreLoad | None:
        if not loads:
            return None
        max_blocks = min(MAX_ROUTING_BLOCKS, (len(request.prompt_token_ids) - 1) // self.block_size)
        hashes = prompt_block_hashes(
            request.prompt_token_ids, self.block_size, request.cache_salt, max_blocks, request.lora_digest
        )
        matched = self.index.matched_blocks(hashes, [load.index for load in loads]) if hashes else {}
        self.last_matched = matched
        self._most_matched = max(matched.values(), default=0)
        self.last_hashes = (request.request_id, hashes)
        digest = request.lora_digest
        prompt_tokens = len(request.prompt_token_ids)

        def cost(load: CoreLoad) -> tuple[float, int]:
            cached, pulled = self._reused_tokens(load.index)
            adapter = digest is not None and digest in load.adapters
            return kv_aware_cost(load, prompt_tokens, cached, pulled, adapter), load.index

        return min(loads, key=cost)

    def tokens_to_compute(self, request: EngineCoreRequest, core: int) -> int:
        if self.last_hashes[0] != request.request_id:
            return len(request.prompt_token_ids)
        cached, pulled = self._reused_tokens(core)
        return len(request.prompt_token_ids) - cached - pulled


ROUTING_POLICIES = ("kv_aware", "load", "vllm")
# Why a new request went where it went (raylm:routing_decisions_total):
# pinned by its client (data_parallel_rank), to a core holding some of its
# prompt's prefix, to one holding its LoRA adapter, by load alone, or
# queued (no core serving).
ROUTING_REASONS = ("pinned", "prefix", "adapter", "load", "queued")


def routing_policy(name: str, index: PrefixIndex, block_size: int, pulls: bool = False) -> RoutingPolicy:
    """`pulls`: whether prefix pulls are on (kv_aware counts what they bring)."""
    if name == "kv_aware":
        return KVAwareRouting(index, block_size, pulls)
    if name == "load":
        return LoadRouting()
    if name == "vllm":
        return VllmRouting()
    raise ValueError(f"routing_policy must be one of {', '.join(ROUTING_POLICIES)}, not {name!r}")


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
        # Where a new request's cached prefix is pulled to the core chosen
        # for it from another that holds more of it (raylm.engine.prefix_pull).
        self.pulls: Pulls | None = None
        # Where it is loaded from the node's tiers of evicted blocks instead
        # (raylm.engine.tier_loads), when they hold more of it.
        self.tier_loads: TierLoads | None = None
        self.decisions: collections.Counter[str] = collections.Counter()  # new requests, by ROUTING_REASONS
        # Which of the serving cores take new and resent requests (P/D: the
        # prefill replicas, raylm.engine.handoff); None: all of them.
        self.candidates: Callable[[EngineCoreRequest, list[CoreChannel]], list[CoreChannel]] | None = None
        self._adapter_held = False  # the last choice's core held its request's LoRA adapter

    def choose(self, request: EngineCoreRequest, rank: int | None) -> CoreChannel | None:
        """The core for `request`; ValueError for a rank that does not serve."""
        channels = self.ledger.channels
        if rank is not None:
            channel = channels.get(rank)
            if channel is None or channel.draining:
                raise ValueError(
                    f"data_parallel_rank {rank} is not a serving replica "
                    f"(serving: {sorted(c.index for c in self.ledger.serving())})"
                )
            return channel
        serving = self.ledger.serving()
        if self.candidates is not None:
            serving = self.candidates(request, serving)
        ledger = self.ledger if self.policy.counts_pending_prompt_tokens else None
        if request.lora_request is None:
            loads = [load_of(c, ledger=ledger) for c in serving]
        else:
            loads = [load_of(c, adapters_on(c, self.ledger), ledger) for c in serving]
        best = self.policy.choose(request, loads)
        self._adapter_held = best is not None and request.lora_digest in best.adapters
        return None if best is None else channels[best.index]

    def add(self, request: EngineCoreRequest, frame: bytes, rank: int | None) -> None:
        """A new request (`frame`: it, encoded), into the ledger and to its core."""
        channel = self.choose(request, rank)
        entry = self.ledger.add(request, pinned=rank is not None)
        self.decisions[self._reason(request, channel, rank)] += 1
        if channel is None:
            self.ledger.wait(request.request_id)
            return
        entry.prefill_tokens = self.policy.tokens_to_compute(request, channel.index)
        hashes = self._hashes_of(request)
        if self.tier_loads is not None:
            load = self.tier_loads.plan(request, channel, self.ledger.serving(), hashes)
            if load is not None:  # its prefix is in the node's tiers: loaded by the core as it adds it
                self.dispatch(channel, request.request_id, load)
                return
        if self.pulls is not None and self.pulls.start(request, frame, channel, hashes):
            return  # sent once its prefix is there (or the pull gave up)
        self.dispatch(channel, request.request_id, frame)

    def _reason(self, request: EngineCoreRequest, channel: CoreChannel | None, rank: int | None) -> str:
        if rank is not None:
            return "pinned"
        if channel is None:
            return "queued"
        request_id, _ = getattr(self.policy, "last_hashes", ("", None))
        matched = getattr(self.policy, "last_matched", {}) if request_id == request.request_id else {}
        if matched.get(channel.index, 0) > 0:
            return "prefix"
        return "adapter" if self._adapter_held else "load"

    def _hashes_of(self, request: EngineCoreRequest) -> list[bytes] | None:
        """Its prompt's block hashes, where the policy just computed them."""
        request_id, hashes = getattr(self.policy, "last_hashes", ("", None))
        return hashes if request_id == request.request_id else None

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
        entry.prefill_tokens = self.policy.tokens_to_compute(request, channel.index)
        self.dispatch(channel, request_id, self._encode(request))

    def send_waiting(self) -> None:
        """Housekeeping: the requests that waited go to a core, once one serves."""
        for request_id in self.ledger.take_waiting():
            self.resubmit(request_id)
