"""Issue 48, finding 9, the supervisor's parts, scripted on the chaos
harness's fast tier (the real supervisor and real engine cores on the
content model, raylm.testing.chaos.sim):

1. a drained core's stop (up to 10 s) runs off the reading thread, and its
   replica restarts only once that stop returned;
2. a core whose K/V transfers keep failing (a replica whose ranks span
   nodes) is not asked to migrate every 0.25 s for as long as it drains;
3. a replica the restart budget refused is started again once the budget's
   window allows, and is listed meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time

import msgspec
import pytest

from raylm.engine.core_recovery import BackgroundThreads
from raylm.engine.errors import EngineDeadError
from raylm.engine.protocol import ClientMessage, Shutdown
from raylm.testing.chaos.sim import World, chaos_config

PROMPT = [600 + j for j in range(13)]


@pytest.fixture
def quiet():
    logger = logging.getLogger("raylm")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


@pytest.fixture
def make_world(quiet):
    worlds = []

    def make(*args, **kwargs) -> World:
        worlds.append(World(*args, **kwargs))
        return worlds[-1]

    yield make
    for world in worlds:
        world.close()


def _turn_all_and_read(world: World) -> None:
    for index in list(world.cores):
        while world.progress(index):
            pass
        world.turn(index)
    world.read()


def _run_until(world: World, done, rounds: int = 200) -> None:
    for _ in range(rounds):
        if done():
            return
        _turn_all_and_read(world)
        world.clock.now += 0.01
    raise AssertionError("the schedule did not get there")


def _settle(world: World) -> None:
    """After `drain`: a drained core leaves, and starts again if restarting."""
    for _ in range(5):
        world.read()
        while world.run_background():
            pass


def _states(world: World) -> dict[int, str]:
    return {s["replica"]: s["state"] for s in world.sup.replica_states()}


# ---- 1. a drained core is stopped off the reading thread -------------------------------------


def test_a_drained_core_s_stop_does_not_block_the_read_and_its_restart_waits_for_it(make_world):
    world = make_world()
    launcher = world.sup.launcher
    decode = msgspec.msgpack.Decoder(ClientMessage).decode
    events: list[str] = []
    release, stop_entered, stop_done = threading.Event(), threading.Event(), threading.Event()
    stop = launcher.stop

    def slow_stop(index: int, wait_s: float) -> None:
        # The drained core's stop: its loop is slow to end. It was told to
        # leave before: the Shutdown waits in its input.
        frames = list(world.cores[index].input.frames)
        events.append(
            f"stop {index}" + (" after Shutdown" if any(isinstance(decode(f), Shutdown) for f in frames) else "")
        )
        stop_entered.set()
        release.wait(5.0)
        stop(index, wait_s)
        events.append(f"stopped {index}")

    start = launcher.start

    def recording_start(channel, target=None) -> None:
        events.append(f"start {channel.index}")
        start(channel, target)

    launcher.stop, launcher.start = slow_stop, recording_start

    # The stop runs in a thread, as the real supervisor runs it; every other
    # background task waits for the schedule, as the harness has it.
    in_harness = world.sup.background.run

    def in_background(delay_s, run, cancelled, name):
        if not name.startswith("raylm-core-stop-"):
            return in_harness(delay_s, run, cancelled, name)

        def run_and_say() -> None:
            run()
            stop_done.set()

        BackgroundThreads(world.sup._closed).run(delay_s, run_and_say, cancelled, name)

    world.sup.background.run = in_background
    try:
        world.sup.begin_restart(1)  # nothing runs there: it drains at once
        began = time.perf_counter()
        world.read()  # housekeeping retires it
        took = time.perf_counter() - began
        assert took < 1.0, f"the read waited {took:.1f} s for the drained core's stop"
        assert stop_entered.wait(5.0), "the drained core was never stopped"
        assert events == ["stop 1 after Shutdown"] and 1 not in world.sup.channels
        # While it stops: reads go on, requests are served, no second core 1 starts.
        world.submit("r0", PROMPT, 6)
        for _ in range(20):
            world.turn(0)
            world.read()
            world.clock.now += 0.01
        assert world.outcomes["r0"].finished
        assert not world.background and not any(e.startswith("start") for e in events), events
        assert _states(world) == {0: "serving", 1: "restarting"}
    finally:
        release.set()
    assert stop_done.wait(5.0)
    world.read()  # the stop returned: now the replica starts again
    assert world.run_background()
    world.read()
    assert events == ["stop 1 after Shutdown", "stopped 1", "start 1"], events
    assert _states(world) == {0: "serving", 1: "serving"}
    world.submit("r1", PROMPT, 6)
    world.submit("r2", PROMPT[:5], 6)
    world.drain()
    world.check()


def test_a_scale_up_while_a_drained_core_stops_takes_another_index(make_world):
    """The index of a core being stopped is not free yet: the launcher still runs it."""
    world = make_world()
    world.sup.background.run = lambda delay_s, run, cancelled, name: None  # the stop never ends, here
    world.begin_scale(1)  # core 1 drains at once, and is being stopped
    assert 1 not in world.sup.channels and world.cores[1].alive
    world.begin_scale(2)
    assert world.scale_ups[0].indices == [2]


# ---- 2. a core that cannot move K/V is not asked again and again ------------------------------


def test_a_core_that_cannot_move_kv_is_not_retried_and_drains_by_finishing(make_world, caplog):
    world = make_world()
    world.submit("r0", PROMPT, 45)
    _run_until(world, lambda: len(world.outcomes["r0"].tokens) >= 3)
    source = world.sup.ledger["r0"].channel
    attempts = []

    def export_from_another_node(path_prefix, block_ids, background=False):
        # A rank on another node than the supervisor's folder in /dev/shm.
        attempts.append(world.clock.now)
        raise FileNotFoundError(2, "No such file or directory", f"{path_prefix}.rank1")

    world.cores[source].core.executor._rpc_export_kv = export_from_another_node
    caplog.set_level(logging.WARNING, logger="raylm.engine.supervisor")
    world.sup.begin_restart(source)
    began = world.clock.now
    while world.clock.now - began < 10.0 and not world.outcomes["r0"].finished:
        _turn_all_and_read(world)
        world.clock.now += 0.25
    assert world.clock.now - began >= 10.0, "the request ended before the ten seconds the test counts over"
    assert len(attempts) <= 3, f"{len(attempts)} migrations tried in 10 s of a core that cannot move K/V"
    said = [r for r in caplog.records if "cannot move K/V" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in said]
    assert "No such file or directory" in said[0].getMessage()
    # Its request finishes where it runs; then the replica leaves and starts again.
    world.drain()
    world.check()
    _settle(world)
    assert _states(world) == {0: "serving", 1: "serving"}
    assert world.sup.migration_counts["migrated"] == 0


def test_a_transfer_that_cannot_pass_marks_the_core_at_once(make_world):
    """A rank that cannot bind its core's node's address runs elsewhere: no second try."""
    world = make_world()
    world.submit("r0", PROMPT, 30)
    _run_until(world, lambda: len(world.outcomes["r0"].tokens) >= 3)
    source = world.sup.ledger["r0"].channel
    attempts = []

    def cannot_bind(path_prefix, block_ids, background=False):
        attempts.append(world.clock.now)
        raise OSError(99, "Cannot assign requested address")

    world.cores[source].core.executor._rpc_export_kv = cannot_bind
    world.sup.begin_restart(source)
    for _ in range(12):
        _turn_all_and_read(world)
        world.clock.now += 0.25
    assert len(attempts) == 1
    world.drain()
    world.check()


def test_other_refusals_are_still_retried(make_world):
    """A refusal that may pass next time (here: the import's file is gone) is
    tried again, and the request moves once it can."""
    world = make_world()
    world.submit("r0", PROMPT, 40)
    _run_until(world, lambda: len(world.outcomes["r0"].tokens) >= 3)
    source = world.sup.ledger["r0"].channel
    executor = world.cores[source].core.executor
    export = executor._rpc_export_kv
    failures = []

    def fails_twice(path_prefix, block_ids, background=False):
        if len(failures) < 2:
            failures.append(path_prefix)
            raise OSError(28, "No space left on device")
        return export(path_prefix, block_ids, background)

    executor._rpc_export_kv = fails_twice
    world.sup.begin_restart(source)
    for _ in range(30):  # a try every 0.25 s: two refused, then it moves
        _turn_all_and_read(world)
        world.clock.now += 0.13
        if world.sup.migration_counts["migrated"]:
            break
    assert len(failures) == 2 and world.sup.migration_counts["migrated"] == 1
    assert not world.outcomes["r0"].finished
    world.drain()
    world.check()


# ---- 3. a restart the budget refused is tried again ---------------------------------------------


def test_a_replica_lost_past_the_restart_budget_comes_back_once_the_window_allows(make_world):
    world = make_world(chaos_config(max_restarts=1, restart_window=60.0))
    world.kill(1)
    world.read()
    assert world.run_background()  # restart 1 of 1
    world.read()
    assert _states(world) == {0: "serving", 1: "serving"}

    world.clock.now += 20.0
    world.kill(1)
    world.read()  # past the budget: it waits, and says so
    states = {s["replica"]: s for s in world.sup.replica_states()}
    assert states[1]["state"] == "waiting_for_restart_budget"
    assert states[1]["restart_in_s"] == pytest.approx(40.0, abs=0.5)
    assert world.sup.dead_error is None and not world.background

    world.clock.now += 39.0  # the first restart is still in the window
    world.read()
    assert _states(world)[1] == "waiting_for_restart_budget" and not world.background

    world.clock.now += 1.5  # it has left the window
    world.read()
    assert world.run_background()  # the replacement starts...
    world.read()  # ...and serves
    assert _states(world) == {0: "serving", 1: "serving"}
    world.submit("r0", PROMPT, 6)
    world.submit("r1", PROMPT[:5], 6)
    assert {world.sup.ledger[rid].channel for rid in ("r0", "r1")} == {0, 1}
    world.drain()
    world.check()


def test_a_restart_refused_again_waits_for_the_next_place_in_the_window(make_world):
    world = make_world(chaos_config(max_restarts=2, restart_window=60.0))
    t0 = world.clock.now
    world.kill(1)
    world.read()
    assert world.run_background()  # restart 1 of 2, at t0
    world.read()
    world.clock.now = t0 + 10.0
    world.kill(1)
    world.read()
    assert world.run_background()  # restart 2 of 2, at t0 + 10 (after its backoff)
    world.read()
    world.clock.now = t0 + 20.0
    world.kill(1)
    world.read()  # refused: the refusal takes no place in the window
    assert _states(world)[1] == "waiting_for_restart_budget"
    world.clock.now = t0 + 60.5  # the first restart left the window
    world.read()
    assert world.run_background()
    world.read()
    assert _states(world) == {0: "serving", 1: "serving"}
    world.kill(0)
    world.read()  # two restarts in the window again (t0 + 10, t0 + 60.5): core 0 waits until t0 + 70
    states = {s["replica"]: s for s in world.sup.replica_states()}
    assert states[0]["state"] == "waiting_for_restart_budget"
    assert states[0]["restart_in_s"] == pytest.approx(70.0 - (world.clock.now - t0), abs=0.1)
    world.clock.now = t0 + 70.5
    world.read()
    assert world.run_background()
    world.read()
    assert _states(world) == {0: "serving", 1: "serving"}
    world.submit("r0", PROMPT, 6)
    world.drain()
    world.check()


def test_with_every_core_lost_past_the_budget_the_engine_ends_as_before(make_world):
    world = make_world(chaos_config(max_restarts=1, restart_window=60.0))
    world.kill(1)
    world.read()
    assert world.run_background()
    world.read()
    world.kill(1)
    world.read()
    assert world.sup.dead_error is None
    world.kill(0)
    with pytest.raises(EngineDeadError, match="no restart left"):
        world.read()


def test_a_scale_replaces_a_restart_waiting_for_the_budget(make_world):
    world = make_world(chaos_config(max_restarts=1, restart_window=60.0))
    world.kill(1)
    world.read()
    world.run_background()
    world.read()
    world.kill(1)
    world.read()
    assert _states(world)[1] == "waiting_for_restart_budget"
    world.begin_scale(2)  # the operator asks for two again: a new replica, now
    assert world.finish_scale()
    world.read()
    assert _states(world) == {0: "serving", 1: "serving"}
    world.clock.now += 120.0
    world.read()  # no second start of replica 1 once the window allows
    assert not world.background and _states(world) == {0: "serving", 1: "serving"}
    world.submit("r0", PROMPT, 6)
    world.drain()
    world.check()
