"""AsyncLLM: the online front end. It tokenizes (off the event loop), sends
requests to the engine core in its own process, and streams RequestOutputs back.

One background task pulls EngineCoreOutputs, detokenizes them (OutputProcessor)
and dispatches each request's outputs to its own asyncio queue. If the core
process dies without a word, that task starts a new one and resubmits every
unfinished request as a continuation (within a restart budget); clients see a
pause, not an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from raylm.config import EngineConfig, create_engine_config
from raylm.core import quarantine
from raylm.core.outputs import EngineCoreOutput
from raylm.core.request import Request
from raylm.engine.core_client import EngineCoreDiedError, EngineDeadError, MPClient
from raylm.engine.core_proc import EngineCoreOutputs, RecoveryStats, SchedulerStats
from raylm.engine.input_processor import InputProcessor, ProcessedPrompt
from raylm.engine.llm_engine import check_data_parallel_rank, make_child_requests
from raylm.engine.output_processor import OutputProcessor
from raylm.engine.restart_budget import BlameLedger, RestartBudget
from raylm.engine.tokenizer import load_tokenizer
from raylm.outputs import RequestOutput
from raylm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class StatLoggerBase:
    """Receives the engine's measurements; the default ignores them.
    The server's Prometheus logger overrides what it exports."""

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        """Counts and cache usage, as the core last reported them."""

    def record_first_token(self, seconds: float) -> None:
        """Time from arrival to a request's first output token."""

    def record_inter_token(self, seconds: float) -> None:
        """Time between two consecutive output steps of one request."""

    def record_queue_and_prefill(self, queue_seconds: float, prefill_seconds: float) -> None:
        """A request waited `queue_seconds` in the core before it was first
        scheduled, then `prefill_seconds` until its first token."""

    def record_finished(self, finish_reason: str, e2e_seconds: float,
                        num_prompt_tokens: int, num_generation_tokens: int,
                        decode_seconds: float = 0.0, inference_seconds: float = 0.0) -> None:
        """One completion (one of a request's n) ended. `decode_seconds`: from
        the request's first token to its last; `inference_seconds`: from its
        first scheduling to its last token (prefill plus decode)."""

    def record_recovery(self, kind: str, seconds: float, num_requests: int) -> None:
        """The engine recovered from a failure of `kind` ("engine_core": the
        front end restarted the core process; the core's own kinds come in
        EngineCoreOutputs.recoveries) in `seconds`, carrying `num_requests` over."""


# Text prompts up to this many characters are tokenized on the event loop
# (well under a millisecond); longer ones in a thread.
_MAX_INLINE_PROMPT_CHARS = 4096


def _worth_a_thread(prompt: Any) -> bool:
    """Whether tokenizing `prompt` takes long enough to move off the event loop."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return False
        prompt = prompt.get("prompt")
    return isinstance(prompt, str) and len(prompt) > _MAX_INLINE_PROMPT_CHARS


# bad_words up to this many characters in all are tokenized on the event loop
# (two encodes of a few words); token sequences up to this many ids are
# checked and copied there. Up to the caps (MAX_BAD_WORDS words, 64 K
# characters) it takes tens of milliseconds: in a thread.
_MAX_INLINE_BAD_WORDS_CHARS = 256
_MAX_INLINE_BAD_WORD_TOKENS = 1024


def _params_worth_a_thread(params: SamplingParams) -> bool:
    """Whether finishing `params` (InputProcessor.finish_params: bad_words
    tokenized, every id checked, the params copied) takes long enough to move
    off the event loop."""
    if params.bad_words_token_ids is not None:  # tokenized already (a server does it in a thread)
        return sum(len(seq) for seq in params.bad_words_token_ids) > _MAX_INLINE_BAD_WORD_TOKENS
    return sum(len(word) for word in params.bad_words or ()) > _MAX_INLINE_BAD_WORDS_CHARS


class EngineUnhealthyError(EngineDeadError):
    """Raised by health checks only: the engine still serves, but failed
    requests caused more recoveries than it forgives, so its supervisor
    should look (HTTP 503 on /health, like a dead engine)."""


class EngineRecoveryTimeoutError(EngineUnhealthyError):
    """Raised by health checks only: a recovery (a core restart, or the core
    rebuilding its executor) has run longer than `engine_start_timeout_s`,
    so it is presumably stuck: HTTP 503 on /health, for a supervisor to act."""

    def __init__(self, what: str, seconds: float, limit_s: float):
        super().__init__(f"the engine has been recovering ({what}) for {seconds:.0f} s, past its limit of "
                         f"{limit_s:g} s (engine_start_timeout)")
        self.seconds = seconds


class RequestFailedError(RuntimeError):
    """This request made the engine's steps fail and was dropped (DESIGN.md,
    "Failure model"); the engine goes on serving the others (HTTP 500)."""


class RequestStream:
    """The outputs of one submitted request, as an async iterator. Closing it
    before the last output (`close`, `aclose`) aborts the request in the core,
    freeing its KV blocks; closing after the end does nothing."""

    def __init__(self, engine: "AsyncLLM", request_id: str, queue: asyncio.Queue):
        self.engine = engine
        self.request_id = request_id
        self._queue = queue
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        failed = [c.error for c in item.outputs if c.finish_reason == "error"]
        if failed:
            # The engine blamed this request for a failing step and dropped it
            # (the others carried on): an error, not a result.
            self.close()  # its other completions, if any
            raise RequestFailedError(f"the engine failed this request: {failed[0]}")
        self.finished = item.finished
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()


@dataclass
class _RequestState:
    queue: asyncio.Queue
    deltas: bool
    num_prompt_tokens: int
    # The engine-core requests as first sent: resubmitted from these if the core dies.
    children: dict[str, Request]
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    prefill_seconds: float | None = None  # as the core measured it
    counted_finished: set[int] = field(default_factory=set)


class AsyncLLM:
    """Serve many concurrent requests from one event loop.

    Construction starts the engine-core process and blocks until it is ready.
    `generate` is an async generator of RequestOutputs: deltas (`stream=True`)
    or one final output. Leaving it early (a client disconnect cancels the
    task) aborts the request in the core, which frees its KV blocks.
    """

    def __init__(self, config: EngineConfig, stat_loggers: list[StatLoggerBase] | None = None):
        self.config = config
        self.tokenizer = load_tokenizer(config.model_config.tokenizer, config.model_config.chat_template)
        self.input_processor = InputProcessor(config.model_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_loggers = list(stat_loggers or [])
        self._requests: dict[str, _RequestState] = {}
        self._pings: dict[int, asyncio.Future] = {}
        self._output_task: asyncio.Task | None = None
        self.dead_error: EngineDeadError | None = None
        # Set when the engine dies for good (not on shutdown); the server exits then.
        self._dead = asyncio.Event()
        ft = config.fault_tolerance
        self.restart_budget = RestartBudget(ft.max_restarts, ft.restart_window_s)
        # Core restarts that failed requests caused are forgiven, up to a rate.
        self.blame = BlameLedger(self.restart_budget, ft.max_blamed_recoveries, ft.restart_window_s)
        # The core's own verdict on its health, from its last report.
        self._core_unhealthy: str | None = None
        # While a new core is starting: new requests wait (unsent) for the
        # resubmission to send them, and /health passes, up to a limit
        # (see recovery_status); `_recovering_since` says since when.
        self.recovering = False
        self._recovering_since: float | None = None
        self._shut_down = False
        self._scale_lock: asyncio.Lock | None = None  # made on the event loop that scales
        self.engine_core = self._make_core_client()

    def _make_core_client(self):
        """The core in a process of its own, or data-parallel replicas behind a router."""
        if self.config.parallel_config.data_parallel_size > 1:
            from raylm.engine.dp_client import AsyncDPClient

            return AsyncDPClient(self.config)
        return self._new_mp_client()

    def _new_mp_client(self) -> MPClient:
        return MPClient(self.config, is_busy=lambda: bool(self._requests))

    @property
    def _owns_request_records(self) -> bool:
        """Whether this front end keeps the requests' failure records
        (raylm.core.quarantine) for a core it restarts; a data-parallel
        client keeps them itself, for the replicas it heals."""
        return isinstance(self.engine_core, MPClient)

    async def scale(self, data_parallel_size: int) -> None:
        """Change the number of data-parallel replicas without failing a request."""
        if not hasattr(self.engine_core, "scale_async"):
            raise ValueError("scaling needs a server started with --data-parallel-size > 1")
        # One change at a time, whoever calls: two scale-ups that both saw the
        # old size would each start the missing replicas.
        if self._scale_lock is None:
            self._scale_lock = asyncio.Lock()
        async with self._scale_lock:
            await self.engine_core.scale_async(data_parallel_size)

    @classmethod
    def from_engine_args(cls, stat_loggers: list[StatLoggerBase] | None = None, **engine_kwargs: Any) -> "AsyncLLM":
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

    # ---- requests ------------------------------------------------------------

    async def process_prompt(self, prompt: Any, params: SamplingParams) -> tuple[ProcessedPrompt, SamplingParams]:
        """Validate and tokenize; a long text prompt, or many bad_words, in a
        thread (one hop for both), so that they never stall the other streams.
        Token ids, short texts and a few bad words are done here: the hop to a
        thread and back costs more than their work, and at a burst of requests
        it queues each behind the others' hops."""
        if _worth_a_thread(prompt) or _params_worth_a_thread(params):
            return await asyncio.get_running_loop().run_in_executor(None, self._process_prompt, prompt, params)
        return self._process_prompt(prompt, params)

    def _process_prompt(self, prompt: Any, params: SamplingParams) -> tuple[ProcessedPrompt, SamplingParams]:
        return self.input_processor.process_prompt(prompt, params), self.input_processor.finish_params(params)

    async def add_request(self, prompt: Any, sampling_params: SamplingParams, request_id: str,
                          stream: bool = True, data_parallel_rank: int | None = None) -> "RequestStream":
        """Validate the request and hand it to the engine core now; its outputs
        come from the returned stream, which the caller must close (or read to
        the end). ValueError for bad input. `data_parallel_rank` pins the
        request to one data-parallel replica.

        A server submits each request as soon as its handler has it, not when
        its response starts streaming: at a burst, the handlers of the other
        arrivals run first, and the core would wait for all of them."""
        self._check_alive()
        self._ensure_output_handler()
        check_data_parallel_rank(self.config, data_parallel_rank)
        processed, params = await self.process_prompt(prompt, sampling_params)
        self._check_alive()
        state = self._add_request(request_id, processed, params, stream, data_parallel_rank)
        return RequestStream(self, request_id, state.queue)

    async def generate(self, prompt: Any, sampling_params: SamplingParams, request_id: str,
                       stream: bool = True, data_parallel_rank: int | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes (add_request, then
        read); closing or cancelling the generator aborts the request."""
        outputs = await self.add_request(prompt, sampling_params, request_id, stream, data_parallel_rank)
        try:
            async for output in outputs:
                yield output
        finally:
            outputs.close()

    def _add_request(self, request_id: str, processed: ProcessedPrompt, params: SamplingParams,
                     stream: bool, data_parallel_rank: int | None = None) -> _RequestState:
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        children = make_child_requests(self.input_processor, request_id, processed, params)
        state = _RequestState(asyncio.Queue(), stream, len(processed.prompt_token_ids),
                              {c.request_id: c for c in children})
        self.output_processor.add_request(
            request_id, processed.prompt, processed.prompt_token_ids, params, [c.request_id for c in children]
        )
        self._requests[request_id] = state
        try:
            for child in children:
                if data_parallel_rank is None:
                    self.engine_core.add_request(child)
                else:
                    self.engine_core.add_request(child, data_parallel_rank=data_parallel_rank)
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
                try:
                    outputs = await self.engine_core.get_output()
                except EngineCoreDiedError as e:
                    await self._restart_core(e)
                    continue
                self._process(outputs)
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:
            self._mark_dead(e)
        except Exception as e:  # a bug here would otherwise hang every client silently
            logger.exception("output handler failed")
            self._mark_dead(EngineDeadError(f"output handler failed: {e}"))

    def _process(self, outputs: EngineCoreOutputs) -> None:
        if outputs.stats is not None:
            self._core_unhealthy = outputs.stats.unhealthy
            for stat_logger in self.stat_loggers:
                stat_logger.record_scheduler_stats(outputs.stats)
        for recovery in outputs.recoveries:
            self._record_recovery(recovery)
            if self._owns_request_records:
                self._apply_verdict(recovery)
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
                    self._record(lambda s: s.record_first_token(now - state.arrival))
                else:
                    gap = now - state.last_token
                    self._record(lambda s: s.record_inter_token(gap))
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
            queue, prefill = output.queue_seconds, output.prefill_seconds
            self._record(lambda s: s.record_queue_and_prefill(queue, prefill))

    def _record_finished(self, state: _RequestState, reason: str, num_tokens: int, now: float | None = None) -> None:
        now = now or time.monotonic()
        e2e = now - state.arrival
        decode = now - state.first_token if state.first_token is not None else 0.0
        inference = decode + (state.prefill_seconds or 0.0)
        self._record(lambda s: s.record_finished(reason, e2e, state.num_prompt_tokens, num_tokens, decode, inference))

    def _record(self, call) -> None:
        for stat_logger in self.stat_loggers:
            try:
                call(stat_logger)
            except Exception:  # metrics must never take serving down
                logger.exception("stat logger failed")

    def _record_recovery(self, recovery: RecoveryStats) -> None:
        self._record(lambda s: s.record_recovery(recovery.kind, recovery.seconds, recovery.num_requests))

    def _mark_dead(self, error: EngineDeadError) -> None:
        logger.error("engine is dead: %s", error)
        self.dead_error = error
        for state in self._requests.values():
            state.queue.put_nowait(error)
        self._requests.clear()
        for future in self._pings.values():
            if not future.done():
                future.set_exception(error)
        self._pings.clear()
        self._dead.set()

    # ---- engine-core restarts -------------------------------------------------

    async def _restart_core(self, died: EngineCoreDiedError) -> None:
        """Replace a core process that vanished and resubmit every unfinished
        request to the new one; EngineDeadError once the budget is spent."""
        noticed = time.monotonic()
        self.recovering, self._recovering_since = True, noticed
        self._answer_pings()
        try:
            culprits, blamed = self._charge_core_death(self.engine_core.running_alone(), str(died))
            if culprits:
                self._process(EngineCoreOutputs(outputs=culprits))
            new_core = await self._start_new_core(died)
            if blamed:  # the culprit's core deaths, this one included: not the core's fault
                self.blame.forgive(blamed)
            # Until now requests went to the old client, which keeps them
            # unsent; the resubmission covers them. Its process is gone, so
            # closing its sockets and folder is quick.
            old_core, self.engine_core = self.engine_core, new_core
            old_core.shutdown()
            num_requests = self._resubmit()
        finally:
            self.recovering, self._recovering_since = False, None
        seconds = time.monotonic() - noticed
        logger.warning("engine core restarted in %.1fs; resubmitted %d requests", seconds, num_requests)
        self._record_recovery(RecoveryStats("engine_core", seconds, num_requests))

    async def _start_new_core(self, died: EngineCoreDiedError) -> MPClient:
        """A ready MPClient, built off the event loop (loading the model takes
        a while and streams must stay open); a core that fails to start costs
        another restart from the budget."""
        budget = self.restart_budget
        failure: BaseException = died
        # Quarantined requests are being run alone: the deaths are presumably theirs.
        hunting = budget.max_restarts > 0 and any(r.quarantined for r in self._unfinished_children().values())
        while True:
            if not budget.allow() and not (hunting and self.blame.excuse()):
                raise EngineDeadError(
                    f"{failure}; no restart left ({budget.max_restarts} allowed within "
                    f"{budget.window_s:g}s)") from failure
            if failure is died:
                logger.warning("engine core process died (exit code %s); restarting it (%s)",
                               died.exitcode, budget.describe())
            else:
                logger.warning("new engine core failed to start (%s); retrying (%s)", failure, budget.describe())
            await asyncio.sleep(0.0 if hunting else budget.backoff_s())
            try:
                return await asyncio.get_running_loop().run_in_executor(None, self._start_core_process)
            except Exception as e:
                failure = e

    def _start_core_process(self) -> MPClient:
        client = self._new_mp_client()
        if self._shut_down:
            # Shut down while this one was loading: nobody will use it.
            client.shutdown()
            raise EngineDeadError("the engine was shut down")
        return client

    def _resubmit(self) -> int:
        """Send every unfinished engine-core request to the (new) core as a
        continuation after the tokens its client already has; how many."""
        count = 0
        for request_id, state in self._requests.items():
            for child_id, token_ids in self.output_processor.resume_points(request_id):
                first = state.children[child_id]
                self.engine_core.add_request(Request(
                    child_id, first.prompt_token_ids, first.sampling_params, first.eos_token_id,
                    first.arrival_time, output_token_ids=token_ids, num_recoveries=first.num_recoveries,
                    quarantined=first.quarantined, cache_salt=first.cache_salt))
                count += 1
        return count

    # ---- poison quarantine (raylm.core.quarantine) ------------------------------

    def _unfinished_children(self) -> dict[str, Request]:
        """Every engine-core request in flight, by id, as first sent: the
        records that travel with a request to the next core."""
        children = {}
        for request_id, state in self._requests.items():
            for child_id, _ in self.output_processor.resume_points(request_id):
                children[child_id] = state.children[child_id]
        return children

    def _apply_verdict(self, recovery: RecoveryStats) -> None:
        """Mirror what the core decided in a recovery of its own, so the
        records a restarted core gets are the same."""
        quarantine.mirror(self._unfinished_children(), recovery.charged, recovery.culprits)

    def _charge_core_death(self, running_alone: str | None, cause: str) -> tuple[list[EngineCoreOutput], int]:
        """The core died: charge the requests exposed to it (see
        quarantine.charge_death). Returns the culprit's error output and the
        core deaths it caused (none if this death names no culprit)."""
        verdict = quarantine.charge_death(self._unfinished_children(), running_alone)
        if not verdict.found_culprit:
            return [], 0
        culprit = verdict.culprits[0]
        logger.error("request %s was present at %d engine-core failures and killed the core again running alone: "
                     "failed, not retried", culprit, verdict.culprit_recoveries + 1)
        return [quarantine.culprit_output(verdict, cause)], verdict.culprit_recoveries + 1

    def _answer_pings(self) -> None:
        """Pings to the dead core will never be answered; the server itself is
        fine (requests wait for the new core), so health checks pass."""
        for future in self._pings.values():
            if not future.done():
                future.set_result(True)
        self._pings.clear()

    # ---- health and shutdown ---------------------------------------------------

    def recovery_status(self) -> dict | None:
        """The recovery in progress, if any: what recovers ("engine_core": this
        front end is starting a new core; "executor": the core is rebuilding
        its executor in place, as it announced before it began), for how many
        seconds, and the limit past which /health fails."""
        since, what = self._recovering_since, "engine_core"
        if since is None:
            # MPClient knows from the core's announcement; other clients do not say.
            since, what = getattr(self.engine_core, "rebuilding_since", None), "executor"
        if since is None:
            return None
        return {"recovering": what, "seconds": time.monotonic() - since,
                "limit_s": self.config.fault_tolerance.engine_start_timeout_s}

    async def check_health(self, timeout: float = 10.0) -> None:
        """Returns when the core answers a ping, or at once while the engine
        recovers (a core that died is being replaced, or the core rebuilds its
        executor) for no longer than the start timeout; EngineDeadError once
        the engine is dead, EngineRecoveryTimeoutError past that limit."""
        self._check_alive()
        self._ensure_output_handler()
        replicas_blame = getattr(self.engine_core, "blame", None)  # data parallel: replica restarts
        unhealthy = (self.blame.unhealthy_reason or self._core_unhealthy
                     or (replicas_blame.unhealthy_reason if replicas_blame is not None else None))
        if unhealthy is not None:
            raise EngineUnhealthyError(f"engine unhealthy: {unhealthy}")
        recovery = self.recovery_status()
        if recovery is not None:
            # A recovery is not answered by pings (a core loading, or one busy
            # rebuilding); past the time a start may take, it is stuck.
            if recovery["seconds"] > recovery["limit_s"]:
                raise EngineRecoveryTimeoutError(recovery["recovering"], recovery["seconds"], recovery["limit_s"])
            return
        if self.recovering or not self.engine_core.is_alive():
            # The output handler restarts a core that died (or marks the engine
            # dead, which the next check reports); meanwhile requests just wait.
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
        """Idempotent: stops the output task and the engine-core process."""
        self._shut_down = True
        if self._output_task is not None:
            self._output_task.cancel()
            self._output_task = None
        if self.dead_error is None:
            self.dead_error = EngineDeadError("the engine was shut down")
        for state in self._requests.values():
            state.queue.put_nowait(self.dead_error)
        self._requests.clear()
        self.engine_core.shutdown()
