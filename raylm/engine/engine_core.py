"""EngineCore: the scheduler and the executor, stepping together, and the
recovery from executor failures.

It sizes the KV cache once (the smallest rank decides, so every rank holds the
same block ids), then each `step` schedules, runs the forward and sampling on
the executor, and turns the sampled tokens into per-request outputs.

With pipeline parallelism the executor can hold `max_concurrent_batches`
(= PP size) steps in flight; the core keeps a queue of them so stage 0 starts
batch N+1 while later stages still work on batch N. Requests of an in-flight
batch have no tokens left to schedule (see Scheduler), so consecutive batches
hold disjoint requests.

When the executor fails (a worker died, hung past its deadline, or raised in a
step) the core rebuilds it in place and every request carries on: see
`_recover` and docs/architecture.md, "The failure model".
"""

from __future__ import annotations

import gc
import logging
import time
import traceback
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from raylm.config import EngineConfig
from raylm.core.decode_burst import BurstPlanner
from raylm.core.kv_cache_manager import KVEventRecorder
from raylm.core.outputs import EngineCoreOutput
from raylm.core.prefill_pace import PrefillPace
from raylm.core.scheduler import Scheduler
from raylm.core.spec_decode import make_speculator
from raylm.core.structured_output import StructuredOutputManager
from raylm.engine.core_migration import MigrationEndpoint
from raylm.engine.core_pull import PullEndpoint
from raylm.engine.core_tier import CoreHostTier
from raylm.engine.errors import EngineDeadError
from raylm.engine.protocol import EngineCoreRequest, KVCacheEvents, MigrationReport, PullReport, RecoveryKind
from raylm.engine.restart_budget import BlameLedger, RestartBudget
from raylm.executor.abstract import Executor
from raylm.executor.errors import ExecutorFailedError, WorkerDiedError, WorkerHungError
from raylm.executor.factory import executor_class
from raylm.messages import KVCacheConfig, SchedulerOutput

logger = logging.getLogger(__name__)

# After a step raised, how long to wait for the executor's liveness verdict:
# a killed rank's peers raise (connection reset) a moment before its death is
# seen, and the death, not their error, is the cause.
_DEATH_VERDICT_GRACE_S = 2.0


@dataclass
class RecoveryEvent:
    """One recovery, for logs and metrics: what failed and what it cost."""

    kind: RecoveryKind
    cause: str
    noticed_at: float  # time.monotonic() when the failure was noticed
    seconds: float  # failure noticed -> executor rebuilt and requests re-queued
    num_requests: int  # requests put back in the queue to continue
    # Poison quarantine (raylm.core.quarantine): the requests charged with this
    # failure, and the one failed for it, if it was found.
    charged: list[str] = field(default_factory=list)
    culprits: list[str] = field(default_factory=list)


class _StepFailed(Exception):
    """An executor call of a step raised `error`; `batch` is the step's output
    of the scheduler (None when it failed outside a step)."""

    def __init__(self, error: BaseException, batch: SchedulerOutput | None):
        super().__init__(str(error))
        self.error = error
        self.batch = batch


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        ft = config.fault_tolerance
        self.restart_budget = RestartBudget(ft.max_restarts, ft.restart_window_s)
        self.recoveries: list[RecoveryEvent] = []
        self.failures_by_kind: dict[RecoveryKind, int] = {}
        self.num_recovered_requests = 0
        # Rebuilds that failed requests caused are forgiven, up to a rate.
        self.blame = BlameLedger(self.restart_budget, ft.max_blamed_recoveries, ft.restart_window_s)
        # Told the id of the quarantined request about to run alone (None when
        # none is): a front end records it where a crash of this process
        # cannot erase it, to know whom a core death is to be blamed on.
        self.on_running_alone = None
        self._announced_alone: str | None = None
        # Called before each attempt to rebuild the executor: a core process
        # tells its front end, which otherwise sees only silence.
        self.on_rebuilding = None
        self.batch_queue: deque[tuple[SchedulerOutput, Future]] = deque()
        # Set once the restart budget is spent: every later step raises it.
        self.dead_error: EngineDeadError | None = None
        self.executor = self._make_executor()
        self._last_health_check = time.monotonic()
        # Live migration of requests to and from other cores; reports of
        # migrations that a recovery ended, for the next message out.
        self.migrations = MigrationEndpoint(self)
        self.pulls = PullEndpoint(self)
        self.migration_reports: list[MigrationReport] = []
        try:
            self._initialize_kv_cache()
            mc = config.model_config
            grammars = StructuredOutputManager(mc.tokenizer, mc.vocab_size)
            self.scheduler = Scheduler(
                config.scheduler_config,
                config.cache_config,
                mc.max_model_len,
                grammars,
                BurstPlanner.for_engine(config),
                make_speculator(config),
                None if config.lora_config is None else config.lora_config.max_loras,
            )
            self.host_tier = CoreHostTier(self)  # evicted blocks kept in shared memory (--kv-offloading-size)
            self.host_tier.open()
            self.prefill_pace = PrefillPace()  # for the supervisor's choice between a pull and a recompute
        except BaseException:
            self.executor.shutdown()
            raise

    def _make_executor(self) -> Executor:
        executor = executor_class(self.config)(self.config)
        # PP keeps one batch per stage in flight; async scheduling keeps two
        # (the next step is scheduled while the current one computes).
        self.batch_queue_size = executor.max_concurrent_batches
        if self.config.scheduler_config.async_scheduling:
            self.batch_queue_size = max(self.batch_queue_size, 2)
        return executor

    def _initialize_kv_cache(self) -> None:
        cc = self.config.cache_config
        available = min(self.executor.determine_available_memory())
        per_block = max(self.executor.get_kv_cache_bytes_per_block())
        # A context-parallel group holds cp ranks' caches, each sequence's
        # blocks spread over them: the scheduler counts the group's blocks.
        cp = self.config.parallel_config.context_parallel_size
        num_blocks = cp * (available // per_block) if per_block else 0
        # One sequence of max_model_len must fit, or nothing long could ever run.
        min_blocks = -(-self.config.model_config.max_model_len // cc.block_size)
        if num_blocks < min_blocks:
            raise ValueError(
                f"KV cache budget of {available} bytes per rank holds {num_blocks} blocks of {cc.block_size} "
                f"tokens{f' across the {cp} ranks of a context-parallel group' if cp > 1 else ''}, fewer than the "
                f"{min_blocks} one sequence of max_model_len ({self.config.model_config.max_model_len}) needs; "
                "raise kv_cache_memory_bytes or context_parallel_size, or lower max_model_len"
            )
        cc.num_blocks = int(num_blocks)
        self.executor.initialize_from_config(KVCacheConfig(num_blocks=cc.num_blocks, block_size=cc.block_size))
        self.worker_threads = max(self.executor.collective_rpc("torch_threads"))  # (each new executor's)
        logger.info(
            "KV cache: %d blocks x %d tokens (per rank: %d blocks, %d tokens, %.1f MiB)",
            cc.num_blocks,
            cc.block_size,
            cc.num_blocks // cp,
            cc.num_blocks // cp * cc.block_size,
            cc.num_blocks // cp * per_block / 2**20,
        )

    def record_kv_events(self) -> None:
        """From now on, keep what changes in the prefix cache for
        `take_kv_events` (a data-parallel core's supervisor routes by it;
        nobody takes them from a core in the user's process)."""
        kv = self.scheduler.kv_cache_manager
        kv.pool.events = KVEventRecorder()
        if kv.tier is not None:  # its tier's changes too (it was opened before)
            kv.tier.events = kv.pool.events

    def take_kv_events(self) -> KVCacheEvents | None:
        events = self.scheduler.kv_cache_manager.pool.events
        taken = events.take() if events is not None else None
        if taken is None:
            return None
        cleared, stored, removed, offloaded, unoffloaded = taken
        return KVCacheEvents(
            cleared=cleared,
            stored=stored,
            removed=removed,
            offloaded=offloaded,
            unoffloaded=unoffloaded,
            tier_prefix=self.host_tier.prefix,
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        """The request, as the front end built and checked it: the scheduler's
        Request is made here, once."""
        self.scheduler.add_request(request.to_request())

    def abort_requests(self, request_ids) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def take_migration_reports(self, message=None) -> list[MigrationReport]:
        """Handle a migration message (if given), and return every report due:
        its own, final exports whose request's steps are done, and those of
        migrations a recovery ended."""
        reports, self.migration_reports = self.migration_reports, []
        if message is not None:
            report = self.migrations.handle(message)
            if report is not None:
                reports.append(report)
        return reports + self.migrations.poll()

    def handle_pull(self, message) -> list[PullReport]:
        """Apply one prefix pull message (raylm.engine.core_pull); its report, if any."""
        report = self.pulls.handle(message)
        return [] if report is None else [report]

    # ---- one step ------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """One step; on an executor failure, recovery instead (the requests of
        the lost steps are re-queued and continue in later steps)."""
        if self.dead_error is not None:
            raise self.dead_error
        try:
            if self.batch_queue_size > 1:
                return self._step_with_batch_queue()
            return self._step_one_batch()
        except _StepFailed as failed:
            error, batch = failed.error, failed.batch
        # Recovered outside the except block, so that the frames of the failed
        # step (see _release_failure) are not kept alive by it.
        return self._recover(error, batch)

    def _step_one_batch(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self._schedule()
        if scheduler_output.is_empty:
            return self.scheduler.take_outputs_outside_step()
        started = time.perf_counter()
        try:
            self.host_tier.flush()
            forward = self.executor.execute_model(scheduler_output, non_block=True)
            # Structured outputs: the bitmask is computed while the forward runs.
            grammar_output = self.scheduler.get_grammar_output(scheduler_output)
            try:
                runner_output = self.executor.sample_tokens(grammar_output)
            except Exception:
                forward.result()  # the forward's own error, if it failed, is the cause
                raise
        except Exception as e:
            raise _StepFailed(e, scheduler_output) from e
        elapsed = time.perf_counter() - started
        self.prefill_pace.observe(scheduler_output.total_num_scheduled_tokens, elapsed)
        if self.scheduler.burst_planner is not None:
            self.scheduler.burst_planner.observe(scheduler_output, elapsed)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Launch a new batch if there is room and work; otherwise (or when the
        queue is full) wait for the oldest batch and apply its output.

        Structured outputs with async scheduling: a batch whose bitmask needs
        a token an earlier batch is still sampling runs its forward now and
        samples once that batch's output is in (queued with no future until
        then); nothing is launched behind it meanwhile, since the workers take
        each step's calls in order."""
        waiting_to_sample = bool(self.batch_queue) and self.batch_queue[-1][1] is None
        if (
            len(self.batch_queue) < self.batch_queue_size
            and not waiting_to_sample
            and self.scheduler.has_unfinished_requests()
        ):
            scheduler_output = self._schedule()
            if scheduler_output.is_empty:
                outputs = self.scheduler.take_outputs_outside_step()
                if outputs:
                    return outputs
            else:
                future = None
                try:
                    self.host_tier.flush()
                    self.executor.execute_model(scheduler_output, non_block=True)
                    if not self.scheduler.needs_tokens_in_flight(scheduler_output):
                        future = self._sample(scheduler_output)
                except Exception as e:
                    raise _StepFailed(e, scheduler_output) from e
                self.batch_queue.append((scheduler_output, future))
                if future is not None and len(self.batch_queue) < self.batch_queue_size:
                    return []
        if not self.batch_queue:
            return []
        scheduler_output, future = self.batch_queue.popleft()
        try:
            runner_output = (future or self._sample(scheduler_output)).result()
        except Exception as e:
            raise _StepFailed(e, scheduler_output) from e
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.batch_queue and self.batch_queue[-1][1] is None:
            deferred, _ = self.batch_queue[-1]
            if not self.scheduler.needs_tokens_in_flight(deferred):
                try:
                    self.batch_queue[-1] = (deferred, self._sample(deferred))
                except Exception as e:
                    raise _StepFailed(e, deferred) from e
        return outputs

    def _schedule(self) -> SchedulerOutput:
        """schedule(), telling `on_running_alone` when the request that a
        step runs alone changes (an empty step changes nothing: the steps in
        flight still run what they ran)."""
        scheduler_output = self.scheduler.schedule()
        alone = self.scheduler.running_alone
        if not scheduler_output.is_empty and alone != self._announced_alone:
            if self.on_running_alone is not None:
                self.on_running_alone(alone)
            self._announced_alone = alone
        return scheduler_output

    def _sample(self, scheduler_output: SchedulerOutput) -> Future:
        grammar_output = self.scheduler.get_grammar_output(scheduler_output)
        return self.executor.sample_tokens(grammar_output, non_block=True)

    def has_work_in_flight(self) -> bool:
        return bool(self.batch_queue)

    # ---- health and recovery ------------------------------------------------------------

    def check_health_if_due(self) -> None:
        """Called by an idle core loop: every `health_check_interval_s`, make
        every worker answer; a dead or hung one is replaced before the next
        request needs it."""
        now = time.monotonic()
        if now - self._last_health_check < self.config.fault_tolerance.health_check_interval_s:
            return
        self._last_health_check = now
        if self.batch_queue or self.dead_error is not None:
            return  # steps in flight have their own deadline
        try:
            self.executor.check_health()
        except Exception as e:
            error = e
        else:
            return
        self._recover(error, None)

    def _recover(self, error: BaseException, batch: SchedulerOutput | None) -> list[EngineCoreOutput]:
        """Rebuild the executor and put every request back in the queue: the
        requests recompute their KV cache from their prompt and the tokens
        they generated and continue (greedy output is unchanged).

        Whatever the kind of failure, the requests of the failed step and of
        every other step in flight are charged with it (raylm.core.quarantine):
        repeat offenders run alone, and one that fails alone again is failed.
        Its recoveries are then forgiven by the restart budget, up to a rate.
        EngineDeadError once the restart budget is spent."""
        noticed = time.monotonic()
        kind, cause = self._diagnose(error)
        _release_failure(error)
        del error
        self.failures_by_kind[kind] = self.failures_by_kind.get(kind, 0) + 1
        exposed = self._requests_in_flight(batch)
        verdict, outputs = self.scheduler.charge_recovery(exposed, cause.splitlines()[0] if cause else kind)
        # A culprit's earlier recoveries, and this one once it is done, were its
        # doing, not the executor's.
        forgive = verdict.found_culprit and self.blame.forgive(verdict.culprit_recoveries)
        self._rebuild_executor(kind, cause)
        if forgive:
            self.blame.forgive(1)
        num_requeued = self.scheduler.reset_after_executor_loss(self.config.cache_config.num_blocks)
        self.host_tier.open(at_start=False)
        self.migration_reports.extend(self.migrations.on_executor_lost())
        event = RecoveryEvent(
            kind, cause, noticed, time.monotonic() - noticed, num_requeued, verdict.charged, verdict.culprits
        )
        self.recoveries.append(event)
        self.num_recovered_requests += num_requeued
        logger.warning(
            "recovered from %s in %.2f s: %d request(s) continue on the new executor, %d charged, %d failed as "
            "the cause (%s)",
            kind,
            event.seconds,
            num_requeued,
            len(verdict.charged),
            len(verdict.culprits),
            self.restart_budget.describe(),
        )
        return outputs

    def _requests_in_flight(self, failed_batch: SchedulerOutput | None) -> list[str]:
        """The requests exposed to a failure: those of the failed step and of
        every step still in flight (none for a failure found while idle)."""
        request_ids: list[str] = []
        for batch, _ in self.batch_queue:
            request_ids.extend(batch.num_scheduled_tokens)
        if failed_batch is not None:
            request_ids.extend(failed_batch.num_scheduled_tokens)
        return request_ids

    def _diagnose(self, error: BaseException) -> tuple[RecoveryKind, str]:
        """(kind, cause) of a failure. A step error is a death if the executor
        reports one within a short grace, whatever the surviving ranks raised
        (no grace where the workers cannot die apart from this process)."""
        if isinstance(error, WorkerHungError):
            return RecoveryKind.WORKER_HUNG, str(error)
        if isinstance(error, WorkerDiedError):
            return RecoveryKind.WORKER_DIED, str(error)
        deadline = time.monotonic() + (_DEATH_VERDICT_GRACE_S if self.executor.workers_die_apart else 0.0)
        while True:
            try:
                self.executor.check_liveness()
            except WorkerDiedError as died:
                return RecoveryKind.WORKER_DIED, str(died)
            except Exception:  # a step error already on record: not a death (yet)
                pass
            if time.monotonic() >= deadline:
                described = str(error) if isinstance(error, ExecutorFailedError) else f"{type(error).__name__}: {error}"
                return RecoveryKind.STEP_ERROR, described
            time.sleep(0.05)

    def _rebuild_executor(self, kind: RecoveryKind, cause: str) -> None:
        """Tear the executor down completely (actors, placement group,
        processes, shared memory) and build a new one through the same
        factory (Ray may place it on other nodes); retried within the budget."""
        while True:
            logger.error("executor failed (%s): %s", kind, cause)
            # Quarantined requests run alone: the failures are presumably theirs
            # (unless recovery is off: max_restarts=0).
            hunting = bool(self.scheduler.quarantined) and self.restart_budget.max_restarts > 0
            if not self.restart_budget.allow() and not (hunting and self.blame.excuse()):
                self._shutdown_executor()  # nothing of it may outlive the engine
                ft = self.config.fault_tolerance
                self.dead_error = EngineDeadError(
                    f"the executor failed more than {ft.max_restarts} time(s) within {ft.restart_window_s:g} s "
                    f"(max_restarts); last failure ({kind}): {cause.splitlines()[0] if cause else ''}"
                )
                raise self.dead_error
            if self.on_rebuilding is not None:
                self.on_rebuilding()
            self._shutdown_executor()
            _free_released_memory()
            delay = 0.0 if hunting else self.restart_budget.backoff_s()
            if delay > 0:
                time.sleep(delay)
            try:
                self.executor = self._make_executor()
                self._initialize_kv_cache()
                return
            except Exception as e:
                kind = RecoveryKind.REBUILD_FAILED
                cause = f"rebuilding the executor failed: {type(e).__name__}: {e}"
                self.failures_by_kind[kind] = self.failures_by_kind.get(kind, 0) + 1

    def _shutdown_executor(self) -> None:
        self.batch_queue.clear()
        self.executor.is_failed = True  # no grace for its workers: see the executors' shutdown
        try:
            self.executor.shutdown()
        except Exception:  # it is broken already; what it holds is released by its finalizers
            logger.exception("shutting down the failed executor")

    @property
    def unhealthy_reason(self) -> str | None:
        return self.blame.unhealthy_reason

    def stats(self) -> dict:
        return {**self.scheduler.stats(), "prefill_seconds_per_token": self.prefill_pace.seconds_per_token}

    def shutdown(self) -> None:
        if self.scheduler.structured_output_manager is not None:
            self.scheduler.structured_output_manager.shutdown()
        self.executor.shutdown()
        self.host_tier.close()


def _release_failure(error: BaseException) -> None:
    """Drop what a failure's tracebacks hold: the frames of the failed step
    reference the old executor, its model and its tensors (with the uni
    backend, in this process). Recovery keeps only the failure's text; the
    old model must be gone before the new one is loaded (on one GPU both
    would not fit)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if error.__traceback__ is not None:
            traceback.clear_frames(error.__traceback__)
            error.__traceback__ = None
        error = error.__cause__ or error.__context__


def _free_released_memory() -> None:
    """After the failed executor is shut down: collect what it left in
    reference cycles, and give its cached device memory back, before the new
    executor measures what it may use."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
