"""A scale that fails does not end autoscaling, and a data-parallel replica
on Ray that is not ready in time fails the way a core process does.

On Ray, a replica not ready within engine_start_timeout raised the builtin
TimeoutError; the autoscaler caught only ValueError and RuntimeError, so
its task ended (silently: nobody awaits it) and the server never scaled
again, and POST /scale answered 500. In-process, no Ray cluster: the
autoscaler runs over a stub engine, the replica manager over a stub of
Ray's API that never reports the replica ready."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI

from raylm.config import AutoscaleConfig
from raylm.engine import autoscaler as autoscaler_module
from raylm.engine.autoscaler import Autoscaler
from raylm.engine.errors import EngineStartTimeoutError
from raylm.entrypoints.openai import data_parallel_routes
from raylm.entrypoints.openai.data_parallel_routes import install_data_parallel_routes

ray_exceptions = pytest.importorskip("ray.exceptions")

# Two requests in flight at a target of 1 per replica, on one replica: the load asks for 2, at once.
CONFIG = AutoscaleConfig(
    min_replicas=1, max_replicas=2, target_ongoing_requests=1.0, upscale_delay_s=0.0, downscale_delay_s=0.0
)


class ScalingEngine:
    """Two requests in flight over its replicas (one at first); `scale`
    fails with the errors given, in order, then succeeds."""

    def __init__(self, *failures: BaseException):
        self.failures = list(failures)
        self.scales: list[int] = []
        self.size = 1

    def replica_states(self) -> list[dict]:
        return [
            {"replica": i, "state": "serving", "in_flight": 2 // self.size, "num_waiting": 0, "kv_cache_usage": 0.0}
            for i in range(self.size)
        ]

    async def scale(self, size: int) -> None:
        if self.failures:
            raise self.failures.pop(0)
        self.scales.append(size)
        self.size = size


async def _until_decided(autoscaler: Autoscaler, task: asyncio.Task, decisions: list) -> None:
    while not decisions:
        if task.done():  # ended by the error: nobody would ever see it
            raise AssertionError(f"the autoscaler stopped: {task.exception()!r}")
        await asyncio.sleep(0)


def _run_until_decided(engine) -> list:
    decisions: list = []

    async def run() -> None:
        autoscaler = Autoscaler(engine, CONFIG, on_decision=decisions.append)
        task = asyncio.create_task(autoscaler.run())
        try:
            await asyncio.wait_for(_until_decided(autoscaler, task, decisions), 30)
        finally:
            task.cancel()

    asyncio.run(run())
    return decisions


@pytest.fixture(autouse=True)
def no_interval(monkeypatch):
    monkeypatch.setattr(autoscaler_module, "_INTERVAL_S", 0.0)


@pytest.mark.parametrize(
    "failure",
    [
        TimeoutError("replica 1 was not ready within 3 s"),
        EngineStartTimeoutError("replica 1 was not ready within 3 s"),
        KeyError("a bug"),
    ],
    ids=["TimeoutError", "EngineStartTimeoutError", "bug"],
)
def test_a_failed_scale_is_logged_and_the_next_decision_is_made(failure, caplog):
    engine = ScalingEngine(failure)
    with caplog.at_level(logging.ERROR, logger="raylm.engine.autoscaler"):
        decisions = _run_until_decided(engine)
    assert engine.scales == [2] and [d.num_replicas for d in decisions] == [2]
    [failed] = [r for r in caplog.records if r.levelno == logging.ERROR]
    message = failed.getMessage()
    assert "autoscaling to 2 replicas failed" in message and type(failure).__name__ in message
    assert str(failure.args[0]) in message


def test_an_error_outside_the_scale_does_not_end_autoscaling(caplog):
    engine = ScalingEngine()
    states = engine.replica_states
    calls = iter(range(1000))

    def broken_once() -> list[dict]:
        if next(calls) == 0:
            raise RuntimeError("the replica table is being rebuilt")
        return states()

    engine.replica_states = broken_once
    with caplog.at_level(logging.ERROR, logger="raylm.engine.autoscaler"):
        decisions = _run_until_decided(engine)
    assert [d.num_replicas for d in decisions] == [2]
    [failed] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "RuntimeError: the replica table is being rebuilt" in failed.getMessage()


def test_cancelling_the_autoscaler_ends_it_even_during_a_scale():
    """The loop survives a decision's errors, never its cancellation (the
    engine's shutdown)."""

    class SlowEngine(ScalingEngine):
        def __init__(self):
            super().__init__()
            self.scaling = asyncio.Event()

        async def scale(self, size: int) -> None:
            self.scaling.set()
            await asyncio.sleep(3600)

    async def run() -> asyncio.Task:
        engine = SlowEngine()
        task = asyncio.create_task(Autoscaler(engine, CONFIG).run())
        await asyncio.wait_for(engine.scaling.wait(), 30)
        task.cancel()
        await asyncio.wait([task], timeout=30)
        return task

    assert asyncio.run(run()).cancelled()


# ---- a replica on Ray not ready within the start timeout ---------------------------------------


class _Actor:
    def __init__(self):
        self.ready = SimpleNamespace(remote=lambda: "ready-ref")
        self.run = SimpleNamespace(remote=lambda: "run-ref")


class _ActorClass:
    def options(self, **_):
        return self

    def remote(self, *_):
        return _Actor()


class NeverReadyRay:
    """What CoreEngineActorManager.start_replica uses of Ray, for a replica
    whose ready() does not answer within the timeout."""

    exceptions = ray_exceptions

    def __init__(self):
        self.timeouts: list[float] = []

    def remote(self, cls):
        return _ActorClass()

    def get(self, ref, timeout=None):
        self.timeouts.append(timeout)
        raise ray_exceptions.GetTimeoutError("Get timed out: some object(s) not ready.")


@pytest.fixture
def never_ready_manager(monkeypatch):
    """A CoreEngineActorManager (no Ray cluster, no monitor thread) and what it released."""
    from raylm.engine import dp_manager

    released = {"actors": [], "placement_groups": []}
    monkeypatch.setattr(dp_manager, "replica_bundles", lambda config: ([{"CPU": 1}], 1, []))
    monkeypatch.setattr(dp_manager, "place_replica", lambda index, bundles, placement, target: f"pg-{index}")
    monkeypatch.setattr(dp_manager, "worker_env_vars", lambda device: {})
    monkeypatch.setattr(dp_manager, "kill_actors", released["actors"].extend)
    monkeypatch.setattr(
        sys.modules["ray.util.placement_group"], "remove_placement_group", released["placement_groups"].append
    )
    manager = object.__new__(dp_manager.CoreEngineActorManager)
    manager.config = SimpleNamespace(
        fault_tolerance=SimpleNamespace(engine_start_timeout_s=3.0),
        parallel_config=SimpleNamespace(data_parallel_placement="pack"),
        num_threads=1,
        device="cpu",
    )
    manager._ray = NeverReadyRay()
    manager.replicas, manager._lock = {}, threading.Lock()
    return manager, released


def test_a_ray_replica_not_ready_in_time_is_an_engine_start_timeout(never_ready_manager):
    """The same error type as a core process not ready in time
    (process_launcher), so that every caller handles both alike; still a
    TimeoutError for those that catch that."""
    manager, released = never_ready_manager
    with pytest.raises(EngineStartTimeoutError, match="replica 1 was not ready within 3 s") as raised:
        manager.start_replica(1, channel=None)
    assert isinstance(raised.value, (RuntimeError, TimeoutError))
    assert manager._ray.timeouts == [3.0]
    assert len(released["actors"]) == 1 and released["placement_groups"] == ["pg-1"]  # nothing left of it
    assert manager.replicas == {}


def test_scale_answers_409_when_a_new_ray_replica_is_not_ready_in_time(never_ready_manager, monkeypatch):
    """POST /scale over an engine whose new replica times out as the Ray
    manager's does: a 409 saying why, not a 500."""
    manager, _ = never_ready_manager
    monkeypatch.setattr(data_parallel_routes, "_cluster_cpus", lambda: None)

    class Engine:
        def replica_states(self) -> list[dict]:
            return []

        async def scale(self, size: int) -> None:
            manager.start_replica(size - 1, channel=None)

    app = FastAPI()
    install_data_parallel_routes(app, Engine(), api_key=None)

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/scale", json={"data_parallel_size": 2})

    response = asyncio.run(post())
    assert response.status_code == 409, response.text
    message = response.json()["error"]["message"]
    assert message.startswith("could not scale: ") and "replica 1 was not ready within 3 s" in message
    assert "engine_start_timeout" in message
