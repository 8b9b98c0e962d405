"""Data-parallel replicas on Ray: `EngineCoreActor`, one whole engine core
(scheduler, KV cache, executor) in a Ray actor, and `CoreEngineActorManager`,
which places, starts, watches and stops them (docs/architecture.md, "Data parallel and the supervisor").

Each replica gets one placement group of its own, all on one node: bundle 0
for the engine actor, then one bundle per model rank when its executor is Ray
(which reuses those bundles: no nested groups). Replicas are packed onto as few
nodes as possible, or spread one per node. Ray places and watches replicas; the
per-token path is the ZMQ/msgpack channel of a local core (see ray_launcher.py).

That channel is ZMQ CURVE (raylm.distributed.tcp_auth), on one node too: each
replica gets a keypair of its own from the front end through Ray (a
`ReplicaChannel` in the actor's constructor) and accepts no server but the
front end; the front end admits only its replicas' keys, and knows from the
key which replica sent what.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from raylm.config import EngineConfig
from raylm.distributed.tcp_auth import CurveKeys, secure_client
from raylm.engine.core_channel import DropLog
from raylm.engine.core_proc import EngineCoreProc
from raylm.engine.errors import EngineStartTimeoutError
from raylm.engine.protocol import ClientMessage
from raylm.executor.ray_cluster import connect_ray, kill_actors
from raylm.executor.ray_placement import (
    place_replica,
    replica_bundles,
    replica_num_cpus_hint,
    replica_target_nodes,
    undo_ray_worker_niceness,
    worker_env_vars,
)
from raylm.startup_heap import freeze_startup_heap

logger = logging.getLogger(__name__)

# How often the monitor looks at the replicas' loops (bounds death detection).
_MONITOR_POLL_S = 0.5
# How long a replica asked to stop may take before it is killed.
_STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ReplicaChannel:
    """Where a replica connects, and with which keys: its own keypair (the
    front end admits its public half, and only this replica holds the
    secret) and the front end's public key (the only server it accepts).
    It holds a secret: it travels to the actor through Ray only."""

    input_address: str
    output_address: str
    keys: CurveKeys
    front_end_key: bytes
    # Where the replica records the quarantined request it runs alone (RunningAloneRecordInRay).
    running_alone_key: str = ""

    def secure(self, sock) -> None:
        """Before connect: present our key, and talk to the front end only."""
        secure_client(sock, self.keys, server_key=self.front_end_key)


class RunningAloneRecordInRay:
    """core_proc.RunningAloneRecord for a replica, which may run on another
    node than its front end: the record is a key in Ray's GCS store, written
    synchronously (so a replica killed in the next step has written it) and
    only when the request running alone changes."""

    def __init__(self, key: str):
        self.key = key.encode()

    def write(self, request_id: str | None) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(self.key, (request_id or "").encode(), overwrite=True)

    def read(self) -> str | None:
        from ray.experimental import internal_kv

        try:
            value = internal_kv._internal_kv_get(self.key)
        except Exception:  # Ray is shutting down: no record
            return None
        return value.decode() if value else None

    def delete(self) -> None:
        from ray.experimental import internal_kv

        try:
            internal_kv._internal_kv_del(self.key)
        except Exception:
            pass


class ReplicaCoreProc(EngineCoreProc):
    """A replica's core loop: a frame on its input that does not decode is
    dropped and logged, never fatal (it would end every request the replica
    holds). CURVE lets only the front end write there, so it would be a bug."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._undecodable = DropLog("an input frame that does not decode")

    def _decode_input(self, frame) -> ClientMessage | None:
        try:
            return super()._decode_input(frame)
        except msgspec.DecodeError as e:
            self._undecodable.dropped(f"replica {self.engine_index}: {e}")
            return None


class EngineCoreActor:
    """One replica: builds its EngineCore at construction (so a failure to
    start is an actor-creation error), then `run` is the core's busy loop,
    talking to the front end over ZMQ exactly like a core process does."""

    def __init__(
        self, config: EngineConfig, engine_index: int, channel: ReplicaChannel, log_level: int = logging.WARNING
    ):
        from raylm.engine.engine_core import EngineCore

        undo_ray_worker_niceness()  # the model loads and warms up on this thread
        logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.engine_index = engine_index
        self.core = EngineCore(config)
        self.proc = ReplicaCoreProc(
            self.core,
            channel.input_address,
            channel.output_address,
            engine_index,
            watch_parent=False,
            secure_socket=channel.secure,
        )
        if channel.running_alone_key:
            self.core.on_running_alone = RunningAloneRecordInRay(channel.running_alone_key).write
        freeze_startup_heap()  # here, not in `run`: the replica gets traffic once it is ready

    def ready(self) -> dict:
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "num_blocks": self.core.config.cache_config.num_blocks,
        }

    def run(self) -> None:
        """Until the front end sends Shutdown; always releases the executor."""
        # A threaded actor (max_concurrency=2): the loop may run on another
        # thread than __init__, and its helpers (the K/V copies') start from it.
        undo_ray_worker_niceness()
        try:
            self.proc.run()
        finally:
            self.core.shutdown()
            self.proc.close()


@dataclass
class ReplicaHandle:
    index: int
    actor: object
    placement_group: object
    run_ref: object
    node_id: str
    node_ip: str
    pid: int


class CoreEngineActorManager:
    """Creates replicas, waits until they are ready, starts their loops,
    watches them (`on_death(index, cause)` from a monitor thread, within a
    second), and stops them leaving no actor or placement group."""

    def __init__(self, config: EngineConfig, on_death: Callable[[int, str], None]):
        import ray

        self.config = config
        self.on_death = on_death
        connect_ray(config.parallel_config, num_cpus_hint=replica_num_cpus_hint(config))
        self._ray = ray
        self.replicas: dict[int, ReplicaHandle] = {}
        # Replicas being stopped (by index): out of `replicas`, not yet
        # released; `shutdown` releases them too, should it come first.
        self._stopping: dict[int, ReplicaHandle] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._monitor = threading.Thread(target=self._monitor_loop, name="raylm-dp-replica-monitor", daemon=True)
        self._monitor.start()

    # ---- placement ---------------------------------------------------------------

    def plan_nodes(self, num_replicas: int) -> list[str | None]:
        """Target nodes for `num_replicas` more replicas (ray_placement.replica_target_nodes),
        counting the replicas this manager runs."""
        with self._lock:
            existing: dict[str, int] = {}
            for handle in self.replicas.values():
                existing[handle.node_id] = existing.get(handle.node_id, 0) + 1
        return replica_target_nodes(self.config, num_replicas, existing)

    def start_replica(
        self, index: int, channel: ReplicaChannel, target_node: str | None = None, config: EngineConfig | None = None
    ) -> ReplicaHandle:
        """Place, build and start replica `index` (with `config`, its role's
        threads: CoreLauncher.core_config; default the engine's); blocks
        until it serves. On failure nothing of it is left and the error says why."""
        ray = self._ray
        from ray.util.placement_group import remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        config = config or self.config
        bundles, engine_cpus, rank_bundles = replica_bundles(config)
        pg = place_replica(index, bundles, config.parallel_config.data_parallel_placement, target_node)
        replica_config = copy.deepcopy(config)
        rpc = replica_config.parallel_config
        rpc.data_parallel_size = 1
        rpc.placement_group = pg
        rpc.placement_group_bundles = rank_bundles
        # The executor sizes its ranks' bundles from num_threads: it must ask
        # for exactly what the replica reserved for them.
        replica_config.num_threads = config.num_threads or 1
        actor = None
        # A replica stuck starting is given up (killed) at the engine's start deadline.
        start_timeout = self.config.fault_tolerance.engine_start_timeout_s
        try:
            actor_cls = ray.remote(EngineCoreActor)
            engine_gpus = bundles[0].get("GPU", 0)
            actor = actor_cls.options(
                num_cpus=engine_cpus,
                num_gpus=engine_gpus,
                # One thread for the core's loop, one for ready() and friends.
                max_concurrency=2,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
                ),
                runtime_env={"env_vars": worker_env_vars(self.config.device)},
                name=None,
            ).remote(replica_config, index, channel, logging.getLogger().getEffectiveLevel())
            info = ray.get(actor.ready.remote(), timeout=start_timeout)
            run_ref = actor.run.remote()
        except BaseException as e:
            if actor is not None:
                kill_actors([actor])
            remove_placement_group(pg)
            if isinstance(e, ray.exceptions.RayActorError):
                raise RuntimeError(f"data-parallel replica {index} failed to start: {_first_line(e)}") from e
            if isinstance(e, ray.exceptions.GetTimeoutError):
                # The engine's own type, as for a core process (process_launcher):
                # a bare TimeoutError was neither a RuntimeError for POST /scale
                # (a 500, not a 409) nor for the autoscaler (its task ended).
                raise EngineStartTimeoutError(
                    f"data-parallel replica {index} was not ready within "
                    f"{start_timeout:g} s (engine_start_timeout); killed it"
                ) from e
            raise
        handle = ReplicaHandle(index, actor, pg, run_ref, info["node_id"], info["node_ip"], info["pid"])
        with self._lock:
            self.replicas[index] = handle
        logger.info(
            "data-parallel replica %d: node %s (%s), pid %d, %d KV blocks",
            index,
            info["node_ip"],
            info["node_id"][:12],
            info["pid"],
            info["num_blocks"],
        )
        return handle

    # ---- liveness ------------------------------------------------------------------

    def _monitor_loop(self) -> None:
        ray = self._ray
        while not self._closed:
            with self._lock:
                watched = {h.run_ref: h for h in self.replicas.values() if h.index not in self._stopping}
            if not watched:
                time.sleep(_MONITOR_POLL_S)
                continue
            try:
                ready, _ = ray.wait(list(watched), num_returns=1, timeout=_MONITOR_POLL_S)
            except Exception:  # Ray shutting down under us
                if self._closed:
                    return
                logger.exception("data-parallel replica monitor")
                time.sleep(_MONITOR_POLL_S)
                continue
            for ref in ready:
                handle = watched[ref]
                with self._lock:
                    if handle.index in self._stopping or self.replicas.get(handle.index) is not handle:
                        continue
                    del self.replicas[handle.index]
                try:
                    ray.get(ref)
                    cause = "its engine loop returned"
                except Exception as e:
                    cause = _first_line(e)
                self._release(handle)
                logger.error(
                    "data-parallel replica %d (pid %d, node %s) died: %s",
                    handle.index,
                    handle.pid,
                    handle.node_ip,
                    cause,
                )
                self.on_death(handle.index, cause)

    # ---- stopping --------------------------------------------------------------------

    def stop_replica(self, index: int, wait_s: float = _STOP_TIMEOUT_S) -> None:
        """After its front-end channel sent Shutdown: wait for the loop, then
        kill the actor and remove its placement group."""
        with self._lock:
            handle = self.replicas.pop(index, None)
            if handle is None:
                return
            self._stopping[index] = handle
        try:
            try:
                self._ray.wait([handle.run_ref], timeout=wait_s)
            except Exception:
                pass
        finally:
            with self._lock:
                # Released here unless a shutdown took it meanwhile (and released it).
                mine = self._stopping.pop(index, None) is handle
            if mine:
                self._release(handle)

    def _release(self, handle: ReplicaHandle) -> None:
        from ray.util.placement_group import remove_placement_group

        kill_actors([handle.actor])
        try:
            remove_placement_group(handle.placement_group)
        except Exception as e:
            logger.warning("could not remove the placement group of replica %d: %s", handle.index, e)

    def shutdown(self, grace_s: float = _STOP_TIMEOUT_S) -> None:
        """Idempotent; every replica's actor and placement group are gone after.
        The replicas get `grace_s` to leave their loops (after the front end
        sent them Shutdown); then they are killed."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            # Those a background stop still waits for too: that stop may end
            # after the engine (and the test that checks nothing is left).
            handles = list(self.replicas.values()) + list(self._stopping.values())
            self.replicas.clear()
            self._stopping.clear()
        if handles:
            try:
                self._ray.wait([h.run_ref for h in handles], num_returns=len(handles), timeout=grace_s)
            except Exception:
                pass
        for handle in handles:
            self._release(handle)
        self._monitor.join(2 * _MONITOR_POLL_S)


def _first_line(error: BaseException) -> str:
    """The line of Ray's long error text that says what happened: the last
    "...Error: ..." line (the original exception), else the first line."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error:" in line and not line.startswith(("File ", "ray."))]
    line = errors[-1] if errors else (lines[0] if lines else "")
    return f"{type(error).__name__}: {line[:300]}" if line else type(error).__name__
