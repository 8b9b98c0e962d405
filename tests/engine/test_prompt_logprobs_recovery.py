"""Prompt logprobs survive a recovery mid-prompt exactly once each: the new
workers (or a new core) compute the prompt again from its start, and the front
end keeps one entry per prompt token (HF's values, the prompt's length), placed
by the prompt token the core says they score."""

from __future__ import annotations

import os
import signal

import pytest
from transformers import AutoTokenizer

from raylm import LLM, SamplingParams
from raylm.core.outputs import EngineCoreOutput
from raylm.engine.output_processor import OutputProcessor
from raylm.engine.protocol import RecoveryKind
from raylm.testing.hf_oracle import hf_prompt_logprobs
from tests.conftest import executor_of

PROMPT = [(11 * j) % 500 + 3 for j in range(40)]
CHUNK = 8  # max_num_batched_tokens: the prompt's logprobs come over five steps


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


def _prompt_logprobs_held(llm: LLM, request_id: str) -> int:
    return len(llm.llm_engine.output_processor.parents[request_id].prompt_logprobs)


def test_a_worker_killed_mid_prompt_duplicates_no_prompt_logprob(model):
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    with LLM(
        model,
        dtype="float32",
        distributed_executor_backend="mp",
        num_threads=1,
        kv_cache_memory_bytes=16 << 20,
        max_num_batched_tokens=CHUNK,
    ) as llm:
        engine = llm.llm_engine
        engine.add_request("r", {"prompt_token_ids": PROMPT}, params)
        outputs = []
        # Some of the prompt's logprobs are in, not all: kill the worker.
        while _prompt_logprobs_held(llm, "r") < 1 + CHUNK:
            outputs += engine.step()
        assert _prompt_logprobs_held(llm, "r") < len(PROMPT)
        os.kill(executor_of(llm).worker_pids[0], signal.SIGKILL)
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert [e.kind for e in engine.engine_core.engine_core.recoveries] == [RecoveryKind.WORKER_DIED]
    (out,) = outputs
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for token, position, hf_lp in zip(PROMPT[1:], out.prompt_logprobs[1:], hf_prompt_logprobs(model, PROMPT)):
        assert abs(position[token].logprob - hf_lp) < 1e-3


def _entries(first: int, last: int) -> list:
    """Prompt logprob entries scoring prompt tokens first..last, each carrying its index as the logprob."""
    return [([PROMPT[i]], [-float(i)], 1) for i in range(first, last + 1)]


def _out(first: int, last: int) -> EngineCoreOutput:
    return EngineCoreOutput("r", [], new_prompt_logprobs=_entries(first, last), prompt_logprobs_start=first)


@pytest.fixture
def processor(model):
    processor = OutputProcessor(AutoTokenizer.from_pretrained(model))
    processor.add_request("r", None, PROMPT, SamplingParams(prompt_logprobs=0), ["r"])
    return processor


def _held(processor) -> list[float]:
    return [-p[PROMPT[i]].logprob for i, p in enumerate(processor.parents["r"].prompt_logprobs) if p is not None]


def test_prompt_logprobs_sent_again_from_the_start_are_kept_once(processor):
    processor.process_outputs([_out(1, 8), _out(9, 16)])
    # The executor is rebuilt: its new workers start the prompt over.
    processor.process_outputs([_out(1, 8), _out(9, 16), _out(17, 24), _out(25, 39)])
    assert _held(processor) == list(range(1, 40))


def test_a_resumed_request_keeps_what_it_had_and_skips_late_or_repeated_entries(processor):
    processor.process_outputs([_out(1, 8)])
    assert processor.resume_points("r") == [("r", [])]
    # A late output of the old core, then the new core from the start.
    processor.process_outputs([_out(9, 16), _out(1, 16), _out(17, 39)])
    assert _held(processor) == list(range(1, 40))


def test_prompt_logprobs_after_a_gap_are_not_misplaced(processor):
    processor.process_outputs([_out(1, 8), _out(17, 24)])
    assert _held(processor) == list(range(1, 9))


def test_prompt_logprobs_of_requests_preempted_with_steps_in_flight(model):
    """Async scheduling: a request preempted while a prefill chunk of it is in
    flight loses that step's outputs; its prompt logprobs are computed again
    on its return, none missing, none twice."""
    prompts = [[(13 * i + 7 * j) % 600 + 3 for j in range(120)] for i in range(6)]
    block_bytes = 2 * 2 * 2 * 16 * 4 * 16  # K and V, 2 layers, 2 KV heads of 16, float32, 16 tokens
    with LLM(
        model,
        dtype="float32",
        async_scheduling=True,
        kv_cache_memory_bytes=40 * block_bytes,
        max_num_batched_tokens=32,
        max_model_len=256,
    ) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=60, ignore_eos=True, prompt_logprobs=0),
            use_tqdm=False,
        )
        assert llm.llm_engine.engine_core.engine_core.scheduler.num_preemptions > 0  # 6 x 12 blocks wanted, 40 held
    for prompt, out in zip(prompts, outs):
        assert len(out.prompt_logprobs) == len(prompt)
        for token, position, hf_lp in zip(prompt[1:], out.prompt_logprobs[1:], hf_prompt_logprobs(model, prompt)):
            assert abs(position[token].logprob - hf_lp) < 1e-3
