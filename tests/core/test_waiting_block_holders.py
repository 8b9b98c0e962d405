"""A waiting request that holds its K/V already (a migration brought it)
never deadlocks the queue of a small cache (found by the chaos harness with
a 16-block cache): behind a head that cannot get its blocks, it goes first;
where the head must run alone (quarantine), it gives its blocks up and
computes its K/V again later. Scheduler only, no model."""

from __future__ import annotations

import pytest

from raylm.config import CacheConfig, SchedulerConfig
from raylm.core.request import Request
from raylm.core.scheduler import Scheduler
from raylm.messages import ModelRunnerOutput
from raylm.sampling_params import SamplingParams

BLOCK = 4


def _scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(num_scheduler_steps=1), CacheConfig(block_size=BLOCK, num_blocks=16), 64)


def _queue_behind_an_import(quarantined: bool) -> tuple[Scheduler, Request, Request]:
    """16 blocks: `imported` holds 7 of them (25 tokens computed of 26);
    `head`, ahead of it in the queue, needs 10, and only 9 are free."""
    scheduler = _scheduler()
    kv = scheduler.kv_cache_manager
    head = Request("head", list(range(100, 137)), SamplingParams(max_tokens=4), None, quarantined=quarantined)
    imported = Request("imported", list(range(200, 226)), SamplingParams(max_tokens=4), None)
    assert kv.allocate_for_import("m", 7) is not None
    assert kv.adopt_import("m", "imported", 25) is None
    scheduler.add_imported(imported, 25)
    scheduler.add_request(head)
    scheduler.waiting.remove(head)  # ahead of it, as a request preempted since
    scheduler.waiting.appendleft(head)
    return scheduler, head, imported


def _run_to_end(scheduler: Scheduler, max_steps: int = 40) -> None:
    """Steps until every request ended (or `max_steps`): a token for each
    request whose step reached its last token (the others were prefill chunks)."""
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return
        out = scheduler.schedule()
        rids = list(out.num_scheduled_tokens)
        sampled = [
            [7] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens else [] for r in rids
        ]
        scheduler.update_from_output(out, ModelRunnerOutput(req_ids=rids, sampled_token_ids=sampled))


def test_an_import_behind_a_head_that_does_not_fit_goes_first():
    scheduler, head, imported = _queue_behind_an_import(quarantined=False)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"imported": 1}  # its K/V kept: its last token only


def test_an_import_gives_its_blocks_up_to_a_head_that_runs_alone():
    scheduler, head, imported = _queue_behind_an_import(quarantined=True)
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["head"]
    assert imported.num_computed_tokens == 0 and "imported" not in scheduler.kv_cache_manager.req_blocks


@pytest.mark.parametrize("quarantined", [False, True])
def test_both_finish(quarantined):
    scheduler, _, _ = _queue_behind_an_import(quarantined)
    _run_to_end(scheduler)
    assert not scheduler.has_unfinished_requests()


def test_running_requests_give_way_to_a_quarantined_one_that_does_not_fit():
    """A quarantined request runs alone: the running ones wait meanwhile,
    and when their blocks are the room it lacks they are preempted."""
    scheduler = _scheduler()
    running = Request("running", list(range(300, 315)), SamplingParams(max_tokens=20), None)
    scheduler.add_request(running)
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"running": 15}
    scheduler.update_from_output(first, ModelRunnerOutput(req_ids=["running"], sampled_token_ids=[[7]]))
    suspect = Request("suspect", list(range(100, 149)), SamplingParams(max_tokens=4), None, quarantined=True)
    scheduler.add_request(suspect)  # 13 blocks; "running" holds 4 of the 16
    scheduled = []
    for _ in range(3):
        out = scheduler.schedule()
        scheduled.append(list(out.num_scheduled_tokens))
        rids = list(out.num_scheduled_tokens)
        scheduler.update_from_output(out, ModelRunnerOutput(req_ids=rids, sampled_token_ids=[[7] for _ in rids]))
    assert ["suspect"] in scheduled and running.num_preemptions == 1


def test_two_imports_each_a_block_short_of_a_full_cache_both_finish():
    """Found by the P/D chaos variant: two hand-offs filled a 16-block
    decode replica, 8 blocks each, and each needs a 9th. Each tried first in
    turn, neither fits, nothing runs: the newest gives its blocks up."""
    scheduler = _scheduler()
    kv = scheduler.kv_cache_manager
    for name in ("a", "b"):
        assert kv.allocate_for_import(name, 8) is not None
        assert kv.adopt_import(name, name, 32) is None
        scheduler.add_imported(Request(name, list(range(100, 133)), SamplingParams(max_tokens=2), None), 32)
    _run_to_end(scheduler)
    assert not scheduler.has_unfinished_requests()
