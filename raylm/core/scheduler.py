"""Continuous batching under a token budget, with chunked prefill and
preemption by recompute.

There is no separate prefill or decode phase: every running request simply
wants `num_tokens - num_computed_tokens` more tokens computed (a whole prompt,
a chunk of it, or the one token sampled last step), and each step hands out a
token budget, running requests first, then waiting ones. `num_computed_tokens`
advances when a request is scheduled, so a request whose step is still in
flight (pipeline parallel, async scheduling) has nothing left to schedule and
is naturally skipped until its sampled token arrives.

With async scheduling the next step is scheduled before the current one has
sampled: a request that samples this step gets an output placeholder, its next
step computes that (yet unknown) token, and the workers fill it in from their
own sampler output. Placeholders are never sent as token ids.

Structured outputs: a constrained request waits in the queue until its grammar
is compiled (others pass it), its matcher accepts each token as it arrives, and
it ends with "stop" once its grammar is terminated (see StructuredOutputManager);
a speculative draft of it is cut to what its grammar allows (fit_draft).

The requests' places (queues, pauses, quarantine) and the moves between them
that are not a step's decision (added, aborted, migrated, reset after the
workers are lost) are raylm.core.request_queues.RequestQueues, which
Scheduler extends with the step. When the KV cache is full, the step decides
who gives blocks up and raylm.core.preemption makes those moves.
"""

from __future__ import annotations

import logging
import time

from raylm.config import CacheConfig, SchedulerConfig
from raylm.core import preemption
from raylm.core.decode_burst import BurstPlanner
from raylm.core.lora_admission import AdapterAdmission
from raylm.core.outputs import EngineCoreOutput
from raylm.core.request import Request, RequestStatus
from raylm.core.request_queues import RequestQueues
from raylm.core.spec_decode import Speculator
from raylm.core.structured_output import GrammarError, StructuredOutputManager
from raylm.messages import CachedRequestData, GrammarOutput, ModelRunnerOutput, NewRequestData, SchedulerOutput

logger = logging.getLogger(__name__)

# How long an otherwise idle step waits for a grammar being compiled, rather than spin.
_GRAMMAR_WAIT_S = 0.005


class Scheduler(RequestQueues):
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        max_model_len: int,
        structured_output_manager: StructuredOutputManager | None = None,
        burst_planner: BurstPlanner | None = None,
        speculator: Speculator | None = None,
        max_loras: int | None = None,
    ):
        super().__init__(cache_config, structured_output_manager)
        self.config = scheduler_config
        self.async_scheduling = scheduler_config.async_scheduling
        self.max_model_len = max_model_len
        # The quarantined request the last schedule() ran alone, if any.
        self.running_alone: str | None = None
        # Requests ended outside a step (their grammar failed to compile),
        # reported with the next step's outputs.
        self._outputs_outside_step: list[EngineCoreOutput] = []
        # Decode bursts (raylm.core.decode_burst); None: one step at a time.
        self.burst_planner = burst_planner
        # Speculative decoding (raylm.core.spec_decode); None: off.
        self.speculator = speculator
        self.adapters = AdapterAdmission(max_loras)  # LoRA adapters among the running requests

    # ---- one step --------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_block_ids: dict[str, list[int]] = {}
        drafts: dict[str, list[int]] = {}
        preempted_now = False
        self._fail_broken_grammars()
        isolated = self._isolated_request()
        if self.speculator is not None:
            self.speculator.begin_step(len(self.running))

        # Running requests first, oldest first; the newest is the preemption victim.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if isolated is not None and request is not isolated:
                i += 1
                continue
            if self._no_more_tokens_needed(request) or request.request_id in self.unscheduled:
                i += 1
                continue
            num_new = min(request.num_tokens + request.num_output_placeholders - request.num_computed_tokens, budget)
            num_new = min(num_new, self.max_model_len - request.num_computed_tokens)
            if num_new <= 0:
                i += 1
                continue
            draft = self._draft(request, num_new, budget)
            while True:
                block_ids = self.kv_cache_manager.allocate_slots(request, num_new + len(draft))
                if block_ids is not None:
                    break
                if draft:  # no room for the draft's positions: decode one token, as without one
                    draft = []
                    continue
                victim = self.running.pop()
                preemption.preempt(self, victim, num_scheduled, new_block_ids)
                preempted_now = True
                if victim is request:
                    break
            if block_ids is None:
                break
            if draft:
                drafts[request.request_id] = draft
            num_scheduled[request.request_id] = num_new + len(draft)
            new_block_ids[request.request_id] = block_ids
            budget -= num_new + len(draft)
            i += 1
        if self.speculator is not None:
            self.speculator.end_step()

        # Then waiting requests, unless we just had to preempt (no room anyway).
        compiling: list[Request] = []
        promoted: set[str] = set()
        self.adapters.begin(self.running)
        while self.waiting and budget > 0 and not preempted_now and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if isolated is not None and (request is not isolated or num_scheduled):
                break
            if self.structured_output_manager is not None and self.structured_output_manager.is_compiling(
                request.request_id
            ):
                compiling.append(self.waiting.popleft())  # the ones behind it go first
                continue
            if not self.adapters.admits(request):  # its adapter waits for a slot; the ones behind it go first
                # It must run alone (quarantine), and the running requests, which isolation keeps
                # from running, would hold their adapters forever (found by the chaos harness: a
                # P/D replica left alone after a scale-in): the newest gives its adapter up.
                if request is isolated and preemption.preempt_newest_but(self, request, num_scheduled, new_block_ids):
                    break  # the preempted request is ahead of it now; the next schedule puts it first again
                compiling.append(self.waiting.popleft())
                continue
            imported = request.num_computed_tokens > 0  # its K/V came with a migration
            computed_blocks, num_cached = [], request.num_computed_tokens
            if not imported:
                computed_blocks, num_cached = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_cached
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            block_ids = self.kv_cache_manager.allocate_slots(request, num_new, computed_blocks)
            if block_ids is None:
                alone = isolated is not None
                if preemption.make_room_for(self, request, alone, promoted, num_scheduled, new_block_ids):
                    continue
                break
            self.waiting.popleft()
            if self.kv_cache_manager.enable_prefix_caching and not imported:
                self.kv_cache_manager.record_prefix_lookup(request.num_tokens, num_cached)
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            self.adapters.admit(request)
            num_scheduled[request.request_id] = num_new
            new_block_ids[request.request_id] = block_ids
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))
        if compiling and not num_scheduled and not self.running:
            self.structured_output_manager.wait_for_compilation(_GRAMMAR_WAIT_S)

        self.running_alone = isolated.request_id if isolated is not None and num_scheduled else None
        steps = 1
        # A burst holds back whoever is not in it: only when nobody waits and
        # every running request is in the step.
        if (
            not self.waiting
            and not drafts
            and not preempted_now
            and isolated is None
            and not self.unscheduled
            and not self.expecting_imports
            and len(num_scheduled) == len(self.running)
        ):
            steps = self._burst_length(num_scheduled, new_block_ids)
        for rid in [rid for rid in drafts if rid not in num_scheduled]:  # preempted after drafting
            del drafts[rid]
        return self._make_output(num_scheduled, new_block_ids, steps, drafts)

    def _draft(self, request: Request, num_new: int, budget: int) -> list[int]:
        """A speculative draft for a request about to decode one token: only
        after its last committed token (a token in flight has none)."""
        if self.speculator is None or num_new != 1:
            return []
        after_last = not request.num_output_placeholders and request.num_computed_tokens == request.num_tokens - 1
        som = self.structured_output_manager
        constrained = som is not None and som.is_constrained(request.request_id)
        draft = self.speculator.draft(request, constrained, self.max_model_len, budget, after_last)
        if draft and constrained:
            # Grammar-checked: cut at its first token the grammar forbids, which
            # could never be committed (its verification row masks it out).
            draft = som.fit_draft(request, draft)
        return draft

    def _burst_length(self, num_scheduled: dict[str, int], new_block_ids: dict[str, list[int]]) -> int:
        """How many decode steps this step's requests take at once (a decode
        burst), with their KV slots allocated for them all; 1 when they cannot."""
        if self.burst_planner is None or self.async_scheduling:
            return 1
        som = self.structured_output_manager
        steps = self.burst_planner.length(
            [(self.requests[rid], n) for rid, n in num_scheduled.items()],
            self.max_model_len,
            lambda rid: som is not None and som.is_constrained(rid),
        )
        if steps == 1:
            return 1
        for rid in num_scheduled:
            more = self.kv_cache_manager.allocate_slots(self.requests[rid], steps)
            if more is None:
                # The pool is nearly full: one step, as usual. Blocks already
                # added stay with their requests, whose next tokens use them.
                return 1
            new_block_ids[rid] = new_block_ids[rid] + more
        return steps

    def _isolated_request(self) -> Request | None:
        """While quarantined requests remain, the one allowed to run (alone): a
        running one, else the first waiting one, moved to the queue's head."""
        if not self.quarantined:
            return None
        for request in self.running:
            if request.request_id in self.quarantined:
                return request
        for request in self.waiting:
            if request.request_id in self.quarantined:
                self.waiting.remove(request)
                self.waiting.appendleft(request)
                return request
        self.quarantined.clear()  # defensive: every quarantined request has finished
        return None

    def _no_more_tokens_needed(self, request: Request) -> bool:
        """Async scheduling: the steps in flight already produce every token the
        request may still generate."""
        if not request.num_output_placeholders:
            return False
        max_tokens = request.sampling_params.max_tokens
        pending = request.num_output_tokens + request.num_output_placeholders
        return (max_tokens is not None and pending >= max_tokens) or (
            request.num_tokens + request.num_output_placeholders >= self.max_model_len
        )

    def _make_output(
        self,
        num_scheduled: dict[str, int],
        new_block_ids: dict[str, list[int]],
        num_decode_steps: int = 1,
        spec_token_ids: dict[str, list[int]] | None = None,
    ) -> SchedulerOutput:
        new_reqs, cached_reqs = [], []
        for rid, n in num_scheduled.items():
            request = self.requests[rid]
            if rid in self.needs_full_send:
                self.needs_full_send.discard(rid)
                new_reqs.append(
                    NewRequestData(
                        req_id=rid,
                        prompt_token_ids=request.prompt_token_ids,
                        output_token_ids=list(request.output_token_ids),
                        sampling_params=request.sampling_params,
                        block_ids=self.kv_cache_manager.get_block_ids(rid),
                        num_computed_tokens=request.num_computed_tokens,
                        lora_request=request.lora_request,
                    )
                )
            else:
                cached_reqs.append(
                    CachedRequestData(
                        req_id=rid,
                        new_token_ids=request.unsent_token_ids,
                        new_block_ids=new_block_ids[rid],
                        num_computed_tokens=request.num_computed_tokens,
                    )
                )
            request.unsent_token_ids = []
            # A burst computes the K/V of each step's input token: its own and
            # the tokens it samples but the last.
            request.num_computed_tokens += n + num_decode_steps - 1
            caught_up = request.num_computed_tokens == request.num_tokens + request.num_output_placeholders
            if self.async_scheduling and caught_up:
                request.num_output_placeholders += 1
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            num_decode_steps=num_decode_steps,
            spec_token_ids=spec_token_ids or {},
        )
        self.finished_req_ids = set()
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs, self._outputs_outside_step = self._outputs_outside_step, []
        for rid, token_ids in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while its step was in flight
            prompt_lps = runner_output.prompt_logprobs.get(rid, [])
            new_tokens = []
            error = None
            if token_ids and request.num_output_placeholders:
                request.num_output_placeholders -= 1
            # Async scheduling and bursts: the workers keep the tokens they sampled.
            workers_hold_tokens = self.async_scheduling or scheduler_output.num_decode_steps > 1
            # A verified draft's tokens are taken one by one, like steps': a
            # stop token or max_tokens cuts the run where it would have stopped.
            draft = scheduler_output.spec_token_ids.get(rid)
            for token_id in token_ids:
                request.append_output_token(token_id)
                if draft is not None:  # before the request can end and free its blocks
                    self.kv_cache_manager.register_verified(request)
                if workers_hold_tokens:
                    request.unsent_token_ids.clear()
                new_tokens.append(token_id)
                error = self._advance_grammar(request)
                if request.is_finished or self._check_stop(request):
                    break
            if draft is not None:
                self._after_verification(request, draft, token_ids)
            if not new_tokens and not prompt_lps:
                continue
            # One entry per sampled token: those of tokens cut off by a stop go too.
            logprobs = runner_output.logprobs.get(rid, [])[: len(new_tokens)]
            out = EngineCoreOutput(
                request_id=rid,
                new_token_ids=new_tokens,
                new_logprobs=logprobs,
                new_prompt_logprobs=prompt_lps,
                num_cached_tokens=max(request.num_cached_tokens, 0),
            )
            if prompt_lps:
                out.prompt_logprobs_start = _first_scored_prompt_token(scheduler_output, rid)
            if new_tokens and request.first_token_time is None:
                request.first_token_time = time.monotonic()
                out.queue_seconds = request.first_scheduled_time - request.received_time
                out.prefill_seconds = request.first_token_time - request.first_scheduled_time
            if request.is_finished:
                out.finish_reason = request.status.value
                out.stop_reason = request.stop_reason
                out.error = error
            outputs.append(out)
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        super()._finish(request, status)
        if self.speculator is not None:
            self.speculator.proposer.request_finished(request)  # suffix decoding learns its output

    def _after_verification(self, request: Request, draft: list[int], committed: list[int]) -> None:
        """Count the verified draft and roll the request back over its
        rejected positions: their K/V is recomputed (overwritten) when their
        tokens are, from the last committed one, which has none yet."""
        self.speculator.record_verified(request, len(draft), len(committed))
        if not request.is_finished:
            request.num_computed_tokens = request.num_tokens - 1

    def stats(self) -> dict:
        stats = super().stats()
        stats["lora_slots"] = list(self.adapters.resident)
        if self.speculator is not None:
            stats.update(self.speculator.stats.as_dict())
        return stats

    def take_outputs_outside_step(self) -> list[EngineCoreOutput]:
        """Outputs of requests ended outside a step, for a step that ran none."""
        outputs, self._outputs_outside_step = self._outputs_outside_step, []
        return outputs

    # ---- structured outputs ------------------------------------------------------

    def get_grammar_output(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The grammar bitmasks of a step's constrained requests, computed
        while its forward runs; None when none of them samples."""
        if self.structured_output_manager is None:
            return None
        return self.structured_output_manager.grammar_output(scheduler_output, self.requests)

    def needs_tokens_in_flight(self, scheduler_output: SchedulerOutput) -> bool:
        """Async scheduling: a constrained request of this step samples after
        a token an earlier step is still sampling, so the step's bitmask (and
        its sampling) must wait for that step's output."""
        som = self.structured_output_manager
        return som is not None and som.needs_tokens_in_flight(scheduler_output, self.requests)

    def _advance_grammar(self, request: Request) -> str | None:
        """Feed a constrained request's matcher its new token; a terminated
        grammar ends the request with "stop". The error, if the token does
        not fit (the request then ends with "error")."""
        som = self.structured_output_manager
        if som is None or not som.is_constrained(request.request_id):
            return None
        try:
            terminated = som.accept_tokens(request)
        except GrammarError as e:
            logger.error("request %s: %s", request.request_id, e)
            self._finish(request, RequestStatus.FINISHED_ERROR)
            return str(e)
        if terminated:
            self._finish(request, RequestStatus.FINISHED_STOPPED)
        return None

    def _fail_broken_grammars(self) -> None:
        if self.structured_output_manager is None:
            return
        for rid, error in self.structured_output_manager.failed_requests():
            self._finish(self.requests[rid], RequestStatus.FINISHED_ERROR)
            self._outputs_outside_step.append(
                EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason="error", error=error)
            )

    def _check_stop(self, request: Request) -> bool:
        params = request.sampling_params
        status = None
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last == request.eos_token_id:
                status = RequestStatus.FINISHED_STOPPED
            elif last in params.stop_token_ids:
                status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last
        if status is None and (
            (params.max_tokens is not None and request.num_output_tokens >= params.max_tokens)
            or request.num_tokens >= self.max_model_len
        ):
            status = RequestStatus.FINISHED_LENGTH
        if status is None:
            return False
        self._finish(request, status)
        return True


def _first_scored_prompt_token(so: SchedulerOutput, rid: str) -> int:
    """The prompt token that the first of a step's prompt logprobs scores:
    the workers give them for every prompt position the step computes, from
    its first (position p scores token p + 1)."""
    start = next(r.num_computed_tokens for r in (*so.scheduled_new_reqs, *so.scheduled_cached_reqs) if r.req_id == rid)
    return start + 1
