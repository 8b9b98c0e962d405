"""Ray plumbing for the executor: connecting to (or starting) a cluster,
placement groups, the worker actor class, and rank ordering."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

from raylm.config import EngineConfig, ParallelConfig
from raylm.distributed.shm_broadcast import MessageQueue, MessageQueueHandle, unlink_segment
from raylm.distributed.tcp_auth import CurveKeys
from raylm.executor.mq_rpc import CallableRegistry, WorkerLoop
from raylm.worker.cpu_placement import (RankPlacement, apply_rank_placement, parse_cpu_bind, plan_cpu_placement,
                                        read_topology)
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


# The local Ray instance this process started (None when raylm started none,
# or the Ray in use is someone else's): its GCS address and CPU count, so a
# later engine that needs more can restart it larger while nothing uses it.
_own_local_ray: dict | None = None
# How long a TCP connect to a cluster file's GCS address may take before the
# file is judged stale.
_GCS_PROBE_TIMEOUT_S = 2.0
# How long a given address may take to answer (a head still starting).
_EXPLICIT_ADDRESS_WAIT_S = 10.0
# How long to wait for a previous engine's actors and placement group to be
# gone before deciding whether raylm's local Ray can be restarted larger.
_SETTLE_TIMEOUT_S = 10.0


def connect_ray(parallel_config: ParallelConfig, num_cpus_hint: int) -> None:
    """Connect to Ray, as `ray.init()` would, or start a local instance.

    - an address (`ray_address`, else `RAY_ADDRESS`): connect there ("auto" as
      in Ray; "local" starts a local instance);
    - none: join the cluster named by Ray's cluster file (written by `ray start`
      on this machine, /tmp/ray/ray_current_cluster by default) if its GCS
      answers; a stale file (a killed head left it behind) is logged and
      ignored; else start a local instance.

    A local instance that raylm started is raylm's to resize: its CPUs are
    scheduling tokens (one per rank and thread), and a later engine of this
    process that needs more restarts it larger while no actor or placement
    group lives in it. A cluster raylm did not start is never stopped.
    """
    import ray

    if ray.is_initialized():
        _grow_own_local_ray(num_cpus_hint)
        return
    address = parallel_config.ray_address or os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        _require_reachable(address, "ray_address" if parallel_config.ray_address else "RAY_ADDRESS")
        ray.init(address=address, log_to_driver=True)
        logger.info("connected to Ray cluster at %s", address)
        return
    if not address:
        running = running_local_cluster_address()
        if running is not None:
            ray.init(address=running, log_to_driver=True)
            logger.info("joined the running Ray cluster at %s (from %s)", running, ray_cluster_file())
            return
    _start_own_local_ray(num_cpus_hint)


def ray_cluster_file() -> str:
    """Where `ray start` records the cluster that a bare `ray.init()` joins."""
    try:
        from ray._private.utils import get_ray_address_file

        return get_ray_address_file(None)
    except ImportError:  # moved in another Ray version: Ray's documented default
        return os.path.join(os.environ.get("RAY_TMPDIR") or "/tmp", "ray", "ray_current_cluster")


def running_local_cluster_address() -> str | None:
    """The GCS address in Ray's cluster file if a GCS answers there; None when
    there is no file, or when it is stale (then said once, with the fix)."""
    path = ray_cluster_file()
    try:
        with open(path) as f:
            address = f.read().strip()
    except OSError:
        return None
    if not address:
        return None
    if gcs_reachable(address):
        return address
    logger.warning(
        "Ray's cluster file %s names %s, but no Ray GCS answers there (a Ray head that was killed left "
        "the file behind; `ray stop` removes it): starting a local Ray instance instead",
        path, address,
    )
    return None


def gcs_reachable(address: str, timeout: float = _GCS_PROBE_TIMEOUT_S) -> bool:
    """True when something accepts TCP connections at host:port."""
    import socket

    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def _require_reachable(address: str, source: str) -> None:
    """A host:port address where no GCS answers fails here, in seconds, naming
    it: Ray itself retries such an address for minutes and then exits the
    process. ("auto" and ray:// client addresses are left to Ray.)"""
    if address == "auto" or "://" in address:
        return
    deadline = time.monotonic() + _EXPLICIT_ADDRESS_WAIT_S
    while not gcs_reachable(address):
        if time.monotonic() >= deadline:
            raise ConnectionError(
                f"no Ray cluster answers at {address} (from {source}) within {_EXPLICIT_ADDRESS_WAIT_S:g} s; "
                "start one there (ray start --head), or leave the address out to use the cluster started "
                "on this machine, or a local Ray instance"
            )
        time.sleep(0.5)


def _local_ray_num_cpus(num_cpus_hint: int) -> int:
    # At least the machine's cores, so the user's own Ray tasks have room too;
    # not more than asked for beyond that: Ray starts one idle Python worker
    # per CPU token.
    return max(os.cpu_count() or 1, num_cpus_hint)


def _start_own_local_ray(num_cpus_hint: int) -> None:
    global _own_local_ray
    import ray

    num_cpus = _local_ray_num_cpus(num_cpus_hint)
    # "local": a new instance whatever Ray's cluster file says (it is stale
    # when we get here, or an address was not wanted).
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
    _own_local_ray = {"identity": _current_ray_identity(), "num_cpus": num_cpus}
    logger.info("started a local Ray instance with %d CPU tokens", num_cpus)


def _current_ray_identity() -> str | None:
    """The connected Ray instance's session name: unique per instance, where
    a GCS address is not (a later local instance may get the same port, and
    must not be taken for raylm's own and restarted)."""
    try:
        from ray._private import worker

        return worker.global_worker.node.session_name
    except Exception:  # noqa: BLE001 - another Ray version: identity unknown, so never ours
        return None


def owns_local_ray() -> bool:
    """True when the Ray this process is connected to was started by raylm."""
    return (_own_local_ray is not None and _own_local_ray["identity"] is not None
            and _own_local_ray["identity"] == _current_ray_identity())


def _grow_own_local_ray(num_cpus_hint: int) -> None:
    """Restart raylm's own local instance with more CPU tokens when an engine
    needs more than it has and nothing lives in it; a Ray that raylm did not
    start is left as it is (placement then says what is missing)."""
    global _own_local_ray
    import ray

    if not owns_local_ray() or num_cpus_hint <= _own_local_ray["num_cpus"]:
        return
    have = _own_local_ray["num_cpus"]
    users = _wait_until_unused(_SETTLE_TIMEOUT_S)
    if users:
        logger.warning(
            "raylm's local Ray instance has %d CPU tokens and this engine needs %d, but it cannot be "
            "restarted larger while %s live in it; start Ray yourself with enough CPUs "
            "(ray start --head --num-cpus N) to run these engines side by side",
            have, num_cpus_hint, users,
        )
        return
    logger.info("restarting raylm's local Ray instance: it has %d CPU tokens, this engine needs %d",
                have, num_cpus_hint)
    _own_local_ray = None
    ray.shutdown()
    _start_own_local_ray(num_cpus_hint)


def _wait_until_unused(timeout: float) -> str:
    """'' once no actor or placement group lives in the connected Ray (a shut
    down engine's are removed asynchronously), else what still lives there."""
    from ray._private.state import actors
    from ray.util import placement_group_table

    deadline = time.monotonic() + timeout
    while True:
        live_actors = [a for a in actors().values() if a.get("State") != "DEAD"]
        live_pgs = [g for g in placement_group_table().values() if g.get("state") != "REMOVED"]
        if not live_actors and not live_pgs:
            return ""
        if time.monotonic() >= deadline:
            return f"{len(live_actors)} actor(s) and {len(live_pgs)} placement group(s)"
        time.sleep(0.1)


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
        allowed = parallel_config.placement_group_bundles
        candidates = range(len(specs)) if allowed is None else allowed
        usable = [i for i in candidates if specs[i].get(key, 0) >= bundle[key]]
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


def cpus_per_rank(config: EngineConfig) -> int:
    """CPU tokens for each rank's bundle: the threads a rank is planned to get
    when all ranks share the driver's node (the usual layout; on a node with
    fewer ranks an actor still keeps to its bundle's count)."""
    if config.num_threads:
        return config.num_threads
    bind = parse_cpu_bind(config.cpu_bind)
    if isinstance(bind, list):
        return min(len(group) for group in bind)
    world = config.parallel_config.world_size
    return plan_cpu_placement(read_topology(), world, engine_loop_here=True).ranks[0].num_threads


def initialize_ray_cluster(parallel_config: ParallelConfig, device: str, cpus_per_worker: int) -> PlacementInfo:
    """Connect to (or start) Ray and get one placement-group bundle per rank:
    {"GPU": 1} on CUDA, {"CPU": cpus_per_worker} on CPU."""
    world = parallel_config.world_size
    connect_ray(parallel_config, num_cpus_hint=world * cpus_per_worker)
    bundle = {"GPU": 1} if device == "cuda" else {"CPU": cpus_per_worker}
    return get_placement_group(parallel_config, bundle, world)


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


def check_cupy_for_nccl_channels() -> None:
    """A compiled graph moves CUDA tensors between pipeline stages over NCCL
    channels, which Ray builds on CuPy: without it the first step would fail
    deep inside Ray; say so at start-up instead, with the fix."""
    try:
        import cupy  # noqa: F401
    except Exception as e:  # ImportError, or a CuPy built for another CUDA failing at import
        import torch

        major = (torch.version.cuda or "").split(".")[0]
        package = f"cupy-cuda{major}x" if major else "cupy-cuda12x (or the cupy-cudaNNx matching your CUDA)"
        raise RuntimeError(
            "ray_step_transport='cgraph' on CUDA sends pipeline-stage tensors over NCCL channels of Ray "
            f"Compiled Graphs, which need CuPy, and it does not import here ({type(e).__name__}: {e}). "
            f"Install it on every node: pip install {package}; or use ray_step_transport='mq' "
            "(--ray-step-transport mq)"
        ) from e


def disconnect_ray() -> None:
    """Disconnect from Ray; the local instance raylm started, if that is the
    one in use, stops with it (a joined cluster lives on)."""
    global _own_local_ray
    import ray

    ray.shutdown()
    _own_local_ray = None


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
            current, node_ip, found,
        )
    os.environ["GLOO_SOCKET_IFNAME"] = found
    return found


def _is_loopback_init(init_method: str) -> bool:
    host = init_method.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


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

    def place_on_cpus(self, local_rank: int, num_local_ranks: int, engine_loop_here: bool, bundle_cpus: int,
                      num_threads: int | None, cpu_bind: str) -> tuple[RankPlacement, tuple[int, ...]]:
        """Plan the ranks of this node from the node's own cores, take this
        rank's share (at most its bundle's CPUs) and pin this whole process
        to it. Returns (this rank's placement, the engine loop's CPUs here)."""
        plan = plan_cpu_placement(read_topology(), num_local_ranks, engine_loop_here=engine_loop_here,
                                  num_threads=num_threads, cpu_bind=cpu_bind, max_threads_per_rank=bundle_cpus)
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
        self, broadcast_handle: MessageQueueHandle, response_over_zmq: bool, driver_pid: int | None,
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
                num_local_readers=0, num_remote_readers=1, host_ip=ray.util.get_node_ip_address(),
                tcp_keys=tcp_keys, authenticate_tcp=tcp_keys is not None,
            )
        else:
            response = MessageQueue(num_local_readers=1)
        self._rpc_callables = CallableRegistry()
        self._mq_loop = WorkerLoop(self, broadcast, response, self._rpc_callables)
        if driver_pid is not None and broadcast_handle.shm_name:
            threading.Thread(
                target=self._watch_driver, args=(driver_pid, broadcast_handle.shm_name),
                name="raylm-driver-watch", daemon=True,
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
