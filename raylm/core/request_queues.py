"""The scheduler's requests and where each one is: waiting, running, paused
for a live migration, quarantined, finished (for the workers to drop), with
the KV-cache blocks they hold; and every move between those places that is
not a step's decision: a request added, aborted or finished, a migration's
pause, resume, release and import, the reset after the workers are lost and
the charging of a failure's suspects, and the counts reported as stats.

Apart from the step (raylm.core.scheduler.Scheduler, which extends this with
what to compute next: the token budget, preemption, decode bursts, the
outputs) so that the bookkeeping the engine core and a migration drive from
outside reads in one place, and the step in another. Everything here is
state this class defines; the step reads and moves it.
"""

from __future__ import annotations

from collections import deque

from raylm.config import CacheConfig
from raylm.core import quarantine
from raylm.core.kv_cache_manager import KVCacheManager
from raylm.core.outputs import EngineCoreOutput
from raylm.core.request import Request, RequestStatus
from raylm.core.structured_output import StructuredOutputManager


class RequestQueues:
    """The requests of one engine core and their places (see the module docstring)."""

    def __init__(self, cache_config: CacheConfig, structured_output_manager: StructuredOutputManager | None = None):
        assert cache_config.num_blocks is not None, "the KV cache must be sized before scheduling"
        self.kv_cache_manager = KVCacheManager(
            cache_config.num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            num_shards=cache_config.num_kv_shards,
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests the workers still hold state for and must be told to drop.
        self.finished_req_ids: set[str] = set()
        # Requests whose next step must be sent in full (new, or resumed after preemption).
        self.needs_full_send: set[str] = set()
        self.num_preemptions = 0
        # Requests quarantined after failures (raylm.core.quarantine): each runs
        # alone, in queue order, until it finishes or fails alone.
        self.quarantined: set[str] = set()
        self.structured_output_manager = structured_output_manager
        # Live migration (raylm.engine.migration): requests no longer
        # scheduled (being paused), and those paused, holding their blocks.
        self.unscheduled: set[str] = set()
        self.paused: dict[str, Request] = {}
        # A request is migrating here: no decode bursts, so that it joins a
        # step as soon as its final stage is read in (a burst would hold it
        # back for up to the burst's length, a pause its client sees).
        self.expecting_imports = False

    # ---- requests in and out -------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.needs_full_send.add(request.request_id)
        if request.quarantined:
            self.quarantined.add(request.request_id)
        if self.structured_output_manager is not None:
            self.structured_output_manager.add_request(request)

    def abort_requests(self, request_ids) -> list[Request]:
        aborted = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            aborted.append(request)
        return aborted

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.paused.pop(request.request_id, None)
        self.unscheduled.discard(request.request_id)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
        self.needs_full_send.discard(request.request_id)
        self.quarantined.discard(request.request_id)
        if self.structured_output_manager is not None:
            self.structured_output_manager.remove_request(request.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        # A paused request (being migrated) waits for the supervisor, not for a step.
        return len(self.requests) > len(self.paused)

    # ---- live migration (raylm.engine.migration) -------------------------------------

    def stop_scheduling(self, request_id: str) -> None:
        """No new step for this request; `pause` once its steps in flight are done."""
        self.unscheduled.add(request_id)

    def pause(self, request_id: str) -> Request:
        """Take the request out of the queues, keeping its blocks (its K/V is
        being copied). Only once no step of it is in flight: that step's
        token would be lost."""
        request = self.requests[request_id]
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.PAUSED
        self.unscheduled.discard(request_id)
        self.paused[request_id] = request
        return request

    def resume(self, request_id: str) -> None:
        """A migration that did not happen: the request goes on here, first in line."""
        self.unscheduled.discard(request_id)
        request = self.paused.pop(request_id, None)
        if request is None:
            return
        if request.num_computed_tokens:
            request.status = RequestStatus.RUNNING
            self.running.insert(0, request)
        else:
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)

    def release_migrated(self, request_id: str) -> None:
        """The request lives on at the destination: free it here, silently."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, RequestStatus.FINISHED_ABORTED)

    def add_imported(self, request: Request, num_computed_tokens: int) -> None:
        """A migrated request whose first `num_computed_tokens` tokens have
        their K/V in the blocks already imported for it: it goes first in the
        queue and continues from there (see schedule)."""
        request.num_computed_tokens = num_computed_tokens
        self.add_request(request)
        self.waiting.remove(request)
        self.waiting.appendleft(request)

    # ---- failures --------------------------------------------------------------------

    def reset_after_executor_loss(self, num_blocks: int) -> int:
        """The workers and their KV cache are gone: every running request goes
        back to the head of the queue, in order, to be recomputed from its
        prompt and the tokens it already generated (preemption by recompute);
        the new KV cache gets a fresh block manager. Returns how many requests
        were running."""
        # Paused requests (a migration in progress) lost their K/V too: they
        # stay paused until the migration ends, and recompute if they resume.
        for request in self.paused.values():
            request.num_computed_tokens = 0
            request.num_output_placeholders = 0
        running = list(self.running)
        for request in reversed(running):
            request.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(request)
        self.running = []
        for request in self.waiting:
            request.num_computed_tokens = 0
            request.num_output_placeholders = 0
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            self.kv_cache_manager.block_size,
            self.kv_cache_manager.enable_prefix_caching,
            num_shards=self.kv_cache_manager.num_shards,
            events=self.kv_cache_manager.pool.events,
        )
        # New workers know no request: each is sent in full, and none is finished there.
        self.needs_full_send = set(self.requests)
        self.finished_req_ids = set()
        return len(running)

    def charge_recovery(self, request_ids, cause: str) -> tuple[quarantine.Verdict, list[EngineCoreOutput]]:
        """A failure that these requests were exposed to (they were in the
        failed steps) is being recovered from: charge them, quarantine the
        repeat offenders and fail the culprit, if this failure names one (see
        raylm.core.quarantine). Returns the verdict and the culprits' outputs."""
        exposed = [self.requests[rid] for rid in dict.fromkeys(request_ids) if rid in self.requests]
        verdict = quarantine.charge(exposed)
        outputs = []
        if verdict.found_culprit:
            self._finish(self.requests[verdict.culprits[0]], RequestStatus.FINISHED_ERROR)
            outputs.append(quarantine.culprit_output(verdict, cause))
            quarantine.release(self.requests.values())
        self.quarantined = {rid for rid, request in self.requests.items() if request.quarantined}
        return verdict, outputs

    def stats(self) -> dict:
        tier = self.kv_cache_manager.tier
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "kv_cache_usage": self.kv_cache_manager.usage,
            "prefix_cache_hit_rate": self.kv_cache_manager.prefix_cache_hit_rate,
            "prefix_cache_queries": self.kv_cache_manager.prefix_queries,
            "prefix_cache_hits": self.kv_cache_manager.prefix_hits,
            "prefix_cache_tier_hits": self.kv_cache_manager.tier_hits,
            "kv_tier_blocks": len(tier) if tier is not None else 0,
            "kv_tier_capacity_blocks": tier.num_slots if tier is not None else 0,
            "num_preemptions": self.num_preemptions,
            "lora_running": _adapter_names(self.running),
            "lora_waiting": _adapter_names(self.waiting),
            # What the KV cache holds: in all, and on each rank (a CP group's ranks share it out).
            "kv_capacity_tokens": self.kv_cache_manager.num_blocks * self.kv_cache_manager.block_size,
            "kv_capacity_tokens_per_rank": self.kv_cache_manager.num_blocks
            // self.kv_cache_manager.num_shards
            * self.kv_cache_manager.block_size,
        }


def _adapter_names(requests) -> list[str]:
    """The names of the LoRA adapters `requests` run with, sorted."""
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})
