"""EngineCoreSupervisor: the front ends' one client of their engine cores
(DESIGN.md, "Layers" and "Failure model"), whatever runs them: a local core
process, N of them, or N data-parallel replicas on Ray (a `CoreLauncher`).

It owns
- the ledger of every request in flight in a core: the request as first sent
  (prompt, sampling params, failure record) and the tokens that came back;
- one channel per core (core_channel.CoreChannel) and the routing of each new
  request to one of them (routing.py);
- recovery: when a core dies, hangs or gives up, its unfinished requests go
  to the other cores, or wait for its replacement, as continuations (prompt
  plus the tokens so far: the client sees a pause, not an error); the
  replacement starts within one restart budget with backoff, and the
  recovery is reported with its measured seconds;
- poison quarantine across core deaths (raylm.core.quarantine): the ledger
  keeps each request's record, charges the requests a death exposed, and
  fails the culprit alone;
- scaling: new cores warmed before they get traffic, drained ones removed.

DP=1 and DP=N are the same code: one core is N=1. `AsyncEngineCoreSupervisor`
(AsyncLLM) and `SyncEngineCoreSupervisor` (LLMEngine with data parallelism)
differ only in how `get_output` waits.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from raylm.config import EngineConfig
from raylm.core import quarantine
from raylm.core.outputs import EngineCoreOutput
from raylm.distributed.tcp_auth import terminate_context
from raylm.engine.core_channel import CoreChannel, CoreLauncher, DropLog
from raylm.engine.core_recovery import BudgetWait, CoreRecovery, Replacement
from raylm.engine.errors import EngineDeadError
from raylm.engine.migration import MigrationControl
from raylm.engine.prefix_index import PrefixIndex
from raylm.engine.protocol import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    Ping,
    RecoveryStats,
    SchedulerStats,
    Shutdown,
)
from raylm.engine.replica_restart import AsyncReplicaRestart, ReplicaRestart
from raylm.engine.restart_budget import BlameLedger, RestartBudget
from raylm.engine.routing import CoreLoad, routing_policy

logger = logging.getLogger(__name__)

_POLL_MS = 100
# How long a drained core may take to leave its loop before it is killed.
_DRAINED_STOP_S = 10.0


def make_launcher(config: EngineConfig) -> CoreLauncher:
    """Ray replicas for data parallelism on Ray, else local core processes."""
    pc = config.parallel_config
    scalable = pc.data_parallel_size > 1 or config.autoscale is not None
    if scalable and pc.data_parallel_backend == "ray":
        from raylm.engine.ray_launcher import RayReplicaLauncher

        return RayReplicaLauncher(config)
    from raylm.engine.process_launcher import ProcessCoreLauncher

    return ProcessCoreLauncher(config)


@dataclass
class ScaleUp:
    """A scale-up under way: the new cores, starting."""

    size: int  # the data parallel size once they serve
    indices: list[int]
    channels: list[CoreChannel]
    targets: list


@dataclass
class LedgerEntry:
    """A request in flight in a core: as first sent, and what came back."""

    request: EngineCoreRequest
    channel: int  # the core serving it; -1 while it waits for one
    token_ids: list[int] = field(default_factory=list)  # generated so far, across cores
    pinned: bool = False  # sent to a data_parallel_rank by its client: never moved by rebalancing

    def continuation(self) -> EngineCoreRequest:
        """The request to send again: it continues after the tokens so far.
        Prompt logprobs start again from the prompt's first position; those
        the client already has are skipped above (OutputProcessor)."""
        return self.request.continuation(self.token_ids)


class EngineCoreSupervisor(CoreRecovery, MigrationControl, ReplicaRestart):
    asyncio_mode = False

    def __init__(self, config: EngineConfig, launcher: CoreLauncher | None = None):
        pc, ft = config.parallel_config, config.fault_tolerance
        self.config = config
        self.restart_budget = RestartBudget(ft.max_restarts, ft.restart_window_s)
        # Restarts that failed requests caused are forgiven, up to a rate.
        self.blame = BlameLedger(self.restart_budget, ft.max_blamed_recoveries, ft.restart_window_s)
        # What each core's prefix cache holds (from its block events), and the
        # policy that routes new requests by it and by the cores' loads.
        self.prefix_index = PrefixIndex()
        self.router = routing_policy(pc.routing_policy, self.prefix_index, config.cache_config.block_size)
        self.channels: dict[int, CoreChannel] = {}
        self.ledger: dict[str, LedgerEntry] = {}
        self._waiting: list[str] = []  # ledger ids with no core to go to yet
        self._starting: dict[int, Replacement] = {}  # cores being replaced, by index
        self._budget_waits: dict[int, BudgetWait] = {}  # cores lost past the restart budget, by index
        self._scaling_up: set[int] = set()  # cores a scale-up is starting
        self._started: queue.Queue = queue.Queue()
        # Drained cores being stopped off the reading thread, by index, and
        # those whose stop returned (taken up by housekeeping: `_on_stopped`).
        self._stopping: dict[int, CoreChannel] = {}
        self._stopped: queue.Queue = queue.Queue()
        self._recoveries: list[RecoveryStats] = []
        self._culprit_outputs: list[EngineCoreOutput] = []
        self._pings: dict[int, set[int]] = {}
        self._pongs: list[int] = []  # pings answered for cores that died
        self._nonce = 0
        self._last_failure = ""
        self.dead_error: EngineDeadError | None = None
        self._closed = threading.Event()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.undecodable = DropLog("a core message that does not decode", logger)
        self.foreign = DropLog("outputs for requests not routed to the core that sent them", logger)
        self._init_migration()
        self._init_restarts()
        self._ctx = zmq.Context()
        self.launcher = launcher if launcher is not None else make_launcher(config)
        output = self.launcher.bind_output(self._ctx)
        self._output = zmq.asyncio.Socket.from_socket(output) if self.asyncio_mode else output
        self._finalizer = weakref.finalize(self, _shutdown, self.launcher, self.channels, self._output, self._ctx,
                                           self._closed)
        try:
            self._start_cores(list(range(pc.data_parallel_size)))
        except BaseException:
            self._finalizer()
            raise

    # ---- requests --------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest, data_parallel_rank: int | None = None) -> None:
        """Route `request` to a core (or keep it until one serves); ValueError
        for a request that cannot be encoded or a rank that does not serve."""
        try:
            frame = self._encoder.encode(request)
        except (OverflowError, msgspec.EncodeError) as e:
            raise ValueError(f"request cannot be encoded: {e}") from e
        channel = self._route(request, data_parallel_rank)
        self.ledger[request.request_id] = LedgerEntry(request, -1, list(request.output_token_ids),
                                                      pinned=data_parallel_rank is not None)
        if channel is None:
            self._waiting.append(request.request_id)
            return
        self._dispatch(channel, request.request_id, frame)

    def _dispatch(self, channel: CoreChannel, request_id: str, frame: bytes) -> None:
        if not channel.in_flight:
            channel.last_heard = time.monotonic()  # its silence while idle was no hang
        channel.in_flight.add(request_id)
        channel.num_routed += 1
        self.ledger[request_id].channel = channel.index
        channel.send(frame)

    def _route(self, request: EngineCoreRequest, rank: int | None) -> CoreChannel | None:
        if rank is not None:
            channel = self.channels.get(rank)
            if channel is None or channel.draining:
                raise ValueError(f"data_parallel_rank {rank} is not a serving replica "
                                 f"(serving: {sorted(i for i, c in self.channels.items() if not c.draining)})")
            return channel
        loads = [CoreLoad(c.index, len(c.in_flight), c.stats.num_waiting if c.stats else 0,
                          c.stats.kv_cache_usage if c.stats else 0.0)
                 for c in self.channels.values() if not c.draining]
        best = self.router.choose(request, loads)
        return None if best is None else self.channels[best.index]

    def _resubmit(self, request_id: str) -> None:
        """Send a request in the ledger again, after the tokens it already produced."""
        entry = self.ledger.get(request_id)
        if entry is None:
            return
        request = entry.continuation()
        channel = self._route(request, None)
        if channel is None:
            entry.channel = -1
            self._waiting.append(request_id)
            return
        self._dispatch(channel, request_id, self._encoder.encode(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        by_channel: dict[int, list[str]] = {}
        for request_id in request_ids:
            entry = self.ledger.pop(request_id, None)
            if entry is None:
                continue
            channel = self.channels.get(entry.channel)
            if channel is not None:
                channel.in_flight.discard(request_id)
                channel.aborted.append(request_id)
                by_channel.setdefault(channel.index, []).append(request_id)
        if self._waiting and len(by_channel) < len(request_ids):
            self._waiting = [rid for rid in self._waiting if rid in self.ledger]
        for index, ids in by_channel.items():
            self.channels[index].send(self._encoder.encode(AbortRequests(ids)))
        for request_id in request_ids:
            self._migration_request_gone(request_id)

    def ping(self) -> int:
        """Every serving core is asked; the pong goes up once all answered."""
        self._nonce += 1
        self._pings[self._nonce] = set(self.channels)
        for channel in self.channels.values():
            channel.send(self._encoder.encode(Ping(self._nonce)))
        return self._nonce

    def is_alive(self) -> bool:
        return self.dead_error is None

    # ---- cores -------------------------------------------------------------------

    def _start_cores(self, indices: list[int]) -> None:
        """Start cores and wait until they all serve (they load in parallel)."""
        channels, targets = self._new_channels(indices)
        try:
            self._wait_started(channels, targets)
        except BaseException:
            for channel in channels:
                self.launcher.close_channel(channel)
            raise
        self._adopt(channels)

    def _new_channels(self, indices: list[int]) -> tuple[list[CoreChannel], list]:
        return [self.launcher.new_channel(self._ctx, i) for i in indices], self.launcher.plan_targets(len(indices))

    def _wait_started(self, channels: list[CoreChannel], targets: list) -> None:
        """Blocking, and touches no socket (any thread may run it): start the
        cores in parallel; on any failure none of them is left running."""
        errors: list[BaseException] = []

        def start(channel: CoreChannel, target) -> None:
            try:
                self.launcher.start(channel, target)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=start, args=(c, t), name=f"raylm-core-start-{c.index}")
                   for c, t in zip(channels, targets)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            for channel in channels:
                self.launcher.stop(channel.index, wait_s=0)
            raise errors[0]

    def _adopt(self, channels: list[CoreChannel]) -> None:
        for channel in channels:
            if channel.index in self.channels:  # would orphan the requests of the core serving it
                raise RuntimeError(f"engine core {channel.index} started twice")
            self.channels[channel.index] = channel

    def _plan_scale(self, data_parallel_size: int) -> list[int]:
        """Drain what a scale-down removes; the new indices a scale-up needs."""
        if not self.launcher.can_scale:
            raise ValueError("scaling needs an engine started with data_parallel_size > 1")
        if self.restarting:
            raise ValueError(f"replica(s) {sorted(self.restarting)} are restarting: scale once they serve again")
        # A replica being replaced or added will serve without being counted
        # here: a scale planned meanwhile would count wrong (or take the same
        # index twice). One change at a time.
        if self._starting:
            raise ValueError(f"replica(s) {sorted(self._starting)} are being replaced: scale once they serve")
        if self._scaling_up:
            raise ValueError(f"replica(s) {sorted(self._scaling_up)} are starting: scale once they serve")
        if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {data_parallel_size!r}")
        # The size asked for is what serves: a replica lost past the restart
        # budget is not started later on top of it.
        self._give_up_budget_waits(f"the scale to {data_parallel_size} replica(s) replaces it")
        active = sorted(i for i, c in self.channels.items() if not c.draining)
        if data_parallel_size <= len(active):
            for index in active[data_parallel_size:]:
                self.channels[index].draining = True
            for index in active[data_parallel_size:]:
                self._migrate_away(index, reason="scale_in")
            self._retire_drained()
            return []
        # A drained core still being stopped keeps its index until it is gone:
        # two cores of one index would share its launcher's slot.
        taken = set(self.channels) | set(self._starting) | set(self._stopping)
        free = (i for i in range(data_parallel_size + len(taken)) if i not in taken)
        return [next(free) for _ in range(data_parallel_size - len(active))]

    def begin_scale(self, data_parallel_size: int) -> ScaleUp | None:
        """Plan a scale (ValueError if it cannot be): a scale-down drains its
        cores now; a scale-up's new cores are returned to start
        (`start_scaled`, blocking, from any thread) and then adopt
        (`end_scale`, on the reading thread)."""
        new = self._plan_scale(data_parallel_size)
        if not new:
            logger.info("data parallel size is now %d", data_parallel_size)
            return None
        channels, targets = self._new_channels(new)
        self._scaling_up.update(new)
        return ScaleUp(data_parallel_size, new, channels, targets)

    def start_scaled(self, scale_up: ScaleUp) -> None:
        """Blocking, and touches no socket: the new cores load (in parallel)."""
        self._wait_started(scale_up.channels, scale_up.targets)

    def end_scale(self, scale_up: ScaleUp, started: bool) -> None:
        """The new cores take traffic (`started`), or are given up."""
        self._scaling_up.difference_update(scale_up.indices)
        if not started:
            for channel in scale_up.channels:
                self.launcher.close_channel(channel)
            return
        self._adopt(scale_up.channels)
        logger.info("data parallel size is now %d", scale_up.size)

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

    def _retire_drained(self) -> None:
        """A draining core with nothing left is sent Shutdown and leaves the
        supervisor at once; the launcher stops it (waiting up to
        _DRAINED_STOP_S for its loop to end, then killing it) in the
        background: this runs on the reading thread, which is the event loop
        for AsyncLLM, and must not wait that long."""
        for index, channel in list(self.channels.items()):
            if channel.draining and not channel.in_flight and not self._is_migration_source(index):
                channel.send(self._encoder.encode(Shutdown()))
                self._remove_channel(index, why="drained and left")
                self._stop_in_background(channel)

    def _stop_in_background(self, channel: CoreChannel) -> None:
        index = channel.index
        self._stopping[index] = channel

        def stop() -> None:
            try:
                self.launcher.stop(index, wait_s=_DRAINED_STOP_S)
            except Exception as e:  # nothing else to try: the launcher's shutdown stops what it still runs
                logger.warning("stopping drained engine core %d failed: %s", index, e)
            self._stopped.put(channel)

        # Nothing to undo if the engine shuts down before this runs: the
        # launcher's shutdown stops every core, this one included.
        self._in_background(0.0, stop, lambda: None, name=f"raylm-core-stop-{index}")

    def _on_stopped(self, channel: CoreChannel) -> None:
        """On the reading thread, once a drained core's stop returned: its
        socket closes, and a replica restarting starts again only now, so two
        cores of one index never run at once."""
        index = channel.index
        del self._stopping[index]
        self.launcher.close_channel(channel)
        logger.info("engine core %d drained and removed", index)
        if index in self.restarting:
            self._restart_retired(index)

    def replica_states(self) -> list[dict]:
        """For /health and logs: each core's node, load and state. A replica
        without a core (starting, restarting, or lost and waiting for the
        restart budget: see `_restart_if_allowed`) is listed with no load."""
        states = []
        restarting_stopped = {i for i in self._stopping if i in self.restarting}
        waiting = self.budget_waits()
        for index in sorted(set(self.channels) | set(self._starting) | self._scaling_up | restarting_stopped
                            | set(waiting)):
            channel = self.channels.get(index)
            if channel is None:
                state = {"replica": index, "state": self.restart_state(index) or "starting", "node_ip": "",
                         "in_flight": 0, "num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0,
                         "num_routed": 0}
                if index in waiting:
                    state.update(state="waiting_for_restart_budget", restart_in_s=round(waiting[index], 1))
                states.append(state)
                continue
            stats = channel.stats
            states.append({
                "replica": index,
                "state": self.restart_state(index) or ("draining" if channel.draining else "serving"),
                "node_ip": channel.node_ip, "in_flight": len(channel.in_flight),
                "num_running": stats.num_running if stats else 0,
                "num_waiting": stats.num_waiting if stats else 0,
                "kv_cache_usage": stats.kv_cache_usage if stats else 0.0,
                "num_routed": channel.num_routed,
            })
        return states

    # ---- failures ------------------------------------------------------------------

    def _housekeeping(self) -> None:
        """Between reads: adopt new cores, heal dead ones, resend, kill hung
        ones, retire drained ones; EngineDeadError once none is left."""
        # Cores that started first: one that died before it was adopted is
        # then found dead as the core serving its index (its death, handled
        # before it was adopted, would be lost, and its requests stall until
        # the step deadline).
        while not self._started.empty():
            self._on_started(*self._started.get())
        while not self._stopped.empty():
            self._on_stopped(self._stopped.get())
        for index, cause in self.launcher.deaths():
            self._on_death(index, cause)
        if self._waiting and any(not c.draining for c in self.channels.values()):
            waiting, self._waiting = self._waiting, []
            for request_id in waiting:
                self._resubmit(request_id)
        for channel in self.channels.values():
            channel.flush()
        self._kill_hung_cores()
        self._retry_draining_migrations()
        self._rebalance_if_due()
        self._retire_drained()
        self._restart_when_budget_allows()
        # A replica restarting is started again once its old core has stopped.
        coming = self._starting or any(i in self.restarting for i in self._stopping)
        if not self.channels and not coming and self.dead_error is None:
            budget = self.restart_budget
            self.dead_error = EngineDeadError(f"{self._last_failure}; no restart left ({budget.max_restarts} "
                                              f"allowed within {budget.window_s:g}s)")
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
        self._drop_foreign_outputs(channel, outputs)
        if outputs.error is not None:
            # That core gave up (its own recoveries failed): replace it.
            cause = outputs.error.strip().splitlines()[-1]
            logger.error("engine core %d failed: %s", channel.index, cause)
            self.launcher.stop(channel.index, wait_s=0)
            self._on_death(channel.index, f"engine core failed: {cause}")
            return None
        for recovery in outputs.recoveries:  # the core's own: mirror its verdicts
            quarantine.mirror({rid: self.ledger[rid].request for rid in channel.in_flight if rid in self.ledger},
                              recovery.charged, recovery.culprits)
        if outputs.stats is not None:
            channel.stats = outputs.stats
            outputs.stats = self.aggregate_stats()
        for out in outputs.outputs:
            entry = self.ledger[out.request_id]
            entry.token_ids.extend(out.new_token_ids)
            if out.new_token_ids:
                self._migration_saw_tokens(channel, out.request_id)
            if out.finished:
                channel.in_flight.discard(out.request_id)
                del self.ledger[out.request_id]
                self._migration_request_gone(out.request_id)
        # After the outputs: a final export follows the source's last tokens.
        for report in outputs.migrations:
            self._on_migration_report(channel, report)
        outputs.migrations = []
        outputs.migrated = self.take_migration_events()
        if outputs.pong is not None:
            waiting = self._pings.get(outputs.pong)
            if waiting is not None:
                waiting.discard(channel.index)
            if waiting:  # others still to answer
                outputs.pong = None
            else:
                self._pings.pop(outputs.pong, None)
        outputs.recoveries = outputs.recoveries + self._recoveries
        self._recoveries = []
        return outputs

    def _drop_foreign_outputs(self, channel: CoreChannel, outputs: EngineCoreOutputs) -> None:
        """Keep only the outputs of requests routed to `channel`: a core may
        not speak for another's. Outputs of a request it was told to abort
        are expected (they cross the abort) and dropped quietly."""
        kept = []
        for out in outputs.outputs:
            entry = self.ledger.get(out.request_id)
            if entry is not None and entry.channel == channel.index:
                kept.append(out)
            elif out.request_id not in channel.aborted:
                self.foreign.dropped(f"core {channel.index} sent request {out.request_id[:64]!r}")
        outputs.outputs = kept

    def aggregate_stats(self) -> SchedulerStats:
        stats = [c.stats for c in self.channels.values() if c.stats is not None]
        n = max(1, len(stats))
        return SchedulerStats(
            num_running=sum(s.num_running for s in stats),
            num_waiting=sum(s.num_waiting for s in stats),
            kv_cache_usage=sum(s.kv_cache_usage for s in stats) / n,
            prefix_cache_hit_rate=sum(s.prefix_cache_hit_rate for s in stats) / n,
            prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
            num_preemptions=sum(s.num_preemptions for s in stats),
            kv_capacity_tokens=sum(s.kv_capacity_tokens for s in stats),
            kv_capacity_tokens_per_rank=max((s.kv_capacity_tokens_per_rank for s in stats), default=0),
            unhealthy=next((s.unhealthy for s in stats if s.unhealthy), None),
        )

    def _housekeeping_and_pending(self) -> EngineCoreOutputs | None:
        self._housekeeping()
        return self._pending()

    def _pending(self) -> EngineCoreOutputs | None:
        """What the supervisor itself has to pass up: its recoveries, culprits
        failed, pings answered for dead cores, migrations ended."""
        if not self._recoveries and not self._culprit_outputs and not self._pongs and not self._migration_events:
            return None
        outputs = EngineCoreOutputs(outputs=self._culprit_outputs, recoveries=self._recoveries,
                                    pong=self._pongs.pop() if self._pongs else None,
                                    migrated=self.take_migration_events())
        self._recoveries, self._culprit_outputs = [], []
        return outputs

    def stats(self) -> dict:
        return msgspec.structs.asdict(self.aggregate_stats())

    def shutdown(self) -> None:
        """Idempotent: every core stopped, nothing of them left."""
        if self.dead_error is None:
            self.dead_error = EngineDeadError("the engine was shut down")
        self._finalizer()
        self._close_migration()


class AsyncEngineCoreSupervisor(EngineCoreSupervisor, AsyncReplicaRestart):
    """For AsyncLLM: `get_output` awaits the output socket."""

    asyncio_mode = True

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
            if await self._output.poll(_POLL_MS):
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
            if self._output.poll(_POLL_MS):
                outputs = self._receive(self._output.recv(copy=False))
                if outputs is not None:
                    return outputs


def _shutdown(launcher: CoreLauncher, channels: dict, output, ctx, closed: threading.Event) -> None:
    closed.set()  # replacements waiting out their backoff give up
    shutdown = msgspec.msgpack.encode(Shutdown())
    for channel in channels.values():
        try:
            channel.send(shutdown)  # never blocks: what a dead core cannot take is dropped below
        except zmq.ZMQError:
            pass
    launcher.shutdown()
    for channel in channels.values():
        launcher.close_channel(channel)
    channels.clear()
    output.close(linger=0)
    for sock in list(ctx._sockets):  # any socket still open (pyzmq's own list, as Context.destroy uses it)
        sock.close(linger=0)
    terminate_context(ctx)  # bounded: a stranger's pending handshake must not hang shutdown
