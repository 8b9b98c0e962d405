"""Start-up has deadlines (docs/architecture.md, "The failure model"): an engine core that is
never ready, and a worker hung in any executor start-up call, become clear
errors within `engine_start_timeout`, and nothing started is left behind.

Hangs are injected by executors that never finish a start-up call
(tests/engine/start_hangs.py), never by hoping the machine is slow; the
timeouts here only need to exceed a normal start of the tiny model."""

from __future__ import annotations

import asyncio
import functools
import os
import time

import psutil
import pytest
import zmq

import raylm.engine.process_launcher as process_launcher
from raylm import LLM
from raylm.config import create_engine_config
from raylm.engine.errors import EngineCoreDiedError, EngineStartTimeoutError
from raylm.engine.process_launcher import ProcessCoreLauncher
from raylm.engine.restart_budget import RestartBudget
from raylm.engine.supervisor import AsyncEngineCoreSupervisor
from raylm.executor.errors import WorkerHungError
from raylm.executor.ray_executor import RayDistributedExecutor
from raylm.testing.chaos.schedule import descendants
from tests.conftest import our_live_ray_state
from tests.engine.conftest import FakeCore, FakeLauncher
from tests.engine.start_hangs import (
    HUNG_AFTER_START_S,
    HangingUniExecutor,
    HangInSizingOnRank1Executor,
    HangOnRank1Executor,
    hang_in_on_rank_1,
)

# Long enough for a normal start-up call of the tiny model on a busy 2-core
# machine. A call hung before the model is loaded waits this long once; one
# hung after (sizing the KV cache) waits HUNG_AFTER_START_S (start_hangs.py).
START_TIMEOUT_S = 20.0


def _children() -> set[int]:
    """This process's descendants, but for multiprocessing's resource tracker."""
    return descendants()


def _wait_gone(pids: set[int]) -> list[int]:
    """The pids still running after a bounded wait (a killed core's workers
    exit when they see their parent's death pipe close)."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=15)
    return [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _ours(segments: set[str], pids: set[int]) -> set[str]:
    """raylm's segments (raylm_mq_<creator pid>_...) that this process or one
    of `pids` created: other tests may run beside this one."""
    ours = {str(os.getpid())} | {str(pid) for pid in pids}
    return {name for name in segments if name.startswith("raylm_mq_") and name.split("_")[2] in ours}


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


def _config(model: str, backend, tp: int = 1, start_timeout: float = START_TIMEOUT_S, **kwargs):
    return create_engine_config(
        model,
        tensor_parallel_size=tp,
        distributed_executor_backend=backend,
        num_threads=1,
        kv_cache_memory_bytes=4 << 20,
        max_model_len=256,
        engine_start_timeout=start_timeout,
        **kwargs,
    )


# ---- the executors' start-up calls ------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_mp_worker_hung_while_the_kv_cache_is_sized_is_named_and_nothing_is_left(model):
    children, segments = _children(), _shm()
    with pytest.raises(WorkerHungError) as hung:
        LLM(
            model,
            tensor_parallel_size=2,
            distributed_executor_backend=HangInSizingOnRank1Executor,
            num_threads=1,
            kv_cache_memory_bytes=4 << 20,
            max_model_len=256,
            engine_start_timeout=START_TIMEOUT_S,
        )
    message = str(hung.value)
    assert "determine_available_memory" in message and "rank 1" in message
    workers = _children() - children
    assert not _wait_gone(workers)
    assert not _ours(_shm() - segments, workers)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_ray_worker_hung_while_the_kv_cache_is_sized_is_named_and_nothing_is_left(model, ray_session):
    class HangInSizingOnRank1RayExecutor(RayDistributedExecutor):
        sizing = False

        @property
        def start_timeout_s(self) -> float:
            return HUNG_AFTER_START_S if self.sizing else super().start_timeout_s

        def determine_available_memory(self) -> list[int]:
            self.collective_rpc(
                functools.partial(hang_in_on_rank_1, "determine_available_memory"), timeout=self.start_timeout_s
            )
            self.sizing = True  # the hung call's deadline: HUNG_AFTER_START_S
            return super().determine_available_memory()

    segments = _shm()
    with pytest.raises(WorkerHungError) as hung:
        LLM(
            model,
            tensor_parallel_size=2,
            distributed_executor_backend=HangInSizingOnRank1RayExecutor,
            num_threads=1,
            kv_cache_memory_bytes=4 << 20,
            max_model_len=256,
            engine_start_timeout=START_TIMEOUT_S,
        )
    message = str(hung.value)
    assert "determine_available_memory" in message and "rank 1" in message
    for _ in range(100):  # ray.kill is asynchronous: the actors are marked dead a moment later
        if our_live_ray_state() == ([], []):
            break
        time.sleep(0.1)
    assert our_live_ray_state() == ([], [])
    assert not {name for name in _shm() - segments if name.startswith(f"raylm_mq_{os.getpid()}_")}


@pytest.mark.ray
def test_ray_start_up_get_names_the_actor_that_does_not_answer(ray_session):
    """Every ray.get of the Ray executor's set-up goes through one bounded
    wait: an actor hung in its constructor or in the call is named."""
    import ray

    @ray.remote
    class Answers:
        def call(self, hang: bool) -> int:
            if hang:
                time.sleep(3600)
            return 1

    actors = [Answers.remote(), Answers.remote()]
    # Started outside the bounded wait: an actor's process may take seconds
    # to come up on a loaded machine, which is not what is tested here.
    assert ray.get([a.call.remote(False) for a in actors], timeout=120) == [1, 1]
    executor = RayDistributedExecutor.__new__(RayDistributedExecutor)
    executor.config = _config_stub(start_timeout=5.0)
    executor.worker_pids, executor.node_ips, executor.node_ids = [], [], []
    try:
        assert executor._startup_get([a.call.remote(False) for a in actors], "call") == [1, 1]
        with pytest.raises(WorkerHungError, match=r"start-up call 'call': rank 1 .*did not answer"):
            executor._startup_get([actors[0].call.remote(False), actors[1].call.remote(True)], "call")
    finally:
        for actor in actors:
            ray.kill(actor)


def _config_stub(start_timeout: float):
    from types import SimpleNamespace

    from raylm.config import FaultToleranceConfig

    return SimpleNamespace(fault_tolerance=FaultToleranceConfig(engine_start_timeout_s=start_timeout))


# ---- the engine core's start ----------------------------------------------------------------


@pytest.mark.timeout(120)
def test_core_never_ready_is_killed_with_a_clear_error(model):
    children = _children()
    with pytest.raises(EngineStartTimeoutError, match="not ready within 3 s"):
        AsyncEngineCoreSupervisor(_config(model, HangingUniExecutor, start_timeout=3.0))
    assert not _wait_gone(_children() - children)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_core_killed_at_its_deadline_takes_its_hung_workers_and_segments_along(model, monkeypatch):
    """The core is killed before its own executor's deadline (both count the
    same timeout, the core's from earlier): its mp workers, one of them hung,
    exit through their death pipes and remove the shared memory."""
    children, segments = _children(), _shm()
    started: set[int] = set()
    stop_process = process_launcher._stop_process

    def kill_and_remember(process, wait_s):
        started.update(_children() - children)  # the core and its workers, before they are orphaned
        stop_process(process, wait_s)

    monkeypatch.setattr(process_launcher, "_stop_process", kill_and_remember)
    with pytest.raises(EngineStartTimeoutError):
        AsyncEngineCoreSupervisor(_config(model, HangOnRank1Executor, tp=2))
    assert len(started) == 3  # the core and two workers
    assert not _wait_gone(started)
    assert not _ours(_shm() - segments, started)


def test_a_core_restart_that_hangs_counts_against_the_budget(make_engine, monkeypatch, model):
    """Under AsyncLLM, a new core that is not ready in time is killed and
    counted as a failed restart; the next one serves."""
    hung_config = _config(model, HangingUniExecutor, start_timeout=3.0)
    attempts = []

    def start(attempt: int) -> None:
        attempts.append(attempt)
        if attempt == 1:  # the first replacement hangs while starting: a real core, killed at its deadline
            launcher, ctx = ProcessCoreLauncher(hung_config), zmq.Context()
            try:
                launcher.start(launcher.new_channel(ctx, 0))
            finally:
                launcher.shutdown()
                ctx.destroy(linger=0)

    monkeypatch.setattr(FakeLauncher, "on_start", start)
    monkeypatch.setattr(RestartBudget, "backoff_s", lambda self: 0.0)
    engine, stats = make_engine(max_restarts=3)
    children = _children()

    async def run() -> None:
        engine._ensure_output_handler()
        FakeCore.started[0].script.put_nowait(EngineCoreDiedError(-9))
        for _ in range(3000):
            if len(FakeCore.started) == 2 and not engine.recovering:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the engine never recovered")

    asyncio.run(run())
    assert len(attempts) == 3 and not engine.is_dead
    assert engine.restart_budget.num_recent == 2  # the death, and the restart that hung
    assert stats.seen == [("engine_core", 0)]
    assert not _wait_gone(_children() - children)


# ---- data parallel: a replica stuck starting ------------------------------------------------


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_dp_replica_stuck_starting_is_killed_at_the_deadline(model, ray_session):
    """The replica's actor hangs building its core: at the start deadline it
    is killed and its placement group removed (the supervisor counts the error as a
    failed start against the restart budget)."""
    from raylm.distributed.tcp_auth import CurveKeys
    from raylm.engine.dp_manager import CoreEngineActorManager, ReplicaChannel

    manager = CoreEngineActorManager(
        _config(model, HangingUniExecutor, start_timeout=3.0), on_death=lambda index, cause: None
    )
    channel = ReplicaChannel("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", CurveKeys.generate(), b"\0" * 32)
    try:
        with pytest.raises(TimeoutError, match="replica 0 was not ready within 3 s"):
            manager.start_replica(0, channel)
    finally:
        manager.shutdown()
    for _ in range(100):  # ray.kill is asynchronous
        if our_live_ray_state() == ([], []):
            break
        time.sleep(0.1)
    assert our_live_ray_state() == ([], [])


# ---- the engine core's in-place rebuild -------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rebuild_hung_at_start_up_is_retried_within_the_budget(model, monkeypatch):
    """A worker dies; the first rebuild hangs on a rank while sizing the KV
    cache, which the start deadline turns into an error: the core tears that
    executor down and rebuilds again, and the request completes."""
    import signal

    from raylm import SamplingParams
    from raylm.engine.protocol import RecoveryKind
    from tests.conftest import executor_of
    from tests.engine.start_hangs import HangInFirstRebuildOnRank1Executor

    monkeypatch.setattr(HangInFirstRebuildOnRank1Executor, "instances", 0)
    monkeypatch.setattr(HangInFirstRebuildOnRank1Executor, "all_worker_pids", [])
    llm = LLM(
        model,
        tensor_parallel_size=2,
        distributed_executor_backend=HangInFirstRebuildOnRank1Executor,
        num_threads=1,
        kv_cache_memory_bytes=4 << 20,
        max_model_len=256,
        engine_start_timeout=START_TIMEOUT_S,
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        first = executor_of(llm)
        os.kill(first.worker_pids[1], signal.SIGKILL)
        output = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0]
        assert len(output.outputs[0].token_ids) == 8
        core = llm.llm_engine.engine_core.engine_core
        assert core.failures_by_kind.get(RecoveryKind.WORKER_DIED) == 1
        assert core.failures_by_kind.get(RecoveryKind.REBUILD_FAILED) == 1
        assert HangInFirstRebuildOnRank1Executor.instances == 3
        # The hung executor's workers, and the first one's, are gone.
        replaced = set(HangInFirstRebuildOnRank1Executor.all_worker_pids) - set(executor_of(llm).worker_pids)
        assert len(replaced) == 4 and not _wait_gone(replaced)
    finally:
        llm.shutdown()
