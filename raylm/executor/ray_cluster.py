"""The Ray cluster a run uses: connect to one (an address, or the cluster
`ray start` recorded on this machine), or start a local instance and grow it
while nothing lives in it; describe what its nodes have, so that a request
that does not fit can say what is missing. Placement is ray_placement's."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from raylm.config import ParallelConfig

logger = logging.getLogger(__name__)

# The oldest Ray the tests pass on (README, "Supported versions"; 2.40 lacks
# placement_group(bundle_label_selector=...), and its pipeline-parallel runs
# returned no tokens).
MIN_RAY_VERSION = (2, 58)


def check_ray_version() -> None:
    """Fail early and clearly when Ray is missing, too old, or lacks compiled graphs."""
    try:
        import ray
    except ImportError as e:
        raise RuntimeError(
            "distributed_executor_backend='ray' needs Ray: pip install 'ray[default]>=2.58,<2.61'"
        ) from e
    version = tuple(int(p) for p in ray.__version__.split(".")[:2])
    if version < MIN_RAY_VERSION:
        raise RuntimeError(
            f"Ray {ray.__version__} is too old for raylm's Ray executor; need >= {'.'.join(map(str, MIN_RAY_VERSION))}"
        )
    try:
        import ray.dag.compiled_dag_node
    except ImportError as e:
        raise RuntimeError(f"Ray {ray.__version__} lacks compiled-graph support (ray.dag)") from e


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
        path,
        address,
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
    except Exception:  # another Ray version: identity unknown, so never ours
        return None


def owns_local_ray() -> bool:
    """True when the Ray this process is connected to was started by raylm."""
    return (
        _own_local_ray is not None
        and _own_local_ray["identity"] is not None
        and _own_local_ray["identity"] == _current_ray_identity()
    )


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
            have,
            num_cpus_hint,
            users,
        )
        return
    logger.info(
        "restarting raylm's local Ray instance: it has %d CPU tokens, this engine needs %d", have, num_cpus_hint
    )
    _own_local_ray = None
    ray.shutdown()
    _start_own_local_ray(num_cpus_hint)


# How long kill_actors waits for Ray to report the actors dead.
KILL_WAIT_S = 5.0


def kill_actors(actors: list, timeout: float = KILL_WAIT_S) -> None:
    """Kill the `actors` (one already dead is skipped) and wait until Ray
    reports them dead: ray.kill only asks the GCS, which reports them later
    (under load, a while later). An engine that failed to start or was shut
    down must not return while its actors still hold their resources: the
    next engine of the process (a test's, a restarted replica's) would be
    placed beside them."""
    import ray
    from ray._private.state import actors as actor_table

    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # already dead
            pass

    deadline = time.monotonic() + timeout
    pending = [actor._actor_id.hex() for actor in actors]
    while True:
        try:
            pending = [i for i in pending if actor_table(actor_id=i).get("State") not in ("DEAD", None)]
        except Exception as e:  # Ray going down: nothing left to wait for
            logger.debug("cannot read the actors' states: %s", e)
            return
        if not pending:
            return
        if time.monotonic() >= deadline:
            logger.warning("%d killed Ray actor(s) are not reported dead yet", len(pending))
            return
        time.sleep(0.02)


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


def describe_cluster() -> str:
    """Each live node's free and total resources, for an error that says
    why a placement group was not placed."""
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
class NodeState:
    node_id: str
    ip: str
    total: dict[str, float]
    available: dict[str, float]
    is_driver: bool = False


def cluster_nodes(driver_node_id: str) -> list[NodeState]:
    """The live nodes, the driver's first, then by IP and id."""
    import ray
    from ray._private.state import available_resources_per_node

    available = available_resources_per_node()
    nodes = [
        NodeState(
            n["NodeID"],
            n["NodeManagerAddress"],
            _plain(n.get("Resources", {})),
            _plain(available.get(n["NodeID"], {})),
            n["NodeID"] == driver_node_id,
        )
        for n in ray.nodes()
        if n.get("Alive")
    ]
    return sorted(nodes, key=lambda n: (not n.is_driver, _ip_key(n.ip), n.node_id))


def _plain(resources: dict) -> dict[str, float]:
    """Schedulable resources only: no node:IP markers, memory, or the bundle
    resources Ray makes for placement groups."""
    return {
        k: float(v)
        for k, v in resources.items()
        if not k.startswith(("node:", "accelerator_type:")) and "memory" not in k and "_group_" not in k
    }


def _ip_key(ip: str):
    try:
        return (0, tuple(int(p) for p in ip.split(".")))
    except ValueError:
        return (1, ip)


def gcs_address() -> str | None:
    """The address of the connected cluster's GCS, if Ray says."""
    import ray

    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # "if Ray says": any failure means no address
        return None


def disconnect_ray() -> None:
    """Disconnect from Ray; the local instance raylm started, if that is the
    one in use, stops with it (a joined cluster lives on)."""
    global _own_local_ray
    import ray

    ray.shutdown()
    _own_local_ray = None
