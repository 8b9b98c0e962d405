"""Decode bursts in the scheduler, without an executor: which steps burst and
how long (raylm.core.decode_burst), the KV slots a burst gets, and a burst's
tokens applied as a run of single steps would apply them."""

from __future__ import annotations

import pytest

from raylm.config import CacheConfig, SchedulerConfig
from raylm.core.decode_burst import BurstPlanner, can_burst
from raylm.core.request import Request, RequestStatus
from raylm.core.scheduler import Scheduler
from raylm.messages import ModelRunnerOutput
from raylm.sampling_params import SamplingParams

EOS = 1
BLOCK = 4


def _scheduler(max_steps=8, budget_s=0.01, num_blocks=64, max_model_len=256, sample_alike=True) -> Scheduler:
    return Scheduler(
        SchedulerConfig(),
        CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
        max_model_len,
        burst_planner=BurstPlanner(max_steps, budget_s, workers_sample_alike=sample_alike),
    )


def _request(rid: str, prompt_len: int = 5, **params) -> Request:
    params.setdefault("temperature", 0.0)
    return Request(rid, list(range(10, 10 + prompt_len)), SamplingParams(**params), EOS)


def _step(scheduler: Scheduler, tokens: dict[str, list[int]] | None = None, seconds: float = 0.001):
    """One step: schedule, report each request's tokens (default: one token
    per step of the burst, 100, 101, ...), observe its time."""
    so = scheduler.schedule()
    rids = list(so.num_scheduled_tokens)
    sampled = [(tokens or {}).get(rid, list(range(100, 100 + so.num_decode_steps))) for rid in rids]
    scheduler.burst_planner.observe(so, seconds * so.num_decode_steps)
    scheduler.update_from_output(so, ModelRunnerOutput(req_ids=rids, sampled_token_ids=sampled))
    return so


def test_a_burst_needs_a_measured_decode_step_and_fits_the_budget():
    scheduler = _scheduler(max_steps=8, budget_s=0.01)
    scheduler.add_request(_request("a", max_tokens=100))
    assert _step(scheduler).num_decode_steps == 1  # the prefill
    assert _step(scheduler, seconds=0.004).num_decode_steps == 1  # a decode, but no pace known yet
    assert _step(scheduler).num_decode_steps == 2  # 10 ms at 4 ms a step
    assert _step(scheduler).num_decode_steps == 8  # 10 ms at 1 ms a step, capped at num_scheduler_steps
    scheduler.burst_planner.observe(_step(scheduler), 0.08)  # 8 steps of 10 ms each
    assert _step(scheduler).num_decode_steps == 1


def test_a_burst_gets_slots_for_all_its_steps_and_advances_by_them():
    scheduler = _scheduler()
    request = _request("a", prompt_len=5, max_tokens=100)
    scheduler.add_request(request)
    _step(scheduler)
    _step(scheduler)
    assert request.num_tokens == 7 and request.num_computed_tokens == 6
    so = _step(scheduler)
    assert so.num_decode_steps == 8 and so.num_scheduled_tokens == {"a": 1} and so.total_num_scheduled_tokens == 1
    # Positions 6..13 computed: 14 tokens, KV for 14 -> 4 blocks of 4.
    assert request.num_computed_tokens == 14 and request.num_tokens == 15
    assert len(scheduler.kv_cache_manager.get_block_ids("a")) == 4
    # The workers sampled these tokens themselves: none is sent back.
    assert request.unsent_token_ids == []
    assert request.output_token_ids[-8:] == list(range(100, 108))


def test_a_burst_ends_at_max_tokens_and_max_model_len():
    scheduler = _scheduler(max_model_len=20)
    short, long = _request("short", max_tokens=5), _request("long", max_tokens=100)
    for r in (short, long):
        scheduler.add_request(r)
    _step(scheduler)
    _step(scheduler)
    assert _step(scheduler).num_decode_steps == 3  # short has 2 tokens, may have 5
    assert short.status == RequestStatus.FINISHED_LENGTH and len(short.output_token_ids) == 5
    # long: 5 prompt + 5 output tokens, 10 to go to max_model_len 20.
    assert long.num_tokens == 10 and long.status == RequestStatus.RUNNING
    assert _step(scheduler).num_decode_steps == 8
    assert long.num_tokens == 18
    assert _step(scheduler).num_decode_steps == 2
    assert long.num_tokens == 20 and long.status == RequestStatus.FINISHED_LENGTH


def test_tokens_after_a_stop_token_are_dropped():
    scheduler = _scheduler()
    request = _request("a", max_tokens=100, stop_token_ids=[77])
    scheduler.add_request(request)
    _step(scheduler)
    _step(scheduler)
    so = _step(scheduler, tokens={"a": [100, 101, 77, 103, 104, 105, 106, 107]})
    assert so.num_decode_steps == 8
    assert request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason == 77
    assert request.output_token_ids[-3:] == [100, 101, 77]
    assert scheduler.kv_cache_manager.pool.num_free_blocks == 64  # its blocks freed


@pytest.mark.parametrize(
    "params",
    [
        dict(stop=["x"]),
        dict(logprobs=0),
        dict(prompt_logprobs=0),
        dict(presence_penalty=0.5),
        dict(frequency_penalty=0.5),
        dict(repetition_penalty=1.1),
        dict(min_tokens=3),
    ],
)
def test_requests_that_need_the_engine_between_tokens_never_burst(params):
    scheduler = _scheduler()
    scheduler.add_request(_request("plain", max_tokens=100))
    scheduler.add_request(_request("other", max_tokens=100, **params))
    for _ in range(4):
        assert _step(scheduler).num_decode_steps == 1


def test_random_sampling_bursts_with_one_sampler_or_a_seed():
    alike = dict(temperature=0.8)
    assert can_burst(SamplingParams(**alike), constrained=False, workers_sample_alike=True)
    assert not can_burst(SamplingParams(**alike), constrained=False, workers_sample_alike=False)
    assert can_burst(SamplingParams(seed=3, **alike), constrained=False, workers_sample_alike=False)
    assert can_burst(SamplingParams(temperature=0.0), constrained=False, workers_sample_alike=False)
    assert not can_burst(SamplingParams(temperature=0.0), constrained=True, workers_sample_alike=True)
    # Inputs that stay the same every step do not stop a burst.
    assert can_burst(
        SamplingParams(temperature=0.0, logit_bias={5: 2.0}, allowed_token_ids=[5, 6]),
        constrained=False,
        workers_sample_alike=True,
    )


def test_no_burst_while_a_request_waits_or_with_prefills_in_the_step():
    scheduler = _scheduler(num_blocks=64)
    scheduler.config.max_num_seqs = 1
    scheduler.add_request(_request("a", max_tokens=100))
    scheduler.add_request(_request("b", max_tokens=100))  # waits for a's seat
    for _ in range(4):
        assert _step(scheduler).num_decode_steps == 1
    scheduler = _scheduler()
    scheduler.add_request(_request("a", max_tokens=100))
    _step(scheduler)
    _step(scheduler)
    scheduler.add_request(_request("b", prompt_len=9, max_tokens=100))
    so = _step(scheduler)  # b's prefill (past the prefix-cached block) beside a's decode
    assert so.num_scheduled_tokens == {"a": 1, "b": 5} and so.num_decode_steps == 1
    assert _step(scheduler).num_decode_steps == 1  # two rows, paced on one
    assert _step(scheduler).num_decode_steps == 8


def test_a_nearly_full_pool_runs_single_steps():
    # 5 prompt tokens + 2 outputs: 2 blocks of 4 each for a and b; 5 blocks in all.
    scheduler = _scheduler(num_blocks=5)
    for rid in "ab":
        scheduler.add_request(_request(rid, max_tokens=100))
    _step(scheduler)
    _step(scheduler)
    so = _step(scheduler)
    assert so.num_decode_steps == 1  # 8 more tokens each would need 3 more blocks each
    assert all(r.status == RequestStatus.RUNNING for r in scheduler.requests.values())


def test_bursts_off_with_one_step_or_async_scheduling():
    for scheduler in (
        _scheduler(max_steps=1),
        Scheduler(
            SchedulerConfig(async_scheduling=True),
            CacheConfig(block_size=BLOCK, num_blocks=64),
            256,
            burst_planner=BurstPlanner(8, 0.01, True),
        ),
    ):
        scheduler.add_request(_request("a", max_tokens=100))
        for _ in range(4):
            so = scheduler.schedule()
            assert so.num_decode_steps == 1
            scheduler.burst_planner.observe(so, 0.001)
            scheduler.update_from_output(so, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[100]]))


def test_no_burst_while_a_running_request_is_left_out_of_the_step():
    scheduler = _scheduler()
    for rid in "ab":
        scheduler.add_request(_request(rid, max_tokens=100))
    _step(scheduler)
    _step(scheduler)
    # Both running; a token budget of one now leaves one of them out of each step.
    scheduler.config.max_num_batched_tokens = 1
    for _ in range(4):
        so = _step(scheduler)
        assert len(so.num_scheduled_tokens) == 1 and so.num_decode_steps == 1
    scheduler.config.max_num_batched_tokens = 8
    assert _step(scheduler).num_decode_steps == 1  # two rows, paced on one
    assert _step(scheduler).num_decode_steps == 8


def test_no_burst_while_a_migrating_request_is_expected():
    # A burst would hold the arriving request back for its whole length.
    scheduler = _scheduler()
    scheduler.add_request(_request("a", max_tokens=100))
    _step(scheduler)
    _step(scheduler)
    scheduler.expecting_imports = True
    for _ in range(3):
        assert _step(scheduler).num_decode_steps == 1
    scheduler.expecting_imports = False
    assert _step(scheduler).num_decode_steps == 8


def test_after_requests_join_a_single_step_measures_the_pace_first():
    scheduler = _scheduler()
    scheduler.add_request(_request("a", max_tokens=100))
    _step(scheduler)
    _step(scheduler)
    assert _step(scheduler).num_decode_steps == 8  # paced on one row
    for rid in "bc":
        scheduler.add_request(_request(rid, prompt_len=9, max_tokens=100))
    assert _step(scheduler).num_decode_steps == 1  # b and c's prefills
    so = _step(scheduler)
    assert len(so.num_scheduled_tokens) == 3 and so.num_decode_steps == 1  # three rows, paced on one
    assert _step(scheduler, seconds=0.002).num_decode_steps == 8
    assert _step(scheduler).num_decode_steps == 5  # 10 ms at 2 ms a step
