"""An engine core's side of live migration (the supervisor's side, which
drives it, is raylm.engine.migration).

As a source, a core exports a running request's K/V in stages: first the
blocks complete so far while the request keeps decoding, then (final stage)
it stops scheduling the request, waits until no step of it is in flight,
pauses it and exports the rest, its last partial block included. The paused
request keeps its blocks until the migration ends: dropped if the
destination took it, resumed here otherwise.

As a destination, a core reserves blocks for each stage and reads the
source's transfer files into them; the final stage brings the request
itself, which goes first in the queue and continues after the tokens whose
K/V it imported. What it reserved is freed if the migration is abandoned.

The stages before the last overlap the steps (the pre-copy): the source's
ranks gather the filled blocks (immutable from then on) and the
destination's read them into its reserved blocks on threads of their own
(raylm.kv_transfer.background) while both cores keep stepping; the destination
reports such a stage once its ranks are done (`poll`). Only the final stage
copies on the loop, the request paused. RAYLM_MIGRATION_SYNC_PRECOPY=1 makes
every stage copy on the loop (the benchmark's baseline).

Every transfer is one collective call per stage, each rank moving its own
shard, so TP and PP engines move theirs rank to rank. How the K/V travels is
the migration's transport (raylm.kv_transfer.transport), taken from its
messages once (`transport_for`: files in shared memory, or the sealed
network when the message carries `network`); this endpoint calls the
transport's methods and never asks which kind it is.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from raylm.core.request import RequestStatus
from raylm.engine.protocol import MigrateEnd, MigrateExport, MigrateImport, MigrationReport
from raylm.kv_transfer.transport import KVTransport, stage_name, transport_for

logger = logging.getLogger(__name__)

# Copies of the stages before the last run beside the steps (see above).
OVERLAP_PRECOPY = os.environ.get("RAYLM_MIGRATION_SYNC_PRECOPY", "").strip().lower() not in ("1", "true", "yes")
# How often a destination asks its ranks whether their background imports are
# done (a collective call: not on every loop of a busy core).
_COPY_POLL_INTERVAL_S = 0.005


@dataclass
class _Outgoing:
    request_id: str
    # How its K/V travels (chosen from its first export's message).
    transport: KVTransport
    blocks_sent: int = 0
    # The final export waiting for the request's steps in flight to finish.
    final: MigrateExport | None = None
    # The request's preemptions when the first stage was gathered: a
    # preemption frees (and may reuse) blocks a background gather was reading.
    preemptions: int | None = None
    # Its stages (their paths): what the transport drops at the end.
    stages: set[str] = field(default_factory=set)


@dataclass
class _BackgroundImport:
    """A stage being read in beside the steps, until the ranks say it is done."""

    message: MigrateImport
    block_ids: list[int]
    abandoned: bool = False  # its migration ended: free the blocks once the ranks are done
    ranks_done: dict[int, list] = field(default_factory=dict)  # rank -> [ok, bytes or error]


class MigrationEndpoint:
    def __init__(self, core):
        self.core = core  # EngineCore
        self._outgoing: dict[str, _Outgoing] = {}
        self._incoming: dict[str, str] = {}  # migration id -> request id, until its final stage
        self._importing: dict[str, _BackgroundImport] = {}  # by migration id
        self._next_copy_poll = 0.0

    @property
    def copying(self) -> bool:
        """Background imports under way: the core's loop must come back to `poll` soon."""
        return bool(self._importing)

    @property
    def _scheduler(self):
        return self.core.scheduler

    def handle(self, message) -> MigrationReport | None:
        """Apply one migration message; its report, or None (a final export
        that must wait for the request's steps in flight: see `poll`)."""
        if isinstance(message, MigrateExport):
            return self._export(message)
        if isinstance(message, MigrateImport):
            return self._import(message)
        if isinstance(message, MigrateEnd):
            self._end(message)
            return None
        raise TypeError(f"not a migration message: {type(message).__name__}")

    def poll(self) -> list[MigrationReport]:
        """Final exports whose request has no step in flight any more, and
        stages whose background import has ended."""
        reports = []
        for migration_id, outgoing in list(self._outgoing.items()):
            if outgoing.final is not None and not self._in_flight(outgoing.request_id):
                reports.append(self._export_final(migration_id, outgoing))
        now = time.monotonic()
        if self._importing and now >= self._next_copy_poll:
            self._next_copy_poll = now + _COPY_POLL_INTERVAL_S
            reports.extend(self._imports_done())
        return reports

    # ---- source --------------------------------------------------------------------

    def _export(self, message: MigrateExport) -> MigrationReport | None:
        request = self._scheduler.requests.get(message.request_id)
        if request is None or request.status == RequestStatus.PAUSED:
            return self._refused(message, "the request is not running here (finished, aborted or already paused)")
        outgoing = self._outgoing.get(message.migration_id)
        if outgoing is None:
            outgoing = self._outgoing[message.migration_id] = _Outgoing(
                message.request_id, transport_for(message.network)
            )
        if outgoing.preemptions is None:
            outgoing.preemptions = request.num_preemptions
        if message.final:
            self._scheduler.stop_scheduling(message.request_id)
            outgoing.final = message
            if self._in_flight(message.request_id):
                return None
            return self._export_final(message.migration_id, outgoing)
        # The blocks whose every token has its K/V: steps in flight write
        # theirs before the export call runs (the workers take calls in order).
        num_full = request.num_computed_tokens // self._block_size
        return self._write(message, outgoing, num_full, num_full * self._block_size, request.num_output_tokens)

    def _export_final(self, migration_id: str, outgoing: _Outgoing) -> MigrationReport:
        message = outgoing.final
        outgoing.final = None
        if message.request_id not in self._scheduler.requests:
            del self._outgoing[migration_id]
            return self._refused(message, "the request finished before it could be paused")
        if self._scheduler.requests[message.request_id].num_preemptions != outgoing.preemptions:
            # Blocks an earlier stage read may have been freed and reused meanwhile.
            return self._refused(message, "the request was preempted during the migration")
        request = self._scheduler.pause(message.request_id)
        num_blocks = -(-request.num_computed_tokens // self._block_size)
        return self._write(message, outgoing, num_blocks, request.num_computed_tokens, request.num_output_tokens)

    def _write(
        self, message: MigrateExport, outgoing: _Outgoing, upto_block: int, num_computed: int, num_output: int
    ) -> MigrationReport:
        block_ids = self._scheduler.kv_cache_manager.get_block_ids(message.request_id)[
            outgoing.blocks_sent : upto_block
        ]
        # Before the final stage the blocks are full: gathered beside the steps.
        background = OVERLAP_PRECOPY and not message.final
        try:
            outgoing.stages.add(message.path_prefix)
            num_bytes, sources = outgoing.transport.export(
                self.core.executor.collective_rpc, message.path_prefix, block_ids, background
            )
        except Exception as e:  # the request is untouched (if paused, the supervisor resumes it)
            return self._refused(message, f"exporting its K/V failed: {type(e).__name__}: {e}")
        outgoing.blocks_sent = max(outgoing.blocks_sent, upto_block)
        return MigrationReport(
            message.migration_id,
            message.request_id,
            ok=True,
            final=message.final,
            num_blocks=len(block_ids),
            num_bytes=num_bytes,
            num_computed_tokens=num_computed,
            num_output_tokens=num_output,
            sources=sources,
        )

    def _in_flight(self, request_id: str) -> bool:
        request = self._scheduler.requests.get(request_id)
        if request is not None and request.num_output_placeholders:
            return True
        return any(request_id in batch.num_scheduled_tokens for batch, _ in self.core.batch_queue)

    # ---- destination -----------------------------------------------------------------

    def _import(self, message: MigrateImport) -> MigrationReport:
        rid, migration_id = message.request_id, message.migration_id
        if rid in self._scheduler.requests:
            return self._refused(message, "a request with this id is already here")
        if migration_id not in self._incoming and message.stage > 0:
            # Its earlier stages' blocks are not here (an executor rebuilt
            # since, or they were refused): the request would read blocks
            # nobody wrote.
            return self._refused(message, f"stage {message.stage} of a migration this core holds no stage of")
        if message.final and message.request is None:
            return self._refused(message, "the final stage carries no request")
        self._incoming[migration_id] = rid
        self._scheduler.expecting_imports = True
        kv = self._scheduler.kv_cache_manager
        block_ids = kv.allocate_for_import(migration_id, message.num_blocks)
        if block_ids is None:
            self._abandon(migration_id)
            return self._refused(message, f"no room for {message.num_blocks} more KV blocks")
        background = OVERLAP_PRECOPY and not message.final
        try:
            self.core.host_tier.flush()  # what that allocation evicted goes to the tier before it is overwritten
            num_bytes = self._read(message, block_ids, background)
        except Exception as e:
            self._abandon(migration_id)
            return self._refused(message, f"importing its K/V failed: {type(e).__name__}: {e}")
        if background:  # reported by `poll` once the ranks are done
            self._importing[migration_id] = _BackgroundImport(message, block_ids)
            return None
        if message.final:
            error = kv.adopt_import(migration_id, rid, message.num_computed_tokens)
            if error is not None:
                self._abandon(migration_id)
                return self._refused(message, error)
            del self._incoming[migration_id]
            self._scheduler.expecting_imports = bool(self._incoming)
            self._scheduler.add_imported(message.request.to_request(), message.num_computed_tokens)
        return MigrationReport(
            migration_id, rid, ok=True, final=message.final, num_blocks=len(block_ids), num_bytes=num_bytes
        )

    def _read(self, message: MigrateImport, block_ids: list[int], background: bool) -> int | None:
        """Each rank reads the source's same rank's blocks, by the migration's
        transport; `background`: on a thread of its own (None)."""
        return transport_for(message.network).import_(
            self.core.executor.collective_rpc,
            message.path_prefix,
            block_ids,
            background,
            message.sources,
            self.core.config.parallel_config.world_size,
        )

    def _imports_done(self) -> list[MigrationReport]:
        """Ask the ranks which background imports have ended; report (or, for
        an abandoned migration, free) those every rank has finished."""
        names = {stage_name(job.message.path_prefix): mid for mid, job in self._importing.items()}
        try:
            per_rank = KVTransport.copies_done(self.core.executor.collective_rpc, list(names))
        except Exception as e:  # the executor is failing: its recovery ends these (on_executor_lost)
            logger.warning("could not ask the ranks about their K/V copies: %s", e)
            return []
        reports = []
        for name, migration_id in names.items():
            job = self._importing[migration_id]
            for rank, finished in enumerate(per_rank):
                # A rank answers for a copy once: asked again (another rank was
                # still copying), it no longer knows the name.
                if name in finished and rank not in job.ranks_done:
                    job.ranks_done[rank] = finished[name]
            if len(job.ranks_done) < len(per_rank):
                continue
            del self._importing[migration_id]
            message = job.message
            errors = [str(outcome) for ok, outcome in job.ranks_done.values() if not ok]
            if job.abandoned:
                self._scheduler.kv_cache_manager.free_import(migration_id)
            elif errors:
                self._abandon(migration_id)
                reports.append(self._refused(message, f"importing its K/V failed: {errors[0]}"))
            else:
                reports.append(
                    MigrationReport(
                        migration_id,
                        message.request_id,
                        ok=True,
                        final=False,
                        num_blocks=len(job.block_ids),
                        num_bytes=sum(n for _, n in job.ranks_done.values()),
                    )
                )
        return reports

    def _abandon(self, migration_id: str) -> None:
        """Free what an incoming migration reserved (its request never arrived);
        blocks a background import still writes are freed once it has ended."""
        self._incoming.pop(migration_id, None)
        self._scheduler.expecting_imports = bool(self._incoming)
        job = self._importing.get(migration_id)
        if job is None:
            self._scheduler.kv_cache_manager.free_import(migration_id)
        elif not job.abandoned:
            job.abandoned = True
            self._cancel_background_import(migration_id, job)

    def _cancel_background_import(self, migration_id: str, job: _BackgroundImport) -> None:
        """A rank still waiting for the source (dead, maybe) gives up now
        instead of holding the blocks until its timeout."""
        try:
            KVTransport.cancel(self.core.executor.collective_rpc, [stage_name(job.message.path_prefix)])
        except Exception as e:  # the executor is failing: its recovery frees the blocks
            logger.warning("could not cancel the K/V copies of migration %s: %s", migration_id, e)

    # ---- either side -------------------------------------------------------------------

    def _end(self, message: MigrateEnd) -> None:
        outgoing = self._outgoing.pop(message.migration_id, None)
        if outgoing is not None:
            if outgoing.stages:  # what the source still holds of them: their files, offers never fetched
                outgoing.transport.end_at_source(
                    self.core.executor.collective_rpc, message.migration_id, outgoing.stages
                )
            if message.commit:
                self._scheduler.release_migrated(message.request_id)
            else:
                self._scheduler.resume(message.request_id)
            return
        self._abandon(message.migration_id)

    def on_executor_lost(self) -> list[MigrationReport]:
        """The workers (and the K/V) are gone: every incoming migration is
        refused (the blocks of its stages so far are lost; a later stage
        would be refused as one of a migration this core holds no stage of),
        and outgoing ones that have not paused their request give up (the
        request continues here, recomputed). A paused one stays paused for
        the supervisor to end."""
        reports = []
        for migration_id, rid in self._incoming.items():
            job = self._importing.get(migration_id)
            if job is None or not job.abandoned:
                logger.info(
                    "migration %s of request %s refused: the destination's executor failed", migration_id, rid[:64]
                )
                reports.append(
                    MigrationReport(
                        migration_id,
                        rid,
                        ok=False,
                        final=False,
                        error="the destination's executor failed during the import",
                    )
                )
        self._incoming.clear()  # the scheduler's blocks are reset with the executor
        self._importing.clear()
        self._scheduler.expecting_imports = False
        for migration_id, outgoing in list(self._outgoing.items()):
            if outgoing.request_id not in self._scheduler.paused:
                del self._outgoing[migration_id]
                self._scheduler.resume(outgoing.request_id)
                reports.append(
                    MigrationReport(
                        migration_id,
                        outgoing.request_id,
                        ok=False,
                        final=True,
                        error="the source's executor failed during the migration",
                    )
                )
        return reports

    @property
    def _block_size(self) -> int:
        return self._scheduler.kv_cache_manager.block_size

    @staticmethod
    def _refused(message, reason: str) -> MigrationReport:
        logger.info("migration %s of request %s refused: %s", message.migration_id, message.request_id[:64], reason)
        return MigrationReport(
            message.migration_id, message.request_id, ok=False, final=getattr(message, "final", True), error=reason
        )
