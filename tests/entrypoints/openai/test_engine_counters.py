"""The engine counters fed from the cores' running totals
(vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total,
vllm:num_preemptions_total) count each event once under data parallelism:
each core's own increase is added, so a replica that leaves (a scale-in)
adds nothing and one that restarts counts from its new start; the replicas'
sum, which drops at both, is not what they follow. A synthetic sequence of
stats on the Prometheus logger, then the same through AsyncLLM and its real
supervisor with scripted fake cores (tests/engine/conftest.py). No Ray."""

from __future__ import annotations

import asyncio

from raylm.engine.errors import EngineCoreDiedError
from raylm.engine.protocol import EngineCoreOutputs, SchedulerStats
from raylm.entrypoints.openai.metrics import PrometheusStatLogger
from tests.conftest import async_wait_until
from tests.engine.conftest import FakeCore, make_engine  # noqa: F401 - the fixture

COUNTERS = {
    "num_preemptions": "vllm:num_preemptions_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
}


def _exported(logger: PrometheusStatLogger) -> dict[str, float]:
    labels = {"model_name": "m", "engine": "0"}
    return {field: logger.registry.get_sample_value(name, labels) for field, name in COUNTERS.items()}


def _stats(replica: int, start: int, preemptions: int) -> SchedulerStats:
    """A core's report: its running totals (queries 10 and hits 4 per preemption, to tell them apart)."""
    return SchedulerStats(
        engine_index=replica,
        core_start=start,
        num_preemptions=preemptions,
        prefix_cache_queries=10 * preemptions,
        prefix_cache_hits=4 * preemptions,
    )


def _expected(events: int) -> dict[str, float]:
    return {"num_preemptions": events, "prefix_cache_queries": 10 * events, "prefix_cache_hits": 4 * events}


def test_each_event_is_counted_once_through_scale_in_and_restarts():
    logger = PrometheusStatLogger("m")
    # Each step: the serving cores' reports (replica, start, its total), and
    # the events that really happened since the step before.
    steps = [
        ([(0, 11, 3), (1, 21, 4)], 7),
        ([(0, 11, 5), (1, 21, 4)], 2),
        ([(0, 11, 6), (1, 21, 9)], 6),
        # Scale-in: replica 1 leaves; the sum drops from 15 to 7, no event is undone.
        ([(0, 11, 7)], 1),
        # Replica 0 restarts and counts from zero: 2 events in its new start.
        ([(0, 12, 2)], 2),
        # Replica 1 is back (a scale-up), a new start; and replica 0 restarts
        # again, its new total already past its old one (only its start tells).
        ([(0, 13, 5), (1, 22, 1)], 6),
        ([(0, 13, 5), (1, 22, 1)], 0),  # the same reports again
        # A core whose start is unknown (0) and whose total went down: a new count.
        ([(0, 0, 4), (1, 22, 3)], 6),
        ([(0, 0, 1), (1, 22, 3)], 1),
    ]
    events = 0
    for reports, happened in steps:
        logger.record_core_stats([_stats(*report) for report in reports])
        events += happened
        assert _exported(logger) == _expected(events), (reports, events)


def test_the_aggregate_alone_moves_no_counter():
    # The replicas' sum (record_scheduler_stats) sets the gauges only.
    logger = PrometheusStatLogger("m")
    logger.record_scheduler_stats(_stats(0, 0, 9))
    assert _exported(logger) == _expected(0)


def _serving(engine) -> list[int]:
    return [r["replica"] for r in engine.replica_states() if r["state"] == "serving"]


def test_async_llm_counts_a_restarted_replica_from_its_new_start(make_engine):  # noqa: F811 - the fixture
    engine, _ = make_engine(data_parallel_size=2, data_parallel_backend="mp")
    logger = PrometheusStatLogger("m")
    engine.stat_loggers.append(logger)

    def report(core: FakeCore, start: int, preemptions: int) -> None:
        core.script.put_nowait(EngineCoreOutputs(stats=_stats(core.channel.index, start, preemptions)))

    async def run() -> None:
        engine._ensure_output_handler()
        await async_wait_until(lambda: len(FakeCore.started) == 2)
        first, second = FakeCore.started
        report(first, 11, 3)
        report(second, 21, 4)
        await async_wait_until(lambda: _exported(logger) == _expected(7))
        # Replica 0's core dies; its new core counts from zero. The replicas'
        # sum drops from 7 to 1 + 4: before, that was added again (12).
        first.script.put_nowait(EngineCoreDiedError(-9))
        await async_wait_until(lambda: len(FakeCore.started) == 3 and _serving(engine) == [0, 1])  # adopted: heard from
        restarted = FakeCore.started[2]
        assert restarted.channel.index == 0
        report(restarted, 12, 1)
        await async_wait_until(lambda: _exported(logger)["num_preemptions"] != 7)
        assert _exported(logger) == _expected(8)
        report(second, 21, 6)
        await async_wait_until(lambda: _exported(logger)["num_preemptions"] != 8)
        assert _exported(logger) == _expected(10)

    asyncio.run(run())


def test_speculative_decoding_counters_follow_each_core():
    """vllm:spec_decode_* (per draft position too) and raylm:spec_decode_steps_aside,
    from two cores' running totals, one of which restarts."""
    logger = PrometheusStatLogger("m")

    def core(replica, start, drafts, accepted_per_pos, aside):
        return SchedulerStats(
            engine_index=replica,
            core_start=start,
            spec_decode_num_drafts=drafts,
            spec_decode_num_draft_tokens=4 * drafts,
            spec_decode_num_accepted_tokens=sum(accepted_per_pos),
            spec_decode_num_accepted_tokens_per_pos=accepted_per_pos,
            spec_decode_num_steps_aside=aside,
            spec_decode_steps_aside_by_reason={"large_batch": aside} if aside else {},
        )

    logger.record_core_stats([core(0, 1, 5, [4, 2], 0), core(1, 1, 2, [1, 0], 3)])
    logger.record_core_stats([core(0, 2, 1, [1, 1], 0), core(1, 1, 3, [2, 1], 5)])  # core 0 restarted
    labels = {"model_name": "m", "engine": "0"}

    def value(name, **extra):
        return logger.registry.get_sample_value(name, {**labels, **extra})

    assert value("vllm:spec_decode_num_drafts_total") == 5 + 3 + 1
    assert value("vllm:spec_decode_num_draft_tokens_total") == 4 * 9
    assert value("vllm:spec_decode_num_accepted_tokens_total") == 6 + 3 + 2
    assert value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 4 + 2 + 1
    assert value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 2 + 1 + 1
    assert value("raylm:spec_decode_steps_aside_total", reason="large_batch") == 5
    assert value("raylm:spec_decode_steps_aside_total", reason="penalties") == 0
