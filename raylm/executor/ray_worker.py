"""The actor of one rank on Ray (`RayWorkerWrapper`): a WorkerWrapper plus
what only Ray can tell it (its node, its GPU), its own CPU pinning and
network interface, and the rank's side of both step transports (the
message-queue loop of `mq`, the hop of a compiled graph)."""

from __future__ import annotations

import logging
import os
import threading
import time

from raylm.config import EngineConfig
from raylm.distributed.shm_broadcast import MessageQueue, MessageQueueHandle
from raylm.distributed.shm_ring import unlink_segment
from raylm.distributed.tcp_auth import CurveKeys
from raylm.executor.mq_rpc import CallableRegistry, WorkerLoop
from raylm.executor.ray_placement import undo_ray_worker_niceness
from raylm.startup_heap import freeze_startup_heap
from raylm.worker.cpu_placement import RankPlacement, apply_rank_placement, plan_cpu_placement
from raylm.worker.cpu_topology import read_topology
from raylm.worker.worker import WorkerWrapper

logger = logging.getLogger(__name__)

# How often an actor on the driver's node checks that the driver still lives
# (the `mq` transport: it then removes the driver's broadcast segment).
_DRIVER_WATCH_INTERVAL_S = 1.0


def cuda_device_index(ray_gpu_ids: list, cuda_visible_devices: str | None) -> int:
    """The torch device index, on its node, of the GPU Ray gave a worker.

    Ray names GPUs by the entries of the node's CUDA_VISIBLE_DEVICES when it
    started (physical indices when unset, maybe UUIDs), and raylm's workers keep
    that variable as the node has it (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES):
    torch counts only the visible devices, so Ray's GPU "2" on a node showing
    "2,3" is cuda:0, and "GPU-9f2c..." is its position in the list.

    `ray_gpu_ids`: ray.get_gpu_ids() in the worker (the first is used);
    `cuda_visible_devices`: the worker's CUDA_VISIBLE_DEVICES, None when unset.
    """
    if not ray_gpu_ids:
        raise ValueError("Ray assigned no GPU to this worker (its bundle reserves none)")
    gpu = str(ray_gpu_ids[0]).strip()
    if cuda_visible_devices is None:
        try:
            return int(gpu)
        except ValueError:
            raise ValueError(
                f"Ray assigned GPU {gpu!r}, which is not a device index, and CUDA_VISIBLE_DEVICES is unset "
                "on this node: set it when starting Ray there (the ids Ray reports come from it)"
            ) from None
    visible = [entry.strip() for entry in cuda_visible_devices.split(",") if entry.strip()]
    if gpu in visible:
        return visible.index(gpu)
    raise ValueError(
        f"Ray assigned GPU {gpu!r}, but this node's CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} does not "
        "list it: start Ray on this node with the CUDA_VISIBLE_DEVICES its workers see"
    )


def interface_of_ip(ip: str) -> str | None:
    """The name of this machine's network interface that carries `ip`."""
    import socket

    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if addr.family in (socket.AF_INET, socket.AF_INET6) and addr.address.split("%")[0] == ip:
                return name
    return None


def set_gloo_socket_ifname(node_ip: str) -> str | None:
    """Point gloo at the interface carrying this node's Ray IP, before the
    process group is created: left to itself gloo binds to the address the
    host name resolves to, which on a multi-homed host (or a container, or a
    network namespace) may be another network or none at all.

    A GLOO_SOCKET_IFNAME already set (by the user, forwarded from the driver)
    is kept when this node has such an interface. Returns the value in effect."""
    import psutil

    current = os.environ.get("GLOO_SOCKET_IFNAME")
    if current and all(name in psutil.net_if_addrs() for name in current.split(",")):
        return current
    found = interface_of_ip(node_ip)
    if found is None:
        logger.warning("no network interface of this node carries its Ray IP %s; gloo picks its own", node_ip)
        return current
    if current:
        logger.warning(
            "GLOO_SOCKET_IFNAME=%s names no interface of this node (%s); using %s, which carries its Ray IP",
            current,
            node_ip,
            found,
        )
    os.environ["GLOO_SOCKET_IFNAME"] = found
    return found


def _is_loopback_init(init_method: str) -> bool:
    host = init_method.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


class RayWorkerWrapper(WorkerWrapper):
    """The actor of one rank: a WorkerWrapper plus what only Ray can tell
    (node identity, GPU ids), the entry point of the compiled graph, and the
    message-queue loop of the `mq` step transport."""

    # The one rank whose compiled-graph output the executor reads.
    is_output_rank = False

    def __init__(self, rank: int = 0):
        super().__init__(rank)
        undo_ray_worker_niceness()

    _mq_loop: WorkerLoop | None = None
    _mq_thread: threading.Thread | None = None

    def init_worker(self, config: EngineConfig, local_rank: int, distributed_init_method: str) -> None:
        # Ranks on several nodes meet at a node's Ray IP: gloo must use the
        # interface that carries this node's one (on one node, loopback).
        if not _is_loopback_init(distributed_init_method):
            import ray

            set_gloo_socket_ifname(ray.util.get_node_ip_address())
        super().init_worker(config, local_rank, distributed_init_method)

    def set_output_rank(self, is_output_rank: bool) -> None:
        self.is_output_rank = is_output_rank

    def get_node_info(self) -> tuple[str, str, list]:
        import ray

        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ray.util.get_node_ip_address(), [str(g) for g in ray.get_gpu_ids()]

    def get_pid(self) -> int:
        return os.getpid()

    def place_on_cpus(
        self,
        local_rank: int,
        num_local_ranks: int,
        engine_loop_here: bool,
        bundle_cpus: int,
        num_threads: int | None,
        cpu_bind: str,
    ) -> tuple[RankPlacement, tuple[int, ...]]:
        """Plan the ranks of this node from the node's own cores, take this
        rank's share (at most its bundle's CPUs) and pin this whole process
        to it. Returns (this rank's placement, the engine loop's CPUs here)."""
        plan = plan_cpu_placement(
            read_topology(),
            num_local_ranks,
            engine_loop_here=engine_loop_here,
            num_threads=num_threads,
            cpu_bind=cpu_bind,
            max_threads_per_rank=bundle_cpus,
        )
        placement = plan.ranks[local_rank]
        apply_rank_placement(placement, whole_process=True)
        return placement, plan.engine_loop_cpus

    def get_cuda_device_index(self) -> int:
        """The torch device index of the GPU Ray gave this actor, on its node."""
        import ray

        return cuda_device_index(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))

    def get_free_port(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def wait_until_dead(self) -> None:
        # Held open by the executor's monitor: this call never returns, so its
        # ref resolves (with an error) exactly when the actor dies.
        while True:
            time.sleep(3600)

    # ---- the `mq` step transport --------------------------------------------------

    def init_mq(
        self,
        broadcast_handle: MessageQueueHandle,
        response_over_zmq: bool,
        driver_pid: int | None,
        tcp_keys: CurveKeys | None = None,
    ) -> MessageQueueHandle:
        """Attach to the driver's broadcast queue as this rank and create this
        rank's response queue; returns the response queue's handle.

        An actor on another node than the driver answers over ZMQ, bound to
        its own node's Ray IP, with the driver as the one remote reader,
        authenticated with the executor's CURVE keys (None: plain TCP, the
        driver's choice).
        """
        import ray

        broadcast = MessageQueue.create_from_handle(broadcast_handle, self.rank)
        if response_over_zmq:
            response = MessageQueue(
                num_local_readers=0,
                num_remote_readers=1,
                host_ip=ray.util.get_node_ip_address(),
                tcp_keys=tcp_keys,
                authenticate_tcp=tcp_keys is not None,
            )
        else:
            response = MessageQueue(num_local_readers=1)
        self._rpc_callables = CallableRegistry()
        self._mq_loop = WorkerLoop(self, broadcast, response, self._rpc_callables)
        if driver_pid is not None and broadcast_handle.shm_name:
            threading.Thread(
                target=self._watch_driver,
                args=(driver_pid, broadcast_handle.shm_name),
                name="raylm-driver-watch",
                daemon=True,
            ).start()
        return response.export_handle()

    def register_rpc_callable(self, token: int, fn) -> None:
        """A collective_rpc callable, carried here by Ray (which cloudpickles
        it); the queue then names it by token (a CallableRef), never carries it."""
        self._rpc_callables.register(token, fn)

    def start_mq_loop(self) -> None:
        """Run the dequeue-run-reply loop on a thread of its own and return at
        once, so the actor's concurrency slots stay free (liveness, shutdown)."""
        if self._mq_loop is None:
            raise RuntimeError("init_mq must come before start_mq_loop")
        self._mq_thread = threading.Thread(target=self._run_mq_loop, name=f"raylm-mq-loop-{self.rank}", daemon=True)
        self._mq_thread.start()

    def _run_mq_loop(self) -> None:
        freeze_startup_heap()
        try:
            self._mq_loop.run()  # returns when the driver closes the broadcast queue
        except Exception:
            logger.exception("rank %d: the message-queue loop failed", self.rank)

    def wait_mq_loop_exit(self, timeout: float) -> bool:
        """True once the loop thread has finished (its queues are closed)."""
        if self._mq_thread is None:
            return True
        self._mq_thread.join(timeout)
        return not self._mq_thread.is_alive()

    def _watch_driver(self, driver_pid: int, broadcast_segment: str) -> None:
        import psutil

        while self._mq_thread is None or self._mq_thread.is_alive():
            time.sleep(_DRIVER_WATCH_INTERVAL_S)
            if not psutil.pid_exists(driver_pid):
                # The driver died without closing its queue. Its segment is in
                # the driver's resource tracker, not ours: unlink, do not unregister.
                logger.error("rank %d: the driver (pid %d) is gone; leaving", self.rank, driver_pid)
                unlink_segment(broadcast_segment, unregister=False)
                if self._mq_loop is not None:
                    self._mq_loop.response.close()
                os._exit(1)

    def execute_model_graph(self, step_input: tuple):
        """One compiled-graph hop: (scheduler_output, grammar_output[, intermediate])."""
        scheduler_output, grammar_output, *rest = step_input
        worker = self.worker
        out = worker.execute_model(scheduler_output, rest[0] if rest else None)
        from raylm.distributed.parallel_state import get_pp_group

        if not get_pp_group().is_last_rank:
            return (scheduler_output, grammar_output, out)
        result = worker.sample_tokens(grammar_output)
        return result if self.is_output_rank else None
