"""Where a Ray run's actors go, for the run and for `raylm plan` alike (the
dry run calls these very functions, so it cannot drift from the run):

- an engine's ranks: what each rank's bundle holds (`rank_request`), the
  placement group of one bundle per rank (`place_ranks`), the options of a
  rank's actor, and the order of the created actors by rank;
- data-parallel replicas: the bundles of one replica (engine actor plus its
  ranks, all on one node), the node each new replica should go to, and its
  placement group.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from raylm.config import EngineConfig, ParallelConfig
from raylm.config.engine_args import PLACEMENT_STRATEGIES
from raylm.cpu_bind import parse_cpu_bind
from raylm.executor.ray_cluster import NodeState, connect_ray, describe_cluster
from raylm.worker.cpu_placement import plan_cpu_placement
from raylm.worker.cpu_topology import read_topology

logger = logging.getLogger(__name__)

# How long remove_placement_groups waits for Ray to show the groups gone.
_REMOVAL_WAIT_S = 10.0
# The driver's environment variables that a Ray actor raylm starts (a rank, a
# data-parallel replica) is given, through its runtime_env, and only these. An
# allow list, not every RAYLM_*: Ray keeps an actor's runtime_env and its state
# API shows it to anyone who reaches the dashboard (`ray list actors --detail`),
# so a secret must never be copied there: RAYLM_API_KEY (the server's key; only
# the front end checks it), or a key or token of the user's own, whatever its
# name. A RAYLM_* variable raylm reads must be listed here or in
# NEVER_FORWARDED_ENV_VARS (tests/executor/test_worker_env.py checks the source).
# Per-worker ones (CUDA_VISIBLE_DEVICES, RANK, MASTER_ADDR, ...) are never listed.
FORWARDED_ENV_VARS = (
    # raylm's own settings that ranks and replicas read.
    "RAYLM_ALLOW_SHARED_NODE_IP",
    "RAYLM_DEVICE",
    "RAYLM_DISABLE_CPU_KERNELS",
    "RAYLM_DISABLE_FLASHINFER",
    "RAYLM_DISABLE_SHM_COLLECTIVE",
    "RAYLM_FAULT_INJECTION",
    "RAYLM_FUSED_DECODE",
    "RAYLM_GGUF_CACHE",
    "RAYLM_KV_PEER_FILTER",
    "RAYLM_MIGRATION_COPY_CPU_SHARE",
    "RAYLM_MIGRATION_NETWORK",
    "RAYLM_MIGRATION_SYNC_PRECOPY",
    "RAYLM_MQ_UNAUTHENTICATED_TCP",
    "RAYLM_PP_LAYER_PARTITION",
    "RAYLM_PULL_ESTIMATES",
    "RAYLM_QUANT_KERNEL",
    "RAYLM_SPECULATIVE_MAX_BATCH",
    # Other libraries' settings (none holds a secret: HF_TOKEN is not here).
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "TOKENIZERS_PARALLELISM",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    # How idle OpenMP threads wait, when the user chose it.
    "OMP_WAIT_POLICY",
    "GOMP_SPINCOUNT",
    "KMP_BLOCKTIME",
    "NCCL_DEBUG",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "RAY_CGRAPH_get_timeout",
    "RAY_CGRAPH_submit_timeout",
    "RAY_CGRAPH_teardown_timeout",
    # The CPU kernels an actor builds or loads are the driver's: same compiler, same folder
    # (a Ray started elsewhere would otherwise give its actors another build of their own).
    "CXX",
    "TORCH_EXTENSIONS_DIR",
)
# Variables raylm reads that are never copied from the driver's environment:
# the API key (cli_args.API_KEY_ENV_VARS; only the front end checks it), and
# RAYLM_DRIVER_NICENESS, which worker_env_vars sets from the driver's niceness.
NEVER_FORWARDED_ENV_VARS = ("RAYLM_API_KEY", "VLLM_API_KEY", "RAYLM_DRIVER_NICENESS")


def worker_env_vars(device: str) -> dict[str, str]:
    """The environment of a Ray actor raylm starts (a rank, a replica): the
    driver's FORWARDED_ENV_VARS that are set, and its niceness."""
    env = {k: v for k, v in os.environ.items() if k in FORWARDED_ENV_VARS}
    env["RAYLM_DRIVER_NICENESS"] = str(os.getpriority(os.PRIO_PROCESS, 0))
    if device == "cuda":
        # Keep every GPU visible to every worker; each is told its device id.
        env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
    return env


def undo_ray_worker_niceness() -> None:
    """Ray starts worker processes at niceness 15 (its `worker_niceness`) so
    background tasks yield to the driver; a model rank or an engine core is
    the opposite of a background task: at nice 15 it loses every contended
    core to any other process (measured here: ray TP=2 ~10% behind mp TP=2
    on a busy 2-core host). Raise it back to the driver's level
    (worker_env_vars) where the OS allows. On Linux a niceness is a
    thread's (and that of the threads it starts afterwards): call this on
    the thread that steps, before it starts its helpers."""
    try:
        current = os.getpriority(os.PRIO_PROCESS, 0)
        target = int(os.environ.get("RAYLM_DRIVER_NICENESS", "0"))
        if current > target:
            os.setpriority(os.PRIO_PROCESS, 0, target)
    except (OSError, ValueError) as e:  # no CAP_SYS_NICE: keep Ray's niceness
        logger.debug("could not lower the worker's niceness: %s", e)


# ---- an engine's ranks ---------------------------------------------------------------


@dataclass(frozen=True)
class RankRequest:
    """What an engine asks Ray for its ranks: `world` bundles of `bundle`.
    `cpus_per_worker`: the CPU tokens (and OpenMP threads) of a rank's actor
    on CPU; 1 on CUDA, where a rank's actor asks for its GPU only."""

    world: int
    cpus_per_worker: int
    bundle: dict

    @property
    def num_cpus_hint(self) -> int:
        """CPU tokens a local Ray started for this engine should have."""
        return self.world * self.cpus_per_worker


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
    planned = plan_cpu_placement(read_topology(), world, engine_loop_here=True).ranks[0]
    # An actor keeps to its bundle's CPU tokens: a single rank's every-core
    # count would claim the engine loop's token too, so the bundle holds the
    # fallback count (and the actor runs that many threads).
    return planned.contended_threads or planned.num_threads


def rank_request(config: EngineConfig) -> RankRequest:
    """{"GPU": 1} per rank on CUDA, {"CPU": cpus_per_rank} on CPU."""
    world = config.parallel_config.world_size
    if config.device == "cuda":
        return RankRequest(world, 1, {"GPU": 1})
    cpus = cpus_per_rank(config)
    return RankRequest(world, cpus, {"CPU": cpus})


def place_ranks(parallel_config: ParallelConfig, request: RankRequest) -> PlacementInfo:
    """Connect to (or start) Ray and get one placement-group bundle per rank."""
    connect_ray(parallel_config, num_cpus_hint=request.num_cpus_hint)
    return get_placement_group(parallel_config, request.bundle, request.world)


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
    from ray.util.placement_group import get_current_placement_group, placement_group

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
                f"but tensor_parallel_size x pipeline_parallel_size x context_parallel_size = {world_size}"
            )
        return PlacementInfo(current, False, usable[:world_size])

    bundles = [dict(bundle) for _ in range(world_size)]
    # Ask for a sliver of the driver node's own resource in the first bundle,
    # so rank 0 (and with PACK its TP group) lands where the driver runs.
    bundles[0][f"node:{ray.util.get_node_ip_address()}"] = 0.001
    pg = placement_group(bundles, strategy=strategy)
    wait_placed(
        pg, parallel_config.ray_placement_timeout, f"{world_size} workers with {bundle} each (strategy {strategy})"
    )
    return PlacementInfo(pg, True, list(range(world_size)))


def wait_placed(pg, timeout: float, what: str) -> None:
    """Wait until Ray has placed `pg`; one it cannot place within `timeout`
    is removed (its bundles would stay reserved) and the error says what was
    asked (`what`) and what each node has: never a silent hang."""
    import ray
    from ray.util.placement_group import remove_placement_group

    ready, _ = ray.wait([pg.ready()], timeout=timeout)
    if not ready:
        description = describe_cluster()
        remove_placement_group(pg)
        raise RuntimeError(f"could not place {what} within {timeout:g} s; the cluster offers:\n{description}")


def rank_actor_options(placement_group, bundle_index: int, device: str, cpus_per_worker: int) -> dict:
    """The `.options()` of the actor of the rank on bundle `bundle_index`:
    the bundle's CPUs (or its GPU), the driver's environment, and every task
    it starts kept in the group."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    env = worker_env_vars(device)
    if device == "cpu":
        # OpenMP sizes its pool from this when the actor's process starts.
        env["OMP_NUM_THREADS"] = str(cpus_per_worker)
    return dict(
        num_cpus=0 if device == "cuda" else cpus_per_worker,
        num_gpus=1 if device == "cuda" else 0,
        # One thread for the steps (or the compiled graph's loop), one for
        # the liveness call, one for health checks.
        max_concurrency=3,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=placement_group,
            placement_group_bundle_index=bundle_index,
            placement_group_capture_child_tasks=True,
        ),
        runtime_env={"env_vars": env},
    )


def sort_workers(infos: list[tuple[str, str, list]], driver_node_id: str) -> list[int]:
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


# ---- data-parallel replicas -----------------------------------------------------------

# How long a replica may take to be placed (loading its model then has the
# engine's start timeout, fault_tolerance.engine_start_timeout_s).
REPLICA_PLACEMENT_TIMEOUT_S = 60.0
# CPU a replica's engine actor reserves when its ranks are Ray actors of their
# own: the engine loop is light, and Ray's CPUs are scheduling tokens.
_ENGINE_ONLY_CPUS = 0.01


def replica_bundles(config: EngineConfig) -> tuple[list[dict], float, list[int] | None]:
    """(bundles, the engine actor's CPUs, the bundles its executor's ranks take).
    A rank takes `num_threads` CPUs (1 by default) or, on CUDA, one GPU."""
    pc = config.parallel_config
    return engine_actor_bundles(
        pc.world_size, config.device, config.num_threads, pc.distributed_executor_backend == "ray"
    )


def engine_actor_bundles(
    world: int, device: str, num_threads: int | None, ray_ranks: bool
) -> tuple[list[dict], float, list[int] | None]:
    """replica_bundles from plain settings, for an engine that runs inside a
    Ray actor someone else places (a Ray Serve replica, whose deployment
    reserves these bundles before any config is resolved)."""
    cpus = float(num_threads or 1)
    rank = {"GPU": 1.0} if device == "cuda" else {"CPU": cpus}
    if ray_ranks:
        return (
            [{"CPU": _ENGINE_ONLY_CPUS}] + [dict(rank) for _ in range(world)],
            _ENGINE_ONLY_CPUS,
            list(range(1, world + 1)),
        )
    # uni or mp: the model runs in the actor or in processes it starts.
    engine = {"CPU": cpus * world} if device != "cuda" else {"CPU": 1.0, "GPU": float(world)}
    return [engine], engine["CPU"], None


def replica_num_cpus_hint(config: EngineConfig) -> int:
    """CPU tokens a local Ray started for the replicas should have (each
    replica with its P/D role's threads, EngineConfig.for_role)."""
    pc = config.parallel_config
    return sum(
        int(sum(b.get("CPU", 0) for b in replica_bundles(config.for_role(pc.role_of(i)))[0]) + 1)
        for i in range(pc.data_parallel_size)
    )


def choose_nodes(
    num_replicas: int,
    cpus_per_replica: float,
    mode: str,
    nodes: list[tuple[str, float]],
    existing: dict[str, int] | None = None,
) -> list[str | None]:
    """A target node per replica from (node id, free CPUs), in preference
    order: "pack" fills a node before using the next, "spread" puts each
    replica on the node holding fewest so far (`existing` replicas counted).
    None: no node has room (Ray then decides, and the placement timeout says
    what is missing)."""
    free = {node: cpus for node, cpus in nodes}
    count = {node: (existing or {}).get(node, 0) for node, _ in nodes}
    order = [node for node, _ in nodes]
    targets: list[str | None] = []
    for _ in range(num_replicas):
        fitting = [n for n in order if free[n] >= cpus_per_replica]
        if not fitting:
            targets.append(None)
            continue
        if mode == "spread":
            node = min(fitting, key=lambda n: (count[n], order.index(n)))
        else:
            node = fitting[0]
        free[node] -= cpus_per_replica
        count[node] += 1
        targets.append(node)
    return targets


def replica_target_nodes(config: EngineConfig, num_replicas: int, existing: dict[str, int]) -> list[str | None]:
    """Target nodes for `num_replicas` more replicas, `existing` (node id ->
    replicas there) already running. Packing fills what is free now;
    spreading goes by capacity, counting the replicas already on each node
    (free CPUs lag behind a group just removed, and a busy node is still the
    right one for a spread replica: Ray waits for it)."""
    import ray
    from ray._private.state import available_resources_per_node, total_resources_per_node

    # With P/D roles of their own threads, room for the larger role's replica.
    roles = ("prefill", "decode") if config.parallel_config.prefill_replicas else ("both",)
    need = max(sum(b.get("CPU", 0) for b in replica_bundles(config.for_role(role))[0]) for role in roles)
    driver = ray.get_runtime_context().get_node_id()
    mode = config.parallel_config.data_parallel_placement
    per_node = total_resources_per_node() if mode == "spread" else available_resources_per_node()
    nodes = sorted(
        ((node, res.get("CPU", 0.0)) for node, res in per_node.items()), key=lambda item: (item[0] != driver, item[0])
    )
    if mode == "spread":
        # Capacity, not free CPUs: what a node holds is counted by replicas.
        nodes = [(node, cpus - existing.get(node, 0) * need) for node, cpus in nodes]
    return choose_nodes(num_replicas, need, mode, nodes, existing)


def replica_placement_group(bundles: list[dict], mode: str, target_node: str | None):
    """A replica's placement group, requested (not waited for). One node per
    replica: its TP group and its engine stay together. Spread replicas must
    land on their node (a hard label selector: Ray waits for it); packing is
    a preference (soft: any node with room)."""
    from ray.util.placement_group import placement_group

    if target_node is not None and mode == "spread":
        return placement_group(
            bundles, strategy="STRICT_PACK", bundle_label_selector=[{"ray.io/node-id": target_node}] * len(bundles)
        )
    return placement_group(bundles, strategy="STRICT_PACK", _soft_target_node_id=target_node)


def place_replica(index: int, bundles: list[dict], mode: str, target_node: str | None):
    """Replica `index`'s placement group, once Ray has placed it; a replica
    not placed within REPLICA_PLACEMENT_TIMEOUT_S leaves no group behind and
    the error says what the cluster offers."""
    pg = replica_placement_group(bundles, mode, target_node)
    wait_placed(pg, REPLICA_PLACEMENT_TIMEOUT_S, f"data-parallel replica {index} (bundles {bundles}, all on one node)")
    return pg


def remove_placement_groups(groups: list, nodes: list[NodeState] | None = None) -> None:
    """Remove the groups and wait until Ray says they are gone, and until the
    `nodes`' free resources read as they did before the groups again: the
    view of free resources lags behind, and a run started right after (a
    `raylm plan`'s, say) places by it (data-parallel packing does)."""
    import ray
    from ray._private.state import available_resources_per_node
    from ray.util.placement_group import remove_placement_group

    for group in groups:
        try:
            remove_placement_group(group)
        except Exception as e:  # say so: its bundles would stay reserved
            logger.warning("could not remove placement group %s: %s", group.id.hex()[:12], e)
    deadline = time.monotonic() + _REMOVAL_WAIT_S
    for group in groups:
        while ray.util.placement_group_table(group).get("state") not in ("REMOVED", None):
            if time.monotonic() >= deadline:
                logger.warning("placement group %s is not removed yet", group.id.hex()[:12])
                break
            time.sleep(0.05)
    while nodes and groups and time.monotonic() < deadline:
        now = available_resources_per_node()
        if all(now.get(n.node_id, {}).get(k, 0.0) >= v - 1e-6 for n in nodes for k, v in n.available.items()):
            return
        time.sleep(0.1)
