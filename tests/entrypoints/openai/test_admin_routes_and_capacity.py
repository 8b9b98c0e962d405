"""Issue 48, finding 9, the server's parts:
- the admin routes (/scale, /replicas/{i}/restart) without an API key answer
  only on a loopback bind; on any other they are a 403 that says how to enable
  them;
- admission capacity follows the number of serving replicas, whoever scales
  (/scale or the autoscaler).
In-process against a fake engine (no Ray, no cores)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI

from raylm.config import AutoscaleConfig
from raylm.engine import autoscaler as autoscaler_module
from raylm.engine.autoscaler import Autoscaler
from raylm.entrypoints.openai import data_parallel_routes
from raylm.entrypoints.openai.data_parallel_routes import install_data_parallel_routes, is_loopback_host
from raylm.entrypoints.openai.limits import AdmissionControl, Overloaded

MAX_NUM_SEQS = 4


class FakeEngine:
    """A data-parallel engine's surface: its replicas' states, scale, restart."""

    def __init__(self, replicas: int = 2) -> None:
        self.config = SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_seqs=MAX_NUM_SEQS),
            parallel_config=SimpleNamespace(data_parallel_size=replicas),
        )
        self.states = ["serving"] * replicas
        self.restarted: list[int] = []

    def replica_states(self) -> list[dict]:
        return [
            {"replica": i, "state": s, "in_flight": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
            for i, s in enumerate(self.states)
        ]

    async def scale(self, size: int) -> None:
        self.states = self.states[:size] + ["serving"] * (size - len(self.states))

    async def restart_replica(self, index: int) -> None:
        self.restarted.append(index)


def _post(app: FastAPI, path: str, json=None, headers=None) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=json, headers=headers)

    return asyncio.run(go())


def _app(engine: FakeEngine, api_key: str | None, host: str | None) -> FastAPI:
    app = FastAPI()
    install_data_parallel_routes(app, engine, api_key, host=host)
    return app


@pytest.fixture(autouse=True)
def _no_ray_cluster(monkeypatch):
    monkeypatch.setattr(data_parallel_routes, "_cluster_cpus", lambda: None)


# ---- admin routes without a key ----------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_loopback_hosts_are_loopback(host):
    assert is_loopback_host(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.0.0.5", "192.168.1.2", "example.com", "fe80::1"])
def test_other_hosts_are_not(host):
    assert not is_loopback_host(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.5", "::"])
def test_without_a_key_a_non_loopback_bind_refuses_the_admin_routes(host):
    engine = FakeEngine()
    app = _app(engine, None, host)
    scaled = _post(app, "/scale", json={"data_parallel_size": 3})
    restarted = _post(app, "/replicas/0/restart")
    for response in (scaled, restarted):
        assert response.status_code == 403
        error = response.json()["error"]
        assert error["type"] == "permission_error" and error["code"] == 403
        # Says why and how to enable them.
        assert "non-loopback" in error["message"] and "--api-key" in error["message"]
    assert len(engine.states) == 2 and engine.restarted == []


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", None])
def test_without_a_key_a_loopback_bind_serves_them(host):
    engine = FakeEngine()
    app = _app(engine, None, host)
    assert _post(app, "/scale", json={"data_parallel_size": 3}).status_code == 200
    assert _post(app, "/replicas/1/restart").status_code == 200
    assert len(engine.states) == 3 and engine.restarted == [1]


def test_with_a_key_any_bind_serves_them_to_the_key_only():
    engine = FakeEngine()
    app = _app(engine, "k", "0.0.0.0")
    assert _post(app, "/scale", json={"data_parallel_size": 3}).status_code == 401
    response = _post(app, "/scale", json={"data_parallel_size": 3}, headers={"Authorization": "Bearer k"})
    assert response.status_code == 200 and len(engine.states) == 3


# ---- admission capacity follows the replicas -------------------------------------


def test_capacity_follows_scale_route():
    engine = FakeEngine(replicas=2)
    admission = AdmissionControl.for_engine(engine, max_waiting=1)
    app = _app(engine, None, "127.0.0.1")
    assert admission.capacity == 2 * MAX_NUM_SEQS + 1
    assert _post(app, "/scale", json={"data_parallel_size": 3}).status_code == 200
    assert admission.max_running == 3 * MAX_NUM_SEQS and admission.capacity == 3 * MAX_NUM_SEQS + 1
    admission.admit(3 * MAX_NUM_SEQS + 1, None)  # fits three replicas and the queue
    assert _post(app, "/scale", json={"data_parallel_size": 1}).status_code == 200
    assert admission.capacity == MAX_NUM_SEQS + 1
    with pytest.raises(Overloaded, match=f"{MAX_NUM_SEQS} can run"):
        admission.admit(1, None)  # more in flight than one replica holds: 429 until they finish


def test_only_serving_replicas_count_and_never_fewer_than_one():
    engine = FakeEngine(replicas=3)
    admission = AdmissionControl.for_engine(engine, max_waiting=0)
    engine.states = ["serving", "draining", "starting"]  # one leaving, one not yet warm
    assert admission.max_running == MAX_NUM_SEQS
    engine.states = ["restarting"]  # the only one restarts: requests wait for it
    assert admission.max_running == MAX_NUM_SEQS


def test_capacity_follows_the_autoscaler(monkeypatch):
    monkeypatch.setattr(autoscaler_module, "_INTERVAL_S", 0.0)
    engine = FakeEngine(replicas=1)
    engine.states = ["serving"]
    admission = AdmissionControl.for_engine(engine, max_waiting=0)
    config = AutoscaleConfig(
        min_replicas=1, max_replicas=2, target_ongoing_requests=1.0, upscale_delay_s=0.0, downscale_delay_s=0.0
    )
    busy = engine.replica_states

    def loaded() -> list[dict]:  # two requests in flight at target 1: asks for 2 replicas
        return [{**state, "in_flight": 2} for state in busy()]

    engine.replica_states = loaded
    decisions = []

    async def run_until_decided():
        task = asyncio.create_task(Autoscaler(engine, config, on_decision=decisions.append).run())
        while not decisions:
            await asyncio.sleep(0)
        task.cancel()

    asyncio.run(asyncio.wait_for(run_until_decided(), 30))
    assert decisions[0].num_replicas == 2 and admission.max_running == 2 * MAX_NUM_SEQS
