"""What `raylm plan` finds, and how it prints: the Plan with each replica's
ranks (node, device, GPU ids) and its TP/PP/CP groups (whether each spans
nodes), built from where Ray put each bundle (`rank_placement`,
`replica_placement`), and the table `format_plan` writes. plan.py does the
reserving and probing that fills it in.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from raylm.distributed.parallel_state import cp_group_ranks, pp_group_ranks, rank_coordinates, tp_group_ranks
from raylm.executor.ray_cluster import NodeState


@dataclass
class RankPlacement:
    rank: int
    tp_rank: int
    pp_rank: int
    node_id: str
    node_ip: str
    device: str  # "cpu", or "cuda:N" (N: the index among the devices the node shows)
    local_rank: int
    gpu_ids: list[str] = field(default_factory=list)
    cp_rank: int = 0


@dataclass
class GroupPlacement:
    ranks: list[int]
    node_ids: list[str]
    spans_nodes: bool


@dataclass
class ReplicaPlacement:
    replica: int
    node_id: str | None
    node_ip: str | None
    ranks: list[RankPlacement]
    tp_groups: list[GroupPlacement]
    pp_groups: list[GroupPlacement]
    cp_groups: list[GroupPlacement] = field(default_factory=list)
    # Its P/D role (raylm.config.replica_role): prefill, decode, or both.
    role: str = "both"
    # Torch threads per worker it starts with (its role's, EngineConfig.for_role);
    # None: planned by each worker from the cores it finds.
    threads: int | None = None


@dataclass
class Plan:
    fits: bool
    ray_address: str | None
    driver_node_id: str
    nodes: list[NodeState]
    request: dict
    replicas: list[ReplicaPlacement] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def rank_placement(
    rank: int, pc, node_id: str, ip: str, device: str, local_rank: int, gpu_ids: list[str] | None = None
) -> RankPlacement:
    tp_rank, pp_rank, cp_rank = rank_coordinates(rank, pc.tensor_parallel_size, pc.context_parallel_size)
    return RankPlacement(rank, tp_rank, pp_rank, node_id, ip, device, local_rank, gpu_ids or [], cp_rank)


def replica_placement(
    index, node_id, node_ip, ranks: list[RankPlacement], pc, threads: int | None = None
) -> ReplicaPlacement:
    tp, pp, cp = pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.context_parallel_size

    def group(members: list[int]) -> GroupPlacement:
        node_ids = [ranks[r].node_id for r in members]
        return GroupPlacement(members, node_ids, len(set(node_ids)) > 1)

    return ReplicaPlacement(
        index,
        node_id,
        node_ip,
        ranks,
        [group(g) for g in tp_group_ranks(tp, pp, cp)],
        [group(g) for g in pp_group_ranks(tp, pp, cp)],
        [group(g) for g in cp_group_ranks(tp, pp, cp)],
        pc.role_of(index),
        threads,
    )


def format_ranks(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def describe_resources(resources: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"


# ---- output ---------------------------------------------------------------------------


def format_plan(plan: Plan) -> str:
    short = {n.node_id: n.node_id[:12] for n in plan.nodes}
    req = plan.request
    lines = [f"Ray cluster {plan.ray_address or '?'}: {len(plan.nodes)} node(s)"]
    for n in plan.nodes:
        res = ", ".join(f"{k} {n.available.get(k, 0):g}/{n.total[k]:g}" for k in sorted(n.total))
        driver = "  <- driver" if n.is_driver else ""
        lines.append(f"  {short[n.node_id]}  {n.ip:<15} {res or '-'} (free/total){driver}")
    layout = f"TP={req['tensor_parallel_size']} x PP={req['pipeline_parallel_size']}"
    if req.get("context_parallel_size", 1) > 1:
        layout += f" x CP={req['context_parallel_size']}"
    if req["data_parallel_size"] > 1:
        per_role = req.get("role_bundles") or {"": req["replica_bundles"]}
        each = "; ".join(
            f"each {role + ' ' if role else ''}replica: {' + '.join(describe_resources(b) for b in bundles)}"
            for role, bundles in per_role.items()
        )
        lines.append(
            f"Request: {req['data_parallel_size']} data-parallel replicas ({req['data_parallel_placement']}) "
            f"of {layout}, executor {req['executor_backend']}, device {req['device']}; {each} on one node"
        )
        if req.get("prefill_replicas"):
            p, n = req["prefill_replicas"], req["data_parallel_size"]
            lines.append(
                f"Roles (--prefill-replicas {p}): replica(s) {format_ranks(list(range(p)))} prefill, "
                f"{format_ranks(list(range(p, n)))} decode (added ones decode)"
            )
            threads = req.get("role_threads") or {}
            if threads:
                lines.append(
                    "Threads per worker: "
                    + ", ".join(f"{role} {threads[role] or 'planned'}" for role in ("prefill", "decode"))
                )
    else:
        lines.append(
            f"Request: {layout} = {req['bundles']} Ray workers, {describe_resources(req['bundle'])} each, "
            f"strategy {req['placement_strategy']}, device {req['device']}"
        )
    if any(replica.ranks for replica in plan.replicas):
        lines.append("")
        dp = req["data_parallel_size"] > 1
        with_cp = req.get("context_parallel_size", 1) > 1
        with_roles = dp and bool(req.get("prefill_replicas"))
        with_threads = with_roles and bool(req.get("role_threads"))
        header = (
            (["replica"] if dp else [])
            + (["role"] if with_roles else [])
            + (["threads"] if with_threads else [])
            + ["rank", "tp", "pp"]
            + (["cp"] if with_cp else [])
            + ["node", "ip", "device", "gpu"]
        )
        rows = []
        for replica in plan.replicas:
            for r in replica.ranks:
                rows.append(
                    ([str(replica.replica)] if dp else [])
                    + ([replica.role] if with_roles else [])
                    + ([str(replica.threads or "planned")] if with_threads else [])
                    + [str(r.rank), str(r.tp_rank), str(r.pp_rank)]
                    + ([str(r.cp_rank)] if with_cp else [])
                    + [short.get(r.node_id, r.node_id[:12]), r.node_ip, r.device, ",".join(r.gpu_ids) or "-"]
                )
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
        lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
        lines.extend("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
        if not dp:
            lines.append("")
        # (A replica's groups never leave its node.)
        for replica in [] if dp else plan.replicas:
            for kind, groups in (("TP", replica.tp_groups), ("PP", replica.pp_groups), ("CP", replica.cp_groups)):
                if not groups or len(groups[0].ranks) < 2:
                    continue
                parts = []
                for g in groups:
                    where = (
                        f"across {len(set(g.node_ids))} nodes"
                        if g.spans_nodes
                        else f"on {short.get(g.node_ids[0], g.node_ids[0][:12])}"
                    )
                    parts.append(f"ranks {format_ranks(g.ranks)} {where}")
                lines.append(f"{kind} groups: " + "; ".join(parts))
    for warning in plan.warnings:
        lines.append(f"warning: {warning}")
    if plan.fits:
        lines.append("Fits. (Placement groups reserved for the plan are removed.)")
    else:
        lines.append("Does not fit:")
        lines.extend(f"  - {m}" for m in plan.missing)
    return "\n".join(lines)
