"""A prefix pull weighed against recomputing its prefix (issue 49, item 3):
a pull expected to take longer than the destination's recompute is not
started (`too_slow`), and a holder that has not exported by the time the
recompute would have ended is not waited for (`timeout`), whatever the fixed
export timeout says. Outputs equal Hugging Face's greedy output (float32)."""

from __future__ import annotations

import os
import signal

import pytest

from raylm.core.prefill_pace import MIN_TOKENS, PrefillPace
from raylm.engine import pull_estimate
from raylm.engine.protocol import SchedulerStats
from raylm.engine.pull_estimate import EXPORT_TIMEOUT_S, PullEstimate
from raylm.testing.hf_oracle import hf_greedy
from tests.engine.test_prefix_pull import FIRST, GREEDY, PREFIX, SECOND, _engine, _run


def test_a_core_measures_its_prompt_tokens_on_steps_that_compute_many():
    pace = PrefillPace()
    pace.observe(1, 0.5)  # a decode step: mostly the step's fixed cost, not measured
    pace.observe(MIN_TOKENS - 1, 0.5)
    assert pace.seconds_per_token == 0.0
    pace.observe(100, 0.2)
    assert pace.seconds_per_token == pytest.approx(0.002)
    pace.observe(100, 0.6)  # a slower step moves the average, not all the way
    assert 0.002 < pace.seconds_per_token < 0.006


def test_a_pull_is_weighed_only_once_both_sides_are_measured():
    estimate = PullEstimate(enabled=True)
    fast_core = SchedulerStats(prefill_seconds_per_token=1e-4)  # 16 tokens: 1.6 ms
    unmeasured = SchedulerStats()
    # Nothing measured: every pull is tried, with the fixed export timeout.
    assert estimate.worth_starting(4, 64, fast_core)
    assert estimate.export_deadline(10.0, 64, unmeasured) == 10.0 + EXPORT_TIMEOUT_S
    estimate.observe(num_blocks=4, num_bytes=4 << 20, seconds=0.04)  # 10 ms a block
    assert estimate.pull_seconds(2) == pytest.approx(0.02)
    assert not estimate.worth_starting(1, 16, fast_core)  # 10 ms against 1.6 ms
    assert estimate.worth_starting(1, 16, SchedulerStats(prefill_seconds_per_token=1e-3))  # against 16 ms
    assert estimate.worth_starting(1, 16, unmeasured)
    # The export is waited for as long as the recompute would take, longer than the fixed
    # timeout too (a loaded holder's long prefill step outlasts it).
    assert estimate.export_deadline(10.0, 16, fast_core) == pytest.approx(10.0016)
    assert estimate.export_deadline(10.0, 10**6, fast_core) == pytest.approx(10.0 + 100.0)
    off = PullEstimate(enabled=False)
    off.observe(4, 4 << 20, 0.04)
    assert off.worth_starting(1, 16, fast_core)
    assert off.export_deadline(10.0, 16, fast_core) == 10.0 + EXPORT_TIMEOUT_S


def _measured(llm, rank: int) -> float:
    stats = llm.llm_engine.engine_core.channels[rank].stats
    return stats.prefill_seconds_per_token if stats else 0.0


@pytest.mark.slow
def test_a_stopped_holder_is_waited_for_no_longer_than_the_recompute(tiny_model_dir, monkeypatch):
    """The holder is stopped (SIGSTOP) before it can export, with the fixed
    export timeout set far off: the pull falls back once the destination's
    measured recompute time has passed, the request finishes on core 0 while
    the holder is still stopped, equal to HF. Then, with the pulls measured
    as slower than the recompute, the next pull is not started."""
    monkeypatch.setenv("RAYLM_PULL_ESTIMATES", "1")
    monkeypatch.setattr(pull_estimate, "EXPORT_TIMEOUT_S", 600.0)
    model = tiny_model_dir("llama")
    outputs: dict[str, list[int]] = {}
    warm = [(11 * j) % 250 + 3 for j in range(MIN_TOKENS + 40)]
    third = PREFIX + [12, 13]
    with _engine(model) as llm:
        sup = llm.llm_engine.engine_core
        assert sup.pulls.estimate.enabled
        _run(llm, outputs, "warm", warm, rank=0)  # core 0 measures its pace
        assert _measured(llm, 0) > 0
        _run(llm, outputs, "first", FIRST, rank=1)
        holder = sup.launcher._processes[1].pid
        os.kill(holder, signal.SIGSTOP)
        try:
            _run(llm, outputs, "second", SECOND, rank=0)
            assert sup.pulls.counts["timeout"] == 1 and sup.pulls.counts["ok"] == 0, dict(sup.pulls.counts)
        finally:
            os.kill(holder, signal.SIGCONT)
        # Core 0 now holds the prefix too: the third request pulls nothing.
        # Make core 1 the only holder of a new prefix, with pulls measured slow.
        sup.pulls.estimate.observe(num_blocks=1, num_bytes=1, seconds=3600.0)
        other = [(5 * j) % 250 + 3 for j in range(96)]
        _run(llm, outputs, "fourth", other + [1, 2], rank=1)
        _run(llm, outputs, "fifth", other + [3, 4], rank=0)
        assert sup.pulls.counts["too_slow"] == 1 and sup.pulls.counts["started"] == 1, dict(sup.pulls.counts)
        _run(llm, outputs, "third", third, rank=0)
        assert len(sup.pulls) == 0
    names = ["warm", "first", "second", "third", "fourth", "fifth"]
    prompts = [warm, FIRST, SECOND, third, other + [1, 2], other + [3, 4]]
    assert [outputs[n] for n in names] == [r.token_ids for r in hf_greedy(model, prompts, GREEDY.max_tokens)]
