"""Shared fixtures: tiny random-weight models of every architecture, built once
per test session, and Hugging Face reference generations cached per model."""

from __future__ import annotations

import contextlib
import os
import random
import time
from pathlib import Path

import pytest
import torch

from raylm.testing.tiny_models import make_tiny_model
from raylm.worker.fault_injection import ENV_VAR as FAULT_INJECTION_ENV

ARCHS = ("llama", "qwen2", "qwen3", "mistral")

TESTS = Path(__file__).parent

# The suite runs on CPU even on a GPU host (else the Ray tests would move to
# CUDA and the TP=2 ones ask for two GPUs); tests/gpu/ opts back in. Set in the
# environment so that processes the tests start inherit it too.
os.environ["RAYLM_DEVICE"] = "cpu"
# Prefix pulls are tried whatever they are expected to cost: the tiny models
# here compute a prompt faster than any copy, so the estimate
# (raylm.engine.pull_estimate) would replace the pulls the tests exercise by
# recomputes. tests/engine/test_pull_estimate.py turns it back on.
os.environ["RAYLM_PULL_ESTIMATES"] = "0"


def pytest_collection_modifyitems(items):
    """The tiers (markers declared in pyproject.toml), given here by what a test
    uses: the `ray_session` fixture -> ray; a `server` or `*_server` fixture (a
    `raylm serve` process) -> server; tests/multinode/ -> multinode; tests/gpu/
    -> gpu. A test that starts Ray or a server itself,
    or is slow, carries the mark in its module (pytestmark, a decorator, or its
    parameter's marks)."""
    for item in items:
        folder = item.path.relative_to(TESTS).parts[:-1]
        fixtures = set(item.fixturenames)  # with the fixtures they use, transitively
        if "ray_session" in fixtures:
            item.add_marker(pytest.mark.ray)
        if any(f == "server" or f.endswith("_server") for f in fixtures):
            item.add_marker(pytest.mark.server)
        if folder[:1] == ("multinode",):
            item.add_marker(pytest.mark.multinode)
        if folder[:1] == ("gpu",):
            item.add_marker(pytest.mark.gpu)
    _clusters_last(items)


# Modules that shut the session's shared Ray down for a cluster of their own
# (simulated nodes, a private head): run after every other module, so that
# the shared Ray, once started, serves them all instead of being started
# again after each of these (a Ray start is 10-40 s on two busy cores).
OWN_RAY_CLUSTER_MODULES = {
    "engine/test_data_parallel_placement.py",
    "executor/test_gpu_placement.py",
    "executor/test_plan.py",
    "executor/test_ray_connect.py",
    "executor/test_ray_node_loss.py",
    "executor/test_ray_placement.py",
}


def _clusters_last(items) -> None:
    """Moves the items of OWN_RAY_CLUSTER_MODULES to the end, in their order."""

    def own(item) -> bool:
        return item.path.relative_to(TESTS).as_posix() in OWN_RAY_CLUSTER_MODULES

    items[:] = [i for i in items if not own(i)] + [i for i in items if own(i)]


@pytest.fixture(scope="session", autouse=True)
def _threads():
    # Two cores on CI: one torch thread per process keeps parallel workers
    # (Ray actors, mp workers) from fighting over them.
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """arch -> folder of a tiny random model (built lazily, once)."""
    root = tmp_path_factory.mktemp("tiny_models")
    cache: dict[str, str] = {}

    def get(arch: str, **overrides) -> str:
        key = arch + repr(sorted(overrides.items()))
        if key not in cache:
            name = f"{arch}-{len(cache)}"
            cache[key] = str(make_tiny_model(arch, root / name, **overrides))
        return cache[key]

    return get


def oracle_prompts(vocab_size: int, lengths=(1, 2, 7, 16, 33, 64, 130, 300), seed: int = 0) -> list[list[int]]:
    """Random prompts of the given lengths (a mix of block-aligned and not)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


@pytest.fixture
def ray_session():
    """One local Ray per test session (started on first use; a module that
    needs its own cluster shuts it down and the next user starts it again)."""
    yield start_shared_ray()


def start_shared_ray():
    """The session's shared Ray (`ray_session`), started if it is not running;
    for a module-scoped fixture, which cannot use the per-test `ray_session`."""
    import ray

    if not ray.is_initialized():
        # address="local": a private instance even if a cluster runs on this machine.
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    return ray


def our_live_ray_state():
    """(live RayWorkerWrapper actors, live placement groups) in the current Ray."""
    from ray._private.state import actors
    from ray.util import placement_group_table

    ours = ("RayWorkerWrapper", "EngineCoreActor")
    live_actors = [a for a in actors().values() if a["ActorClassName"] in ours and a["State"] != "DEAD"]
    live_pgs = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
    return live_actors, live_pgs


def executor_of(llm):
    """The executor behind an offline LLM (through its in-process core client)."""
    return llm.llm_engine.engine_core.engine_core.executor


def process_gone(pid: int) -> bool:
    """The process has exited. A worker orphaned by a killed engine may linger
    as a zombie if nobody reaps it; a zombie has exited and holds nothing."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# A token id no test prompt otherwise holds (theirs are 3..252), within every
# tiny model's vocabulary: prompts that carry it can be slowed (`straggling`).
STRAGGLER_TOKEN = 500


def straggler_env(token_id: int = STRAGGLER_TOKEN, ms: int = 20) -> dict[str, str]:
    """The environment of fault injection's straggler: each step holding a
    request with `token_id` takes `ms` ms longer, so that what a test waits
    for (a kill, an attack, a signal, a migration) lands while requests still
    run, however fast the machine decodes."""
    return {FAULT_INJECTION_ENV: f"slow:token={token_id}:ms={ms}"}


def bos_straggler_env(model_dir: str | None = None, ms: int = 5) -> dict[str, str]:
    """`straggler_env` for a server of `model_dir` (None: the embedded model)
    whose every prompt starts with the model's BOS token: each step holding
    any request takes at least `ms` ms."""
    from transformers import AutoTokenizer

    import raylm

    folder = model_dir or str(Path(raylm.__file__).parent / "data" / "default_model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer("Story 0:").input_ids[0] == tokenizer.bos_token_id
    return straggler_env(tokenizer.bos_token_id, ms)


def straggling(monkeypatch, token_id: int = STRAGGLER_TOKEN, ms: int = 20) -> None:
    """`straggler_env` for the engines this test starts (read at their start)."""
    for name, value in straggler_env(token_id, ms).items():
        monkeypatch.setenv(name, value)


POLL_S = 0.05


def wait_until(condition, within_s: float, step=None, message="the condition"):
    """Call `condition()` until it returns something true, and return that.
    Between calls: `step()` when `step` is a function (one unit of progress,
    e.g. an engine step), else a sleep of `step` seconds (default POLL_S).
    Past `within_s` seconds the test fails saying what it waited for:
    `message`, or `message()` read at that moment."""
    deadline = time.monotonic() + within_s
    while True:
        value = condition()
        if value:
            return value
        _give_up_past(deadline, within_s, message)
        if callable(step):
            step()
        else:
            time.sleep(POLL_S if step is None else step)


async def async_wait_until(condition, within_s: float = 10.0, message="the condition"):
    """`wait_until` for a test running on an event loop: the loop turns
    between calls (the engine's output handler runs there)."""
    import asyncio

    deadline = time.monotonic() + within_s
    while True:
        value = condition()
        if value:
            return value
        _give_up_past(deadline, within_s, message)
        await asyncio.sleep(0.01)


def _give_up_past(deadline: float, within_s: float, message) -> None:
    """The test fails once `deadline` passed, saying what it waited for:
    `message`, or `message()` read at that moment."""
    if time.monotonic() >= deadline:
        what = message() if callable(message) else message
        raise AssertionError(f"gave up after {within_s} s waiting for {what}")


def wait_until_unhealthy(executor, within_s: float) -> str:
    """The error check_health() raises once the executor notices a dead
    worker; a test failure when it still looks healthy after `within_s` s."""

    def health_error() -> str | None:
        try:
            executor.check_health()
        except RuntimeError as e:
            return str(e)
        return None

    return wait_until(health_error, within_s, message="a dead worker to be noticed")


@contextlib.contextmanager
def simulated_cluster(node_cpus: list[int]):
    """A `ray.cluster_utils.Cluster` whose head has no CPUs (nothing runs
    there) and one node per entry of `node_cpus`, with this process connected
    to it; yields (cluster, nodes). Simulated nodes share one IP, which raylm
    is told to allow. The session's shared Ray is shut down first (the next
    user of `ray_session` starts it again)."""
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=n) for n in node_cpus]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    patch = pytest.MonkeyPatch()
    patch.setenv("RAYLM_ALLOW_SHARED_NODE_IP", "1")
    try:
        yield cluster, nodes
    finally:
        patch.undo()
        ray.shutdown()
        cluster.shutdown()
