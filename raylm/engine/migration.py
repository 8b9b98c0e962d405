"""Live migration, the supervisor's side (the cores' side is
core_migration.py): a running request moves, with its KV cache, from one
engine core to another while the client's stream goes on.

One migration, as the supervisor drives it:

1. stage copies: the source writes the K/V blocks completed so far to
   per-rank files in the supervisor's private folder in shared memory, while
   the request keeps decoding; the destination reserves as many blocks and
   reads them in. Repeated while a stage still had many blocks to move;
2. the final stage: the source pauses the request (once no step of it is in
   flight) and writes the rest, its last partial block included; the
   request, with its tokens so far, now belongs to the destination in the
   ledger, which reads the rest in and resumes it after those tokens: no
   token is sampled twice or skipped, and nothing is recomputed;
3. the source drops its paused copy (commit), or resumes it if the
   destination refused (no room, an import error).

Either side may give up before the final stage: the request goes on at the
source and every reservation is freed. A source that dies mid-migration
leaves the request to the usual recovery (recompute on a survivor); a
destination that dies leaves it at the source, or, once it owned it, to the
usual recovery too.

The K/V takes one of two ways, chosen once per migration from its pair of
cores and sent in each of its messages: files in the supervisor's /dev/shm
folder, or the sealed network (kv_routes.py: which way, and which cores
cannot move K/V at all). Both are a KVTransport
(raylm.kv_transfer.transport): past the choice the supervisor names each
stage in its folder (StageFolder) and has the migration's transport end what
it made, whichever way it is.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from raylm.config import EngineConfig
from raylm.engine.core_channel import CoreChannel
from raylm.engine.kv_routes import KVRoutes
from raylm.engine.ledger import Ledger
from raylm.engine.protocol import (
    KVNetwork,
    MigrateEnd,
    MigrateExport,
    MigrateImport,
    MigrationReport,
    MigrationStats,
)
from raylm.engine.routing import Router, load_of, plan_rebalance
from raylm.kv_transfer.transport import KVTransport, transport_for

logger = logging.getLogger("raylm.engine.supervisor")

# A stage that moved at most this many blocks makes the next stage the last:
# what the request adds while a stage is read in is then small.
_FINAL_STAGE_BLOCKS = 2
_MAX_STAGES = 4
# A draining replica's request whose migration was given up (the destination
# had no room, say) is tried again after this long, until it moves or ends.
_RETRY_AFTER_S = 0.25
# Rebalancing: how often the loads are compared, and how long a request that
# was moved stays where it went (hysteresis: requests do not bounce).
_REBALANCE_INTERVAL_S = 0.5
_MOVED_COOLDOWN_S = 30.0


@dataclass
class Migration:
    migration_id: str
    request_id: str
    source: int
    destination: int
    reason: str
    started: float = field(default_factory=lambda: time.monotonic())
    stage: int = 0
    # Sent the final import: the request is the destination's in the ledger.
    handed_over: bool = False
    num_bytes: int = 0
    # When the source last sent the request a token (the pause the client
    # sees runs from there to the destination's first token).
    last_token_at: float | None = None
    # How the K/V crosses between the cores' nodes, as its messages say; None: through /dev/shm.
    network: KVNetwork | None = None
    # The same, as the transport that ends what the supervisor made for it (chosen with `network`).
    transport: KVTransport | None = field(default=None, repr=False)
    # When the destination reported the request queued there (the final stage read in).
    resumed_at: float | None = None
    # When the current stage's export was asked for (each stage's time is logged, at DEBUG).
    stage_started: float = field(default_factory=lambda: time.monotonic())
    # The two cores as they were when it started: an index may be served by
    # a replacement later (a new start, which never had the request).
    source_channel: CoreChannel | None = field(default=None, repr=False)
    destination_channel: CoreChannel | None = field(default=None, repr=False)


class Migrations(Mapping[str, Migration]):
    """The supervisor's part for live migration: the migrations in progress
    (it reads as a mapping of them, by migration id), rebalancing, and the events and counts they report. It
    moves requests only through the ledger, and sends through the channels
    the ledger holds."""

    def __init__(
        self,
        config: EngineConfig,
        ledger: Ledger,
        router: Router,
        routes: KVRoutes,
        encode: Callable[[object], bytes],
    ):
        self._config = config
        self._ledger = ledger
        self._router = router  # a request whose migration cannot be undone is sent again
        self._routes = routes  # which way K/V goes, and which cores cannot move it
        self._encode = encode
        self._migrations: dict[str, Migration] = {}  # by migration id
        self.by_request: dict[str, str] = {}  # request id -> migration id
        # Migrated requests waiting for their first token at the destination.
        self._resumed: dict[str, tuple[Migration, float]] = {}
        self._migration_events: list[MigrationStats] = []
        self.migration_counts = {"migrated": 0, "abandoned": 0}
        self._retry_at: dict[str, float] = {}  # request id -> when it may be tried again
        self._rebalance = config.parallel_config.data_parallel_rebalance
        self._next_rebalance = 0.0
        self._moved_at: dict[str, float] = {}  # request id -> when rebalancing moved it
        self._migration_ids = itertools.count()
        # Told of every migration that ends (ok, why): P/D hand-offs count their outcomes (handoff.py).
        self.on_end: Callable[[Migration, bool, str], None] | None = None
        # Narrows the candidates of a migration with no destination given (P/D: decode replicas first).
        self.prefer: Callable[[list[CoreChannel]], list[CoreChannel]] | None = None

    def __getitem__(self, migration_id: str) -> Migration:
        return self._migrations[migration_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._migrations)

    def __len__(self) -> int:
        return len(self._migrations)

    # ---- starting one ------------------------------------------------------------

    def migrate(
        self, request_id: str, destination: int | None = None, reason: str = "manual", final_only: bool = False
    ) -> bool:
        """Start moving `request_id` to core `destination` (None: the least
        loaded other serving core). False when it cannot move (unknown,
        already moving, no destination, a context-parallel engine, a
        source that cannot move K/V). `final_only`: no pre-copy, the first
        stage is the final one (a P/D hand-off: the prompt's blocks, once)."""
        entry = self._ledger.get(request_id)
        if entry is None or request_id in self.by_request or entry.channel < 0 or entry.held:
            return False
        if self._config.parallel_config.context_parallel_size > 1:
            return False  # a CP group's KV is sharded over its ranks: not movable yet (issue 26)
        source = self._ledger.channels.get(entry.channel)
        if source is None or self._routes.cannot_move_kv(source):
            return False
        target = self._migration_destination(source, destination)
        if target is None:
            return False
        network = self._routes.kv_network(source, target)
        migration = Migration(
            f"{os.getpid()}-{next(self._migration_ids)}",
            request_id,
            source.index,
            target.index,
            reason,
            network=network,
            transport=transport_for(network),
            source_channel=source,
            destination_channel=target,
        )
        self._migrations[migration.migration_id] = migration
        self.by_request[request_id] = migration.migration_id
        logger.info(
            "migrating request %s from core %d to core %d (%s, %s)",
            request_id[:64],
            source.index,
            target.index,
            reason,
            migration.transport.description,
        )
        self._export_stage(migration, final=final_only)
        return True

    def migrate_away(self, index: int, reason: str) -> int:
        """Start moving every request of core `index` elsewhere; how many could."""
        channel = self._ledger.channels.get(index)
        if channel is None:
            return 0
        return sum(self.migrate(request_id, reason=reason) for request_id in sorted(channel.in_flight))

    def retry_draining(self, reason_of: Callable[[int], str]) -> None:
        """Requests still on a draining replica move as soon as they can
        (those of a core that cannot move K/V finish where they run);
        `reason_of(index)` says why that replica drains."""
        now = time.monotonic()
        for channel in [c for c in self._ledger.channels.values() if c.draining and not self._routes.cannot_move_kv(c)]:
            reason = reason_of(channel.index)
            for request_id in sorted(channel.in_flight):
                if request_id not in self.by_request and self._retry_at.get(request_id, 0.0) <= now:
                    self._retry_at.pop(request_id, None)
                    self.migrate(request_id, reason=reason)

    def rebalance_if_due(self) -> None:
        """Every _REBALANCE_INTERVAL_S, with no migration in progress: move
        requests from a much busier core to the least busy (routing.plan_rebalance),
        the least advanced first (the fewest K/V blocks to move), never a
        request pinned to its core or moved within _MOVED_COOLDOWN_S."""
        now = time.monotonic()
        if not self._rebalance or self._migrations or now < self._next_rebalance:
            return
        self._next_rebalance = now + _REBALANCE_INTERVAL_S
        loads = [
            load_of(c)
            for c in self._ledger.serving()
            if c.rebuilding_since is None and not self._routes.cannot_move_kv(c)
        ]
        plan = plan_rebalance(loads)
        if plan is None:
            return
        source, destination, count = plan
        ledger = self._ledger
        movable = [
            rid
            for rid in ledger.channels[source].in_flight
            if rid in ledger
            and not ledger[rid].pinned
            and now - self._moved_at.get(rid, -_MOVED_COOLDOWN_S) >= _MOVED_COOLDOWN_S
        ]
        movable.sort(key=lambda rid: len(ledger[rid].token_ids))
        for request_id in movable[:count]:
            if self.migrate(request_id, destination, reason="rebalance"):
                self._moved_at[request_id] = now

    def _migration_destination(self, source: CoreChannel, index: int | None) -> CoreChannel | None:
        candidates = [
            c
            for c in self._ledger.serving()
            if c.index != source.index
            and c.rebuilding_since is None
            and not self._routes.cannot_move_kv(c)
            and (index is None or c.index == index)
        ]
        if not candidates:
            return None
        if index is None and self.prefer is not None:
            candidates = self.prefer(candidates)
        return min(candidates, key=lambda c: (len(c.in_flight), c.stats.kv_cache_usage if c.stats else 0.0))

    def _stage_path(self, migration: Migration) -> str:
        return self._routes.stage_folder.stage_path(migration.migration_id, migration.stage)

    def _export_stage(self, migration: Migration, final: bool) -> None:
        migration.stage_started = time.monotonic()
        migration.source_channel.send(
            self._encode(
                MigrateExport(
                    migration.migration_id, migration.request_id, self._stage_path(migration), final, migration.network
                )
            )
        )

    # ---- reports from the cores -----------------------------------------------------

    def on_report(self, channel: CoreChannel, report: MigrationReport) -> None:
        migration = self._migrations.get(report.migration_id)
        if migration is None:
            return  # ended already (aborted, a core died): its sides were told
        if channel is migration.source_channel and not migration.handed_over:
            self._on_exported(migration, report)
        elif channel is migration.destination_channel:
            self._on_imported(migration, report)

    def _on_exported(self, migration: Migration, report: MigrationReport) -> None:
        self._routes.count_transfer(migration.source_channel, report)
        if not report.ok:
            self._end_migration(migration, ok=False, why=report.error or "the source refused")
            return
        migration.num_bytes += report.num_bytes
        request = None
        if report.final:
            entry = self._ledger.get(migration.request_id)
            if entry is None or report.num_output_tokens != len(entry.token_ids):
                self._end_migration(migration, ok=False, why="the source's tokens differ from the ledger's")
                return
            request = entry.continuation()
            self._hand_over(migration)
        migration.destination_channel.send(
            self._encode(
                MigrateImport(
                    migration.migration_id,
                    migration.request_id,
                    self._stage_path(migration),
                    report.num_blocks,
                    report.final,
                    request,
                    report.num_computed_tokens,
                    migration.network,
                    report.sources,
                    migration.stage,
                )
            )
        )
        migration.stage += 1

    def _on_imported(self, migration: Migration, report: MigrationReport) -> None:
        # An import from a source that has left fails for the source's death,
        # not for this core's K/V path: it does not count towards marking the
        # destination unable (a P/D prefill replica's death fails several at once).
        if report.ok or self._ledger.serves(migration.source_channel):
            self._routes.count_transfer(migration.destination_channel, report)
        if not report.ok:
            if migration.handed_over:
                self._take_back(migration)
            self._end_migration(migration, ok=False, why=report.error or "the destination refused")
            return
        if report.final:
            migration.resumed_at = time.monotonic()
            self._end_migration(migration, ok=True)
            return
        logger.debug(
            "migration %s, stage %d: %d blocks (%d bytes) in %.3f s",
            migration.migration_id,
            migration.stage,
            report.num_blocks,
            report.num_bytes,
            time.monotonic() - migration.stage_started,
        )
        last = report.num_blocks <= _FINAL_STAGE_BLOCKS or migration.stage >= _MAX_STAGES
        self._export_stage(migration, final=last)

    def _hand_over(self, migration: Migration) -> None:
        """The request becomes the destination's in the ledger: its outputs are
        believed from there, and a death there recovers it. (Both cores
        serve: a core that left ended the migrations naming it.)"""
        self._ledger.move(migration.request_id, migration.source_channel, migration.destination_channel)
        migration.handed_over = True

    def _take_back(self, migration: Migration) -> None:
        """The destination refused the final stage: the source resumes the
        request, or, gone meanwhile, it goes to the usual recovery."""
        ledger, request_id = self._ledger, migration.request_id
        if request_id in ledger and ledger.serves(migration.source_channel):
            ledger.move(request_id, migration.destination_channel, migration.source_channel)
            return
        ledger.release(request_id, migration.destination_channel)
        if request_id in ledger:
            # Its source died (after the hand-over, so its migration went on):
            # a replacement under the same index never had the request.
            self._router.resubmit(request_id)

    def _end_migration(self, migration: Migration, ok: bool, why: str = "", drop_at_source: bool | None = None) -> None:
        """Tell both sides (those alive), record it, remove its files. The
        source drops its paused copy when the request lives on elsewhere
        (`drop_at_source`, by default when it moved), else resumes it."""
        del self._migrations[migration.migration_id]
        self.by_request.pop(migration.request_id, None)
        drop = ok if drop_at_source is None else drop_at_source
        self._send_to(migration.source_channel, MigrateEnd(migration.migration_id, migration.request_id, commit=drop))
        if not ok:  # whatever the destination reserved is freed
            self._send_to(
                migration.destination_channel, MigrateEnd(migration.migration_id, migration.request_id, commit=False)
            )
        # What the supervisor made for it (its stage files; the source
        # removes those it wrote too, when it hears the end).
        migration.transport.end_at_supervisor(self._routes.stage_folder, migration.migration_id)
        if self.on_end is not None:
            self.on_end(migration, ok, why)
        seconds = time.monotonic() - migration.started
        if ok:
            logger.info(
                "request %s migrated from core %d to core %d in %.3f s (%d bytes, %d stage(s))",
                migration.request_id[:64],
                migration.source,
                migration.destination,
                seconds,
                migration.num_bytes,
                migration.stage,
            )
            self._resumed[migration.request_id] = (migration, seconds)
            self.migration_counts["migrated"] += 1
        else:
            logger.info(
                "migration of request %s from core %d to core %d abandoned: %s",
                migration.request_id[:64],
                migration.source,
                migration.destination,
                why,
            )
            self._retry_at[migration.request_id] = time.monotonic() + _RETRY_AFTER_S
            self._migration_events.append(
                MigrationStats(migration.reason, ok=False, seconds=seconds, num_bytes=migration.num_bytes)
            )
            self.migration_counts["abandoned"] += 1

    # ---- hooks for the rest of the supervisor -----------------------------------------------

    def saw_tokens(self, request_id: str) -> None:
        """A token of `request_id` came from the core that holds it: the pause
        of a migrated request ends at its first token from the destination."""
        migration_id = self.by_request.get(request_id)
        if migration_id is not None:
            self._migrations[migration_id].last_token_at = time.monotonic()
            return
        self._record_resumed(request_id, saw_token=True)

    def _record_resumed(self, request_id: str, saw_token: bool) -> None:
        """The event of a migration that moved `request_id`, once: at its first
        token from the destination (the pause ends there), or when it ended
        before one (no downtime to tell, but it did move)."""
        resumed = self._resumed.pop(request_id, None)
        if resumed is None:
            return
        migration, seconds = resumed
        paused_since = migration.last_token_at or migration.started
        self._migration_events.append(
            MigrationStats(
                migration.reason,
                ok=True,
                seconds=seconds,
                num_bytes=migration.num_bytes,
                downtime_s=time.monotonic() - paused_since if saw_token else None,
                handover_s=migration.resumed_at - paused_since,
            )
        )

    def request_gone(self, request_id: str) -> None:
        """The client aborted `request_id`, or it finished: end its migration.
        (An abort went to the core that owns it in the ledger; the other
        side drops or frees what it holds.)"""
        self._record_resumed(request_id, saw_token=False)
        self._retry_at.pop(request_id, None)
        self._moved_at.pop(request_id, None)
        migration_id = self.by_request.get(request_id)
        if migration_id is not None:
            migration = self._migrations[migration_id]
            # Handed over: the source holds a paused copy (commit drops it);
            # not yet: the destination holds a reservation (abandoning frees it).
            self._end_migration(migration, ok=False, why="the request ended", drop_at_source=True)

    def on_channel_removed(self, channel: CoreChannel, why: str) -> None:
        """Core `channel` left (it died, or drained away): end every migration
        that names it, on both sides, before anything else may reach either
        side (a report naming a core that left would have nowhere to go).
        Called from the supervisor's _remove_channel only, every way a core
        leaves.
        What it owned in the ledger is recovered as usual; a paused copy at a
        live source whose destination owned the request is dropped."""
        for migration in [m for m in self._migrations.values() if channel in (m.source_channel, m.destination_channel)]:
            if migration.handed_over and channel is migration.source_channel:
                continue  # the destination owns the request and resumes it (or gives it back: _take_back)
            # Handed over to a destination that left: the ledger recovers the
            # request (after this, so the source's paused copy is gone first).
            self._end_migration(
                migration, ok=False, why=f"engine core {channel.index} {why}", drop_at_source=migration.handed_over
            )

    def _send_to(self, channel: CoreChannel, message) -> None:
        if self._ledger.serves(channel):
            channel.send(self._encode(message))

    def is_source(self, channel: CoreChannel) -> bool:
        """Whether `channel` is the source of a migration in progress (it
        holds a paused copy, or the request itself, until that ends)."""
        return any(m.source_channel is channel for m in self._migrations.values())

    def has_events(self) -> bool:
        return bool(self._migration_events)

    def take_migration_events(self) -> list[MigrationStats]:
        events, self._migration_events = self._migration_events, []
        return events
