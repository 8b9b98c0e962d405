"""AsyncLLM when its engine-core process dies or gives up: the supervisor
starts a new core and resubmits the unfinished requests as continuations,
within the restart budget; past it, the engine is dead. The front end and its
supervisor are tested against scripted fake cores (tests/engine/conftest.py),
the process launcher against real ones."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from raylm.config import create_engine_config
from raylm.core.outputs import EngineCoreOutput
from raylm.engine.async_llm import AsyncLLM
from raylm.engine.core_channel import CoreChannel
from raylm.engine.errors import EngineCoreDiedError, EngineDeadError
from raylm.engine.protocol import EngineCoreOutputs, EngineCoreRequest
from raylm.engine.supervisor import AsyncEngineCoreSupervisor
from raylm.sampling_params import SamplingParams
from tests.engine.conftest import FakeCore, FakeLauncher


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
        first.script.put_nowait(
            _step(EngineCoreOutput(a, [11]), EngineCoreOutput(b, [21, 22, 23], finish_reason="length"))
        )
        first.script.put_nowait(EngineCoreDiedError(-9))
        await _until(lambda: len(FakeCore.started) == 2 and FakeCore.started[1].requests)
        second = FakeCore.started[1]
        # Only the unfinished child, continuing after the tokens already streamed.
        assert [(r.request_id, r.prompt_token_ids, r.output_token_ids) for r in second.requests] == [
            (a, [1, 2, 3], [10, 11])
        ]
        assert second.requests[0].sampling_params == first.requests[0].sampling_params
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
    release = threading.Event()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    gate = threading.Event()

    def slow_start(attempt: int) -> None:
        # Hold the restart open until the test has sent a request and checked /health.
        if attempt > 0:
            gate.set()
            release.wait()

    async def run() -> None:
        FakeLauncher.on_start = slow_start
        engine._ensure_output_handler()
        FakeCore.started[0].script.put_nowait(EngineCoreDiedError(-9))
        await _until(gate.is_set)
        await _until(lambda: engine.recovering)
        await engine.check_health(timeout=1)  # passes: the server is fine, requests wait
        task = asyncio.ensure_future(_collect(engine, "late", params))
        await asyncio.sleep(0.2)
        assert not FakeCore.started[0].requests  # the dead core gets nothing
        release.set()
        await _until(lambda: len(FakeCore.started) == 2 and FakeCore.started[1].requests)
        second = FakeCore.started[1]
        assert [r.output_token_ids for r in second.requests] == [[]]
        second.script.put_nowait(_step(EngineCoreOutput(second.requests[0].request_id, [7], finish_reason="length")))
        outputs = await task
        assert outputs[-1].outputs[0].token_ids == [7]

    asyncio.run(run())


@pytest.mark.parametrize("failure", ["reported", "died"])
def test_failures_past_the_budget_fail_every_request_and_start_nothing(make_engine, failure):
    engine, stats = make_engine(max_restarts=0)
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
    assert "no restart left (0 allowed within 600s)" in str(engine.dead_error)
    assert ("engine core failed: boom" if failure == "reported" else "exited with code -9") in str(engine.dead_error)


def test_a_core_that_reported_its_error_is_restarted_like_one_that_died(make_engine):
    """One rule for every core, whatever runs it: a core that gave up (its own
    recoveries failed) is replaced within the budget, as a replica is."""
    engine, stats = make_engine(max_restarts=3)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    async def run() -> list:
        task = asyncio.ensure_future(_collect(engine, "req", params))
        first = FakeCore.started[0]
        await _until(lambda: first.requests)
        first.script.put_nowait(_step(EngineCoreOutput("req", [5])))
        first.script.put_nowait(EngineDeadError("engine core failed: boom"))
        await _until(lambda: len(FakeCore.started) == 2 and FakeCore.started[1].requests)
        second = FakeCore.started[1]
        assert [r.output_token_ids for r in second.requests] == [[5]]
        second.script.put_nowait(_step(EngineCoreOutput("req", [6], finish_reason="length")))
        return await task

    outputs = asyncio.run(run())
    assert [t for out in outputs for t in out.outputs[0].token_ids] == [5, 6]
    assert stats.seen == [("engine_core", 1)] and engine.restart_budget.num_restarts == 1


def test_engine_core_request_carries_the_tokens_already_generated():
    import msgspec

    params = SamplingParams(max_tokens=5)
    request = EngineCoreRequest("r", [1, 2], params, eos_token_id=0, arrival_time=1.0, output_token_ids=[3, 4])
    wire = msgspec.msgpack.encode(request)
    again = msgspec.msgpack.decode(wire, type=EngineCoreRequest).to_request()
    assert again.output_token_ids == [3, 4] and again.all_token_ids == [1, 2, 3, 4]


@pytest.fixture(scope="module")
def core_config(tiny_model_dir):
    return create_engine_config(
        tiny_model_dir("llama"), kv_cache_memory_bytes=4 << 20, max_model_len=256, num_threads=1, max_restarts=0
    )


@pytest.mark.slow
def test_the_supervisor_tells_a_killed_core_from_one_that_reported_its_error(core_config):
    """Real core processes: a killed one is reported by its exit code, one
    that failed by its own error; sends to a dead core never block."""
    killed = AsyncEngineCoreSupervisor(core_config)
    try:
        os.kill(killed.launcher._processes[0].pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError) as died:
            asyncio.run(asyncio.wait_for(_drain(killed), 30))
        assert "exited with code -9" in str(died.value)
        killed.channels.get(0, CoreChannel(0, None, "")).unsent.clear()
    finally:
        killed.shutdown()

    failing = AsyncEngineCoreSupervisor(core_config)
    try:
        failing.channels[0].send(b"not a message")  # the core cannot decode it and fails
        with pytest.raises(EngineDeadError) as failed:
            asyncio.run(asyncio.wait_for(_drain(failing), 30))
        assert "engine core failed" in str(failed.value) and "exited with code" not in str(failed.value)
    finally:
        failing.shutdown()


async def _drain(supervisor) -> None:
    while True:
        await supervisor.get_output()


def test_recoveries_the_core_reports_reach_the_stat_loggers(make_engine):
    from raylm.engine.protocol import RecoveryStats

    engine, stats = make_engine()

    async def run() -> None:
        engine._ensure_output_handler()
        FakeCore.started[0].script.put_nowait(EngineCoreOutputs(recoveries=[RecoveryStats("worker_died", 1.5, 3)]))
        await _until(lambda: stats.seen)

    asyncio.run(run())
    assert stats.seen == [("worker_died", 3)]
