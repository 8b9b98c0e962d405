"""POST /scale is bounded above and serialized (issue 20): a size past the
bound is a 400 that never reaches the engine, and concurrent calls run one
after the other, so that two racing scale-ups cannot both start replicas.
Driven in-process against a fake engine that records its scale calls."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI

from raylm.entrypoints.openai import data_parallel_routes
from raylm.entrypoints.openai.data_parallel_routes import MAX_DATA_PARALLEL_SIZE, install_data_parallel_routes

KEY = "admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


class FakeEngine:
    """Scales slowly, counting the calls in progress at once."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.in_progress = 0
        self.most_at_once = 0

    def replica_states(self) -> list[dict]:
        return []

    async def scale(self, size: int) -> None:
        self.in_progress += 1
        self.most_at_once = max(self.most_at_once, self.in_progress)
        try:
            await asyncio.sleep(0.05)  # a replica loading: other calls arrive meanwhile
            self.sizes.append(size)
        finally:
            self.in_progress -= 1


def _app(engine: FakeEngine) -> FastAPI:
    app = FastAPI()
    install_data_parallel_routes(app, engine, KEY)
    return app


async def _post_all(app: FastAPI, sizes: list[int]) -> list[httpx.Response]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=AUTH) as client:
        return await asyncio.gather(*(client.post("/scale", json={"data_parallel_size": s}) for s in sizes))


def test_concurrent_scales_run_one_at_a_time():
    engine = FakeEngine()
    responses = asyncio.run(_post_all(_app(engine), [3, 4, 2, 5]))
    assert [r.status_code for r in responses] == [200] * 4
    assert engine.most_at_once == 1 and sorted(engine.sizes) == [2, 3, 4, 5]


def test_size_past_the_bound_is_a_400_that_never_reaches_the_engine(monkeypatch):
    # No Ray cluster (the test session may hold one, which would bound the size lower).
    monkeypatch.setattr(data_parallel_routes, "_cluster_cpus", lambda: None)
    engine = FakeEngine()
    [response] = asyncio.run(_post_all(_app(engine), [MAX_DATA_PARALLEL_SIZE + 1]))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "data_parallel_size" and str(MAX_DATA_PARALLEL_SIZE) in error["message"]
    assert engine.sizes == []


def test_the_cluster_bounds_the_size(monkeypatch):
    monkeypatch.setattr(data_parallel_routes, "_cluster_cpus", lambda: 3)
    engine = FakeEngine()
    ok, too_many = asyncio.run(_post_all(_app(engine), [3, 4]))
    assert ok.status_code == 200 and too_many.status_code == 400
    assert "3 CPUs" in too_many.json()["error"]["message"] and engine.sizes == [3]
