"""Ray plumbing for the executor: connecting to (or starting) a cluster,
placement groups, the worker actor class, and rank ordering."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

from raylm.config import ParallelConfig
from raylm.distributed.shm_broadcast import MessageQueue, MessageQueueHandle, unlink_segment
from raylm.executor.mq_rpc import WorkerLoop
from raylm.worker.worker import WorkerWrapper

logger = logging.getLogger(__name__)

MIN_RAY_VERSION = (2, 40)
# How often an actor on the driver's node checks that the driver still lives
# (the `mq` transport: it then removes the driver's broadcast segment).
_DRIVER_WATCH_INTERVAL_S = 1.0
PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
# Driver environment variables that workers inherit besides RAYLM_*; the
# per-worker ones (device visibility, ranks, addresses) are never copied.
FORWARDED_ENV_VARS = (
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "TOKENIZERS_PARALLELISM",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "NCCL_DEBUG",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "RAY_CGRAPH_get_timeout",
    "RAY_CGRAPH_submit_timeout",
    "RAY_CGRAPH_teardown_timeout",
)
PER_WORKER_ENV_VARS = ("CUDA_VISIBLE_DEVICES", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def check_ray_version() -> None:
    """Fail early and clearly when Ray is missing, too old, or lacks compiled graphs."""
    try:
        import ray
    except ImportError as e:
        raise RuntimeError("distributed_executor_backend='ray' needs Ray: pip install 'ray[default]==2.58.0'") from e
    version = tuple(int(p) for p in ray.__version__.split(".")[:2])
    if version < MIN_RAY_VERSION:
        raise RuntimeError(
            f"Ray {ray.__version__} is too old for raylm's Ray executor; need >= {'.'.join(map(str, MIN_RAY_VERSION))}"
        )
    try:
        import ray.dag.compiled_dag_node  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"Ray {ray.__version__} lacks compiled-graph support (ray.dag)") from e


def worker_env_vars(device: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.startswith("RAYLM_") or k in FORWARDED_ENV_VARS}
    env["RAYLM_DRIVER_NICENESS"] = str(os.getpriority(os.PRIO_PROCESS, 0))
    for key in PER_WORKER_ENV_VARS:
        env.pop(key, None)
    if device == "cuda":
        # Keep every GPU visible to every worker; each is told its device id.
        env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
    return env


def connect_ray(parallel_config: ParallelConfig, num_cpus_hint: int) -> None:
    import ray

    if ray.is_initialized():
        return
    address = parallel_config.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        logger.info("connected to Ray cluster at %s", address)
    else:
        # A private local Ray: its CPU count is a scheduling token budget, so
        # give at least one per rank even on a small machine.
        ray.init(num_cpus=max(os.cpu_count() or 1, num_cpus_hint), include_dashboard=False, log_to_driver=True)
        logger.info("started a local Ray instance")


def _cluster_description() -> str:
    from ray._private.state import available_resources_per_node, total_resources_per_node

    available = available_resources_per_node()
    total = total_resources_per_node()
    lines = []
    for node_id, res in total.items():
        free = available.get(node_id, {})
        keys = sorted(k for k in res if not k.startswith("node:") and "memory" not in k)
        parts = ", ".join(f"{k} {free.get(k, 0):g}/{res[k]:g}" for k in keys)
        lines.append(f"  node {node_id[:12]}: {parts} (available/total)")
    return "\n".join(lines) or "  (no live nodes)"


@dataclass
class PlacementInfo:
    placement_group: object
    created_here: bool
    bundle_indices: list[int]


def get_placement_group(parallel_config: ParallelConfig, bundle: dict, world_size: int) -> PlacementInfo:
    """Reuse the placement group we run in, or create one bundle per rank and
    wait for it; a request the cluster cannot satisfy fails within the timeout
    with what was asked and what each node has."""
    import ray
    from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group

    strategy = parallel_config.ray_placement_strategy
    if strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(f"ray_placement_strategy must be one of {PLACEMENT_STRATEGIES}, got {strategy!r}")
    current = parallel_config.placement_group or get_current_placement_group()
    if current is not None:
        specs = current.bundle_specs
        key = next(iter(bundle))
        usable = [i for i, spec in enumerate(specs) if spec.get(key, 0) >= bundle[key]]
        if len(usable) < world_size:
            raise ValueError(
                f"the placement group in use has {len(usable)} bundles with {key} >= {bundle[key]}, "
                f"but tensor_parallel_size x pipeline_parallel_size = {world_size}"
            )
        return PlacementInfo(current, False, usable[:world_size])

    bundles = [dict(bundle) for _ in range(world_size)]
    # Ask for a sliver of the driver node's own resource in the first bundle,
    # so rank 0 (and with PACK its TP group) lands where the driver runs.
    bundles[0][f"node:{ray.util.get_node_ip_address()}"] = 0.001
    pg = placement_group(bundles, strategy=strategy)
    timeout = parallel_config.ray_placement_timeout
    ready, _ = ray.wait([pg.ready()], timeout=timeout)
    if not ready:
        description = _cluster_description()
        remove_placement_group(pg)
        raise RuntimeError(
            f"could not place {world_size} workers with {bundle} each (strategy {strategy}) "
            f"within {timeout:g} s; the cluster offers:\n{description}"
        )
    return PlacementInfo(pg, True, list(range(world_size)))


def initialize_ray_cluster(parallel_config: ParallelConfig, device: str, cpus_per_worker: int) -> PlacementInfo:
    """Connect to (or start) Ray and get one placement-group bundle per rank:
    {"GPU": 1} on CUDA, {"CPU": cpus_per_worker} on CPU."""
    world = parallel_config.world_size
    connect_ray(parallel_config, num_cpus_hint=world * cpus_per_worker)
    bundle = {"GPU": 1} if device == "cuda" else {"CPU": cpus_per_worker}
    return get_placement_group(parallel_config, bundle, world)


def _undo_ray_worker_niceness() -> None:
    """Ray starts worker processes at niceness 15 (its `worker_niceness`) so
    background tasks yield to the driver; a model rank is the opposite of a
    background task: at nice 15 it loses every contended core to any other
    process (measured here: ray TP=2 ~10% behind mp TP=2 on a busy 2-core
    host). Raise it back to the driver's level where the OS allows."""
    try:
        current = os.getpriority(os.PRIO_PROCESS, 0)
        target = int(os.environ.get("RAYLM_DRIVER_NICENESS", "0"))
        if current > target:
            os.setpriority(os.PRIO_PROCESS, 0, target)
    except (OSError, ValueError) as e:  # no CAP_SYS_NICE: keep Ray's niceness
        logger.debug("could not lower the worker's niceness: %s", e)


class RayWorkerWrapper(WorkerWrapper):
    """The actor of one rank: a WorkerWrapper plus what only Ray can tell
    (node identity, GPU ids), the entry point of the compiled graph, and the
    message-queue loop of the `mq` step transport."""

    # The one rank whose compiled-graph output the executor reads.
    is_output_rank = False

    def __init__(self, rank: int = 0):
        super().__init__(rank)
        _undo_ray_worker_niceness()
    _mq_loop: WorkerLoop | None = None
    _mq_thread: threading.Thread | None = None

    def set_output_rank(self, is_output_rank: bool) -> None:
        self.is_output_rank = is_output_rank

    def get_node_info(self) -> tuple[str, str, list]:
        import ray

        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ray.util.get_node_ip_address(), [str(g) for g in ray.get_gpu_ids()]

    def get_pid(self) -> int:
        return os.getpid()

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

    def init_mq(self, broadcast_handle: MessageQueueHandle, response_over_zmq: bool, driver_pid: int | None) -> MessageQueueHandle:
        """Attach to the driver's broadcast queue as this rank and create this
        rank's response queue; returns the response queue's handle.

        An actor on another node than the driver answers over ZMQ, bound to
        its own node's Ray IP, with the driver as the one remote reader.
        """
        import ray

        broadcast = MessageQueue.create_from_handle(broadcast_handle, self.rank)
        if response_over_zmq:
            response = MessageQueue(num_local_readers=0, num_remote_readers=1, host_ip=ray.util.get_node_ip_address())
        else:
            response = MessageQueue(num_local_readers=1)
        self._mq_loop = WorkerLoop(self, broadcast, response)
        if driver_pid is not None and broadcast_handle.shm_name:
            threading.Thread(
                target=self._watch_driver, args=(driver_pid, broadcast_handle.shm_name),
                name="raylm-driver-watch", daemon=True,
            ).start()
        return response.export_handle()

    def start_mq_loop(self) -> None:
        """Run the dequeue-run-reply loop on a thread of its own and return at
        once, so the actor's concurrency slots stay free (liveness, shutdown)."""
        if self._mq_loop is None:
            raise RuntimeError("init_mq must come before start_mq_loop")
        self._mq_thread = threading.Thread(target=self._run_mq_loop, name=f"raylm-mq-loop-{self.rank}", daemon=True)
        self._mq_thread.start()

    def _run_mq_loop(self) -> None:
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


def sort_workers(
    infos: list[tuple[str, str, list]], driver_node_id: str
) -> list[int]:
    """Order of the created actors by rank: driver's node first, then nodes
    holding fewer workers, then lower IP (node id breaks ties)."""
    count: dict[str, int] = {}
    for node_id, _, _ in infos:
        count[node_id] = count.get(node_id, 0) + 1

    def ip_key(ip: str):
        try:
            return tuple(int(p) for p in ip.split("."))
        except ValueError:
            return (ip,)

    return sorted(
        range(len(infos)),
        key=lambda i: (infos[i][0] != driver_node_id, count[infos[i][0]], ip_key(infos[i][1]), infos[i][0]),
    )


def check_one_ip_per_node(infos: list[tuple[str, str, list]]) -> None:
    """Two nodes reporting one IP would make torch.distributed connect to the
    wrong machine; Ray's simulated clusters do this, hence the escape hatch."""
    nodes_by_ip: dict[str, set[str]] = {}
    for node_id, ip, _ in infos:
        nodes_by_ip.setdefault(ip, set()).add(node_id)
    shared = {ip: ids for ip, ids in nodes_by_ip.items() if len(ids) > 1}
    if shared and os.environ.get("RAYLM_ALLOW_SHARED_NODE_IP") != "1":
        ip, ids = next(iter(shared.items()))
        raise RuntimeError(
            f"{len(ids)} Ray nodes report the same IP {ip}; give each node its own address "
            "(ray start --node-ip-address), or set RAYLM_ALLOW_SHARED_NODE_IP=1 if they really share one host"
        )
