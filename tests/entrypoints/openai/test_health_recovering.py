"""/health while the engine recovers: 200 with a body saying what recovers and
for how long, under the start timeout; 503 (an OpenAI-style error saying how
long it has been recovering) past it, so a supervisor can act on a recovery
that hangs. The engine core is a scripted fake (tests/engine/conftest.py);
a recovery's age is moved past the limit by hand, not by waiting."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx

from raylm.engine.async_llm import AsyncLLM
from raylm.engine.errors import EngineCoreDiedError
from raylm.engine.protocol import EngineCoreOutputs
from raylm.entrypoints.openai.api_server import build_app
from tests.conftest import async_wait_until
from tests.engine.conftest import FakeCore, FakeLauncher, make_engine  # noqa: F401 - the fixture

LIMIT_S = 600.0  # engine_start_timeout; never waited for


class AnsweringCore(FakeCore):
    """A fake core that answers health pings."""

    def on_ping(self, nonce: int) -> None:
        self.emit(EngineCoreOutputs(pong=nonce))


async def _health(engine: AsyncLLM) -> httpx.Response:
    transport = httpx.ASGITransport(app=build_app(engine, ["tiny"]))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.get("/health")


def _assert_recovering(response: httpx.Response, what: str) -> None:
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "recovering" and body["recovering"] == what
    assert 0 <= body["recovering_for_s"] < LIMIT_S and body["limit_s"] == LIMIT_S


def _assert_past_the_limit(response: httpx.Response, what: str) -> None:
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == 503 and error["type"] == "service_unavailable"
    recovering = re.search(r"recovering \((\w+)\) for (\d+) s", error["message"])
    assert recovering and recovering[1] == what and int(recovering[2]) > LIMIT_S, error["message"]
    assert "engine_start_timeout" in error["message"]


def test_a_core_restart_that_hangs_turns_health_503_past_the_start_timeout(make_engine, monkeypatch):  # noqa: F811 (the fixture imported above)
    release = threading.Event()

    def start(attempt: int) -> None:
        if attempt > 0:  # the replacement hangs while starting, until released
            release.wait()

    monkeypatch.setattr(FakeLauncher, "on_start", start)
    monkeypatch.setattr(FakeLauncher, "core_class", AnsweringCore)
    engine, _ = make_engine(engine_start_timeout=LIMIT_S)

    async def run() -> None:
        engine._ensure_output_handler()
        assert (await _health(engine)).status_code == 200 and engine.recovery_status() is None
        FakeCore.started[0].script.put_nowait(EngineCoreDiedError(-9))
        await async_wait_until(lambda: engine.recovering)
        _assert_recovering(await _health(engine), "engine_core")
        for replacement in engine.engine_core.recovery.starting.values():
            replacement.noticed -= LIMIT_S + 1  # as if it had hung that long
        _assert_past_the_limit(await _health(engine), "engine_core")
        release.set()
        await async_wait_until(lambda: len(FakeCore.started) == 2 and not engine.recovering)
        assert engine.recovery_status() is None

    try:
        asyncio.run(run())
    finally:
        release.set()


def test_an_executor_rebuild_the_core_announced_is_reported_and_bounded(make_engine, monkeypatch):  # noqa: F811 (the fixture imported above)
    monkeypatch.setattr(FakeLauncher, "core_class", AnsweringCore)
    engine, _ = make_engine(engine_start_timeout=LIMIT_S)
    core = engine.engine_core.channels[0]

    async def run() -> None:
        assert (await _health(engine)).status_code == 200 and engine.recovery_status() is None
        core.rebuilding_since = time.monotonic()  # what the supervisor records from the core's word
        status = engine.recovery_status()
        assert status["recovering"] == "executor" and status["limit_s"] == LIMIT_S
        _assert_recovering(await _health(engine), "executor")
        core.rebuilding_since -= LIMIT_S + 1
        _assert_past_the_limit(await _health(engine), "executor")

    asyncio.run(run())
