"""StatLoggerBase: what the online engine measures, as calls a stat logger
receives (the server's Prometheus logger, raylm.entrypoints.openai.metrics,
exports them under vLLM's names). AsyncLLM calls them; a failing logger never
takes serving down."""

from __future__ import annotations

from raylm.engine.protocol import HandoffStats, MigrationStats, PullStats, SchedulerStats


class StatLoggerBase:
    """Receives the engine's measurements; the default ignores them.
    The server's Prometheus logger overrides what it exports."""

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        """Counts and cache usage, as the core last reported them (with data
        parallelism, the replicas' together)."""

    def record_core_stats(self, cores: list[SchedulerStats]) -> None:
        """Each serving core's own stats (one per replica), as it last reported
        them, each with its replica and start (SchedulerStats.engine_index,
        core_start): what turns the cores' running totals into counters, core
        by core, since their sum drops whenever a replica leaves or restarts.
        Called with every record_scheduler_stats."""

    def record_first_token(self, seconds: float) -> None:
        """Time from arrival to a request's first output token."""

    def record_inter_token(self, seconds: float) -> None:
        """Time between two consecutive output steps of one request."""

    def record_queue_and_prefill(self, queue_seconds: float, prefill_seconds: float) -> None:
        """A request waited `queue_seconds` in the core before it was first
        scheduled, then `prefill_seconds` until its first token."""

    def record_finished(
        self,
        finish_reason: str,
        e2e_seconds: float,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        decode_seconds: float = 0.0,
        inference_seconds: float = 0.0,
    ) -> None:
        """One completion (one of a request's n) ended. `decode_seconds`: from
        the request's first token to its last; `inference_seconds`: from its
        first scheduling to its last token (prefill plus decode)."""

    def record_recovery(self, kind: str, seconds: float, num_requests: int) -> None:
        """The engine recovered from a failure of `kind` (a protocol.RecoveryKind:
        the core's own recoveries of its executor, or the supervisor's of a
        core) in `seconds`, carrying `num_requests` over."""

    def record_migration(self, migration: MigrationStats) -> None:
        """A live migration of a running request ended (moved, or abandoned
        with the request still at its source)."""

    def record_pull(self, pull: PullStats) -> None:
        """A prefix pull ended (raylm.engine.prefix_pull): its blocks came, or
        its request computed its prompt instead (the outcome says why)."""

    def record_handoff(self, handoff: HandoffStats) -> None:
        """A P/D hand-off ended (raylm.engine.handoff): the request moved to a
        decode replica, or stayed where it was (the outcome says why)."""

    def record_target_replicas(self, num_replicas: int) -> None:
        """The number of data-parallel replicas asked for (by hand or by the autoscaler)."""

    def record_autoscale(self, direction: str, reason: str) -> None:
        """The autoscaler changed the replica count ("up" or "down"), for `reason`."""
