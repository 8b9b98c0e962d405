"""Scaling, the supervisor's part for changes an operator or the autoscaler
asks for (supervisor.py): new cores started and warmed before they get
traffic, the cores a scale-in removes drained (their requests migrate live
to the others) and stopped once empty, and replica restarts.

A replica restart loses no request: the replica drains by migration like a
scale-in's, leaves once empty, and a fresh core starts under the same index
(through recovery.py's start, without the restart budget: nothing failed)
and takes traffic again once it serves. A rolling restart is one restart
after another (POST /replicas/{i}/restart, then the next).

One change at a time: a scale is refused while a replica restarts, is being
replaced or is starting, since a replica that will serve without being
counted would make the new size wrong (or take the same index twice).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from raylm.engine.core_channel import CoreChannel, CoreLauncher
from raylm.engine.core_recovery import BackgroundThreads, Recovery, Replacement
from raylm.engine.ledger import Ledger
from raylm.engine.migration import Migrations
from raylm.engine.protocol import Shutdown

logger = logging.getLogger("raylm.engine.supervisor")

# How long a drained core may take to leave its loop before it is killed.
_DRAINED_STOP_S = 10.0


@dataclass
class ScaleUp:
    """A scale-up under way: the new cores, starting."""

    size: int  # the data parallel size once they serve
    indices: list[int]
    channels: list[CoreChannel]
    targets: list


class ReplicaRestarts:
    """The replicas being restarted, and why a restart failed, until its
    caller takes it. Recovery tells it how a restart's new core started."""

    def __init__(self):
        self.restarting: set[int] = set()  # replicas being drained or started again
        # Why the new core of a restart failed to start, by replica, until the
        # caller awaiting that restart (AsyncEngineCoreSupervisor.restart_replica) takes it.
        self.failures: dict[int, str] = {}

    def done(self, index: int) -> None:
        if index in self.restarting:
            self.restarting.discard(index)
            logger.info("replica %d restarted and serving", index)

    def failed(self, index: int, why: str) -> None:
        """A restarting replica's restart did not go as planned: its new core
        failed to start, or it died while draining. The restart is over,
        unsuccessful, and its caller is told why; the replica itself is
        recovered as any failure is (a replacement within the restart budget)."""
        if index in self.restarting:
            self.restarting.discard(index)
            self.failures[index] = why
            logger.error("restarting replica %d failed: %s; it is recovered within the restart budget", index, why)


class Scaling:
    def __init__(
        self,
        ledger: Ledger,
        launcher: CoreLauncher,
        ctx,
        recovery: Recovery,
        migrations: Migrations,
        restarts: ReplicaRestarts,
        background: BackgroundThreads,
        encode: Callable[[object], bytes],
        remove_channel: Callable[[int, str], CoreChannel | None],
    ):
        """`remove_channel` is the supervisor's one way for a core to leave."""
        self._ledger = ledger
        self._launcher = launcher
        self._ctx = ctx
        self._recovery = recovery
        self._migrations = migrations
        self.restarts = restarts
        self._background = background
        self._encode = encode
        self._remove_channel = remove_channel
        self.scaling_up: set[int] = set()  # cores a scale-up is starting
        # Drained cores being stopped off the reading thread, by index, and
        # those whose stop returned (taken up by housekeeping: `take_stopped`).
        self.stopping: dict[int, CoreChannel] = {}
        self.stopped: queue.Queue = queue.Queue()

    # ---- starting cores --------------------------------------------------------------

    def start_cores(self, indices: list[int]) -> None:
        """Start cores and wait until they all serve (they load in parallel)."""
        channels, targets = self._new_channels(indices)
        try:
            self._wait_started(channels, targets)
        except BaseException:
            for channel in channels:
                self._launcher.close_channel(channel)
            raise
        for channel in channels:
            self._ledger.adopt(channel)

    def _new_channels(self, indices: list[int]) -> tuple[list[CoreChannel], list]:
        return [self._launcher.new_channel(self._ctx, i) for i in indices], self._launcher.plan_targets(len(indices))

    def _wait_started(self, channels: list[CoreChannel], targets: list) -> None:
        """Blocking, and touches no socket (any thread may run it): start the
        cores in parallel; on any failure none of them is left running."""
        errors: list[BaseException] = []

        def start(channel: CoreChannel, target) -> None:
            try:
                self._launcher.start(channel, target)
            except BaseException as e:
                errors.append(e)

        threads = [
            threading.Thread(target=start, args=(c, t), name=f"raylm-core-start-{c.index}")
            for c, t in zip(channels, targets)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            for channel in channels:
                self._launcher.stop(channel.index, wait_s=0)
            raise errors[0]

    # ---- a scale ---------------------------------------------------------------------------

    def _plan(self, data_parallel_size: int) -> list[int]:
        """Drain what a scale-down removes; the new indices a scale-up needs."""
        if not self._launcher.can_scale:
            raise ValueError("scaling needs an engine started with data_parallel_size > 1")
        if self.restarts.restarting:
            raise ValueError(
                f"replica(s) {sorted(self.restarts.restarting)} are restarting: scale once they serve again"
            )
        # A replica being replaced or added will serve without being counted
        # here: a scale planned meanwhile would count wrong (or take the same
        # index twice). One change at a time.
        if self._recovery.starting:
            raise ValueError(f"replica(s) {sorted(self._recovery.starting)} are being replaced: scale once they serve")
        if self.scaling_up:
            raise ValueError(f"replica(s) {sorted(self.scaling_up)} are starting: scale once they serve")
        if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {data_parallel_size!r}")
        # The size asked for is what serves: a replica lost past the restart
        # budget is not started later on top of it.
        self._recovery.give_up_budget_waits(f"the scale to {data_parallel_size} replica(s) replaces it")
        active = sorted(c.index for c in self._ledger.serving())
        if data_parallel_size <= len(active):
            channels = self._ledger.channels
            for index in active[data_parallel_size:]:
                channels[index].draining = True
            for index in active[data_parallel_size:]:
                self._migrations.migrate_away(index, reason="scale_in")
            self.retire_drained()
            return []
        # A drained core still being stopped keeps its index until it is gone:
        # two cores of one index would share its launcher's slot.
        taken = set(self._ledger.channels) | set(self._recovery.starting) | set(self.stopping)
        free = (i for i in range(data_parallel_size + len(taken)) if i not in taken)
        return [next(free) for _ in range(data_parallel_size - len(active))]

    def begin(self, data_parallel_size: int) -> ScaleUp | None:
        """Plan a scale (ValueError if it cannot be): a scale-down drains its
        cores now; a scale-up's new cores are returned to start (`start`,
        blocking, from any thread) and then adopt (`end`, on the reading
        thread)."""
        new = self._plan(data_parallel_size)
        if not new:
            logger.info("data parallel size is now %d", data_parallel_size)
            return None
        channels, targets = self._new_channels(new)
        self.scaling_up.update(new)
        return ScaleUp(data_parallel_size, new, channels, targets)

    def start(self, scale_up: ScaleUp) -> None:
        """Blocking, and touches no socket: the new cores load (in parallel)."""
        self._wait_started(scale_up.channels, scale_up.targets)

    def end(self, scale_up: ScaleUp, started: bool) -> None:
        """The new cores take traffic (`started`), or are given up."""
        self.scaling_up.difference_update(scale_up.indices)
        if not started:
            for channel in scale_up.channels:
                self._launcher.close_channel(channel)
            return
        for channel in scale_up.channels:
            self._ledger.adopt(channel)
        logger.info("data parallel size is now %d", scale_up.size)

    # ---- draining cores leave ----------------------------------------------------------------

    def drain_reason(self, index: int) -> str:
        """Why replica `index` drains (the reason its migrations carry)."""
        return "restart" if index in self.restarts.restarting else "scale_in"

    def retire_drained(self) -> None:
        """A draining core with nothing left is sent Shutdown and leaves the
        supervisor at once; the launcher stops it (waiting up to
        _DRAINED_STOP_S for its loop to end, then killing it) in the
        background: this runs on the reading thread, which is the event loop
        for AsyncLLM, and must not wait that long. A core still the source of
        a migration stays until that ends (it holds the request's copy)."""
        for index, channel in list(self._ledger.channels.items()):
            if channel.draining and not channel.in_flight and not self._migrations.is_source(channel):
                channel.send(self._encode(Shutdown()))
                self._remove_channel(index, "drained and left")
                self._stop_in_background(channel)

    def _stop_in_background(self, channel: CoreChannel) -> None:
        index = channel.index
        self.stopping[index] = channel

        def stop() -> None:
            try:
                self._launcher.stop(index, wait_s=_DRAINED_STOP_S)
            except Exception as e:  # nothing else to try: the launcher's shutdown stops what it still runs
                logger.warning("stopping drained engine core %d failed: %s", index, e)
            self.stopped.put(channel)

        # Nothing to undo if the engine shuts down before this runs: the
        # launcher's shutdown stops every core, this one included.
        self._background.run(0.0, stop, lambda: None, name=f"raylm-core-stop-{index}")

    def take_stopped(self) -> None:
        """Housekeeping, on the reading thread: a drained core whose stop
        returned has its socket closed, and a replica restarting starts again
        only now, so two cores of one index never run at once."""
        while not self.stopped.empty():
            channel = self.stopped.get()
            index = channel.index
            del self.stopping[index]
            self._launcher.close_channel(channel)
            logger.info("engine core %d drained and removed", index)
            if index in self.restarts.restarting:
                self._recovery.start(index, Replacement(time.monotonic(), "restart asked for", 0, planned=True), 0.0)

    def restart_coming(self) -> bool:
        """Whether a restarting replica's core is still to start (its old one is stopping)."""
        return any(i in self.restarts.restarting for i in self.stopping)

    def replica_states(self) -> list[dict]:
        """For /health and logs: each core's node, load and state. A replica
        without a core (starting, restarting, or lost and waiting for the
        restart budget) is listed with no load."""
        states = []
        restarting = self.restarts.restarting
        restarting_stopped = {i for i in self.stopping if i in restarting}
        waiting = self._recovery.budget_waits()
        for index in sorted(
            set(self._ledger.channels)
            | set(self._recovery.starting)
            | self.scaling_up
            | restarting_stopped
            | set(waiting)
        ):
            state = "restarting" if index in restarting else None
            channel = self._ledger.channels.get(index)
            if channel is None:
                entry = {
                    "replica": index,
                    "state": state or "starting",
                    "node_ip": "",
                    "in_flight": 0,
                    "num_running": 0,
                    "num_waiting": 0,
                    "kv_cache_usage": 0.0,
                    "num_routed": 0,
                    "prefix_cache_hit_rate": 0.0,
                }
                if index in waiting:
                    entry.update(state="waiting_for_restart_budget", restart_in_s=round(waiting[index], 1))
                states.append(entry)
                continue
            stats = channel.stats
            states.append(
                {
                    "replica": index,
                    "state": state or ("draining" if channel.draining else "serving"),
                    "node_ip": channel.node_ip,
                    "in_flight": len(channel.in_flight),
                    "num_running": stats.num_running if stats else 0,
                    "num_waiting": stats.num_waiting if stats else 0,
                    "kv_cache_usage": stats.kv_cache_usage if stats else 0.0,
                    "num_routed": channel.num_routed,
                    "prefix_cache_hit_rate": stats.prefix_cache_hit_rate if stats else 0.0,
                    # Torch threads per worker (0 until the core's first message).
                    "threads": stats.worker_threads if stats else 0,
                }
            )
        return states

    # ---- replica restarts ----------------------------------------------------------------------

    def begin_restart(self, index: int) -> int:
        """Drain replica `index` by migration; it is started again once empty
        (`retire_drained`, then `take_stopped`). Returns how many requests
        began to move. ValueError if it does not serve, or no other replica
        could take its requests."""
        channel = self._ledger.channels.get(index)
        restarting = self.restarts.restarting
        if channel is None or channel.draining or index in restarting:
            raise ValueError(f"replica {index} is not serving (replicas: {self.replica_states()})")
        if not any(c.index != index for c in self._ledger.serving()):
            raise ValueError("a replica restart needs another serving replica to take its requests")
        self.restarts.failures.pop(index, None)  # an earlier restart's, that nobody awaited
        restarting.add(index)
        channel.draining = True
        moving = self._migrations.migrate_away(index, reason="restart")
        logger.info("restarting replica %d: %d of its %d request(s) migrating", index, moving, len(channel.in_flight))
        return moving
