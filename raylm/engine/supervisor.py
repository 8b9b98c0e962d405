"""EngineCoreSupervisor: the front ends' one client of their engine cores
(docs/architecture.md, "Data parallel and the supervisor"), whatever runs
them: a local core process, N of them, or N data-parallel replicas on Ray (a
`CoreLauncher`).

It is composed of parts, each owning its state and given, when it is made,
the parts it talks to (none reads another's attributes):
- the ledger (ledger.py): every request in flight in a core, as first sent
  (prompt, sampling params, failure record) with the tokens that came back,
  and the cores that serve, each with the requests it holds;
- the router (routing.py): sends each request, new or sent again, to a core
  its policy chooses (kv_aware by the prefix index, load, or vllm);
- the prefix index (prefix_index.py): what each core's prefix cache holds,
  from the block events its messages carry;
- recovery (core_recovery.py): when a core dies, hangs or gives up, its
  unfinished requests go to the other cores, or wait for its replacement,
  as continuations (prompt plus the tokens so far: the client sees a pause,
  not an error); the replacement starts within one restart budget with
  backoff, and the recovery is reported with its measured seconds; poison
  quarantine across core deaths (raylm.core.quarantine) charges the
  requests a death exposed and fails the culprit alone;
- migrations (migration.py): live migration of a running request with its
  KV cache between cores, and rebalancing;
- the K/V routes (kv_routes.py): which way K/V goes between two cores
  (files on this node, the sealed network across nodes), shared by
  migrations and prefix pulls, and which cores cannot move it;
- scaling (scaling.py): new cores warmed before they get traffic, drained
  ones removed, replica restarts;
- hand-offs (handoff.py): with prefill/decode roles, new requests go to
  prefill replicas and move to a decode one after their first token.

The supervisor itself reads the cores' messages and hands each part its
share (what it makes of them beyond that: attributing outputs, summing
stats, matching pongs to pings, is core_messages.py), runs housekeeping
between reads, and keeps the one rule that spans the parts: a core leaves
only through `_remove_channel`.

DP=1 and DP=N are the same code: one core is N=1. `AsyncEngineCoreSupervisor`
(AsyncLLM) and `SyncEngineCoreSupervisor` (LLMEngine with data parallelism)
differ only in how `get_output` waits.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref

import msgspec
import zmq
import zmq.asyncio

from raylm.config import EngineConfig
from raylm.core import quarantine
from raylm.engine.core_channel import CoreChannel, CoreLauncher, DropLog
from raylm.engine.core_messages import Pings, aggregate_stats, drop_foreign_outputs
from raylm.engine.core_recovery import BackgroundThreads, Recovery
from raylm.engine.errors import EngineDeadError
from raylm.engine.handoff import Handoffs
from raylm.engine.kv_routes import KVRoutes
from raylm.engine.launchers import make_launcher, shutdown_cores
from raylm.engine.ledger import Ledger, LedgerEntry
from raylm.engine.migration import Migrations
from raylm.engine.prefix_index import PrefixIndex
from raylm.engine.prefix_pull import Pulls
from raylm.engine.protocol import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    MigrationStats,
    Ping,
    SchedulerStats,
)
from raylm.engine.restart_budget import BlameLedger, RestartBudget
from raylm.engine.routing import Router, routing_policy
from raylm.engine.scaling import ReplicaRestarts, ScaleUp, Scaling
from raylm.engine.tier_loads import TierLoads

__all__ = [
    "AsyncEngineCoreSupervisor",
    "EngineCoreSupervisor",
    "LedgerEntry",
    "ScaleUp",
    "SyncEngineCoreSupervisor",
    "make_launcher",
]

logger = logging.getLogger(__name__)

_POLL_MS = 100
_PULL_WAIT_POLL_MS = 25
_RESTART_POLL_S = 0.05


class EngineCoreSupervisor:
    asyncio_mode = False

    def __init__(
        self, config: EngineConfig, launcher: CoreLauncher | None = None, background: BackgroundThreads | None = None
    ):
        """`background` runs the starts and stops that may block (by default
        in threads; the chaos harness runs them at points of its schedule)."""
        self.config = config
        self.pings = Pings()
        self.dead_error: EngineDeadError | None = None
        self._closed = threading.Event()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.undecodable = DropLog("a core message that does not decode", logger)
        self.foreign = DropLog("outputs for requests not routed to the core that sent them", logger)
        self._ctx = zmq.Context()
        self.launcher = launcher if launcher is not None else make_launcher(config)
        self.background = background if background is not None else BackgroundThreads(self._closed)
        encode = self._encoder.encode
        self.ledger = Ledger()
        # What each core's prefix cache holds (its block events), which the
        # kv_aware policy routes by.
        self.prefix_index = PrefixIndex()
        parallel = config.parallel_config
        pulls_on = (
            parallel.prefix_pull and parallel.context_parallel_size == 1 and config.cache_config.enable_prefix_caching
        )
        policy = routing_policy(
            parallel.routing_policy, self.prefix_index, config.cache_config.block_size, pulls=pulls_on
        )
        self.router = Router(self.ledger, policy, encode)
        restarts = ReplicaRestarts()
        self.recovery = Recovery(
            config,
            self.ledger,
            self.router,
            self.launcher,
            self._ctx,
            self.background,
            self._closed,
            restarts,
            self._remove_channel,
        )
        # Which way K/V goes between two cores, for migrations and prefix pulls alike.
        self.kv_routes = KVRoutes(self.launcher)
        self.migrations = Migrations(config, self.ledger, self.router, self.kv_routes, encode)
        self.pulls = Pulls(
            self.ledger, self.prefix_index, config.cache_config.block_size, self.kv_routes, encode, enabled=pulls_on
        )
        self.router.pulls = self.pulls
        self.tier_loads = TierLoads.for_engine(config, self.prefix_index, self.launcher, self.kv_routes, encode)
        self.router.tier_loads = self.tier_loads
        self.handoffs = Handoffs(config, self.ledger, self.migrations, self.kv_routes, policy)
        self.router.candidates = self.handoffs.route_candidates
        # A core starts with its role's threads per worker, the role as it is then.
        self.launcher.role_of = self.handoffs.role_of
        self.scaling = Scaling(
            self.ledger,
            self.launcher,
            self._ctx,
            self.recovery,
            self.migrations,
            restarts,
            self.background,
            encode,
            self._remove_channel,
        )
        output = self.launcher.bind_output(self._ctx)
        self._output = zmq.asyncio.Socket.from_socket(output) if self.asyncio_mode else output
        self._finalizer = weakref.finalize(
            self, shutdown_cores, self.launcher, self.ledger.channels, self._output, self._ctx, self._closed
        )
        try:
            self.scaling.start_cores(list(range(config.parallel_config.data_parallel_size)))
        except BaseException:
            self._finalizer()
            raise

    # ---- what the parts hold, as the engine, the server and the tests read it -----------------

    @property
    def channels(self) -> dict[int, CoreChannel]:
        return self.ledger.channels

    @property
    def restart_budget(self) -> RestartBudget:
        return self.recovery.restart_budget

    @property
    def blame(self) -> BlameLedger:
        return self.recovery.blame

    @property
    def restarting(self) -> set[int]:
        return self.scaling.restarts.restarting

    @property
    def restart_failures(self) -> dict[int, str]:
        return self.scaling.restarts.failures

    @property
    def migration_counts(self) -> dict[str, int]:
        return self.migrations.migration_counts

    def take_migration_events(self) -> list[MigrationStats]:
        return self.migrations.take_migration_events()

    def migrate(self, request_id: str, destination: int | None = None, reason: str = "manual") -> bool:
        return self.migrations.migrate(request_id, destination, reason)

    def budget_waits(self) -> dict[int, float]:
        return self.recovery.budget_waits()

    def recovery_status(self) -> dict | None:
        return self.recovery.recovery_status()

    # ---- requests --------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest, data_parallel_rank: int | None = None) -> None:
        """Route `request` to a core (or keep it until one serves); ValueError
        for a request that cannot be encoded or a rank that does not serve."""
        try:
            frame = self._encoder.encode(request)
        except (OverflowError, msgspec.EncodeError) as e:
            raise ValueError(f"request cannot be encoded: {e}") from e
        self.router.add(request, frame, data_parallel_rank)

    def abort_requests(self, request_ids: list[str]) -> None:
        for index, ids in self.ledger.abort(request_ids).items():
            self.channels[index].send(self._encoder.encode(AbortRequests(ids)))
        for request_id in request_ids:
            self.migrations.request_gone(request_id)
            self.pulls.request_gone(request_id)
            self.handoffs.request_gone(request_id)

    def ping(self) -> int:
        """Every serving core is asked; the pong goes up once all answered."""
        nonce = self.pings.new(self.channels)
        for channel in self.channels.values():
            channel.send(self._encoder.encode(Ping(nonce)))
        return nonce

    def is_alive(self) -> bool:
        return self.dead_error is None

    # ---- scaling ---------------------------------------------------------------------

    def begin_scale(self, data_parallel_size: int) -> ScaleUp | None:
        """Plan a scale (ValueError if it cannot be): a scale-down drains its
        cores now; a scale-up's new cores are returned to start
        (`start_scaled`, blocking, from any thread) and then adopt
        (`end_scale`, on the reading thread)."""
        return self.scaling.begin(data_parallel_size)

    def start_scaled(self, scale_up: ScaleUp) -> None:
        """Blocking, and touches no socket: the new cores load (in parallel)."""
        self.scaling.start(scale_up)

    def end_scale(self, scale_up: ScaleUp, started: bool) -> None:
        """The new cores take traffic (`started`), or are given up."""
        self.scaling.end(scale_up, started)

    def scale(self, data_parallel_size: int) -> None:
        """Scale up (new cores placed and warmed before they get traffic) or
        down (the highest cores get no new requests and leave once theirs
        finish). A scale-up that cannot be placed raises and changes nothing."""
        scale_up = self.begin_scale(data_parallel_size)
        if scale_up is None:
            return
        started = False
        try:
            self.start_scaled(scale_up)
            started = True
        finally:
            self.end_scale(scale_up, started)

    def set_prefill_replicas(self, prefill_replicas: int) -> None:
        """P/D: the first `prefill_replicas` replicas prefill from now on
        (role_autoscaler: a pool scaled); ValueError unless a decode replica
        is left. A replica turned to prefill hands its requests off, one
        turned to decode keeps what it holds."""
        replicas = len(self.replica_states())
        if not self.handoffs.enabled or not 1 <= prefill_replicas < replicas:
            raise ValueError(
                f"prefill_replicas must be from 1 to {replicas - 1} with P/D roles, got {prefill_replicas}"
            )
        self.handoffs.prefill_replicas = prefill_replicas

    def begin_restart(self, index: int) -> int:
        """Drain replica `index` by migration; it is started again once empty.
        Returns how many requests began to move. ValueError if it does not
        serve, or no other replica could take its requests."""
        return self.scaling.begin_restart(index)

    def replica_states(self) -> list[dict]:
        """For /health and logs: each core's node, load, state (see Scaling.replica_states) and role."""
        states = self.scaling.replica_states()
        for state in states:
            state["role"] = self.handoffs.role_of(state["replica"])
            state["pd_handoffs_queued"] = self.handoffs.queued_on(state["replica"])
            state["pd_held"] = self.handoffs.num_held if state["role"] == "prefill" else 0
        return states

    # ---- cores leaving ----------------------------------------------------------------

    def _remove_channel(self, index: int, why: str) -> CoreChannel | None:
        """Core `index`'s channel, out of the ledger (None if it was gone
        already): every way a core leaves (it died, or drained for a
        scale-in or a restart) comes through here, so none leaves a ping
        waiting for an answer that is no longer read, none is still routed
        to by its prefix cache, and none leaves a transfer naming it: removing a replica's channel ends every transfer
        that names it (a migration today), on both sides. The migrations end
        before the core's requests are resubmitted: a paused copy of a
        request handed over to it is dropped at its source before the request
        may go there."""
        channel = self.ledger.remove(index)
        if channel is not None:
            self.tier_loads.on_channel_removed(index)
            self.prefix_index.drop_core(index)
            self.pings.forget_core(index)
            self.kv_routes.on_channel_removed(channel)
            self.migrations.on_channel_removed(channel, why)
            self.pulls.on_channel_removed(channel)
        return channel

    # ---- failures ------------------------------------------------------------------

    def _housekeeping(self) -> None:
        """Between reads: adopt new cores, heal dead ones, resend, kill hung
        ones, retire drained ones; EngineDeadError once none is left."""
        # Cores that started first: one that died before it was adopted is
        # then found dead as the core serving its index (its death, handled
        # before it was adopted, would be lost, and its requests stall until
        # the step deadline).
        self.recovery.adopt_started()
        self.scaling.take_stopped()
        for index, cause in self.launcher.deaths():
            self.recovery.on_death(index, cause)
        self.handoffs.retry_queued()
        self.router.send_waiting()
        self.pulls.holders_lost(self.launcher.dying())
        self.pulls.expire()
        for channel in self.channels.values():
            channel.flush()
        self.recovery.kill_hung_cores()
        self.migrations.retry_draining(self.scaling.drain_reason)
        self.migrations.rebalance_if_due()
        self.scaling.retire_drained()
        self.recovery.restart_when_budget_allows()
        # A replica restarting is started again once its old core has stopped.
        coming = self.recovery.starting or self.scaling.restart_coming()
        if not self.channels and not coming and self.dead_error is None:
            budget = self.restart_budget
            self.dead_error = EngineDeadError(
                f"{self.recovery.last_failure}; no restart left ({budget.max_restarts} "
                f"allowed within {budget.window_s:g}s)"
            )
        if self.dead_error is not None:
            raise self.dead_error

    # ---- reading ----------------------------------------------------------------------

    def _receive(self, frame: zmq.Frame) -> EngineCoreOutputs | None:
        """Bookkeeping for one core message; what to pass up (None: nothing)."""
        try:
            outputs = self._decoder.decode(frame.buffer)
        except msgspec.DecodeError as e:
            self.undecodable.dropped(str(e))
            return None
        channel = self.launcher.sender(frame, outputs, self.channels)
        if channel is None:
            return None
        channel.heard(outputs)
        if outputs.kv_events is not None:
            self.prefix_index.apply(channel.index, outputs.kv_events)
            outputs.kv_events = None
        drop_foreign_outputs(self.ledger, channel, outputs, self.foreign)
        if outputs.error is not None:
            # That core gave up (its own recoveries failed): replace it.
            cause = outputs.error.strip().splitlines()[-1]
            logger.error("engine core %d failed: %s", channel.index, cause)
            self.launcher.stop(channel.index, wait_s=0)
            self.recovery.on_death(channel.index, f"engine core failed: {cause}")
            return None
        for recovery in outputs.recoveries:  # the core's own: mirror its verdicts
            quarantine.mirror(self.ledger.requests_on(channel), recovery.charged, recovery.culprits)
        if outputs.stats is not None:
            channel.stats = outputs.stats
            outputs.stats = self.aggregate_stats()
        for out in outputs.outputs:
            entry = self.ledger[out.request_id]
            entry.token_ids.extend(out.new_token_ids)
            if out.new_token_ids:
                entry.prefill_tokens = 0  # its prompt is computed: no more pending work there
                self.migrations.saw_tokens(out.request_id)
            if out.finished:
                self.ledger.finished(out.request_id, channel)
                self.migrations.request_gone(out.request_id)
        self.handoffs.on_outputs(channel, outputs.outputs)
        # After the outputs: a final export follows the source's last tokens.
        for report in outputs.migrations:
            self.migrations.on_report(channel, report)
        outputs.migrations = []
        for pull in outputs.pulls:
            self.pulls.on_report(channel, pull)
        outputs.pulls = []
        outputs.migrated = self.take_migration_events()
        outputs.pulled = self.pulls.take_events()
        outputs.handed_off = self.handoffs.take_events()
        if outputs.pong is not None:
            if not self.pings.answered(outputs.pong, channel.index):
                outputs.pong = None
        outputs.recoveries = outputs.recoveries + self.recovery.take_recoveries()
        return outputs

    def aggregate_stats(self) -> SchedulerStats:
        return aggregate_stats(self.channels)

    def _poll_ms(self) -> int:
        """How long a read waits for output before housekeeping runs again:
        _POLL_MS, or _PULL_WAIT_POLL_MS while a pull waits for its holder's
        export (a holder's death, or the pull's deadline, then sends the
        request to compute its prompt within tens of ms), or less when that
        deadline comes sooner."""
        deadline = self.pulls.next_deadline()
        if deadline is None:
            return _POLL_MS
        return max(1, min(_PULL_WAIT_POLL_MS, int((deadline - time.monotonic()) * 1000) + 1))

    def _housekeeping_and_pending(self) -> EngineCoreOutputs | None:
        self._housekeeping()
        return self._pending()

    def _pending(self) -> EngineCoreOutputs | None:
        """What the supervisor itself has to pass up: its recoveries, culprits
        failed, pings answered for dead cores, migrations ended."""
        if (
            not self.recovery.has_reports()
            and not self.pings.has_pongs()
            and not self.migrations.has_events()
            and not self.pulls.has_events()
            and not self.handoffs.has_events()
        ):
            return None
        return EngineCoreOutputs(
            outputs=self.recovery.take_culprit_outputs(),
            recoveries=self.recovery.take_recoveries(),
            pong=self.pings.take_pong(),
            migrated=self.take_migration_events(),
            pulled=self.pulls.take_events(),
            handed_off=self.handoffs.take_events(),
        )

    def stats(self) -> dict:
        return msgspec.structs.asdict(self.aggregate_stats())

    def shutdown(self) -> None:
        """Idempotent: every core stopped, nothing of them left."""
        if self.dead_error is None:
            self.dead_error = EngineDeadError("the engine was shut down")
        self._finalizer()
        self.kv_routes.close()


class AsyncEngineCoreSupervisor(EngineCoreSupervisor):
    """For AsyncLLM: `get_output` awaits the output socket."""

    asyncio_mode = True

    async def restart_replica(self, index: int) -> None:
        """Returns once replica `index` serves again; RuntimeError if its new
        core failed to start (the replica is then being recovered) or it
        did not serve in time."""
        self.begin_restart(index)
        ft = self.config.fault_tolerance
        limit = ft.engine_start_timeout_s + ft.execute_model_timeout_s
        deadline = time.monotonic() + limit
        while index in self.restarting:
            if self.dead_error is not None:
                raise self.dead_error
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica {index} did not serve again within {limit:g} s")
            await asyncio.sleep(_RESTART_POLL_S)
        # Out of `restarting`: it serves, or its start failed (ReplicaRestarts.failed).
        failure = self.restart_failures.pop(index, None)
        if failure is not None:
            raise RuntimeError(f"{failure}; the replica is being recovered within the restart budget")

    async def scale_async(self, data_parallel_size: int) -> None:
        """`scale` without blocking the event loop while new cores load."""
        scale_up = self.begin_scale(data_parallel_size)
        if scale_up is None:
            return
        started = False
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.start_scaled, scale_up)
            started = True
        finally:
            self.end_scale(scale_up, started)

    async def get_output(self) -> EngineCoreOutputs:
        while True:
            pending = self._housekeeping_and_pending()
            if pending is not None:
                return pending
            if await self._output.poll(self._poll_ms()):
                outputs = self._receive(await self._output.recv(copy=False))
                if outputs is not None:
                    return outputs


class SyncEngineCoreSupervisor(EngineCoreSupervisor):
    """For LLMEngine: `get_output` blocks on the output socket, and returns an
    empty message when nothing is in flight."""

    def get_output(self) -> EngineCoreOutputs:
        while True:
            pending = self._housekeeping_and_pending()
            if pending is not None:
                return pending
            # Nothing in flight: read what is already queued (a core's error,
            # a stray frame), but do not wait for more.
            if not self.ledger and not self._output.poll(0):
                return EngineCoreOutputs()
            if self._output.poll(self._poll_ms()):
                outputs = self._receive(self._output.recv(copy=False))
                if outputs is not None:
                    return outputs
