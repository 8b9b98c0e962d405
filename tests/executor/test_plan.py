"""`raylm plan` on a simulated cluster: the plan is where the following run's
ranks (and data-parallel replicas) really land, and a request that does not
fit says what is missing, exits non-zero and leaves no placement group."""

from __future__ import annotations

import json
import shutil

import pytest

from raylm import LLM
from raylm.entrypoints import cli
from raylm.entrypoints.plan import EXIT_DOES_NOT_FIT, engine_shortfall
from tests.conftest import executor_of, our_live_ray_state
from tests.multinode.harness import short_tempdir


def test_shortfall_says_what_is_missing_per_strategy():
    nodes = [("a", "10.0.0.1", {"CPU": 3.0}), ("b", "10.0.0.2", {"CPU": 1.0}), ("c", "10.0.0.3", {"CPU": 0.5})]
    one = {"CPU": 1}
    assert engine_shortfall(one, 4, "PACK", nodes, "10.0.0.1") == []
    assert engine_shortfall(one, 4, "SPREAD", nodes, None) == []
    assert "missing 1 x {CPU: 1}" in engine_shortfall(one, 5, "PACK", nodes, "10.0.0.1")[0]
    assert "missing 1 node(s)" in engine_shortfall(one, 3, "STRICT_SPREAD", nodes, "10.0.0.1")[0]
    assert engine_shortfall(one, 3, "STRICT_PACK", nodes, "10.0.0.1") == []
    strict_pack = engine_shortfall(one, 3, "STRICT_PACK", nodes, "10.0.0.2")  # the driver's node is b
    assert len(strict_pack) == 1 and "missing 2 x {CPU: 1}" in strict_pack[0]
    pinned = engine_shortfall(one, 1, "PACK", nodes, "10.0.0.3")  # the driver's node has 0.5 CPU
    assert len(pinned) == 1 and "driver's node (10.0.0.3)" in pinned[0]
    assert engine_shortfall({"GPU": 1}, 1, "PACK", nodes, None)[0].endswith("missing 1 x {GPU: 1}")


@pytest.fixture(scope="module")
def cluster():
    """A head without CPUs, node "big" with 3 CPUs and node "small" with 1
    (simulated: one IP for all), in a RAY_TMPDIR of its own."""
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()  # the session's shared Ray; the next user restarts it
    mp = pytest.MonkeyPatch()
    root = short_tempdir("rlpl")
    mp.setenv("RAY_TMPDIR", root)
    mp.delenv("RAY_ADDRESS", raising=False)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = {"big": c.add_node(num_cpus=3).node_id, "small": c.add_node(num_cpus=1).node_id}
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    mp.setenv("RAYLM_ALLOW_SHARED_NODE_IP", "1")
    yield c, nodes
    ray.shutdown()
    c.shutdown()
    mp.undo()
    shutil.rmtree(root, ignore_errors=True)


def _plan(capsys, *flags) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = cli.main(["plan", "--num-threads", "1", "--ray-placement-timeout", "5", *flags])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.ray
def test_the_plan_is_where_the_run_lands(cluster, tiny_model_dir, capsys):
    _, nodes = cluster
    model = tiny_model_dir("llama")
    code, out, err = _plan(capsys, "-tp", "2", "-pp", "2", "--model", model, "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["fits"] and plan["missing"] == []
    assert our_live_ray_state() == ([], [])  # the plan's group is gone
    ranks = plan["replicas"][0]["ranks"]
    # 3 + 1 CPUs for 4 one-CPU bundles: the node holding fewer ranks comes first.
    assert [r["node_id"] for r in ranks] == [nodes["small"]] + [nodes["big"]] * 3
    assert [(r["tp_rank"], r["pp_rank"]) for r in ranks] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    tp_groups = plan["replicas"][0]["tp_groups"]
    assert [g["spans_nodes"] for g in tp_groups] == [True, False]
    assert any("spans 2 nodes" in w for w in plan["warnings"])

    with LLM(
        model,
        dtype="float32",
        distributed_executor_backend="ray",
        num_threads=1,
        kv_cache_memory_bytes=16 << 20,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
    ) as llm:
        assert executor_of(llm).node_ids == [r["node_id"] for r in ranks]
    assert our_live_ray_state() == ([], [])

    # The same as a table.
    code, out, _ = _plan(capsys, "-tp", "2", "-pp", "2", "--model", model)
    assert code == 0
    assert "TP groups: ranks 0,1 across 2 nodes; ranks 2,3 on " + nodes["big"][:12] in out
    assert "Fits." in out and out.count(nodes["big"][:12]) >= 4


@pytest.mark.ray
def test_replicas_are_planned_where_they_start(cluster, tiny_model_dir, capsys):
    model = tiny_model_dir("llama")
    code, out, err = _plan(capsys, "-dp", "2", "--data-parallel-placement", "spread", "--model", model, "--json")
    assert code == 0, err
    plan = json.loads(out)
    planned = {r["replica"]: r["node_id"] for r in plan["replicas"]}
    assert sorted(planned.values()) == sorted(cluster[1].values())  # one per node
    assert our_live_ray_state() == ([], [])

    with LLM(
        model,
        dtype="float32",
        data_parallel_size=2,
        data_parallel_placement="spread",
        num_threads=1,
        kv_cache_memory_bytes=16 << 20,
    ) as llm:
        manager = llm.llm_engine.engine_core.launcher.manager
        assert {i: h.node_id for i, h in manager.replicas.items()} == planned
    assert our_live_ray_state() == ([], [])


@pytest.mark.ray
def test_each_p_d_role_is_planned_with_its_own_threads(cluster, tiny_model_dir, capsys):
    model = tiny_model_dir("llama")
    flags = ("-dp", "2", "--prefill-replicas", "1", "--prefill-num-threads", "2", "--model", model)
    code, out, err = _plan(capsys, *flags, "--json")
    assert code == 0, err
    plan = json.loads(out)
    # (--num-threads 1, as _plan passes it, is the decode replicas'.)
    assert [(r["role"], r["threads"]) for r in plan["replicas"]] == [("prefill", 2), ("decode", 1)]
    assert plan["request"]["role_bundles"] == {"prefill": [{"CPU": 2.0}], "decode": [{"CPU": 1.0}]}
    assert our_live_ray_state() == ([], [])
    code, out, _ = _plan(capsys, *flags)
    assert code == 0 and "Threads per worker: prefill 2, decode 1" in out, out


@pytest.mark.ray
def test_a_request_that_does_not_fit_says_what_is_missing(cluster, tiny_model_dir, capsys):
    from ray.util import placement_group_table

    model = tiny_model_dir("llama")
    before = set(placement_group_table())
    code, out, _ = _plan(capsys, "-tp", "2", "-pp", "2", "--ray-placement-strategy", "STRICT_SPREAD", "--model", model)
    assert code == EXIT_DOES_NOT_FIT
    assert "Does not fit" in out and "STRICT_SPREAD needs 4 nodes" in out and "missing 2 node(s)" in out

    code, out, err = _plan(capsys, "-tp", "2", "-pp", "3", "--model", model, "--json")
    assert code == EXIT_DOES_NOT_FIT
    assert "missing 2 x {CPU: 1}" in " ".join(json.loads(out)["missing"]) and "does not fit" in err

    code, out, _ = _plan(capsys, "-dp", "5", "--model", model)
    assert code == EXIT_DOES_NOT_FIT and "replica(s) 4 not placed" in out and "hold 4 of 5" in out

    assert our_live_ray_state() == ([], [])
    assert all(g["state"] == "REMOVED" for pg_id, g in placement_group_table().items() if pg_id not in before)


class _Placed(Exception):
    """Raised where the executor would reserve its placement group: what it asked for is recorded."""


@pytest.mark.ray
def test_the_plan_asks_for_the_cpus_per_rank_the_run_does(cluster, tiny_model_dir, capsys, monkeypatch):
    """On a node with more cores than the ranks need (16 here, faked through
    this process's CPU affinity), each rank's bundle holds the threads the
    CPU placement gives it (a core stays with the engine loop): the plan once
    asked for os.cpu_count() // world instead, more than the run reserves."""
    import os

    from raylm.config import create_engine_config
    from raylm.executor import ray_placement
    from raylm.executor.ray_executor import RayDistributedExecutor

    model = tiny_model_dir("llama")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    capsys.readouterr()
    try:
        cli.main(["plan", "-tp", "2", "--model", model, "--ray-placement-timeout", "5", "--json"])
    except SystemExit:
        pass  # 14 CPUs do not fit this cluster: what was asked for is what counts
    planned = json.loads(capsys.readouterr().out)["request"]["bundle"]

    asked = []

    def record(parallel_config, bundle, world_size):
        asked.append((dict(bundle), world_size))
        raise _Placed

    monkeypatch.setattr(ray_placement, "get_placement_group", record)
    config = create_engine_config(model, dtype="float32", distributed_executor_backend="ray", tensor_parallel_size=2)
    with pytest.raises(_Placed):
        RayDistributedExecutor(config)
    assert asked == [(planned, 2)]
    assert planned["CPU"] > 1  # the fake node's cores counted: more than this machine's default
    assert our_live_ray_state() == ([], [])
