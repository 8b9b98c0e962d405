"""Speculative decoding's parts without a model: the config (each bad value
refused by name, the flag's JSON), n-gram prompt lookup, and the scheduler's
side of a verified draft (1 + k tokens scheduled, the rejected positions
rolled back, no block of them registered in the prefix cache, the counts)."""

from __future__ import annotations

import argparse
import pathlib

import pytest

from raylm.config import CacheConfig, SchedulerConfig, SpeculativeConfig, create_engine_config
from raylm.config.engine_args import EngineArgs
from raylm.config.speculative import MAX_SPECULATIVE_TOKENS
from raylm.core.kv_cache_manager import hash_block, root_hash
from raylm.core.request import Request, RequestStatus
from raylm.core.scheduler import Scheduler
from raylm.core.spec_decode import Speculator
from raylm.core.spec_propose import prompt_lookup
from raylm.core.spec_suffix import SuffixProposer
from raylm.messages import ModelRunnerOutput
from raylm.sampling_params import SamplingParams

BLOCK = 4


@pytest.mark.parametrize(
    "setting,field",
    [
        ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}, "lookahead"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 0}, "prompt_lookup_max"),
        ({"method": "ngram", "num_speculative_tokens": 3, "model": "some/draft"}, "model"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "method"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "speculative_config.model"),
        ({"method": "draft_model", "num_speculative_tokens": 3, "model": ""}, "speculative_config.model"),
        ({"method": "draft_model", "num_speculative_tokens": 17, "model": "x"}, "num_speculative_tokens"),
        ({"method": "draft_model", "num_speculative_tokens": 0, "model": "x"}, "num_speculative_tokens"),
        (
            {"method": "draft_model", "num_speculative_tokens": 3, "model": "x", "prompt_lookup_max": 3},
            "prompt_lookup_max",
        ),
        ("{not json", "speculative_config"),
        ([1, 2], "speculative_config"),
    ],
)
def test_bad_settings_are_refused_by_name(setting, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_setting(setting)


def test_a_draft_folder_may_be_a_path():
    setting = {"method": "draft_model", "num_speculative_tokens": 3, "model": pathlib.Path("/some/draft")}
    assert SpeculativeConfig.from_setting(setting).model == "/some/draft"


def test_suffix_is_a_method():
    assert SpeculativeConfig.from_setting({"method": "suffix", "num_speculative_tokens": 3}).method == "suffix"


def test_lookup_bounds_follow_each_other():
    assert SpeculativeConfig.from_setting({"num_speculative_tokens": 2}).prompt_lookup_min == 2
    one = SpeculativeConfig.from_setting({"num_speculative_tokens": 2, "prompt_lookup_max": 1})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (1, 1)
    wide = SpeculativeConfig.from_setting({"num_speculative_tokens": 2, "prompt_lookup_min": 6})
    assert (wide.prompt_lookup_min, wide.prompt_lookup_max) == (6, 6)


def test_the_flag_takes_json_and_the_engine_config_carries_it():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.speculative_config == SpeculativeConfig("ngram", 5, 2, 4)
    assert create_engine_config().speculative_config is None
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        create_engine_config(speculative_config={"method": "ngram", "num_speculative_tokens": 99})


@pytest.mark.parametrize(
    "tokens,max_tokens,draft",
    [
        ([1, 2, 3, 4, 5, 1, 2, 3], 3, [4, 5, 1]),  # the 3-gram found, what followed it
        ([1, 2, 3, 4, 5, 1, 2, 3], 1, [4]),
        ([9, 2, 3, 7, 1, 2, 3, 8, 2, 3], 2, [8, 2]),  # the latest earlier occurrence
        ([5, 1, 2, 8, 1, 2], 5, [8, 1, 2]),  # draft runs up to the end
        ([1, 2, 3, 4], 3, []),  # nothing repeats
        ([7, 7, 7, 7], 3, [7]),  # overlapping occurrences
        ([256, 1, 0, 0, 1, 0, 0], 3, [1, 0, 0]),  # byte patterns across token boundaries do not count
        ([3, 3], 2, []),  # too short for a 2-gram with a token after it
    ],
)
def test_ngram_lookup(tokens, max_tokens, draft):
    assert prompt_lookup(tokens, max_tokens, 2, 3) == draft


def _scheduler(k: int = 4) -> Scheduler:
    config = SpeculativeConfig.from_setting({"num_speculative_tokens": k, "prompt_lookup_min": 1})
    return Scheduler(
        SchedulerConfig(num_scheduler_steps=1),
        CacheConfig(block_size=BLOCK, num_blocks=64),
        max_model_len=256,
        speculator=Speculator(config, None),
    )


def _registered_hashes(scheduler: Scheduler) -> set[bytes]:
    return set(scheduler.kv_cache_manager.pool.cached)


def _committed_block_hashes(tokens: list[int], num_tokens: int) -> list[bytes]:
    hashes, parent = [], root_hash(None)
    for start in range(0, num_tokens - num_tokens % BLOCK, BLOCK):
        parent = hash_block(parent, tokens[start : start + BLOCK])
        hashes.append(parent)
    return hashes


def test_a_rejected_draft_is_rolled_back_and_never_registered():
    scheduler = _scheduler()
    prompt = [10, 11, 12, 13, 14, 10, 11]  # "10 11" was followed by "12 13 14 10"
    request = Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), eos_token_id=None)
    scheduler.add_request(request)
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"r": 7} and not so.spec_token_ids
    scheduler.update_from_output(so, ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[12]]))

    so = scheduler.schedule()  # 8 tokens, the last one's K/V to compute; "11 12" -> "13 14 10 11"
    assert so.spec_token_ids == {"r": [13, 14, 10, 11]}
    assert so.num_scheduled_tokens == {"r": 5}
    # Block 1 (tokens 4..7) is full of committed tokens, written this step: registered.
    # Block 2 holds draft positions only: not.
    assert _registered_hashes(scheduler) == set(_committed_block_hashes(request.all_token_ids, 8))
    # Verified: the first draft token accepted, the second rejected (99 committed instead).
    scheduler.update_from_output(so, ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[13, 99]]))
    assert request.output_token_ids == [12, 13, 99]
    assert request.num_computed_tokens == request.num_tokens - 1 == 9  # position 9 (99) gets its K/V next
    assert _registered_hashes(scheduler) == set(_committed_block_hashes(request.all_token_ids, 8))

    so = scheduler.schedule()
    assert so.scheduled_cached_reqs[0].num_computed_tokens == 9
    assert so.scheduled_cached_reqs[0].new_token_ids == [13, 99]
    # Still no block 2: its tokens 8..11 are not all committed, whatever the draft.
    assert len(_registered_hashes(scheduler)) == 2
    stats = scheduler.stats()
    assert stats["spec_decode_num_drafts"] == 1
    assert stats["spec_decode_num_draft_tokens"] == 4
    assert stats["spec_decode_num_accepted_tokens"] == 1
    assert stats["spec_decode_num_accepted_tokens_per_pos"] == [1, 0, 0, 0]


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there():
    """And the logprobs go with the tokens kept: one entry each."""
    scheduler = _scheduler()
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[14], logprobs=0)
    request = Request("r", [10, 11, 12, 13, 14, 10, 11], params, eos_token_id=None)
    scheduler.add_request(request)
    so = scheduler.schedule()
    first = ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[12]], logprobs={"r": [([12], [-0.5], 1)]})
    assert scheduler.update_from_output(so, first)[0].new_logprobs == [([12], [-0.5], 1)]
    so = scheduler.schedule()
    assert so.spec_token_ids == {"r": [13, 14, 10, 11]}  # logprobs speculate too
    entries = [([13], [-0.1], 1), ([14], [-0.2], 1), ([10], [-0.3], 2)]
    run = ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[13, 14, 10]], logprobs={"r": entries})
    outputs = scheduler.update_from_output(so, run)
    assert outputs[0].new_token_ids == [13, 14]
    assert outputs[0].new_logprobs == entries[:2]
    assert request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason == 14


def test_drafts_leave_room_for_max_tokens_and_steps_aside_are_counted():
    scheduler = _scheduler()
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    scheduler.add_request(Request("r", [10, 11, 12, 13, 14, 10, 11], params, eos_token_id=None))
    penalised = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, presence_penalty=0.5)
    scheduler.add_request(Request("pp", [10, 11, 12, 13, 14, 10, 11], penalised, eos_token_id=None))
    so = scheduler.schedule()
    scheduler.update_from_output(so, ModelRunnerOutput(req_ids=["r", "pp"], sampled_token_ids=[[12], [12]]))
    so = scheduler.schedule()
    assert so.spec_token_ids == {"r": [13]}  # 2 tokens left: a draft of 1, committing 2 at most
    stats = scheduler.stats()
    assert stats["spec_decode_num_steps_aside"] == 1
    assert stats["spec_decode_steps_aside_by_reason"] == {"penalties": 1}


def test_mostly_rejected_drafts_pause_drafting_then_it_resumes():
    from raylm.core import spec_decode

    config = SpeculativeConfig.from_setting({"num_speculative_tokens": 4, "prompt_lookup_min": 1})
    speculator = Speculator(config, None)
    request = Request("r", [1, 2, 3, 1, 2], SamplingParams(temperature=0.0, max_tokens=200), eos_token_id=None)
    request.num_computed_tokens = request.num_tokens - 1

    def draft():
        speculator.begin_step(1)
        out = speculator.draft(request, False, 256, 64)
        speculator.end_step()
        return out

    assert draft() == [3, 1, 2]
    speculator.record_verified(request, 4, 1)  # nothing accepted ...
    assert draft()
    speculator.record_verified(request, 4, 2)  # ... 1 of 8 draft tokens: under LOW_ACCEPTANCE
    assert draft() == []
    assert speculator.stats.steps_aside_by_reason == {"low_acceptance": 1}
    for _ in range(spec_decode.LOW_ACCEPTANCE_PAUSE):
        request.append_output_token(1)
    assert draft()  # a fresh window


def _finished(rid: str, prompt: list[int], output: list[int], salt: str | None = None) -> Request:
    request = Request(rid, prompt, SamplingParams(temperature=0.0), eos_token_id=None, cache_salt=salt)
    for token in output:
        request.append_output_token(token)
    request.status = RequestStatus.FINISHED_LENGTH
    return request


def test_suffix_drafts_follow_earlier_outputs_of_the_same_salt_only():
    proposer = SuffixProposer(2, 4)
    proposer.request_finished(_finished("a", [1, 2], [30, 31, 32, 33, 34, 35], salt="tenant-a"))
    asking = Request("b", [9, 30, 31], SamplingParams(temperature=0.0), eos_token_id=None, cache_salt="tenant-a")
    assert proposer.propose(asking, 3) == [32, 33, 34]
    other = Request("c", [9, 30, 31], SamplingParams(temperature=0.0), eos_token_id=None, cache_salt="tenant-b")
    assert proposer.propose(other, 3) == []  # nothing learnt under its salt, nothing in its own tokens
    unsalted = Request("d", [9, 30, 31], SamplingParams(temperature=0.0), eos_token_id=None)
    assert proposer.propose(unsalted, 3) == []


def test_suffix_drafts_take_the_most_frequent_continuation_and_fall_back_to_lookup():
    proposer = SuffixProposer(2, 4)
    proposer.request_finished(_finished("a", [5], [7, 8, 40, 41]))
    proposer.request_finished(_finished("b", [5], [7, 8, 50, 51]))
    proposer.request_finished(_finished("c", [6], [7, 8, 50, 52]))
    asking = Request("x", [3, 7, 8], SamplingParams(temperature=0.0), eos_token_id=None)
    assert proposer.propose(asking, 2) == [50, 51]  # 50 twice after "7 8"; then a tie, to the smaller id
    own = Request("y", [60, 61, 62, 63, 60, 61], SamplingParams(temperature=0.0), eos_token_id=None)
    assert proposer.propose(own, 2) == [62, 63]  # no earlier output knows "60 61": prompt lookup


def test_suffix_table_is_bounded_and_learns_nothing_from_errors():
    proposer = SuffixProposer(2, 4, max_contexts=50)
    for i in range(20):
        proposer.request_finished(_finished(f"r{i}", [i], [100 + i + j for j in range(10)]))
    assert len(proposer) == 50
    failed = _finished("bad", [1], [2, 3, 4, 5])
    failed.status = RequestStatus.FINISHED_ERROR
    empty = SuffixProposer(2, 4)
    empty.request_finished(failed)
    assert len(empty) == 0
