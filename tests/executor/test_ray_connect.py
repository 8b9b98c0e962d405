"""Finding Ray without an address (ray_cluster.connect_ray): a cluster started
with `ray start --head` on this machine is joined, a cluster file left by a
killed head is ignored with a warning, and the local instance raylm starts
itself grows when a later engine of the process needs more. Node identity:
gloo's interface comes from the node's Ray IP, and nodes sharing an IP fail
with the fix named.

Each test runs with its own RAY_TMPDIR, so the cluster file it reads and
writes is its own, never the machine's /tmp/ray/ray_current_cluster."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest

from raylm import LLM, SamplingParams
from raylm.config import ParallelConfig
from raylm.executor import ray_cluster, ray_worker
from raylm.testing.hf_oracle import hf_greedy
from tests.conftest import our_live_ray_state
from tests.multinode.harness import free_ports, local_ray_head, short_tempdir

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [[4, 5, 6, 7], [9, 10], list(range(3, 40))]


@pytest.fixture
def private_ray_dir(monkeypatch):
    """No Ray connected, no address, a RAY_TMPDIR of the test's own; on exit
    this process is disconnected again (the next user of the session's shared
    Ray starts it again)."""
    import ray

    ray.shutdown()
    root = short_tempdir("rlc")
    monkeypatch.setenv("RAY_TMPDIR", root)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_cluster, "_own_local_ray", None)
    yield root
    ray.shutdown()
    shutil.rmtree(root, ignore_errors=True)


def _llm(model, **kwargs) -> LLM:
    return LLM(
        model,
        dtype="float32",
        distributed_executor_backend="ray",
        num_threads=1,
        kv_cache_memory_bytes=16 << 20,
        ray_placement_timeout=30,
        **kwargs,
    )


def _generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.ray
def test_generate_joins_the_running_local_cluster_without_an_address(private_ray_dir, tiny_model_dir):
    import ray

    with local_ray_head(private_ray_dir, num_cpus=4) as head:
        cli = [
            sys.executable,
            "-m",
            "raylm.entrypoints.cli",
            "generate",
            "ROMEO:",
            "--model",
            tiny_model_dir("llama"),
            "-tp",
            "2",
            "--distributed-executor-backend",
            "ray",
            "--temperature",
            "0",
            "--max-tokens",
            "4",
            "--num-threads",
            "1",
            "--kv-cache-memory-bytes",
            "16MiB",
            "--log-level",
            "info",
        ]
        result = subprocess.run(cli, capture_output=True, text=True, timeout=150, env=dict(os.environ))
        assert result.returncode == 0, result.stderr[-4000:]
        assert result.stdout.startswith("ROMEO:")
        assert f"joined the running Ray cluster at {head.address}" in result.stderr

        # In process too: the user's cluster is joined, never resized or stopped.
        ray_cluster.connect_ray(ParallelConfig(), num_cpus_hint=64)
        assert ray.get_runtime_context().gcs_address == head.address
        assert not ray_cluster.owns_local_ray()
        ray_cluster.connect_ray(ParallelConfig(), num_cpus_hint=64)
        assert ray.cluster_resources()["CPU"] == 4
        ray.shutdown()
        assert head.alive()


@pytest.mark.ray
def test_a_stale_cluster_file_is_ignored_and_a_local_instance_started(private_ray_dir, caplog):
    import ray

    (dead_port,) = free_ports(1)  # nothing listens there any more
    os.makedirs(os.path.join(private_ray_dir, "ray"))
    cluster_file = os.path.join(private_ray_dir, "ray", "ray_current_cluster")
    with open(cluster_file, "w") as f:
        f.write(f"127.0.0.1:{dead_port}")
    assert ray_cluster.ray_cluster_file() == cluster_file

    with caplog.at_level(logging.WARNING, logger="raylm.executor.ray_cluster"):
        ray_cluster.connect_ray(ParallelConfig(), num_cpus_hint=2)
    assert ray.is_initialized() and ray_cluster.owns_local_ray()
    assert ray.get_runtime_context().gcs_address != f"127.0.0.1:{dead_port}"
    warning = "\n".join(r.getMessage() for r in caplog.records)
    assert cluster_file in warning and f"127.0.0.1:{dead_port}" in warning and "ray stop" in warning


@pytest.mark.ray
def test_an_explicit_dead_address_fails_at_once_naming_it(private_ray_dir, monkeypatch):
    # (Ray itself retries a dead address for minutes, then exits the process.)
    (dead_port,) = free_ports(1)
    monkeypatch.setattr(ray_cluster, "_EXPLICIT_ADDRESS_WAIT_S", 1.0)
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{dead_port}")
    expected = f"no Ray cluster answers at 127.0.0.1:{dead_port} \\(from RAY_ADDRESS\\)"
    with pytest.raises(ConnectionError, match=expected):
        ray_cluster.connect_ray(ParallelConfig(), num_cpus_hint=2)
    assert not ray_cluster.owns_local_ray()


@pytest.mark.ray
def test_a_larger_engine_later_in_the_process_gets_room(private_ray_dir, tiny_model_dir, monkeypatch):
    import ray

    # raylm's own instance sized to exactly what the first engine asks for
    # (on a big machine it would have the cores to spare anyway).
    monkeypatch.setattr(ray_cluster, "_local_ray_num_cpus", lambda hint: hint)
    model = tiny_model_dir("llama")
    reference = [r.token_ids for r in hf_greedy(model, PROMPTS, MAX_TOKENS)]

    with _llm(model, tensor_parallel_size=2) as llm:
        assert _generate(llm) == reference
    assert ray_cluster.owns_local_ray() and ray.cluster_resources()["CPU"] == 2
    first_instance = ray.get_runtime_context().gcs_address

    with _llm(model, tensor_parallel_size=2, pipeline_parallel_size=2) as llm:
        assert _generate(llm) == reference
        assert ray.cluster_resources()["CPU"] == 4
    assert ray_cluster.owns_local_ray()
    assert ray.get_runtime_context().gcs_address != first_instance  # restarted, larger
    assert our_live_ray_state() == ([], [])


@pytest.mark.ray
def test_two_nodes_reporting_one_ip_fail_naming_the_fix(private_ray_dir, tiny_model_dir, monkeypatch):
    """Simulated nodes share the machine's IP, as two hosts behind one NAT would."""
    import ray
    from ray.cluster_utils import Cluster

    monkeypatch.delenv("RAYLM_ALLOW_SHARED_NODE_IP", raising=False)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        with pytest.raises(RuntimeError, match="2 Ray nodes report the same IP") as err:
            _llm(tiny_model_dir("llama"), pipeline_parallel_size=2, ray_placement_strategy="STRICT_SPREAD")
        assert "--node-ip-address" in str(err.value) and "RAYLM_ALLOW_SHARED_NODE_IP" in str(err.value)
        assert our_live_ray_state() == ([], [])
    finally:
        ray.shutdown()
        cluster.shutdown()


# ---- gloo's interface from the node's Ray IP ------------------------------------------------


def test_the_interface_of_an_ip():
    assert ray_worker.interface_of_ip("127.0.0.1") is not None
    assert ray_worker.interface_of_ip("203.0.113.77") is None  # TEST-NET-3: no interface here


def test_gloo_socket_ifname_set_from_the_node_ip(monkeypatch):
    loopback = ray_worker.interface_of_ip("127.0.0.1")
    # Set, then deleted: monkeypatch then restores the original state even
    # though set_gloo_socket_ifname writes os.environ itself.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "placeholder")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert ray_worker.set_gloo_socket_ifname("127.0.0.1") == loopback
    assert os.environ["GLOO_SOCKET_IFNAME"] == loopback

    # One the user set, and this node has: kept.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", loopback)
    assert ray_worker.set_gloo_socket_ifname("203.0.113.77") == loopback

    # One forwarded from a driver whose interfaces are named otherwise: replaced.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-nic0")
    assert ray_worker.set_gloo_socket_ifname("127.0.0.1") == loopback
    assert os.environ["GLOO_SOCKET_IFNAME"] == loopback


def test_loopback_init_methods():
    assert ray_worker._is_loopback_init("tcp://127.0.0.1:29500")
    assert not ray_worker._is_loopback_init("tcp://10.99.0.1:29500")
