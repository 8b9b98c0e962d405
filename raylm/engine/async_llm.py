"""AsyncLLM: the online front end. It tokenizes (off the event loop), sends
requests to the engine core in its own process, and streams RequestOutputs back
(each request a RequestStream, request_stream.py).

One background task pulls EngineCoreOutputs, detokenizes them (OutputProcessor)
and dispatches each request's outputs to its own asyncio queue. The cores are
run by an EngineCoreSupervisor (one core process, or data-parallel replicas):
if one dies, it resubmits that core's unfinished requests as continuations
and starts a new core within a restart budget; clients see a pause, not an
error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from raylm.config import EngineConfig, create_engine_config
from raylm.engine.autoscaler import Autoscaler
from raylm.engine.errors import EngineDeadError, EngineRecoveryTimeoutError, EngineUnhealthyError
from raylm.engine.input_processor import InputProcessor, ProcessedPrompt, params_worth_a_thread, prompt_worth_a_thread
from raylm.engine.llm_engine import check_data_parallel_rank
from raylm.engine.output_processor import OutputProcessor
from raylm.engine.protocol import EngineCoreOutputs, RecoveryStats, SchedulerStats
from raylm.engine.request_stream import RequestState, RequestStream
from raylm.engine.restart_budget import BlameLedger, RestartBudget
from raylm.engine.role_autoscaler import RoleAutoscalePolicy, scale_steps
from raylm.engine.stat_logger import StatLoggerBase
from raylm.engine.supervisor import AsyncEngineCoreSupervisor
from raylm.engine.tokenizer import load_tokenizer
from raylm.log_text import loggable, traceback_frames
from raylm.lora.request import LoRARequest
from raylm.outputs import RequestOutput
from raylm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    """Serve many concurrent requests from one event loop.

    Construction starts the engine cores (an EngineCoreSupervisor: one core
    process, or data-parallel replicas) and blocks until they are ready.
    `generate` is an async generator of RequestOutputs: deltas (`stream=True`)
    or one final output. Leaving it early (a client disconnect cancels the
    task) aborts the request in the core, which frees its KV blocks.
    """

    def __init__(self, config: EngineConfig, stat_loggers: list[StatLoggerBase] | None = None):
        self.config = config
        self.tokenizer = load_tokenizer(config.model_config.tokenizer, config.model_config.chat_template)
        self.input_processor = InputProcessor(config.model_config, self.tokenizer, config.lora_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_loggers = list(stat_loggers or [])
        self._requests: dict[str, RequestState] = {}
        self._pings: dict[int, asyncio.Future] = {}
        self._output_task: asyncio.Task | None = None
        self._autoscale_task: asyncio.Task | None = None  # --autoscale (raylm.engine.autoscaler)
        self.dead_error: EngineDeadError | None = None
        # Set when the engine dies for good (not on shutdown); the server exits then.
        self._dead = asyncio.Event()
        # The cores' own verdict on their health, from their last report.
        self._core_unhealthy: str | None = None
        self._scale_lock: asyncio.Lock | None = None  # made on the event loop that scales
        self.engine_core = AsyncEngineCoreSupervisor(config)

    @property
    def restart_budget(self) -> RestartBudget:
        """The supervisor's budget of core restarts."""
        return self.engine_core.restart_budget

    @property
    def blame(self) -> BlameLedger:
        return self.engine_core.blame

    @property
    def recovering(self) -> bool:
        """Whether no core can serve now because one is being replaced or
        rebuilds its executor: requests wait, /health passes up to a limit."""
        return self.engine_core.recovery_status() is not None

    def replica_states(self) -> list[dict] | None:
        """Each data-parallel replica's node, load and state (for /health and
        metrics); None for an engine started without data parallelism."""
        if self.config.parallel_config.data_parallel_size == 1 and self.config.autoscale is None:
            return None
        return self.engine_core.replica_states()

    def routing_decisions(self) -> dict[str, int] | None:
        """New requests routed so far, by reason (routing.ROUTING_REASONS); None without data parallelism."""
        if self.replica_states() is None:
            return None
        return dict(self.engine_core.router.decisions)

    async def scale(self, data_parallel_size: int) -> None:
        """Change the number of data-parallel replicas without failing a request."""
        # One change at a time, whoever calls: two scale-ups that both saw the
        # old size would each start the missing replicas.
        if self._scale_lock is None:
            self._scale_lock = asyncio.Lock()
        async with self._scale_lock:
            await self.engine_core.scale_async(data_parallel_size)
        self._record(lambda s: s.record_target_replicas(data_parallel_size))

    async def scale_roles(self, data_parallel_size: int, prefill_replicas: int) -> None:
        """P/D: `data_parallel_size` replicas, the first `prefill_replicas` of
        them prefilling (raylm.engine.role_autoscaler: the role change and the
        scale in the order that keeps a decode replica serving)."""
        if self._scale_lock is None:
            self._scale_lock = asyncio.Lock()
        async with self._scale_lock:
            supervisor = self.engine_core
            for step in scale_steps(supervisor.handoffs.prefill_replicas, prefill_replicas):
                if step == "roles":
                    supervisor.set_prefill_replicas(prefill_replicas)
                else:
                    await supervisor.scale_async(data_parallel_size)
        self._record(lambda s: s.record_target_replicas(data_parallel_size))

    async def restart_replica(self, index: int) -> None:
        """Restart data-parallel replica `index` without losing a request: its
        requests migrate to the others, it starts anew and serves again."""
        if self.replica_states() is None:
            raise ValueError("restarting a replica needs an engine started with data_parallel_size > 1")
        if self._scale_lock is None:
            self._scale_lock = asyncio.Lock()
        async with self._scale_lock:  # not while the replica count changes
            await self.engine_core.restart_replica(index)

    @classmethod
    def from_engine_args(cls, stat_loggers: list[StatLoggerBase] | None = None, **engine_kwargs: Any) -> AsyncLLM:
        """An engine for online streams: unless told otherwise, its defaults
        are those for serving (usage_context="api_server")."""
        engine_kwargs.setdefault("usage_context", "api_server")
        return cls(create_engine_config(**engine_kwargs), stat_loggers)

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def num_requests_with_adapter(self, lora_int_id: int) -> int:
        """Requests in flight that run with the LoRA adapter of this id."""
        return sum(1 for state in self._requests.values() if state.lora_int_id == lora_int_id)

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    async def wait_until_dead(self) -> EngineDeadError:
        """Returns the error once the engine is dead for good (a fatal core
        error, or the restart budget spent); not on shutdown."""
        self._ensure_output_handler()
        await self._dead.wait()
        return self.dead_error

    def _ensure_output_handler(self) -> None:
        if self._output_task is None:
            self._output_task = asyncio.get_running_loop().create_task(
                self._run_output_handler(), name="raylm-output-handler"
            )
        if self.config.autoscale is not None and self._autoscale_task is None:
            autoscaler = Autoscaler(
                self,
                self.config.autoscale,
                on_decision=lambda d: self._record(lambda s: s.record_autoscale(d.direction, d.reason)),
                # With P/D roles the prefill and decode pools scale apart.
                policy=RoleAutoscalePolicy(self.config.autoscale)
                if self.config.parallel_config.prefill_replicas
                else None,
            )
            self._autoscale_task = asyncio.get_running_loop().create_task(autoscaler.run(), name="raylm-autoscaler")

    # ---- requests ------------------------------------------------------------

    async def process_prompt(
        self, prompt: Any, params: SamplingParams, lora_request: LoRARequest | None = None
    ) -> tuple[ProcessedPrompt, SamplingParams]:
        """Validate and tokenize; a long text prompt, many bad_words, or a
        LoRA adapter (its files read and checked, once) in a thread (one hop
        for all), so that they never stall the other streams.
        Token ids, short texts and a few bad words are done here: the hop to a
        thread and back costs more than their work, and at a burst of requests
        it queues each behind the others' hops."""
        process = self.input_processor.process
        if prompt_worth_a_thread(prompt) or params_worth_a_thread(params) or lora_request is not None:
            return await asyncio.get_running_loop().run_in_executor(None, process, prompt, params, lora_request)
        return process(prompt, params)

    async def add_request(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        stream: bool = True,
        data_parallel_rank: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Validate the request and hand it to the engine core now; its outputs
        come from the returned stream, which the caller must close (or read to
        the end). ValueError for bad input. `data_parallel_rank` pins the
        request to one data-parallel replica; `lora_request` names its LoRA
        adapter (enable_lora).

        A server submits each request as soon as its handler has it, not when
        its response starts streaming: at a burst, the handlers of the other
        arrivals run first, and the core would wait for all of them."""
        self._check_alive()
        check_data_parallel_rank(self.config, data_parallel_rank)
        processed, params = await self.process_prompt(prompt, sampling_params, lora_request)
        return self.add_validated_request(request_id, processed, params, stream, data_parallel_rank)

    def add_validated_request(
        self,
        request_id: str,
        processed: ProcessedPrompt,
        params: SamplingParams,
        stream: bool = True,
        data_parallel_rank: int | None = None,
    ) -> RequestStream:
        """`add_request` for a request `process_prompt` validated already (a
        server fits max_tokens to the context between the two): it is not
        checked again (LLMEngine.add_validated_request is the same for an
        offline engine). Its outputs come from the returned stream."""
        self._check_alive()
        self._ensure_output_handler()
        check_data_parallel_rank(self.config, data_parallel_rank)
        state = self._add_request(request_id, processed, params, stream, data_parallel_rank)
        return RequestStream(request_id, state.queue, self.abort)

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        stream: bool = True,
        data_parallel_rank: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes (add_request, then
        read); closing or cancelling the generator aborts the request."""
        outputs = await self.add_request(prompt, sampling_params, request_id, stream, data_parallel_rank, lora_request)
        try:
            async for output in outputs:
                yield output
        finally:
            outputs.close()

    def _add_request(
        self,
        request_id: str,
        processed: ProcessedPrompt,
        params: SamplingParams,
        stream: bool,
        data_parallel_rank: int | None = None,
    ) -> RequestState:
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        children = self.input_processor.core_requests(request_id, processed, params)
        lora = processed.lora_request
        state = RequestState(
            asyncio.Queue(), stream, len(processed.prompt_token_ids), lora_int_id=lora.lora_int_id if lora else None
        )
        self.output_processor.add_request(
            request_id, processed.prompt, processed.prompt_token_ids, params, [c.request_id for c in children]
        )
        self._requests[request_id] = state
        try:
            for child in children:
                self.engine_core.add_request(child, data_parallel_rank)
        except BaseException:
            self.abort(request_id)
            raise
        return state

    def abort(self, request_id: str) -> None:
        """Drop a request here and in the core; a no-op for unknown ids."""
        state = self._requests.pop(request_id, None)
        child_ids = self.output_processor.abort(request_id)
        if state is not None:
            for index in range(len(child_ids)):
                if index not in state.counted_finished:
                    self._record_finished(state, "abort", 0)
        if child_ids and not self.is_dead:
            self.engine_core.abort_requests(child_ids)

    def finish_all(self) -> int:
        """End every in-flight request now with finish_reason "abort" (its
        stream closes cleanly) and abort it in the core; returns how many."""
        request_ids = list(self._requests)
        for request_id in request_ids:
            parent = self.output_processor.parents.get(request_id)
            if parent is None:
                continue
            for child in parent.children.values():
                if child.finish_reason is None:
                    child.finish_reason = "abort"
            child_ids = list(parent.children)
            self._emit(request_id, time.monotonic())
            if not self.is_dead:
                self.engine_core.abort_requests(child_ids)
        return len(request_ids)

    # ---- outputs -------------------------------------------------------------

    async def _run_output_handler(self) -> None:
        try:
            while True:
                self._process(await self.engine_core.get_output())
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:
            self._mark_dead(e)
        except Exception as e:  # a bug here would otherwise hang every client silently
            # Its message may quote a request id: escaped, the frames apart.
            logger.error("output handler failed: %s\n%s", loggable(f"{type(e).__name__}: {e}"), traceback_frames(e))
            self._mark_dead(EngineDeadError(f"output handler failed: {e}"))

    def _process(self, outputs: EngineCoreOutputs) -> None:
        if outputs.stats is not None:
            self._core_unhealthy = outputs.stats.unhealthy
            for stat_logger in self.stat_loggers:
                stat_logger.record_scheduler_stats(outputs.stats)
            cores = self._core_stats()
            self._record(lambda s: s.record_core_stats(cores))
        for recovery in outputs.recoveries:
            self._record_recovery(recovery)
        for migration in outputs.migrated:
            self._record(lambda s, m=migration: s.record_migration(m))
        for pull in outputs.pulled:
            self._record(lambda s, p=pull: s.record_pull(p))
        for handoff in outputs.handed_off:
            self._record(lambda s, h=handoff: s.record_handoff(h))
        if outputs.pong is not None:
            future = self._pings.pop(outputs.pong, None)
            if future is not None and not future.done():
                future.set_result(True)
        if not outputs.outputs:
            return
        now = time.monotonic()
        stepped = {self.output_processor.child_to_parent.get(o.request_id) for o in outputs.outputs if o.new_token_ids}
        self._record_core_timings(outputs)
        changed, to_abort = self.output_processor.process_outputs(outputs.outputs)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        for request_id in changed:
            state = self._requests.get(request_id)
            if state is None:
                continue
            if request_id in stepped:
                if state.first_token is None:
                    state.first_token = now
                    # Values bound now (default arguments), not read from the loop's variables later.
                    self._record(lambda s, ttft=now - state.arrival: s.record_first_token(ttft))
                else:
                    self._record(lambda s, gap=now - state.last_token: s.record_inter_token(gap))
                state.last_token = now
            self._emit(request_id, now)

    def _emit(self, request_id: str, now: float) -> None:
        state = self._requests[request_id]
        parent = self.output_processor.parents[request_id]
        finished = parent.finished
        if not (state.deltas or finished):
            return
        for child in parent.children.values():
            if child.finish_reason is not None and child.index not in state.counted_finished:
                state.counted_finished.add(child.index)
                self._record_finished(state, child.finish_reason, len(child.token_ids), now)
        state.queue.put_nowait(self.output_processor.make_output(request_id, delta=state.deltas))
        if finished:
            del self._requests[request_id]

    def _record_core_timings(self, outputs: EngineCoreOutputs) -> None:
        for output in outputs.outputs:
            if output.queue_seconds is None:
                continue
            state = self._requests.get(self.output_processor.child_to_parent.get(output.request_id))
            # Once per request: its other children of n, or its continuation in a
            # restarted core, report again.
            if state is None or state.prefill_seconds is not None:
                continue
            state.prefill_seconds = output.prefill_seconds
            self._record(
                lambda s, queue=output.queue_seconds, prefill=output.prefill_seconds: s.record_queue_and_prefill(
                    queue, prefill
                )
            )

    def _record_finished(self, state: RequestState, reason: str, num_tokens: int, now: float | None = None) -> None:
        now = now or time.monotonic()
        e2e = now - state.arrival
        decode = now - state.first_token if state.first_token is not None else 0.0
        inference = decode + (state.prefill_seconds or 0.0)
        self._record(lambda s: s.record_finished(reason, e2e, state.num_prompt_tokens, num_tokens, decode, inference))

    def _core_stats(self) -> list[SchedulerStats]:
        """Each serving core's stats as it last sent them. The supervisor
        passes up their sum (aggregate_stats), in which a replica that left or
        restarted reads as totals going back; the stat loggers count per core.
        Read on the event loop, where the supervisor updates its channels."""
        return [c.stats for c in self.engine_core.channels.values() if c.stats is not None]

    def _record(self, call) -> None:
        for stat_logger in self.stat_loggers:
            try:
                call(stat_logger)
            except Exception:  # metrics must never take serving down
                logger.exception("stat logger failed")

    def _record_recovery(self, recovery: RecoveryStats) -> None:
        self._record(lambda s: s.record_recovery(recovery.kind, recovery.seconds, recovery.num_requests))

    def _mark_dead(self, error: EngineDeadError) -> None:
        # Mostly the server's words (a core's error), but they may quote a request.
        logger.error("engine is dead: %s", loggable(error, limit=1000))
        self.dead_error = error
        for state in self._requests.values():
            state.queue.put_nowait(error)
        self._requests.clear()
        for future in self._pings.values():
            if not future.done():
                future.set_exception(error)
        self._pings.clear()
        self._dead.set()

    # ---- health and shutdown ---------------------------------------------------

    def recovery_status(self) -> dict | None:
        """The recovery in progress, if any (EngineCoreSupervisor.recovery_status)."""
        return self.engine_core.recovery_status()

    async def check_health(self, timeout: float = 10.0) -> None:
        """Returns when the core answers a ping, or at once while the engine
        recovers (a core that died is being replaced, or the core rebuilds its
        executor) for no longer than the start timeout; EngineDeadError once
        the engine is dead, EngineRecoveryTimeoutError past that limit."""
        self._check_alive()
        self._ensure_output_handler()
        unhealthy = self.blame.unhealthy_reason or self._core_unhealthy
        if unhealthy is not None:
            raise EngineUnhealthyError(f"engine unhealthy: {unhealthy}")
        recovery = self.recovery_status()
        if recovery is not None:
            # A recovery is not answered by pings (a core loading, or one busy
            # rebuilding); past the time a start may take, it is stuck.
            if recovery["seconds"] > recovery["limit_s"]:
                raise EngineRecoveryTimeoutError(recovery["recovering"], recovery["seconds"], recovery["limit_s"])
            return
        if not self.engine_core.is_alive():
            # The output handler marks the engine dead, which the next check reports.
            return
        future = asyncio.get_running_loop().create_future()
        nonce = self.engine_core.ping()
        self._pings[nonce] = future
        try:
            await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise EngineDeadError(f"engine core did not answer within {timeout:.0f}s") from None
        finally:
            self._pings.pop(nonce, None)

    async def wait_until_idle(self, timeout: float) -> bool:
        """Wait for in-flight requests to finish; True if they all did."""
        deadline = time.monotonic() + timeout
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self._requests

    def shutdown(self) -> None:
        """Idempotent: stops the output task and the engine cores."""
        if self._output_task is not None:
            self._output_task.cancel()
            self._output_task = None
        if self._autoscale_task is not None:
            self._autoscale_task.cancel()
            self._autoscale_task = None
        if self.dead_error is None:
            self.dead_error = EngineDeadError("the engine was shut down")
        for state in self._requests.values():
            state.queue.put_nowait(self.dead_error)
        self._requests.clear()
        self.engine_core.shutdown()
