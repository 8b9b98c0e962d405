"""The wire protocol between a front end and its engine cores: every message
that crosses the socket of a core process or a data-parallel replica, as
msgspec structs (msgpack on the wire), and the kinds of recovery they report.

It imports nothing of the engine, so the core, its process loop, the
supervisor and the front ends all sit above it (no import circle).
"""

from __future__ import annotations

import enum
import time

import msgspec

from raylm.core.outputs import EngineCoreOutput
from raylm.core.request import Request
from raylm.lora.request import LoRARequest
from raylm.sampling_params import SamplingParams


class RecoveryKind(enum.StrEnum):
    """What failed, as logs and metrics (the `kind` label) name it."""

    WORKER_DIED = "worker_died"  # a worker process or actor died; the core rebuilt its executor
    WORKER_HUNG = "hang"  # a step passed its deadline; the core rebuilt its executor
    STEP_ERROR = "step_error"  # a step raised; the core rebuilt its executor
    REBUILD_FAILED = "rebuild_failed"  # a rebuild itself failed; the core tried again
    ENGINE_CORE = "engine_core"  # the core process died or hung; the supervisor started a new one
    DP_REPLICA = "dp_replica"  # a data-parallel replica died or hung; the supervisor replaced it


class SchedulerStats(msgspec.Struct):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    # Totals since the core started (the front end turns them into counters).
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found
    prefix_cache_tier_hits: int = 0  # of which loaded back from the tier of evicted blocks
    kv_tier_blocks: int = 0  # blocks the tier of evicted blocks holds
    kv_tier_capacity_blocks: int = 0  # and can hold
    num_preemptions: int = 0
    kv_capacity_tokens: int = 0  # tokens the KV cache holds, in all
    kv_capacity_tokens_per_rank: int = 0  # of which each rank holds (a CP group shares a sequence out)
    # Seconds a prompt token takes here (raylm.core.prefill_pace; 0: not measured yet).
    prefill_seconds_per_token: float = 0.0
    # Torch threads per rank, as the ranks read them once the executor was
    # built (the most of any rank; 0: unknown): a P/D role's own count shows here.
    worker_threads: int = 0
    # Speculative decoding (raylm.core.spec_decode), totals since the core started.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)
    spec_decode_num_steps_aside: int = 0  # steps in which a decoding request decoded without a draft
    spec_decode_steps_aside_by_reason: dict[str, int] = msgspec.field(default_factory=dict)
    # LoRA adapters (raylm.lora): the names of those the running and the
    # waiting requests run with (vllm:lora_requests_info), and the content
    # digests of those the core's adapter slots hold (routing by adapter).
    lora_running: list[str] = msgspec.field(default_factory=list)
    lora_waiting: list[str] = msgspec.field(default_factory=list)
    lora_slots: list[str] = msgspec.field(default_factory=list)
    # Set once failed requests caused more recoveries than the engine forgives
    # (EngineCore.unhealthy_reason): /health turns 503 for a supervisor to act.
    unhealthy: str | None = None
    # Whose totals these are, stamped by the core (EngineCoreProc): its
    # replica, and which start of a core it is (drawn at random when the core
    # process starts). The front end counts each core's own increase: a sum
    # over replicas drops when one leaves or restarts, which is no event.
    engine_index: int = 0
    core_start: int = 0


class EngineCoreRequest(msgspec.Struct, tag="add"):
    """A request's one form from intake to the core: built once, validated
    and tokenized, by the input processor (InputProcessor.core_requests),
    kept as is in the supervisor's ledger (a recovery or a migration sends
    it again with the tokens generated so far: `continuation`), and turned
    into the scheduler's Request by the core that runs it, once
    (EngineCore.add_request). Nothing between checks it again."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # all_stop_token_ids, filled in by the front end, included
    eos_token_id: int | None
    arrival_time: float = msgspec.field(default_factory=time.monotonic)
    # Tokens it already generated in a core that died: it continues after them.
    output_token_ids: list[int] = msgspec.field(default_factory=list)
    # Its record of failures so far (raylm.core.quarantine), kept across cores.
    num_recoveries: int = 0
    quarantined: bool = False
    # Mixed into its prefix-cache block hashes (raylm.core.kv_cache_manager).
    cache_salt: str | None = None
    # Its LoRA adapter, its content digest stamped at intake; None: the base model.
    lora_request: LoRARequest | None = None

    @property
    def lora_digest(self) -> str | None:
        return None if self.lora_request is None else self.lora_request.content_digest

    def continuation(self, output_token_ids: list[int]) -> EngineCoreRequest:
        """The same request, to continue after `output_token_ids` (its
        tokens so far, across cores) with its failure record as it is now."""
        return msgspec.structs.replace(self, output_token_ids=list(output_token_ids))

    def to_request(self) -> Request:
        """The scheduler's view of it, made by the core that runs it."""
        return Request(
            self.request_id,
            self.prompt_token_ids,
            self.sampling_params,
            self.eos_token_id,
            self.arrival_time,
            output_token_ids=self.output_token_ids,
            num_recoveries=self.num_recoveries,
            quarantined=self.quarantined,
            cache_salt=self.cache_salt,
            lora_request=self.lora_request,
        )


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Ping(msgspec.Struct, tag="ping"):
    nonce: int


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class KVNetwork(msgspec.Struct):
    """How a migration's K/V crosses nodes (raylm.kv_transfer.network): the
    source's ranks offer their blocks on `host` (its node's address); both
    sides hold the supervisor's pre-shared transfer `key`
    (raylm.kv_transfer.sealed_frames); `peer`, the destination's node's
    address, is the only one the source's server lets connect
    (raylm.kv_transfer.peer_filter), and the one the destination connects
    from. None in a migration message: the two cores share a node, and the
    K/V goes through files."""

    host: str
    key: bytes
    peer: str = ""


class MigrateExport(msgspec.Struct, tag="migrate_export"):
    """To a migration's source: write the KV blocks of `request_id` that the
    destination does not have yet to the transfer files at `path_prefix`
    (one per rank). Not `final`: the blocks complete so far, the request keeps
    decoding. `final`: pause the request first, then the rest, the last
    partial block included (raylm.engine.migration)."""

    migration_id: str
    request_id: str
    path_prefix: str
    final: bool
    network: KVNetwork | None = None


class MigrateImport(msgspec.Struct, tag="migrate_import"):
    """To a migration's destination: reserve `num_blocks` blocks for
    `request_id` and read the transfer files at `path_prefix` into them. The
    `final` stage carries the request itself (its tokens so far) and how many
    of its tokens have their K/V in the blocks: it resumes here."""

    migration_id: str
    request_id: str
    path_prefix: str
    num_blocks: int
    final: bool
    request: EngineCoreRequest | None = None
    num_computed_tokens: int = 0
    # Across nodes: the keys, and where each source rank offers its blocks
    # (rank i fetches from sources[i]).
    network: KVNetwork | None = None
    sources: list[str] | None = None
    # Which stage this is (0 first): a destination refuses a later stage of
    # a migration it does not know (it lost the earlier stages' blocks).
    stage: int = 0


class MigrateEnd(msgspec.Struct, tag="migrate_end"):
    """Ends a migration at one side. At the source: `commit` drops the
    paused request (it lives on at the destination), else resumes it. At the
    destination (never after its final stage succeeded): frees what was
    reserved."""

    migration_id: str
    request_id: str
    commit: bool


class PullExport(msgspec.Struct, tag="pull_export"):
    """To a core that holds a prompt's prefix in its cache (a prefix pull,
    raylm.engine.prefix_pull): export the cached blocks of `block_hashes`
    (the prompt's leading blocks, in order), as many as it still holds from
    the first, to the stage `path_prefix` (across nodes: offered to
    `network.peer`), unpaced (a request waits for them)."""

    pull_id: str
    block_hashes: list[bytes]
    path_prefix: str
    network: KVNetwork | None = None


class PullImport(msgspec.Struct, tag="pull_import"):
    """To a pull's destination, with the request itself: read the pulled
    blocks into free blocks, keep them in the prefix cache only under the
    hashes this core computes from the request's prompt (and only if those
    are `block_hashes`), then add the request, which finds them as its
    cached prefix. Whatever fails, the request is added (it recomputes)."""

    pull_id: str
    request: EngineCoreRequest
    block_hashes: list[bytes]
    path_prefix: str
    network: KVNetwork | None = None
    sources: list[str] | None = None


class PullEnd(msgspec.Struct, tag="pull_end"):
    """To a pull's holder: the pull ended; drop what it still holds of its
    stage (files, an offer nobody fetched)."""

    pull_id: str
    path_prefix: str
    network: KVNetwork | None = None


class TierLoad(msgspec.Struct, tag="tier_load"):
    """To the core routing chose, with the request itself: its prompt's
    blocks `first_block`, `first_block` + 1, ... are in the tiers of evicted
    blocks of this node's cores: `blocks` (the tier files' prefix, the slot,
    the hash the supervisor computed). Read them into free blocks, kept only
    under the hashes this core computes and only as far as each slot still
    held its block through the copy (raylm.engine.tier_loads), then add the
    request, which finds them cached. Whatever fails, the request is added."""

    request: EngineCoreRequest
    first_block: int
    blocks: list[tuple[str, int, bytes]]


ClientMessage = (
    EngineCoreRequest
    | AbortRequests
    | Ping
    | Shutdown
    | MigrateExport
    | MigrateImport
    | MigrateEnd
    | PullExport
    | PullImport
    | PullEnd
    | TierLoad
)


class PullReport(msgspec.Struct):
    """A core's answer to PullExport (the blocks it exported) or PullImport
    (the blocks it took in; its request was added either way)."""

    pull_id: str
    ok: bool
    num_blocks: int = 0
    num_bytes: int = 0
    error: str | None = None
    # Export across nodes: where each rank offers the blocks.
    sources: list[str] | None = None
    # The ranks' CPU seconds on the copy (the holder's export, or the
    # destination's read; a network send by the holder's server thread is not in it).
    cpu_seconds: float = 0.0


class MigrationReport(msgspec.Struct):
    """A core's answer to MigrateExport / MigrateImport: what it did, or why not."""

    migration_id: str
    request_id: str
    ok: bool
    final: bool
    num_blocks: int = 0
    num_bytes: int = 0
    # Export: how many of the request's tokens have their K/V in the blocks
    # sent so far (final: all of them), and its output tokens at that point.
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    # Export across nodes: where each rank offers its blocks.
    sources: list[str] | None = None


class PullStats(msgspec.Struct):
    """One prefix pull as the supervisor saw it end, for metrics: its
    `outcome` (raylm.engine.prefix_pull.OUTCOMES), the bytes it moved, and,
    for one that brought its blocks, its seconds from start to the
    destination's import."""

    outcome: str
    num_bytes: int = 0
    seconds: float | None = None
    cpu_seconds: float = 0.0  # the ranks' CPU on its copies, at both ends


class HandoffStats(msgspec.Struct):
    """One P/D hand-off's outcome, for metrics (raylm.engine.handoff.OUTCOMES):
    `seconds`, for one that moved, from its start (the prefill replica's
    first token seen) to the decode replica's import."""

    outcome: str
    seconds: float | None = None


class MigrationStats(msgspec.Struct):
    """One live migration as the supervisor saw it end, for metrics:
    `downtime_s` is the pause the client saw (the source's last token to the
    destination's first), `seconds` the whole migration. `handover_s` is the
    part of the pause the request was in no core's queue: the source's last
    token to the destination's report that it holds the request, ready to be
    scheduled. The rest of the pause is the destination's steps: the ones
    already launched when the request arrived, then its own. A request that
    ended (finished, aborted, or stopped by the front end) before its first
    token from the destination has no downtime (None)."""

    reason: str
    ok: bool
    seconds: float
    num_bytes: int
    downtime_s: float | None = None
    handover_s: float = 0.0


class RecoveryStats(msgspec.Struct):
    """One recovery from a failure: `kind` says what failed (the core's own
    recoveries of its executor, or the supervisor's of a core process or
    replica), `seconds` from the failure being noticed to serving again,
    `num_requests` the requests carried over."""

    kind: RecoveryKind
    seconds: float
    num_requests: int
    # Poison quarantine: the requests charged with this failure (each one more
    # recovery on its record) and those failed as its cause, whose quarantine
    # partners were released (raylm.core.quarantine).
    charged: list[str] = msgspec.field(default_factory=list)
    culprits: list[str] = msgspec.field(default_factory=list)


class KVCacheEvents(msgspec.Struct):
    """What changed in a core's prefix cache since its last message
    (core/kv_cache_manager.py KVEventRecorder): emptied first (a fresh
    pool), then the block hashes it began to hold and those it dropped. The
    supervisor's prefix index follows each core by these; a hint for
    routing, never a key of any cache."""

    cleared: bool = False
    stored: list[bytes] = msgspec.field(default_factory=list)
    removed: list[bytes] = msgspec.field(default_factory=list)
    # The core's tier of evicted blocks (raylm.core.host_tier): (hash, slot)
    # now there, hashes no longer there; and where its files are
    # (`<tier_prefix>.rank<i>`), sent with every change.
    offloaded: list[tuple[bytes, int]] = msgspec.field(default_factory=list)
    unoffloaded: list[bytes] = msgspec.field(default_factory=list)
    tier_prefix: str | None = None


class EngineCoreOutputs(msgspec.Struct):
    """One message from the core: a step's outputs and/or its scheduler stats,
    a reply to a Ping, or (as its last words) the error that killed it.

    `recoveries`: the recoveries the core made in place since its last message;
    the front end hands each to its stat loggers (`record_recovery`)."""

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    stats: SchedulerStats | None = None
    pong: int | None = None
    error: str | None = None
    recoveries: list[RecoveryStats] = msgspec.field(default_factory=list)
    # Which core sent it (0 without data parallelism), and which start of
    # that core: a core replaced under the same index starts anew, and what
    # the old one sent last must not count as the new one's.
    engine_index: int = 0
    incarnation: int = 0
    # Sent (alone) before each attempt to rebuild the executor in place: the
    # core sends nothing else until it is done, which may take as long as a
    # start. Its front end then allows it the start timeout, not the step
    # deadline, and /health says it is recovering.
    rebuilding: bool = False
    # Answers to migration messages (MigrateExport, MigrateImport).
    migrations: list[MigrationReport] = msgspec.field(default_factory=list)
    # Answers to prefix pull messages (PullExport, PullImport).
    pulls: list[PullReport] = msgspec.field(default_factory=list)
    # Migrations that ended, from the supervisor to its front end (metrics).
    migrated: list[MigrationStats] = msgspec.field(default_factory=list)
    # Prefix pulls that ended, from the supervisor to its front end (metrics).
    pulled: list[PullStats] = msgspec.field(default_factory=list)
    # P/D hand-offs that ended, or requests that stayed where they were (metrics).
    handed_off: list[HandoffStats] = msgspec.field(default_factory=list)
    # A data-parallel core's prefix cache changes since its last message.
    kv_events: KVCacheEvents | None = None
