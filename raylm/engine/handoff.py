"""Prefill/decode disaggregation, the supervisor's side (issue 50, its first
step): with `--prefill-replicas P`, replicas 0..P-1 prefill and the others
decode (`raylm.config.replica_role`: by index, so a replica restarted or
replaced keeps its role, a scale-out adds decode replicas and a scale-in
removes them first).

One hand-off, in order:
1. Routing sends every request, new or sent again after a failure (a
   continuation recomputes its prompt and tokens: a prefill), to a prefill
   replica (`route_candidates`); when none serves, the decode replicas serve
   both roles (counted `prefill_on_decode`).
2. The prefill replica computes the prompt and samples the first token, and
   its message carries that token to the client at once: the supervisor
   passes the outputs up before anything moves.
3. Seeing a request's tokens come from a prefill replica (`on_outputs`), the
   supervisor picks the decode replica by the routing policy's cost among
   the decode replicas that can take K/V, and starts a live migration there
   whose first stage is its final one (raylm.engine.migration, `final_only`:
   no pre-copy; the prompt's blocks, once): the source pauses the request
   after its steps in flight, the ledger hands it over, the destination
   imports the blocks and resumes it after the same tokens, sampler state
   included (the continuation's seed offset, grammar and penalties).

What finishes on the prefill replica: a request whose first token ends it
(`max_tokens=1`, EOS or a stop token; a stop string too, which the front end
aborts), a request with prompt logprobs (a later recovery would compute them
again at its new replica: kept where they were computed), and one pinned to a
replica by its client (`data_parallel_rank`). Each child of `n > 1` is a
request of its own and hands off alone.

Never a failed request: whatever stops a hand-off, the request goes on where
it is, as a migration that did not happen does (counted by cause): no decode
replica serving or able to move K/V (`no_decode`), the destination had no
room (`no_room`) or refused, a K/V transfer failed (`failed`), the
destination left before the hand-over (`destination_gone`; after it, the
ledger's recovery takes the request, recomputed on a prefill replica and
handed off again), the prefill replica left (`source_gone`: recovery), or the
request ended meanwhile (`ended`: finished or aborted). A request tries one
hand-off per start of a prefill core that holds it: a fallback stays where it
is to its end; one that moved, or whose destination left, tries again if it
comes back to a prefill replica (a recovery, a drain).

A drain (scale-in, restart) or a migration without a destination prefers
the decode replicas too (`migration_candidates`).

The prefill replica may send a token or a decode burst more before the
final export reaches it (the supervisor reads behind the cores); those are
the ledger's and the client's like any, and the final stage carries them.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass

from raylm.config import EngineConfig, replica_role
from raylm.core.outputs import EngineCoreOutput
from raylm.engine.core_channel import CoreChannel
from raylm.engine.kv_routes import KVRoutes
from raylm.engine.ledger import Ledger
from raylm.engine.migration import Migration, Migrations
from raylm.engine.protocol import EngineCoreRequest, HandoffStats
from raylm.engine.routing import RoutingPolicy, load_of

logger = logging.getLogger("raylm.engine.supervisor")

# The migrations' reason for a hand-off (their metrics count it apart).
REASON = "pd_handoff"

# Every outcome, exported from the start (a fixed label set): `ok` moved; the
# rest say why the request stayed, or where it went instead (module docstring).
OUTCOMES = (
    "ok",
    "short_prompt",
    "queued",
    "held",
    "finished_on_prefill",
    "kept_on_prefill",
    "no_decode",
    "no_room",
    "refused",
    "failed",
    "destination_gone",
    "source_gone",
    "ended",
    "prefill_on_decode",
)

# How a migration's end says why it did not happen (migration.py and
# core_migration.py's words).
_ENDED = "the request ended"
_NO_ROOM = "no room for"
_TRANSFER_FAILED = "K/V failed"

# Conditional disaggregation's default threshold, in prompt tokens (capped at
# a quarter of the context, so that a short-context model still hands off).
PD_MIN_PROMPT_TOKENS = 256
# A queued hand-off is tried again after 50 ms, 100 ms, 200 ms, then decodes
# where it is (`no_room`): the queue always drains, so the admission it holds
# back never waits for long.
QUEUE_RETRIES = 3
QUEUE_FIRST_WAIT_S = 0.05


def min_prompt_tokens(config: EngineConfig) -> int:
    """The prompt length from which a request is handed off (`--pd-min-prompt-tokens`)."""
    threshold = config.parallel_config.pd_min_prompt_tokens
    if threshold is not None:
        return threshold
    return min(PD_MIN_PROMPT_TOKENS, config.model_config.max_model_len // 4)


@dataclass
class Queued:
    """A finished prefill waiting for decode room (decoding where it is meanwhile)."""

    source: CoreChannel
    tries: int  # the hand-offs it tried that found no room
    due: float  # when it tries again


class Handoffs:
    """The supervisor's part for P/D: which role each replica has, where a
    new request goes, and the hand-offs, which it starts through the
    migrations and counts by outcome when they end (`Migrations.on_end`)."""

    def __init__(
        self, config: EngineConfig, ledger: Ledger, migrations: Migrations, routes: KVRoutes, policy: RoutingPolicy
    ):
        # Settable while serving (the chaos harness turns roles on mid-schedule).
        self.prefill_replicas = config.parallel_config.prefill_replicas
        self.min_prompt_tokens = min_prompt_tokens(config)
        self.queue_size = config.parallel_config.pd_handoff_queue
        self._ledger = ledger
        self._migrations = migrations
        self._routes = routes  # which cores cannot move K/V
        self._policy = policy  # the decode replica is chosen by its cost
        # Request id -> the start of the prefill core that tried to hand it
        # off: one try per core that holds it (see the module docstring).
        self._tried: dict[str, CoreChannel] = {}
        # Finished prefills waiting for decode room, oldest first.
        self.queue: dict[str, Queued] = {}
        # New requests held back while every prefill replica's queue is full.
        self._held: set[str] = set()
        self.counts: collections.Counter[str] = collections.Counter()
        self._events: list[HandoffStats] = []
        migrations.on_end = self._migration_ended
        migrations.prefer = self.migration_candidates

    @property
    def enabled(self) -> bool:
        return self.prefill_replicas > 0

    def role_of(self, index: int) -> str:
        return replica_role(index, self.prefill_replicas)

    # ---- routing -----------------------------------------------------------------------

    def route_candidates(self, request: EngineCoreRequest, serving: list[CoreChannel]) -> list[CoreChannel]:
        """The cores `request` may be routed to among `serving`: a decode
        replica for a short prompt; else the prefill replicas whose queue of
        finished prefills has room (none: it waits in the ledger, admission
        held back until one drains); with no prefill replica serving, the
        decode ones (which then prefill too)."""
        if not self.enabled:
            return serving
        decode = [c for c in serving if self.role_of(c.index) == "decode"]
        if decode and len(request.prompt_token_ids) < self.min_prompt_tokens:
            self._count("short_prompt")  # (a continuation's prompt holds its tokens so far)
            return decode
        prefill = [c for c in serving if self.role_of(c.index) == "prefill"]
        admitting = [c for c in prefill if self._admits(c)]
        if admitting:
            self._held.discard(request.request_id)
            return admitting
        if prefill:
            if request.request_id not in self._held:
                self._held.add(request.request_id)
                self._count("held")
            return []
        if serving:
            self._count("prefill_on_decode")
        return serving

    def _admits(self, channel: CoreChannel) -> bool:
        """Whether prefill replica `channel` takes new prompts: its queue is not full."""
        if self.queue_size == 0:
            return True
        return sum(1 for q in self.queue.values() if q.source is channel) < self.queue_size

    @property
    def num_held(self) -> int:
        """New requests held back in the ledger while every prefill replica's queue is full."""
        return len(self._held)

    def queued_on(self, index: int) -> int:
        """How many finished prefills on replica `index` wait for decode room."""
        return sum(1 for q in self.queue.values() if q.source.index == index)

    def migration_candidates(self, candidates: list[CoreChannel]) -> list[CoreChannel]:
        """Where a drain (scale-in, restart) or a migration with no destination
        sends a running request: a decode replica if one can take it (from a
        prefill replica it would be handed there anyway), else any."""
        if not self.enabled:
            return candidates
        return [c for c in candidates if self.role_of(c.index) == "decode"] or candidates

    def _decode_destination(self, request: EngineCoreRequest) -> CoreChannel | None:
        """The decode replica with the lowest routing cost that can take K/V now."""
        candidates = [
            c
            for c in self._ledger.serving()
            if self.role_of(c.index) == "decode" and c.rebuilding_since is None and not self._routes.cannot_move_kv(c)
        ]
        best = self._policy.choose(request, [load_of(c) for c in candidates]) if candidates else None
        return None if best is None else self._ledger.channels[best.index]

    # ---- the hand-off ----------------------------------------------------------------------

    def on_outputs(self, channel: CoreChannel, outputs: list[EngineCoreOutput]) -> None:
        """After the supervisor took a core's outputs into the ledger (and
        before they go up): requests with tokens from a prefill replica move
        to a decode one; those that ended there are counted."""
        if not self.enabled:
            return
        prefill = self.role_of(channel.index) == "prefill"
        for out in outputs:
            if out.finished:
                self.queue.pop(out.request_id, None)
                tried = self._tried.pop(out.request_id, None)
                if prefill and tried is not channel:  # (a try's end is counted when its migration ends)
                    self._count("finished_on_prefill")
            elif prefill and out.new_token_ids and self._tried.get(out.request_id) is not channel:
                self._hand_off(channel, out.request_id)
        if len(self._tried) > 2 * len(self._ledger) + 1024:  # requests that left another way (failed culprits)
            self._tried = {rid: c for rid, c in self._tried.items() if rid in self._ledger}
            self._held &= set(self._ledger)

    def _movable(self, source: CoreChannel, request_id: str) -> bool:
        entry = self._ledger.get(request_id)
        return not (
            entry is None or entry.channel != source.index or entry.held or request_id in self._migrations.by_request
        )

    def _hand_off(self, source: CoreChannel, request_id: str) -> None:
        if not self._movable(source, request_id):
            return  # not movable now (another migration under way): its next token tries again
        self._tried[request_id] = source
        entry = self._ledger[request_id]
        if entry.pinned or entry.request.sampling_params.prompt_logprobs is not None:
            self._count("kept_on_prefill")
            return
        self._start(source, request_id)

    def _start(self, source: CoreChannel, request_id: str) -> None:
        destination = self._decode_destination(self._ledger[request_id].request)
        if destination is None:
            self.queue.pop(request_id, None)
            self._count("no_decode")
            return
        if not self._migrations.migrate(request_id, destination.index, REASON, final_only=True):
            self.queue.pop(request_id, None)
            self._count("refused")  # (the source cannot move K/V: it has failed transfers)

    def retry_queued(self) -> None:
        """Housekeeping: the queued hand-offs whose wait is over try again;
        one whose source left or stopped prefilling leaves the queue (a
        recovery or a drain moves it)."""
        now = time.monotonic()
        for request_id, queued in list(self.queue.items()):
            source, entry = queued.source, self._ledger.get(request_id)
            if (
                entry is None
                or entry.channel != source.index
                or not self._ledger.serves(source)
                or self.role_of(source.index) != "prefill"
            ):
                del self.queue[request_id]
            elif queued.due <= now and self._movable(source, request_id):
                self._start(source, request_id)  # (it stays queued until the try ends)

    def _migration_ended(self, migration: Migration, ok: bool, why: str) -> None:
        """Every migration's end (Migrations.on_end): a hand-off's outcome."""
        if migration.reason != REASON:
            return
        request_id = migration.request_id
        if ok:
            # It decodes elsewhere now: should it come back to a prefill
            # replica (a recovery, a drain), it is handed off again.
            self.queue.pop(request_id, None)
            self._tried.pop(request_id, None)
            self._count("ok", time.monotonic() - migration.started)
            return
        outcome = self._failure(migration, why)
        if outcome == "no_room" and self._enqueue(migration):
            outcome = "queued"
        else:
            self.queue.pop(request_id, None)
        if outcome == "destination_gone":  # (recovered, or resumed here): it may try again
            self._tried.pop(request_id, None)
        self._count(outcome)
        logger.info("P/D hand-off of request %s: %s (%s)", request_id[:64], outcome, why)

    def _enqueue(self, migration: Migration) -> bool:
        """A hand-off that found no room waits (decoding where it is) to try
        again, if its prefill replica's queue has room and it has tries left."""
        source, queued = migration.source_channel, self.queue.get(migration.request_id)
        tries = 1 if queued is None else queued.tries + 1
        if tries > QUEUE_RETRIES or not self._ledger.serves(source):
            return False
        if queued is None and not self._admits(source):
            return False
        due = time.monotonic() + QUEUE_FIRST_WAIT_S * 2 ** (tries - 1)
        self.queue[migration.request_id] = Queued(source, tries, due)
        return True

    def _failure(self, migration: Migration, why: str) -> str:
        # A core that left has left the ledger before its migrations end.
        if not self._ledger.serves(migration.source_channel):
            return "source_gone"
        if not self._ledger.serves(migration.destination_channel):
            return "destination_gone"
        if why == _ENDED:
            return "ended"
        if why.startswith(_NO_ROOM):
            return "no_room"
        if _TRANSFER_FAILED in why:
            return "failed"
        return "refused"

    # ---- hooks for the rest of the supervisor ---------------------------------------------

    def request_gone(self, request_id: str) -> None:
        """The client aborted it (its hand-off, if any, ends as a migration does)."""
        self._tried.pop(request_id, None)
        self.queue.pop(request_id, None)
        self._held.discard(request_id)

    def _count(self, outcome: str, seconds: float | None = None) -> None:
        self.counts[outcome] += 1
        self._events.append(HandoffStats(outcome, seconds))

    def has_events(self) -> bool:
        return bool(self._events)

    def take_events(self) -> list[HandoffStats]:
        events, self._events = self._events, []
        return events
