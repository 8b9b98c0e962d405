"""How a step makes room when the KV cache is full: which requests give their
blocks up, and what giving them up does to each.

Two ways to give blocks up, both recomputed later from the tokens the request
already has (preemption by recompute, as vLLM v1 does; there is no swap):
- a running request is *preempted*: its blocks and adapter slot are freed and
  it goes back to the front of the queue;
- a waiting request that holds blocks (a migration's or a hand-off's import
  that has not run yet) *gives them up*.

The step (raylm.core.scheduler) decides when; these functions are the moves,
over the places that raylm.core.request_queues.RequestQueues keeps. Apart so
that the step reads as the token budget it hands out, and the deadlock rules
that the chaos harness found read in one place.
"""

from __future__ import annotations

import logging

from raylm.core.request import Request, RequestStatus
from raylm.core.request_queues import RequestQueues

logger = logging.getLogger(__name__)


def make_room_for(
    queues: RequestQueues, head: Request, alone: bool, promoted: set[str], num_scheduled: dict, new_block_ids: dict
) -> bool:
    """`head` cannot get its blocks while others hold blocks nothing would
    free (small-cache deadlocks the chaos harness found). A waiting holder
    of migrated K/V goes first (each once a schedule); when none fits and
    nothing runs, or `head` must run alone (quarantine), holders give their
    blocks up, then running requests are preempted. True: try again."""
    holders = [r for r in queues.waiting if r is not head and r.request_id in queues.kv_cache_manager.req_blocks]
    if alone:
        if holders:
            give_up_blocks(queues, holders[0])
            return True
        # The preempted request is ahead of `head` now; the next schedule puts `head` first again.
        return preempt_newest_but(queues, head, num_scheduled, new_block_ids)
    for request in holders:
        if request.request_id not in promoted:
            promoted.add(request.request_id)
            queues.waiting.remove(request)
            queues.waiting.appendleft(request)
            return True
    if holders and not queues.running:
        # E.g. two hand-offs that filled a decode replica, each a block short.
        give_up_blocks(queues, holders[-1])
        return True
    return False


def preempt_newest_but(queues: RequestQueues, head: Request, num_scheduled: dict, new_block_ids: dict) -> bool:
    """The newest running request other than `head` gives its blocks and
    adapter up (preempted, recomputed later). True: one was preempted."""
    others = [r for r in queues.running if r is not head]
    if not others:
        return False
    queues.running.remove(others[-1])
    preempt(queues, others[-1], num_scheduled, new_block_ids)
    return True


def give_up_blocks(queues: RequestQueues, request: Request) -> None:
    """A waiting request's K/V blocks are freed: it computes them again in its turn."""
    queues.kv_cache_manager.free(request)
    request.num_computed_tokens = 0
    queues.num_preemptions += 1


def preempt(queues: RequestQueues, request: Request, num_scheduled: dict, new_block_ids: dict) -> None:
    """Free a request's blocks (the caller has taken it out of `running`) and
    put it back in front of the queue; it will be recomputed from its prompt
    and the tokens it already generated."""
    queues.kv_cache_manager.free(request)
    request.status = RequestStatus.PREEMPTED
    request.num_computed_tokens = 0
    # Tokens of its steps in flight are dropped on arrival and recomputed.
    request.num_output_placeholders = 0
    request.num_preemptions += 1
    queues.num_preemptions += 1
    if request.request_id in num_scheduled:
        # Scheduled earlier in this same step: undo it.
        num_scheduled.pop(request.request_id)
        new_block_ids.pop(request.request_id)
    queues.waiting.appendleft(request)
    queues.needs_full_send.add(request.request_id)
    logger.debug("preempted %s (KV cache full)", request.request_id)
