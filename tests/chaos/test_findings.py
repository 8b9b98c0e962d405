"""Each hole of issue 48 the harness found or the review named, as the
schedule that shows it, scripted on the fast tier's world (the real
supervisor and real engine cores on the content model,
raylm.testing.chaos.sim). Each fails on da5dc4b."""

from __future__ import annotations

import glob
import logging
import os

import pytest

from raylm.testing.chaos.sim import World

PROMPT = [600 + j for j in range(13)]  # four blocks of 4: a migration of several stages


@pytest.fixture
def world():
    logger = logging.getLogger("raylm")
    level = logger.level
    logger.setLevel(logging.ERROR)
    world = World()
    yield world
    world.close()
    logger.setLevel(level)


def _serving_core(world: World, request_id: str) -> int:
    return world.sup.ledger[request_id].channel


def _run_until(world: World, done, rounds: int = 200) -> None:
    """Every loop turns, every copy ends, the supervisor reads, until `done()`."""
    for _ in range(rounds):
        if done():
            return
        for index in list(world.cores):
            while world.progress(index):
                pass
            world.turn(index)
        world.read()
        world.clock.now += 0.01
    raise AssertionError("the schedule did not get there")


def _decoding(world: World, request_id: str, tokens: int = 3) -> None:
    _run_until(world, lambda: len(world.outcomes[request_id].tokens) >= tokens)


def test_a_replica_restarted_while_it_is_a_migration_s_destination_does_not_end_the_server(world):
    """Finding 1: a draining core that is the destination of a migration still
    in pre-copy was retired; the source's next report then named a channel
    that no longer existed (KeyError), which ended the engine."""
    world.submit("r0", PROMPT, 20)
    _decoding(world, "r0")
    source = _serving_core(world, "r0")
    destination = 1 - source
    assert world.sup.migrate("r0", destination)
    world.sup.begin_restart(destination)
    world.drain()
    world.check()


def test_a_refused_hand_over_does_not_go_to_the_replacement_of_a_dead_source(world):
    """Finding 3: the source died after the hand-over and was replaced under
    the same index; the destination then refused the final stage, and the
    request was given back to the replacement, which never had it: the
    stream hung until the step deadline killed a healthy core."""
    world.submit("r0", PROMPT, 24)
    _decoding(world, "r0")
    source = _serving_core(world, "r0")
    destination = 1 - source
    assert world.sup.migrate("r0", destination)
    migration = next(iter(world.sup.migrations.values()))
    _run_until(world, lambda: migration.handed_over)  # the final stage is on its way to the destination
    world.kill(source)
    world.read()  # the death: the destination owns the request now
    assert world.run_background()  # the source's replacement starts...
    world.read()  # ...and serves
    for path in glob.glob(os.path.join(world.sup.kv_routes.transfer_dir, "*")):
        os.unlink(path)  # the final stage cannot be read: the destination refuses it
    world.drain()
    world.check()


def test_a_core_that_dies_before_it_is_adopted_is_replaced(world):
    """A replacement that started, then died before the supervisor adopted
    it: its death, handled first, found no channel and was lost, and the
    requests routed to it stalled until the step deadline."""
    world.kill(0)
    world.read()
    assert world.run_background()  # the replacement has started, not yet adopted
    world.kill(0)
    world.read()
    world.submit("r0", PROMPT, 6)
    world.submit("r1", PROMPT[:5], 6)
    world.drain()
    world.check()


def test_a_scale_planned_while_another_starts_cores_is_refused(world):
    """Two scales planned while the first one's core was starting took the
    same index twice: the second core adopted replaced the first one under
    it, and its requests hung. One change at a time now."""
    world.begin_scale(3)
    with pytest.raises(ValueError, match="are starting"):
        world.begin_scale(3)
    world.finish_scale()
    world.submit("r0", PROMPT, 6)
    world.drain()
    world.check()


def test_a_stage_written_after_its_migration_ended_is_removed(world):
    """An abort that ends a migration before its source has written the
    stage it was asked for: the file the source then wrote stayed in
    /dev/shm until the engine shut down."""
    world.submit("r0", PROMPT, 20)
    _decoding(world, "r0")
    assert world.sup.migrate("r0", 1 - _serving_core(world, "r0"))
    world.abort("r0")
    world.drain()
    world.check()


def test_a_stage_file_its_source_removed_first_does_not_end_the_engine(world, monkeypatch):
    """The source removes its stage files when it hears its migration ended,
    in its own process, and may do so between the supervisor's listing of
    them and its unlink: that FileNotFoundError was raised on the reading
    thread and ended the engine (the full suite's rolling restart saw it as
    a 500 from POST /replicas/0/restart). Here the source is first."""
    import raylm.kv_transfer.transport as transport_module

    listed = transport_module.glob.glob

    def listing_then_source_removes(pattern: str) -> list[str]:
        paths = listed(pattern)
        for path in paths:
            os.unlink(path)
        return paths

    world.submit("r0", PROMPT, 20)
    _decoding(world, "r0")
    assert world.sup.migrate("r0", 1 - _serving_core(world, "r0"))
    migration = next(iter(world.sup.migrations.values()))
    _run_until(world, lambda: migration.stage > 0)  # a stage file is written
    assert glob.glob(os.path.join(world.sup.kv_routes.transfer_dir, f"{migration.migration_id}-*"))
    monkeypatch.setattr(transport_module.glob, "glob", listing_then_source_removes)
    world.abort("r0")  # ends the migration: the supervisor lists and removes its files
    monkeypatch.undo()
    world.drain()
    world.check()


def test_a_replica_that_dies_while_it_drains_for_a_restart_does_not_stay_restarting(world):
    """Found by the fast tier once it checked that replicas settle: a restart
    asked of a core that had died unnoticed (or that dies while it drains)
    got an unplanned replacement, and only a planned start ended a restart:
    the replica said "restarting" for good, /scale was refused ("are
    restarting") and the restart's caller waited out its deadline."""
    world.submit("r0", PROMPT, 12)
    _decoding(world, "r0")
    world.kill(0)
    world.sup.begin_restart(0)  # its death is not read yet: it still looks alive
    world.drain()
    world.check()  # both replicas serve, no restart left open
    assert "died while draining" in world.sup.restart_failures[0]


def test_a_pull_stage_its_holder_wrote_after_leaving_is_removed():
    """Found by the fast tier's evict_and_revisit (issue 49's tier work): a
    pull's holder drained for a restart leaves the ledger (its pull ends,
    `holder_gone`, and the supervisor sweeps the stage), but its process
    handles the PullExport it was already sent and writes the stage after
    that sweep. Swept at the next housekeeping now; left to the engine's
    end before."""
    from tests.chaos.test_schedules import PROMPTS, ChaosSchedule

    schedule = ChaosSchedule()
    schedule.start(tiered=False)
    schedule.submit(PROMPTS[0], 5)
    schedule.evict_and_revisit(PROMPTS[0], 0, 0)
    schedule.next_start_fails()
    schedule.restart(0)
    schedule.submit(PROMPTS[0], 5)  # pulled from core 0, which leaves before it exports
    schedule.read(1)
    schedule.evict_and_revisit(PROMPTS[0], 1, 0)
    assert schedule.world.sup.pulls.counts["holder_gone"] == 1
    schedule.teardown()  # drains, and checks that no transfer file is left


def test_a_quarantined_request_whose_adapter_is_one_too_many_runs():
    """Found by the P/D variant once LoRA joined the fast tier: a scale-in
    leaves one (prefill) replica; a worker death charges the request that
    arrives from the other, which must then run alone; its adapter is a
    third over max_loras=2, the two running requests hold the other two,
    and isolation keeps them from running: nothing ever ran. The running
    requests now give their adapters up (preempted) for it."""
    from tests.chaos.test_schedules import PDChaosSchedule

    prompt = [23, 40, 41, 42, 43, 44, 45, 46, 47, 100, 101]
    schedule = PDChaosSchedule()
    schedule.start(tiered=False)
    schedule.submit(prompt, 15, adapter="c")
    schedule.rounds(3)
    schedule.scale(1)
    schedule.worker_fault(1, "died")
    schedule.submit(prompt, 14, adapter="a")
    schedule.submit(prompt, 14, adapter="b")
    schedule.teardown()  # drains: every request ends, equal to its reference
