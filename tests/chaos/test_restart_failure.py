"""A planned replica restart whose new core fails to start, scripted on the
chaos harness's fast tier (the real supervisor and real engine cores on the
content model, raylm.testing.chaos.sim).

The restart's caller (POST /replicas/{i}/restart, through
AsyncEngineCoreSupervisor.restart_replica) was told the replica restarted, and the
log said "replica i restarted and serving", while the replica was in fact
lost and being recovered through the failure path. The caller now gets a
RuntimeError naming the cause; the recovery goes on as before."""

from __future__ import annotations

import asyncio
import logging

import pytest

from raylm.engine import supervisor
from raylm.engine.supervisor import AsyncEngineCoreSupervisor
from raylm.testing.chaos.sim import World, chaos_config

PROMPT = [600 + j for j in range(13)]
CAUSE = "chaos: the replica failed to start"  # what the harness's failed start raises


@pytest.fixture
def make_world(monkeypatch):
    """Worlds whose supervisor's log is kept at INFO (caplog reads it)."""
    monkeypatch.setattr(supervisor, "_RESTART_POLL_S", 0.0)
    worlds = []

    def make(**config) -> World:
        worlds.append(World(chaos_config(**config)))
        return worlds[-1]

    yield make
    for world in worlds:
        world.close()


def _step(world: World) -> None:
    """One round of the schedule: cores turn, the supervisor reads, a due
    background task (a stop, a start) runs."""
    for index in list(world.cores):
        while world.progress(index):
            pass
        world.turn(index)
    world.read()
    world.run_background()
    world.clock.now += 0.01


async def _restart(world: World, index: int, fail_its_start: bool, rounds: int = 200) -> None:
    """AsyncEngineCoreSupervisor.restart_replica on the world's supervisor (what
    POST /replicas/{i}/restart awaits), while the schedule runs; the restart's
    new core fails to start if told."""
    restart = asyncio.ensure_future(AsyncEngineCoreSupervisor.restart_replica(world.sup, index))
    await asyncio.sleep(0)  # it began: the replica drains
    world.fail_next_start = fail_its_start
    for _ in range(rounds):
        if restart.done():
            return await restart
        _step(world)
        await asyncio.sleep(0)
    restart.cancel()
    raise AssertionError("the restart never ended")


def _states(world: World) -> dict[int, str]:
    return {s["replica"]: s["state"] for s in world.sup.replica_states()}


def _settle(world: World) -> None:
    for _ in range(20):
        _step(world)


def test_a_restart_whose_new_core_fails_to_start_says_so_and_the_replica_is_recovered(make_world, caplog):
    world = make_world(max_restarts=3)
    world.submit("r0", PROMPT, 20)  # something to migrate off the replica restarting
    caplog.set_level(logging.INFO, logger="raylm.engine.supervisor")

    with pytest.raises(RuntimeError, match=f"failed to start \\({CAUSE}\\)"):
        asyncio.run(_restart(world, 1, fail_its_start=True))

    assert 1 not in world.sup.restarting and world.sup.restart_failures == {}
    messages = [r.getMessage() for r in caplog.records]
    assert not any("replica 1 restarted and serving" in m for m in messages), messages
    assert any(
        r.levelno == logging.ERROR and "restarting replica 1 failed" in r.getMessage() and CAUSE in r.getMessage()
        for r in caplog.records
    ), messages
    # The recovery goes on as before: the failed start cost one restart of the
    # budget, and the replacement serves.
    _settle(world)
    assert world.sup.restart_budget.num_recent == 1
    assert _states(world) == {0: "serving", 1: "serving"}
    world.submit("r1", PROMPT[:5], 6)
    world.drain()
    world.check()


def test_a_restart_whose_start_fails_past_the_budget_says_so_and_the_replica_waits(make_world):
    world = make_world(max_restarts=1, restart_window=60.0)
    world.kill(1)
    world.read()
    assert world.run_background()  # restart 1 of 1: the budget is spent
    world.read()
    assert _states(world) == {0: "serving", 1: "serving"}

    with pytest.raises(RuntimeError, match=CAUSE):
        asyncio.run(_restart(world, 1, fail_its_start=True, rounds=20))
    assert _states(world)[1] == "waiting_for_restart_budget"
    assert world.sup.dead_error is None
    world.submit("r0", PROMPT, 6)
    world.drain()
    world.check()


def test_a_restart_that_succeeds_is_not_told_an_earlier_restart_s_failure(make_world, caplog):
    """A restart begun without awaiting it (begin_restart, as the chaos
    schedules do) leaves its failure unclaimed: the next restart of that
    replica must not report it."""
    world = make_world(max_restarts=3)
    world.sup.begin_restart(1)
    world.fail_next_start = True
    _settle(world)
    assert world.sup.restart_failures and _states(world) == {0: "serving", 1: "serving"}

    caplog.set_level(logging.INFO, logger="raylm.engine.supervisor")
    asyncio.run(_restart(world, 1, fail_its_start=False))
    assert any("replica 1 restarted and serving" in r.getMessage() for r in caplog.records)
    assert _states(world) == {0: "serving", 1: "serving"}
