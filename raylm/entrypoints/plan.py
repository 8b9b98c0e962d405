"""`raylm plan`: where a run's ranks (and data-parallel replicas) would land on
the Ray cluster, before any model loads.

The plan reserves the very placement groups the run would, through the
functions the run calls (raylm.executor.ray_placement: `rank_request` and
`place_ranks` as the Ray executor; for replicas, `replica_target_nodes` and
`replica_placement_group` as the data-parallel manager), reads where Ray put
each bundle, orders the ranks as the executor does (`sort_workers`), and
removes the groups: what it shows cannot drift from what the run asks for.
On CUDA it also starts one empty worker actor per bundle, with the options
the executor gives a rank's actor, to learn which GPU Ray gives it and its
device index there; nothing else starts. A request that does not fit is
answered with what is missing. The plan's records and how they print are
plan_report.py.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import sys
from typing import TextIO

from raylm.config import EngineConfig
from raylm.engine.arg_utils import EngineArgs, HelpFormatter
from raylm.entrypoints.plan_report import (
    Plan,
    describe_resources,
    format_plan,
    format_ranks,
    rank_placement,
    replica_placement,
)
from raylm.executor import ray_placement
from raylm.executor.ray_cluster import cluster_nodes, connect_ray, disconnect_ray, gcs_address
from raylm.executor.ray_worker import RayWorkerWrapper

logger = logging.getLogger(__name__)

EXIT_DOES_NOT_FIT = 1
# A request that can never fit the cluster's total resources is still tried
# (Ray is the judge), but only this long.
_INFEASIBLE_WAIT_S = 2.0
# How long an empty worker actor may take to start and answer (CUDA only).
_PROBE_TIMEOUT_S = 120.0


# ---- what does not fit, and why -------------------------------------------------------


def _fits_count(bundle: dict, resources: dict) -> int:
    """How many copies of `bundle` fit in `resources`."""
    counts = [math.floor(resources.get(k, 0.0) / v + 1e-9) for k, v in bundle.items() if v > 0]
    return min(counts) if counts else 0


def engine_shortfall(
    bundle: dict, world: int, strategy: str, nodes: list[tuple[str, str, dict]], pinned_ip: str | None
) -> list[str]:
    """Why `world` copies of `bundle` cannot be placed with `strategy` on
    `nodes` (id, ip, resources: free or total), bundle 0 on a node at
    `pinned_ip` as the Ray executor asks; [] when they fit."""
    counts = {node_id: _fits_count(bundle, res) for node_id, _, res in nodes}
    ips = {node_id: ip for node_id, ip, _ in nodes}
    pin_nodes = [n for n in counts if pinned_ip is None or ips[n] == pinned_ip]
    b = describe_resources(bundle)
    missing = []
    if pinned_ip is not None and not any(counts[n] >= 1 for n in pin_nodes):
        missing.append(
            f"bundle 0 (rank 0) goes on the driver's node ({pinned_ip}), which has no room for {b}: "
            "free some there, or run from a node that has room"
        )
    if strategy == "STRICT_PACK":
        best = max(pin_nodes, key=lambda n: counts[n], default=None)
        room = counts[best] if best is not None else 0
        if room < world:
            total = {k: v * world for k, v in bundle.items()}
            which = "one node (the driver's)" if pinned_ip is not None else "one node"
            missing.append(
                f"STRICT_PACK needs {which} with room for all {world} bundles {describe_resources(total)}; "
                f"the roomiest has room for {room}: missing {world - room} x {b} there"
            )
    elif strategy == "STRICT_SPREAD":
        with_room = sum(1 for c in counts.values() if c >= 1)
        if with_room < world:
            missing.append(
                f"STRICT_SPREAD needs {world} nodes with room for {b} each; {with_room} have room: "
                f"missing {world - with_room} node(s) with {b} free"
            )
    else:
        room = sum(counts.values())
        if room < world:
            missing.append(
                f"{world} bundles of {b} ({strategy}); the cluster has room for {room}: missing {world - room} x {b}"
            )
    return missing


# ---- one engine: the Ray executor's placement group --------------------------------


def _plan_engine(config: EngineConfig, plan_base: dict) -> Plan:
    import ray

    pc = config.parallel_config
    request = ray_placement.rank_request(config)  # as RayDistributedExecutor asks
    world, bundle = request.world, request.bundle
    connect_ray(pc, num_cpus_hint=request.num_cpus_hint)
    driver_node = ray.get_runtime_context().get_node_id()
    driver_ip = ray.util.get_node_ip_address()
    nodes = cluster_nodes(driver_node)
    plan = Plan(False, gcs_address(), driver_node, nodes, dict(plan_base, bundle=bundle, bundles=world))

    never = engine_shortfall(
        bundle, world, pc.ray_placement_strategy, [(n.node_id, n.ip, n.total) for n in nodes], driver_ip
    )
    pc = copy.copy(pc)  # the timeout is the plan's; the rest is the run's
    if never:
        pc.ray_placement_timeout = min(pc.ray_placement_timeout, _INFEASIBLE_WAIT_S)
    try:
        placement = ray_placement.place_ranks(pc, request)
    except RuntimeError as e:  # not placed within the timeout (the group is removed)
        plan.missing = (
            never
            or engine_shortfall(
                bundle, world, pc.ray_placement_strategy, [(n.node_id, n.ip, n.available) for n in nodes], driver_ip
            )
            or [f"Ray did not place the group within {pc.ray_placement_timeout:g} s: {str(e).splitlines()[0]}"]
        )
        if not never:
            plan.missing.append("(the cluster has the resources in total: they are in use now)")
        return plan

    actors = []
    try:
        pg = placement.placement_group
        to_node = ray.util.placement_group_table(pg)["bundles_to_node_id"]
        ip_of = {n.node_id: n.ip for n in nodes}
        if config.device == "cuda":
            actors = _probe_actors(pg, placement.bundle_indices, request)
            infos = ray.get([a.get_node_info.remote() for a in actors], timeout=_PROBE_TIMEOUT_S)
            indices = []
            for actor, (_, ip, gpu_ids) in zip(actors, infos):
                try:
                    indices.append(ray.get(actor.get_cuda_device_index.remote(), timeout=_PROBE_TIMEOUT_S))
                except ray.exceptions.RayTaskError as e:  # the node does not show the GPU Ray gave
                    indices.append(None)
                    cause = e.cause if isinstance(getattr(e, "cause", None), Exception) else e
                    plan.missing.append(f"a worker on {ip} with Ray's GPU {','.join(map(str, gpu_ids))}: {cause}")
        else:
            infos = [(to_node[i], ip_of.get(to_node[i], "?"), []) for i in placement.bundle_indices]
            indices = None
    finally:
        for actor in actors:
            ray.kill(actor)
        if placement.created_here:
            ray_placement.remove_placement_groups([placement.placement_group], nodes)

    try:
        ray_placement.check_one_ip_per_node(infos)
    except RuntimeError as e:
        plan.missing.append(f"the run would fail: {e}")
    order = ray_placement.sort_workers(infos, driver_node)
    ranks = []
    seen: dict[str, int] = {}
    tp, cp = pc.tensor_parallel_size, pc.context_parallel_size
    for rank, i in enumerate(order):
        node_id, ip, gpu_ids = infos[i]
        local_rank = seen.get(node_id, 0)
        seen[node_id] = local_rank + 1
        device = "cpu"
        if indices is not None:
            local_rank = indices[i] if indices[i] is not None else -1
            device = f"cuda:{indices[i] if indices[i] is not None else '?'}"
        ranks.append(rank_placement(rank, pc, node_id, ip, device, local_rank, [str(g) for g in gpu_ids]))
    replica = replica_placement(0, None, None, ranks, pc)
    plan.replicas = [replica]
    plan.fits = not plan.missing
    for group in replica.tp_groups:
        if group.spans_nodes:
            plan.warnings.append(
                f"the TP group of PP stage {group.ranks[0] // (tp * cp)} (ranks "
                f"{format_ranks(group.ranks)}) spans {len(set(group.node_ids))} nodes: tensor "
                "parallelism across nodes is slow"
            )
    for group in replica.cp_groups:
        if group.spans_nodes:
            plan.warnings.append(
                f"the CP group of ranks {format_ranks(group.ranks)} spans {len(set(group.node_ids))} "
                "nodes: context parallelism merges attention every layer, slow across nodes"
            )
    return plan


def _probe_actors(pg, bundle_indices: list[int], request: ray_placement.RankRequest) -> list:
    """One empty worker actor per bundle, created as the executor creates its
    own: Ray gives each the GPU it would give the rank there."""
    import ray

    actor_cls = ray.remote(RayWorkerWrapper)
    return [
        actor_cls.options(**ray_placement.rank_actor_options(pg, i, "cuda", request.cpus_per_worker)).remote(rank=rank)
        for rank, i in enumerate(bundle_indices)
    ]


# ---- data-parallel replicas: one STRICT_PACK group each -----------------------------


def _plan_replicas(config: EngineConfig, plan_base: dict) -> Plan:
    import ray

    pc = config.parallel_config
    size = pc.data_parallel_size
    mode = pc.data_parallel_placement
    # Each replica as it starts: its P/D role's threads size its bundles.
    configs = [config.for_role(pc.role_of(i)) for i in range(size)]
    bundles_of = [ray_placement.replica_bundles(c)[0] for c in configs]
    bundles, _, rank_bundles = ray_placement.replica_bundles(config)
    need = max(sum(b.get("CPU", 0) for b in each) for each in bundles_of)
    connect_ray(pc, num_cpus_hint=ray_placement.replica_num_cpus_hint(config))  # as the run's manager does
    groups = []
    nodes = None
    try:
        driver_node = ray.get_runtime_context().get_node_id()
        nodes = cluster_nodes(driver_node)
        request = dict(plan_base, replica_bundles=bundles, replica_cpus=need)
        if config.prefill_num_threads is not None or config.decode_num_threads is not None:
            request["role_threads"] = {role: config.threads_of_role(role) for role in ("prefill", "decode")}
            request["role_bundles"] = {
                role: ray_placement.replica_bundles(config.for_role(role))[0] for role in ("prefill", "decode")
            }
        plan = Plan(False, gcs_address(), driver_node, nodes, request)
        capacity = sorted(
            ((n.node_id, n.total.get("CPU", 0.0)) for n in nodes), key=lambda item: (item[0] != driver_node, item[0])
        )
        never = [i for i, t in enumerate(ray_placement.choose_nodes(size, need, mode, capacity)) if t is None]
        # As CoreEngineActorManager places new replicas (none runs yet).
        targets = ray_placement.replica_target_nodes(config, size, {})
        for index, target in enumerate(targets):
            groups.append(ray_placement.replica_placement_group(bundles_of[index], mode, target))
        timeout = min(pc.ray_placement_timeout, _INFEASIBLE_WAIT_S) if never else pc.ray_placement_timeout
        ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=timeout)
        placed = {}
        for index, group in enumerate(groups):
            table = ray.util.placement_group_table(group)
            if table.get("state") == "CREATED":
                placed[index] = table["bundles_to_node_id"]
    finally:
        ray_placement.remove_placement_groups(groups, nodes)

    unplaced = [i for i in range(size) if i not in placed]
    if unplaced:
        now = [i for i, t in enumerate(targets) if t is None]
        plan.missing.append(
            f"replica(s) {format_ranks(unplaced)} not placed: each needs one node with "
            f"{describe_resources({'CPU': need})} "
            f"free (bundles {[describe_resources(b) for b in bundles]}, STRICT_PACK); "
            + (
                f"the cluster's nodes can hold {size - len(never)} of {size} replicas in total"
                if never
                else f"{size - len(now)} of {size} fit what is free now (the rest is in use)"
            )
        )
    ip_of = {n.node_id: n.ip for n in nodes}
    for index in range(size):
        if index not in placed:
            continue
        node = placed[index][0]  # the engine actor's bundle; all of a replica's share its node
        # The replica's executor is its own driver, on this node: ranks in
        # bundle order (Ray executor) or local processes (uni, mp).
        ranks = [
            rank_placement(
                r,
                pc,
                placed[index][rank_bundles[r]] if rank_bundles else node,
                ip_of.get(node, "?"),
                f"cuda:{r}" if config.device == "cuda" else "cpu",
                r,
            )
            for r in range(pc.world_size)
        ]
        plan.replicas.append(
            replica_placement(index, node, ip_of.get(node, "?"), ranks, pc, configs[index].num_threads)
        )
    if config.device == "cuda":
        plan.warnings.append(
            "data-parallel replicas reserve CPU bundles only (ray_placement.replica_bundles): "
            "Ray assigns their ranks no GPU, and the device indices shown are local ranks"
        )
    plan.fits = not plan.missing
    return plan


def make_plan(config: EngineConfig) -> Plan:
    """Reserve the run's placement groups on the cluster (joined, or a local Ray
    started and stopped here), read where the bundles went, release them."""
    import ray

    pc = config.parallel_config
    backend = pc.distributed_executor_backend
    if pc.data_parallel_size == 1 and backend not in (None, "ray"):
        raise ValueError(
            f"raylm plan places a Ray run; distributed_executor_backend {backend!r} runs every rank "
            "on this machine (leave it out, or use ray)"
        )
    base = {
        "tensor_parallel_size": pc.tensor_parallel_size,
        "pipeline_parallel_size": pc.pipeline_parallel_size,
        "context_parallel_size": pc.context_parallel_size,
        "data_parallel_size": pc.data_parallel_size,
        "device": config.device,
    }
    was_connected = ray.is_initialized()
    try:
        if pc.data_parallel_size == 1:
            pc.distributed_executor_backend = "ray"
            base.update(executor_backend="ray", placement_strategy=pc.ray_placement_strategy)
            return _plan_engine(config, base)
        base.update(
            executor_backend=backend or ("uni" if pc.world_size == 1 else "mp"),
            data_parallel_placement=pc.data_parallel_placement,
            prefill_replicas=pc.prefill_replicas,
        )
        return _plan_replicas(config, base)
    finally:
        if not was_connected:
            disconnect_ray()


# ---- command line ---------------------------------------------------------------------


def add_plan_subcommand(commands) -> None:
    parser = commands.add_parser(
        "plan",
        help="dry run: where each rank and replica would land on the Ray cluster",
        description="Reserve the placement groups a run with these flags would, show which rank (and "
        "data-parallel replica) lands on which node and device and which TP/PP/CP groups span nodes, "
        "then release them. Nothing loads. Exits 1, saying what is missing, when it does not fit.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--ray-placement-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long Ray may take to place the groups before the plan says they do not fit",
    )
    EngineArgs.add_cli_args(parser)  # keeps the shorter --ray-placement-timeout above
    parser.set_defaults(handler=run_plan)


def run_plan(args: argparse.Namespace, out: TextIO) -> None:
    config = EngineArgs.from_cli_args(args).create_engine_config()
    try:
        plan = make_plan(config)
    except ConnectionError as e:  # no cluster at the given address: the message says so
        raise ValueError(str(e)) from e
    if args.json:
        out.write(json.dumps(plan.to_json(), indent=2) + "\n")
    else:
        out.write(format_plan(plan) + "\n")
    out.flush()
    if not plan.fits:
        if args.json:
            print("error: does not fit: " + "; ".join(plan.missing), file=sys.stderr)
        raise SystemExit(EXIT_DOES_NOT_FIT)
