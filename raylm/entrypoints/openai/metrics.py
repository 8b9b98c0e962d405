"""Prometheus metrics of the server, under vLLM's names and types (`vllm:*`),
so dashboards and autoscalers built for vLLM read raylm unchanged: the
scheduler's gauges, prefix-cache, preemption and speculative decoding
counters, token counters,
finished requests by reason, and the latency histograms (TTFT, inter-token,
end-to-end, queue, prefill, decode, inference). What vLLM has no name for is
raylm's own (`raylm:*`): recoveries from failures (by kind), live migrations
of running requests (by reason), prefix pulls between replicas (by outcome),
prefill/decode hand-offs (by outcome) and the replicas asked for, and the server's
admission (sequences admitted, requests refused by reason).

Every metric carries vLLM's labels `model_name` and `engine` ("0": the front
end reports its engines as one; per-replica gauges of data parallelism are
raylm's own, in data_parallel_routes.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from raylm.core.spec_decode import STEP_ASIDE_REASONS
from raylm.engine.handoff import OUTCOMES as HANDOFF_OUTCOMES
from raylm.engine.prefix_pull import OUTCOMES as PULL_OUTCOMES
from raylm.engine.protocol import HandoffStats, MigrationStats, PullStats, SchedulerStats
from raylm.engine.stat_logger import StatLoggerBase

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TOKEN_GAP_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
_TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
# A migration's pause: a few ms (a short request, one node) to seconds.
_MIGRATION_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
# From a second (an executor rebuilt in place) to minutes (a big model reloaded).
_RECOVERY_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


def _increase(last: int, total: int) -> int:
    """What a core's running total grew by since `last`. Lower than `last`, it
    is a new count from zero (a core that did not say it restarted)."""
    return total - last if total >= last else total


class PrometheusStatLogger(StatLoggerBase):
    """One registry per server, so several servers in a process never collide."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine": "0"}
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(labels), registry=r).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, list(labels), registry=r).labels(**labels)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=buckets, registry=r).labels(**labels)

        self.num_running = gauge("vllm:num_requests_running", "Requests in the running batch")
        self.num_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)")
        # vLLM has no per-rank capacity gauge: raylm's own (context parallelism shares a sequence out).
        self.kv_capacity = gauge(
            "raylm:kv_cache_capacity_tokens", "Tokens the engine's KV cache holds (a CP group's ranks together)"
        )
        self.kv_capacity_per_rank = gauge(
            "raylm:kv_cache_capacity_tokens_per_rank",
            "Tokens of KV cache each rank holds (the group holds cp times as many)",
        )
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        # The tier of evicted blocks (--kv-offloading-size): its hits are in vllm:prefix_cache_hits too.
        self.prefix_tier_hits = counter(
            "raylm:prefix_cache_tier_hits",
            "Prompt tokens loaded back from the node's tier of evicted KV blocks (also in vllm:prefix_cache_hits)",
        )
        self.kv_tier_blocks = gauge("raylm:kv_offload_blocks", "KV blocks held in the node's tier of evicted blocks")
        self.kv_tier_capacity = gauge(
            "raylm:kv_offload_capacity_blocks", "KV blocks the node's tier of evicted blocks can hold"
        )
        self.num_preemptions = counter("vllm:num_preemptions", "Preemptions (requests sent back to the queue)")
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Speculative drafts verified")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Speculative draft tokens verified")
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted")
        self.spec_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Speculative draft tokens accepted, by position in the draft (0: the first)",
            [*labels, "position"],
            registry=r,
        )
        self.spec_steps_aside = Counter(
            "raylm:spec_decode_steps_aside",
            "Steps in which speculative decoding stepped aside for a decoding request (it decoded one "
            "token), by reason",
            [*labels, "reason"],
            registry=r,
        )
        self.request_success = Counter(
            "vllm:request_success", "Finished completions by finish reason", [*labels, "finished_reason"], registry=r
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished completions")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens of finished completions")
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per finished completion", _TOKEN_COUNT_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Generated tokens per finished completion", _TOKEN_COUNT_BUCKETS
        )
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between output tokens", _TOKEN_GAP_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", _LATENCY_BUCKETS)
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Time a request waited in the engine's queue before it was first scheduled",
            _LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "From a request's first scheduling to its first token",
            _LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds", "From a request's first token to its last", _LATENCY_BUCKETS
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "From a request's first scheduling to its last token",
            _LATENCY_BUCKETS,
        )
        # Counters from the cores' running totals (SchedulerStats field -> counter),
        # and each serving core's last totals, by (replica, start): see record_core_stats.
        self._totals = {
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "prefix_cache_tier_hits": self.prefix_tier_hits,
            "num_preemptions": self.num_preemptions,
            "spec_decode_num_drafts": self.spec_drafts,
            "spec_decode_num_draft_tokens": self.spec_draft_tokens,
            "spec_decode_num_accepted_tokens": self.spec_accepted,
        }
        self._last_totals: dict[tuple[int, int], dict[str | tuple[str, str], int]] = {}
        # `kind`: what failed ("engine_core", or the core's own: "worker", "hang", ...).
        kind_labels = [*labels, "kind"]
        self.recoveries = Counter(
            "raylm:recoveries",
            "Failures recovered from (executor or engine core rebuilt), by kind",
            kind_labels,
            registry=r,
        )
        self.recovered_requests = Counter(
            "raylm:recovered_requests", "Requests carried over to a recovered engine, by kind", kind_labels, registry=r
        )
        self.recovery_time = Histogram(
            "raylm:recovery_seconds",
            "Failure noticed to serving again, by kind",
            kind_labels,
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self.num_admitted = gauge(
            "raylm:num_sequences_admitted", "Sequences (prompts x n) admitted by the server and not yet answered"
        )
        self.requests_refused = Counter(
            "raylm:requests_refused",
            "Requests refused by the server's limits, by reason (queue_full, body_too_large, shutting_down)",
            [*labels, "reason"],
            registry=r,
        )
        reason_labels = [*labels, "reason"]
        self.migrations = Counter(
            "raylm:request_migrations",
            "Running requests moved live to another replica, by reason (scale_in, rebalance, restart, manual, "
            "pd_handoff)",
            reason_labels,
            registry=r,
        )
        self.migrations_abandoned = Counter(
            "raylm:request_migrations_abandoned",
            "Live migrations given up (the request went on at its source), by reason",
            reason_labels,
            registry=r,
        )
        self.migration_downtime = histogram(
            "raylm:migration_downtime_seconds",
            "The pause a migrated request saw: its last token at the source to its first at the destination",
            _MIGRATION_BUCKETS,
        )
        self.migration_bytes = counter("raylm:migration_bytes", "KV cache bytes moved by live migrations")
        # Prefix pulls (raylm.engine.prefix_pull), by outcome: `ok` brought the
        # blocks (the destination's prefix-cache hits count them, as vLLM's
        # counter would: they were not recomputed); the others, why the
        # request computed its prompt instead.
        self.pulls = Counter(
            "raylm:kv_pulls",
            "Prefix pulls between replicas, by outcome (" + ", ".join(PULL_OUTCOMES) + ")",
            [*labels, "outcome"],
            registry=r,
        )
        self.pull_bytes = counter("raylm:kv_pull_bytes", "KV cache bytes moved by prefix pulls")
        # Unpaced, on the request's path: not charged to the background copies' CPU share.
        self.pull_cpu = counter(
            "raylm:kv_pull_cpu_seconds", "CPU seconds the ranks spent copying prefix pulls (both ends)"
        )
        self.pull_seconds = histogram(
            "raylm:kv_pull_seconds",
            "A prefix pull's time, from routing to the destination's import",
            _MIGRATION_BUCKETS,
        )
        for outcome in PULL_OUTCOMES:  # exported from the start, as 0
            self.pulls.labels(outcome=outcome, **labels)
        # P/D hand-offs (raylm.engine.handoff), by outcome: `ok` moved the
        # request to a decode replica; the others, why it stayed (or, for
        # prefill_on_decode, that a decode replica prefilled it).
        self.handoffs = Counter(
            "raylm:pd_handoffs",
            "Prefill/decode hand-offs, by outcome (" + ", ".join(HANDOFF_OUTCOMES) + ")",
            [*labels, "outcome"],
            registry=r,
        )
        self.handoff_seconds = histogram(
            "raylm:pd_handoff_seconds",
            "A P/D hand-off's time, from the prefill replica's first token to the decode replica's import",
            _MIGRATION_BUCKETS,
        )
        for outcome in HANDOFF_OUTCOMES:  # exported from the start, as 0
            self.handoffs.labels(outcome=outcome, **labels)
        # Exported from the start, as 0: the first position, and every reason to step aside.
        self.spec_accepted_per_pos.labels(position="0", **labels)
        for reason in STEP_ASIDE_REASONS:
            self.spec_steps_aside.labels(reason=reason, **labels)
        # LoRA adapters: vLLM's info gauge (its labels, set to the time of the
        # last report, as vLLM does; exported once a stat_logger knows
        # max_loras, i.e. with --enable-lora), and the time to read and
        # check an adapter's files (raylm.lora.registry: at start, at a
        # run-time load, at the first request for files not seen before).
        self.max_loras: int | None = None
        self._lora_info_labels: tuple[str, str, str] | None = None
        self.lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests",
            ["running_lora_adapters", "max_lora", "waiting_lora_adapters"],
            registry=r,
        )
        self.lora_load_time = histogram(
            "raylm:lora_adapter_load_seconds",
            "Time to read and check a LoRA adapter's files against the base model",
            _MIGRATION_BUCKETS,
        )
        self.target_replicas = gauge("raylm:dp_target_replicas", "Data-parallel replicas asked for")
        self.autoscale_decisions = Counter(
            "raylm:autoscale_decisions",
            "Replica count changes the autoscaler made, by direction (up, down)",
            [*labels, "direction"],
            registry=r,
        )
        for reason in ("scale_in", "rebalance", "restart", "manual", "pd_handoff"):  # exported from the start, as 0
            self.migrations.labels(reason=reason, **labels)
            self.migrations_abandoned.labels(reason=reason, **labels)
        self._labels = labels
        for reason in ("queue_full", "body_too_large", "shutting_down"):
            self.requests_refused.labels(reason=reason, **labels)
        # Exported from the start (as 0), so a dashboard sees "no restarts" rather than nothing.
        for metric in (self.recoveries, self.recovered_requests, self.recovery_time):
            metric.labels(kind="engine_core", **labels)

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.kv_capacity.set(stats.kv_capacity_tokens)
        self.kv_capacity_per_rank.set(stats.kv_capacity_tokens_per_rank)
        self.kv_tier_blocks.set(stats.kv_tier_blocks)
        self.kv_tier_capacity.set(stats.kv_tier_capacity_blocks)
        if self.max_loras is not None:
            labels = (",".join(stats.lora_running), str(self.max_loras), ",".join(stats.lora_waiting))
            # One series, the present's: the sets of adapters clients make run
            # are theirs to choose, and a series kept for each would grow
            # /metrics without bound (vLLM keeps them, each at its last time).
            if self._lora_info_labels not in (None, labels):
                self.lora_info.remove(*self._lora_info_labels)
            self._lora_info_labels = labels
            self.lora_info.labels(*labels).set_to_current_time()

    def record_lora_load(self, seconds: float) -> None:
        self.lora_load_time.observe(seconds)

    def record_core_stats(self, cores: list[SchedulerStats]) -> None:
        """Advance the counters by each core's own increase since its last
        report. The replicas' sum would drop when one leaves (a scale-in) or
        restarts, and adding it again would count events twice. A core not
        seen before (a new replica, or a restarted one: a new start) counts
        from its start, its whole total; one that left adds nothing more."""
        seen = {}
        for stats in cores:
            key = (stats.engine_index, stats.core_start)
            now = {name: getattr(stats, name) for name in self._totals}
            # Labelled totals: acceptance by draft position, steps aside by reason.
            for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                now[("position", str(position))] = count
            for reason, count in stats.spec_decode_steps_aside_by_reason.items():
                now[("reason", reason)] = count
            last = self._last_totals.get(key, {})
            for name, total in now.items():
                self._counter_of(name).inc(_increase(last.get(name, 0), total))
            seen[key] = now
        self._last_totals = seen

    def _counter_of(self, name: str | tuple[str, str]):
        if isinstance(name, str):
            return self._totals[name]
        label, value = name
        family = self.spec_accepted_per_pos if label == "position" else self.spec_steps_aside
        return family.labels(**{label: value}, **self._labels)

    def record_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def record_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def record_queue_and_prefill(self, queue_seconds: float, prefill_seconds: float) -> None:
        self.queue_time.observe(queue_seconds)
        self.prefill_time.observe(prefill_seconds)

    def record_finished(
        self,
        finish_reason: str,
        e2e_seconds: float,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        decode_seconds: float = 0.0,
        inference_seconds: float = 0.0,
    ) -> None:
        self.request_success.labels(finished_reason=finish_reason, **self._labels).inc()
        self.e2e.observe(e2e_seconds)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generation_tokens)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)
        if num_generation_tokens:
            self.decode_time.observe(decode_seconds)
            self.inference_time.observe(inference_seconds)

    def record_recovery(self, kind: str, seconds: float, num_requests: int) -> None:
        labels = {**self._labels, "kind": kind}
        self.recoveries.labels(**labels).inc()
        self.recovered_requests.labels(**labels).inc(num_requests)
        self.recovery_time.labels(**labels).observe(seconds)

    def record_migration(self, migration: MigrationStats) -> None:
        labels = {**self._labels, "reason": migration.reason}
        self.migration_bytes.inc(migration.num_bytes)
        if not migration.ok:
            self.migrations_abandoned.labels(**labels).inc()
            return
        self.migrations.labels(**labels).inc()
        if migration.downtime_s is not None:  # None: it ended before the destination's first token
            self.migration_downtime.observe(migration.downtime_s)

    def record_pull(self, pull: PullStats) -> None:
        self.pulls.labels(outcome=pull.outcome, **self._labels).inc()
        self.pull_bytes.inc(pull.num_bytes)
        self.pull_cpu.inc(pull.cpu_seconds)
        if pull.seconds is not None:
            self.pull_seconds.observe(pull.seconds)

    def record_handoff(self, handoff: HandoffStats) -> None:
        self.handoffs.labels(outcome=handoff.outcome, **self._labels).inc()
        if handoff.seconds is not None:
            self.handoff_seconds.observe(handoff.seconds)

    def record_target_replicas(self, num_replicas: int) -> None:
        self.target_replicas.set(num_replicas)

    def record_autoscale(self, direction: str, reason: str) -> None:
        self.autoscale_decisions.labels(direction=direction, **self._labels).inc()

    def record_admitted(self, num_sequences: int) -> None:
        self.num_admitted.set(num_sequences)

    def record_refused(self, reason: str) -> None:
        self.requests_refused.labels(reason=reason, **self._labels).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
