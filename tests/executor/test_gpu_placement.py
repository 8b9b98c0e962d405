"""GPUs on Ray without GPUs: which CUDA device a rank uses follows from the
GPU Ray gave it and the CUDA_VISIBLE_DEVICES its node shows (a pure function,
then the actors' report on a simulated cluster whose nodes declare GPUs, and
the executor's rank assignment); the compiled-graph NCCL path wants CuPy."""

from __future__ import annotations

import json
import os
import shutil
import sys
import types

import pytest

from raylm.config import create_engine_config
from raylm.entrypoints import cli
from raylm.executor import ray_placement
from raylm.executor.ray_cgraph import check_cupy_for_nccl_channels
from raylm.executor.ray_executor import RayDistributedExecutor
from raylm.executor.ray_worker import cuda_device_index
from tests.conftest import our_live_ray_state
from tests.multinode.harness import short_tempdir


@pytest.mark.parametrize(
    "ray_ids, visible, index",
    [
        ([0], None, 0),
        ([3], None, 3),  # nothing hidden: Ray's id is the device index
        (["1"], None, 1),
        (["2"], "2,3", 0),  # a restricted node: Ray's GPU 2 is its first device
        (["3"], "2,3", 1),
        ([3], " 2, 3 ", 1),
        (["GPU-bbbb"], "GPU-aaaa,GPU-bbbb", 1),
        (["MIG-1234"], "MIG-1234", 0),
        (["5"], "5", 0),  # Ray rewrote the variable after all: still right
        (["0", "1"], "0,1", 0),  # several ids: the first
    ],
)
def test_device_index_from_ray_ids_and_visible_devices(ray_ids, visible, index):
    assert cuda_device_index(ray_ids, visible) == index


@pytest.mark.parametrize(
    "ray_ids, visible, message",
    [
        ([], None, "assigned no GPU"),
        (["4"], "2,3", "does not list it"),
        (["GPU-aaaa"], None, "not a device index"),
        (["0"], "", "does not list it"),
    ],
)
def test_device_index_errors_say_why(ray_ids, visible, message):
    with pytest.raises(ValueError, match=message):
        cuda_device_index(ray_ids, visible)


def test_cupy_check_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    with pytest.raises(RuntimeError, match=r"pip install cupy-cuda\w+.*ray_step_transport='mq'"):
        check_cupy_for_nccl_channels()
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    check_cupy_for_nccl_channels()


def test_cgraph_on_cuda_checks_cupy_before_placing_anything(monkeypatch, tiny_model_dir):
    monkeypatch.setitem(sys.modules, "cupy", None)

    def must_not_place(*args, **kwargs):
        raise AssertionError("placed workers before checking for CuPy")

    monkeypatch.setattr(ray_placement, "place_ranks", must_not_place)
    config = create_engine_config(
        tiny_model_dir("llama"),
        device="cuda",
        dtype="float32",
        distributed_executor_backend="ray",
        pipeline_parallel_size=2,
        ray_step_transport="cgraph",
    )
    with pytest.raises(RuntimeError, match="need CuPy"):
        RayDistributedExecutor(config)


class _NoCudaRayExecutor(RayDistributedExecutor):
    """The Ray executor up to the point where a worker would touch CUDA."""

    def collective_rpc(self, method, *args, **kwargs):
        if method in ("init_device", "load_model"):
            return [None] * len(self.workers)
        return super().collective_rpc(method, *args, **kwargs)


@pytest.fixture(scope="module")
def gpu_cluster():
    """A head without resources and three nodes with two GPUs each (declared:
    Ray hands out ids without physical GPUs): "plain" shows every device,
    "restricted" was started with CUDA_VISIBLE_DEVICES=2,3, "uuid" with UUIDs."""
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()  # the session's shared Ray; the next user restarts it
    mp = pytest.MonkeyPatch()
    root = short_tempdir("rlgp")
    mp.setenv("RAY_TMPDIR", root)
    mp.delenv("RAY_ADDRESS", raising=False)
    mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "num_gpus": 0})
    nodes = {}
    # A node's processes (and so its workers) inherit the environment it starts in.
    for name, visible in (("plain", None), ("restricted", "2,3"), ("uuid", "GPU-aaaa,GPU-bbbb")):
        # Through the monkeypatch, so that undo() restores the test process's
        # own value: set directly, the last node's value leaked into every
        # later test (and every Ray they started).
        if visible is None:
            mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            mp.setenv("CUDA_VISIBLE_DEVICES", visible)
        nodes[name] = c.add_node(num_cpus=1, num_gpus=2).node_id
    mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    mp.setenv("RAYLM_ALLOW_SHARED_NODE_IP", "1")
    yield c, nodes
    ray.shutdown()
    c.shutdown()
    mp.undo()
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.ray
def test_ranks_get_the_device_index_their_node_gives_ray_s_gpu(gpu_cluster, tiny_model_dir, capsys):
    _, nodes = gpu_cluster
    model = tiny_model_dir("llama", num_hidden_layers=3)
    flags = ["plan", "--model", model, "--device", "cuda", "--dtype", "float32", "-tp", "2", "-pp", "3", "--json"]
    assert cli.main(flags) == 0
    ranks = json.loads(capsys.readouterr().out)["replicas"][0]["ranks"]
    assert our_live_ray_state() == ([], [])
    # The actors report, per node: Ray's GPU ids, and the index among what the node shows.
    by_node: dict[str, set] = {}
    for r in ranks:
        by_node.setdefault(r["node_id"], set()).add((r["gpu_ids"][0], r["device"]))
    assert by_node == {
        nodes["plain"]: {("0", "cuda:0"), ("1", "cuda:1")},
        nodes["restricted"]: {("2", "cuda:0"), ("3", "cuda:1")},
        nodes["uuid"]: {("GPU-aaaa", "cuda:0"), ("GPU-bbbb", "cuda:1")},
    }
    # Each TP group on one node (PACK, two GPUs a node).
    assert all(len({r["node_id"] for r in ranks[s * 2 : (s + 1) * 2]}) == 1 for s in range(3))

    # The executor hands every rank that index (its Worker would use cuda:<local_rank>).
    config = create_engine_config(
        model,
        device="cuda",
        dtype="float32",
        distributed_executor_backend="ray",
        tensor_parallel_size=2,
        pipeline_parallel_size=3,
    )
    executor = _NoCudaRayExecutor(config)
    try:
        seen = executor.collective_rpc(lambda worker: (worker.local_rank, os.environ.get("CUDA_VISIBLE_DEVICES")))
        assert [index for index, _ in seen] == [int(r["device"].split(":")[1]) for r in ranks]
        assert executor.node_ids == [r["node_id"] for r in ranks]
        visible = {node: v for node, (_, v) in zip(executor.node_ids, seen)}
        assert visible == {nodes["plain"]: None, nodes["restricted"]: "2,3", nodes["uuid"]: "GPU-aaaa,GPU-bbbb"}
    finally:
        executor.shutdown()
    assert our_live_ray_state() == ([], [])
