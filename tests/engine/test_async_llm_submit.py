"""AsyncLLM.add_request hands a request to the core at once, before anyone
reads its outputs; closing its stream early aborts it, closing after the end
does not. And the online defaults of the step size."""

from __future__ import annotations

import asyncio

import pytest

from raylm.config import create_engine_config
from raylm.core.outputs import EngineCoreOutput
from raylm.engine.input_processor import prompt_worth_a_thread
from raylm.engine.protocol import EngineCoreOutputs
from raylm.engine.request_stream import RequestStream
from raylm.sampling_params import SamplingParams
from tests.engine.conftest import FakeCore

PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def test_add_request_submits_before_the_stream_is_read_and_close_aborts(make_engine):
    engine, _ = make_engine()

    async def run() -> None:
        stream = await engine.add_request({"prompt_token_ids": [1, 2, 3]}, PARAMS, "early")
        core = FakeCore.started[0]
        assert isinstance(stream, RequestStream)
        assert [r.request_id for r in core.requests] == ["early"] and engine.num_unfinished_requests == 1
        stream.close()
        assert core.aborted == ["early"] and engine.num_unfinished_requests == 0
        stream.close()  # idempotent
        assert core.aborted == ["early"]

    asyncio.run(run())


def test_a_stream_read_to_its_end_is_not_aborted_on_close(make_engine):
    engine, _ = make_engine()

    async def run() -> list:
        stream = await engine.add_request({"prompt_token_ids": [1, 2, 3]}, PARAMS, "whole")
        core = FakeCore.started[0]
        core.script.put_nowait(EngineCoreOutputs(outputs=[EngineCoreOutput("whole", [7])]))
        core.script.put_nowait(EngineCoreOutputs(outputs=[EngineCoreOutput("whole", [8], finish_reason="length")]))
        outputs = [out async for out in stream]
        await stream.aclose()
        assert core.aborted == []
        return outputs

    outputs = asyncio.run(run())
    assert [c.token_ids for out in outputs for c in out.outputs] == [[7], [8]]
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"


def test_bad_input_fails_add_request_and_submits_nothing(make_engine):
    engine, _ = make_engine()

    async def run() -> None:
        with pytest.raises(ValueError, match="prompt_token_ids"):
            await engine.add_request({"prompt_token_ids": [1, "x"]}, PARAMS, "bad")
        assert all(not core.requests for core in FakeCore.started) and engine.num_unfinished_requests == 0

    asyncio.run(run())


def test_only_long_text_prompts_are_tokenized_in_a_thread():
    assert not prompt_worth_a_thread({"prompt_token_ids": list(range(100_000))})
    assert not prompt_worth_a_thread("a short prompt")
    assert not prompt_worth_a_thread({"prompt": "a short prompt"})
    assert prompt_worth_a_thread("word " * 2000)
    assert prompt_worth_a_thread({"prompt": "word " * 2000})


def test_online_engines_default_to_small_steps_on_cpu(tiny_model_dir):
    model = tiny_model_dir("llama")
    budget = lambda **kw: create_engine_config(model, device="cpu", **kw).scheduler_config.max_num_batched_tokens  # noqa: E731
    assert budget() == 8192  # offline: throughput
    assert budget(usage_context="api_server") == 2048  # online: a burst starts streaming after one chunk
    assert budget(usage_context="api_server", tensor_parallel_size=2) == 4096  # per rank
    assert budget(usage_context="api_server", max_num_batched_tokens=512) == 512  # the user's value wins
    assert budget(usage_context="api_server", max_num_seqs=4000) == 4000  # room for every running sequence
    with pytest.raises(ValueError, match="usage_context"):
        budget(usage_context="batch")
