"""Restarting a replica without losing a request (a mixin of
EngineCoreSupervisor): its running requests migrate live to the other
replicas, it leaves once empty, and a fresh core starts under the same index
and takes traffic again once it serves. A rolling restart is one restart
after another (POST /replicas/{i}/restart, then the next)."""

from __future__ import annotations

import asyncio
import logging
import time

from raylm.engine.core_recovery import Replacement

logger = logging.getLogger("raylm.engine.supervisor")

_RESTART_POLL_S = 0.05


class ReplicaRestart:
    def _init_restarts(self) -> None:
        self.restarting: set[int] = set()  # replicas being drained or started again
        # Why the new core of a restart failed to start, by replica, until the
        # caller awaiting that restart (AsyncReplicaRestart) takes it.
        self.restart_failures: dict[int, str] = {}

    def begin_restart(self, index: int) -> int:
        """Drain replica `index` by migration; it is started again once empty
        (see `_retire_drained`). Returns how many requests began to move.
        ValueError if it does not serve, or no other replica could take its
        requests."""
        channel = self.channels.get(index)
        if channel is None or channel.draining or index in self.restarting:
            raise ValueError(f"replica {index} is not serving (replicas: {self.replica_states()})")
        others = [c for i, c in self.channels.items() if i != index and not c.draining]
        if not others:
            raise ValueError("a replica restart needs another serving replica to take its requests")
        self.restart_failures.pop(index, None)  # an earlier restart's, that nobody awaited
        self.restarting.add(index)
        channel.draining = True
        moving = self._migrate_away(index, reason="restart")
        logger.info("restarting replica %d: %d of its %d request(s) migrating", index, moving, len(channel.in_flight))
        return moving

    def _restart_retired(self, index: int) -> None:
        """Called once a restarting replica has left: start it anew (no
        restart budget: nothing failed)."""
        self._replace_in_background(index, Replacement(time.monotonic(), "restart asked for", 0, planned=True), 0.0)

    def _restart_done(self, index: int) -> None:
        if index in self.restarting:
            self.restarting.discard(index)
            logger.info("replica %d restarted and serving", index)

    def _restart_failed(self, index: int, why: str) -> None:
        """A restarting replica's restart did not go as planned: its new core
        failed to start, or it died while draining. The restart is over,
        unsuccessful, and its caller is told why; the replica itself is
        recovered as any failure is (a replacement within the restart budget)."""
        if index in self.restarting:
            self.restarting.discard(index)
            self.restart_failures[index] = why
            logger.error("restarting replica %d failed: %s; it is recovered within the restart budget", index, why)

    def restart_state(self, index: int) -> str | None:
        return "restarting" if index in self.restarting else None


class AsyncReplicaRestart:
    """For AsyncEngineCoreSupervisor: a restart awaited until the replica serves again."""

    async def restart_replica(self, index: int) -> None:
        """Returns once replica `index` serves again; RuntimeError if its new
        core failed to start (the replica is then being recovered) or it
        did not serve in time."""
        self.begin_restart(index)
        limit = self.config.fault_tolerance.engine_start_timeout_s + self.config.fault_tolerance.execute_model_timeout_s
        deadline = time.monotonic() + limit
        while index in self.restarting:
            if self.dead_error is not None:
                raise self.dead_error
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica {index} did not serve again within {limit:g} s")
            await asyncio.sleep(_RESTART_POLL_S)
        # Out of `restarting`: it serves, or its start failed (_restart_failed).
        failure = self.restart_failures.pop(index, None)
        if failure is not None:
            raise RuntimeError(f"{failure}; the replica is being recovered within the restart budget")
