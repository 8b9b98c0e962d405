"""AsyncLLM when its engine-core process dies: a silent death (killed) starts a
new core and resubmits the unfinished requests as continuations; a core that
reported its error, or a death past the restart budget, is fatal. The front
end is tested against scripted fake cores; MPClient against a real one."""

from __future__ import annotations

import asyncio

import pytest

from raylm.config import create_engine_config
from raylm.core.outputs import EngineCoreOutput
from raylm.engine.async_llm import AsyncLLM
from raylm.engine.core_client import EngineCoreDiedError, EngineDeadError, MPClient
from raylm.engine.core_proc import EngineCoreOutputs, EngineCoreRequest
from raylm.sampling_params import SamplingParams
from tests.engine.conftest import FakeCore


def _step(*outputs: EngineCoreOutput) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=list(outputs))


async def _collect(engine: AsyncLLM, request_id: str, params: SamplingParams) -> list:
    return [out async for out in engine.generate({"prompt_token_ids": [1, 2, 3]}, params, request_id)]


async def _until(predicate) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never became true")


def test_silent_death_restarts_the_core_and_resumes_unfinished_children(make_engine):
    engine, stats = make_engine()
    params = SamplingParams(n=2, max_tokens=4, temperature=0, ignore_eos=True)

    async def run() -> list:
        task = asyncio.ensure_future(_collect(engine, "req", params))
        first = FakeCore.started[0]
        await _until(lambda: len(first.requests) == 2)
        a, b = (r.request_id for r in first.requests)
        first.script.put_nowait(_step(EngineCoreOutput(a, [10]), EngineCoreOutput(b, [20])))
        first.script.put_nowait(_step(EngineCoreOutput(a, [11]),
                                      EngineCoreOutput(b, [21, 22, 23], finish_reason="length")))
        first.script.put_nowait(EngineCoreDiedError(-9))
        await _until(lambda: len(FakeCore.started) == 2 and FakeCore.started[1].requests)
        second = FakeCore.started[1]
        # Only the unfinished child, continuing after the tokens already streamed.
        assert [(r.request_id, r.prompt_token_ids, r.output_token_ids) for r in second.requests] == [
            (a, [1, 2, 3], [10, 11])]
        assert second.requests[0].sampling_params is first.requests[0].sampling_params
        assert first.closed and not engine.recovering
        second.script.put_nowait(_step(EngineCoreOutput(a, [12, 13], finish_reason="length")))
        return await task

    outputs = asyncio.run(run())
    completions = {c.index: c for out in outputs for c in out.outputs}
    assert outputs[-1].finished
    assert [c.finish_reason for c in outputs[-1].outputs] == ["length", "length"]
    # Streamed deltas, joined: each completion's tokens exactly once.
    tokens = {i: [t for out in outputs for c in out.outputs if c.index == i for t in c.token_ids] for i in completions}
    assert tokens == {0: [10, 11, 12, 13], 1: [20, 21, 22, 23]}
    assert stats.seen == [("engine_core", 1)]
    assert engine.restart_budget.num_restarts == 1


def test_requests_arriving_during_the_restart_go_to_the_new_core(make_engine, monkeypatch):
    engine, _ = make_engine()
    release = asyncio.Event()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        gate = asyncio.Event()
        original = engine._start_core_process

        async def slow_start(died):
            # Hold the restart open until the test has sent a request and checked /health.
            gate.set()
            await release.wait()
            return await loop.run_in_executor(None, original)

        monkeypatch.setattr(engine, "_start_new_core", slow_start)
        engine._ensure_output_handler()
        FakeCore.started[0].script.put_nowait(EngineCoreDiedError(-9))
        await gate.wait()
        assert engine.recovering
        await engine.check_health(timeout=1)  # passes: the server is fine, requests wait
        task = asyncio.ensure_future(_collect(engine, "late", params))
        await _until(lambda: FakeCore.started[0].requests)
        release.set()
        await _until(lambda: len(FakeCore.started) == 2 and FakeCore.started[1].requests)
        second = FakeCore.started[1]
        assert [r.output_token_ids for r in second.requests] == [[]]
        second.script.put_nowait(_step(EngineCoreOutput(second.requests[0].request_id, [7], finish_reason="length")))
        outputs = await task
        assert outputs[-1].outputs[0].token_ids == [7]

    asyncio.run(run())


@pytest.mark.parametrize("failure", ["reported", "past_budget"])
def test_fatal_failures_fail_every_request_and_start_nothing(make_engine, failure):
    engine, stats = make_engine(max_restarts=0 if failure == "past_budget" else 3)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def run() -> None:
        task = asyncio.ensure_future(_collect(engine, "req", params))
        first = FakeCore.started[0]
        await _until(lambda: first.requests)
        error = EngineDeadError("engine core failed: boom") if failure == "reported" else EngineCoreDiedError(-9)
        first.script.put_nowait(error)
        with pytest.raises(EngineDeadError):
            await task
        assert await asyncio.wait_for(engine.wait_until_dead(), 5) is engine.dead_error
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await _collect(engine, "new", params)

    asyncio.run(run())
    assert len(FakeCore.started) == 1 and stats.seen == []
    if failure == "past_budget":
        assert "no restart left (0 allowed within 600s)" in str(engine.dead_error)


def test_engine_core_request_carries_the_tokens_already_generated():
    import msgspec

    from raylm.core.request import Request

    params = SamplingParams(max_tokens=5)
    request = Request("r", [1, 2], params, eos_token_id=0, arrival_time=1.0, output_token_ids=[3, 4])
    wire = msgspec.msgpack.encode(EngineCoreRequest.from_request(request))
    again = msgspec.msgpack.decode(wire, type=EngineCoreRequest).to_request()
    assert again.output_token_ids == [3, 4] and again.all_token_ids == [1, 2, 3, 4]


@pytest.fixture(scope="module")
def core_config(tiny_model_dir):
    return create_engine_config(tiny_model_dir("llama"), kv_cache_memory_bytes=4 << 20, max_model_len=256,
                                num_threads=1)


@pytest.mark.slow
def test_mp_client_tells_a_killed_core_from_one_that_reported_its_error(core_config):
    killed = MPClient(core_config)
    try:
        killed.process.kill()
        with pytest.raises(EngineCoreDiedError) as died:
            asyncio.run(asyncio.wait_for(killed.get_output(), 30))
        assert died.value.exitcode == -9
        # Sends to a core that is gone wait in the client; they never block.
        killed._send_frame(b"never delivered")
    finally:
        killed.shutdown()

    failing = MPClient(core_config)
    try:
        failing._send_frame(b"not a message")  # the core cannot decode it and fails
        with pytest.raises(EngineDeadError) as failed:
            asyncio.run(asyncio.wait_for(failing.get_output(), 30))
        assert not isinstance(failed.value, EngineCoreDiedError)
        assert "engine core failed" in str(failed.value)
    finally:
        failing.shutdown()


def test_recoveries_the_core_reports_reach_the_stat_loggers(make_engine):
    from raylm.engine.core_proc import RecoveryStats

    engine, stats = make_engine()

    async def run() -> None:
        engine._ensure_output_handler()
        FakeCore.started[0].script.put_nowait(EngineCoreOutputs(recoveries=[RecoveryStats("worker_died", 1.5, 3)]))
        await _until(lambda: stats.seen)

    asyncio.run(run())
    assert stats.seen == [("worker_died", 3)]
