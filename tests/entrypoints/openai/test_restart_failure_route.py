"""POST /replicas/{i}/restart when the replica's new core fails to start: a
409 naming the cause, not a 200 saying it restarted; the replica is then
recovered as a failed start (its replacement starts within the restart
budget). The app runs in-process over the real supervisor with scripted
fake cores (tests/engine/conftest.py); the fake launcher's second start
(the restart's) fails."""

from __future__ import annotations

import asyncio

import httpx

from raylm.engine.async_llm import AsyncLLM
from raylm.engine.restart_budget import RestartBudget
from raylm.entrypoints.openai.api_server import build_app
from tests.conftest import async_wait_until
from tests.engine.conftest import FakeLauncher, make_engine  # noqa: F401 - the fixture

CAUSE = "the model files are gone"
FIRST_STARTS = 2  # data_parallel_size=2: starts 0 and 1 are the engine's own


async def _post_restart(engine: AsyncLLM, index: int) -> httpx.Response:
    transport = httpx.ASGITransport(app=build_app(engine, ["tiny"]))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post(f"/replicas/{index}/restart")


def _serving(engine: AsyncLLM) -> list[int]:
    return [s["replica"] for s in engine.replica_states() if s["state"] == "serving"]


def test_a_restart_whose_new_core_fails_to_start_answers_409_and_the_replica_recovers(make_engine, monkeypatch):  # noqa: F811 (the fixture imported above)
    def start(attempt: int) -> None:
        if attempt == FIRST_STARTS:  # the restart's new core
            raise RuntimeError(CAUSE)

    monkeypatch.setattr(FakeLauncher, "on_start", start)
    monkeypatch.setattr(RestartBudget, "backoff_s", lambda self: 0.0)
    engine, _ = make_engine(data_parallel_size=2, max_restarts=3)

    async def run() -> None:
        engine._ensure_output_handler()
        await async_wait_until(lambda: _serving(engine) == [0, 1])
        response = await _post_restart(engine, 1)
        assert response.status_code == 409, response.text
        message = response.json()["error"]["message"]
        assert message.startswith("could not restart replica 1: ") and CAUSE in message, message
        # Recovered as before: a replacement started (the failed start cost a
        # restart of the budget), and it serves.
        await async_wait_until(lambda: _serving(engine) == [0, 1])
        assert engine.engine_core.launcher.num_starts == FIRST_STARTS + 2
        assert engine.engine_core.restart_budget.num_recent == 1

    asyncio.run(run())
