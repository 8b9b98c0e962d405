"""The multiprocess executor: HF-equal outputs with TP (and PP), the
collective_rpc contract, and liveness both ways (a killed worker, a killed engine)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from raylm import LLM, SamplingParams
from raylm.distributed.shm_broadcast import SEGMENT_PREFIX
from raylm.executor.mq_rpc import WorkerCallError
from raylm.executor.multiproc_executor import MultiprocExecutor, WorkerDiedError
from raylm.testing.hf_oracle import hf_greedy
from tests.conftest import executor_of, process_gone, wait_until
from tests.executor.worker_callables import fail_on_rank_0_while_rank_1_waits, rank_times

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 70)), [3]]
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _mp_llm(model, tp=1, pp=1, **kwargs) -> LLM:
    return LLM(
        model,
        dtype="float32",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend="mp",
        num_threads=1,
        kv_cache_memory_bytes=16 << 20,
        **kwargs,
    )


def _executor(llm: LLM) -> MultiprocExecutor:
    executor = executor_of(llm)
    assert isinstance(executor, MultiprocExecutor)
    return executor


def _left_in_dev_shm(names) -> set[str]:
    return set(names) & set(os.listdir("/dev/shm"))


def _release(path) -> None:
    with open(path, "w"):
        pass


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", num_key_value_heads=2)


@pytest.fixture(scope="module")
def reference(model):
    return [r.token_ids for r in hf_greedy(model, PROMPTS, GREEDY.max_tokens)]


@pytest.fixture(scope="module")
def tp2(model):
    llm = _mp_llm(model, tp=2)
    yield llm
    pids, segments = _executor(llm).worker_pids, _executor(llm).shm_segment_names
    llm.shutdown()
    assert all(process_gone(p) for p in pids)
    assert not _left_in_dev_shm(segments)


def _tp_collective(worker) -> str:
    from raylm.distributed import parallel_state

    return "gloo" if parallel_state.get_tp_group().shm is None else "shm"


def _world(worker) -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def test_tp2_matches_hf(tp2, reference):
    # Two ranks on one node all-reduce through shared memory by default (the
    # gloo fallback: tests/distributed/test_shm_collective.py).
    assert _executor(tp2).collective_rpc(_tp_collective, timeout=60) == ["shm", "shm"]
    outs = tp2.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_the_ranks_meet_at_a_store_this_process_serves(tp2):
    """No rank binds a port the executor probed free beforehand (something
    else may take it in between: a rebuilt TP=2 executor's init_device failed
    so in CI): the executor serves the rendezvous store on a port the OS gave
    it, and both ranks joined through it."""
    import psutil
    import torch.distributed as dist

    store = _executor(tp2)._res.store
    assert isinstance(store, dist.TCPStore)
    listening = {c.laddr.port for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    assert store.port in listening
    assert _executor(tp2).collective_rpc(_world, timeout=60) == [(0, 2), (1, 2)]


@pytest.mark.slow
def test_async_scheduling_with_tp2_matches_hf_and_uni(model, reference):
    """Every TP rank fills in its own sampled token for the step already in flight."""
    seeded = [SamplingParams(temperature=1.0, seed=i, max_tokens=10, ignore_eos=True) for i in range(len(PROMPTS))]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with _mp_llm(model, tp=2, async_scheduling=True) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == reference
        sampled = [o.outputs[0].token_ids for o in llm.generate(prompts, seeded, use_tqdm=False)]
    with LLM(model, dtype="float32", kv_cache_memory_bytes=16 << 20) as uni:
        assert sampled == [o.outputs[0].token_ids for o in uni.generate(prompts, seeded, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)])
def test_pipeline_layouts_match_hf(model, reference, tp, pp):
    with _mp_llm(model, tp=tp, pp=pp) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_collective_rpc_by_name_and_callable(tp2):
    ex = _executor(tp2)
    assert ex.collective_rpc("check_health") == ex.worker_pids

    def rank_times(worker, factor, offset=0):
        return worker.rank * factor + offset

    assert ex.collective_rpc(rank_times, args=(10,), kwargs={"offset": 1}) == [1, 11]
    assert ex.collective_rpc(rank_times, args=(10,), unique_reply_rank=1) == 10


def test_non_block_futures_resolve_in_order(tp2):
    ex = _executor(tp2)

    def slow_rank(worker, delay):
        time.sleep(delay)
        return worker.rank

    first = ex.collective_rpc(slow_rank, args=(0.2,), non_block=True)
    second = ex.collective_rpc("check_health", non_block=True, unique_reply_rank=0)
    assert second.result(timeout=30) == ex.worker_pids[0]
    assert first.done() and first.result() == [0, 1]


def test_timeout_names_the_silent_ranks_and_the_executor_recovers(tp2, tmp_path):
    ex = _executor(tp2)
    released = str(tmp_path / "released")

    def silent_on_rank_one(worker):
        # Rank 1 answers only once the test says so (not after a sleep that a
        # stalled test thread could outlast); the cap keeps a failed test from
        # leaving the shared workers blocked.
        give_up = time.monotonic() + 120
        while worker.rank == 1 and not os.path.exists(released) and time.monotonic() < give_up:
            time.sleep(0.01)
        return worker.rank

    with pytest.raises(TimeoutError, match=r"rank 1 \(pid \d+"):
        ex.collective_rpc(silent_on_rank_one, timeout=0.3)
    _release(released)
    # The late reply to the timed-out call is discarded, not taken for this one.
    assert ex.collective_rpc("check_health", timeout=30) == ex.worker_pids


def test_worker_exception_carries_rank_and_traceback(tp2):
    ex = _executor(tp2)

    def fail_on_rank_one(worker):
        if worker.rank == 1:
            raise ValueError("deliberate failure")
        return "fine"

    with pytest.raises(RuntimeError) as info:
        ex.collective_rpc(fail_on_rank_one)
    message = str(info.value)
    assert "rank 1" in message and "ValueError" in message and "deliberate failure" in message
    assert "Traceback" in message and "fail_on_rank_one" in message
    # A failure in a call that reported it leaves the workers usable.
    ex.check_health()


@pytest.mark.slow
def test_killed_worker_is_noticed_and_everything_is_cleaned_up(model, reference):
    llm = _mp_llm(model, tp=2)
    ex = _executor(llm)
    pids, segments = ex.worker_pids, ex.shm_segment_names
    assert len(_left_in_dev_shm(segments)) == 3 and all(n.startswith(SEGMENT_PREFIX) for n in segments)
    try:
        os.kill(pids[1], signal.SIGKILL)
        # The monitor thread notices on its own, without a call to prompt it
        # (nothing here calls the executor until it has). The bound only ends
        # a wait for a monitor that never notices: on a loaded machine the
        # killed process takes its time to exit and the monitor to be scheduled.
        wait_until(lambda: ex.is_failed, 60, step=0.01, message="the monitor thread to notice")
        with pytest.raises(WorkerDiedError, match="rank 1"):
            ex.check_health()
        # The engine replaces the dead executor before the next step.
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
        assert out[0].outputs[0].token_ids == reference[0]
        assert _executor(llm) is not ex
        assert all(process_gone(p) for p in pids)  # the old executor is gone entirely
        assert not _left_in_dev_shm(segments)
        new_pids, new_segments = _executor(llm).worker_pids, _executor(llm).shm_segment_names
    finally:
        llm.shutdown()
    assert all(process_gone(p) for p in new_pids)
    assert not _left_in_dev_shm(new_segments)


ENGINE_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from raylm import LLM
    llm = LLM(sys.argv[1], dtype="float32", tensor_parallel_size=2, distributed_executor_backend="mp",
              num_threads=1, kv_cache_memory_bytes=16 << 20)
    executor = llm.llm_engine.engine_core.engine_core.executor
    print(json.dumps([executor.worker_pids, executor.shm_segment_names]), flush=True)
    time.sleep(600)
    """
)


@pytest.mark.slow
def test_killed_engine_leaves_no_orphan_and_no_segment(model):
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE_SCRIPT, model],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    try:
        line = engine.stdout.readline()
        assert line, engine.stderr.read()
        pids, segments = json.loads(line)
        assert all(not process_gone(p) for p in pids)
        assert len(_left_in_dev_shm(segments)) == 3
        engine.send_signal(signal.SIGKILL)
        engine.wait(60)
        # Bounds against hanging only: each worker sees its death pipe close and exits.
        wait_until(lambda: all(process_gone(p) for p in pids), 60, message="the workers to exit")
        assert not _left_in_dev_shm(segments)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait(10)
        for pid in pids:
            if not process_gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_future_result_honours_its_timeout_and_a_later_wait_resumes(tp2, tmp_path):
    ex = _executor(tp2)
    released = str(tmp_path / "released")

    def wait_for_release(worker):
        # The ranks answer only once the test says so: with a sleep instead, a
        # test thread stalled longer than it would find the replies already there.
        give_up = time.monotonic() + 120
        while not os.path.exists(released) and time.monotonic() < give_up:
            time.sleep(0.01)
        return worker.rank

    future = ex.collective_rpc(wait_for_release, non_block=True)
    with pytest.raises(TimeoutError):
        future.result(timeout=0.1)
    assert not future.done()
    _release(released)
    assert future.result(timeout=60) == [0, 1]  # the call was still pending, its replies kept


def test_an_error_on_rank_0_ends_the_call_while_rank_1_still_waits(tp2, tmp_path):
    """Replies are collected rank by rank: rank 0's error must end the call at
    once although rank 1 has not answered (it may wait for rank 0 in a
    rendezvous until a far timeout: a rebuilt executor's init_device hung for
    its 600 s start timeout so in the clean-clone CI of 9cf8e54). Before the
    fix this raised the 60 s deadline's WorkerHungError instead."""
    ex = _executor(tp2)
    release = tmp_path / "release"
    try:
        with pytest.raises(WorkerCallError, match="rank zero says no"):
            ex.collective_rpc(fail_on_rank_0_while_rank_1_waits, args=(str(release),), timeout=60)
    finally:
        release.touch()
    # Rank 1's late answer is dropped, not taken for the next call's.
    assert ex.collective_rpc(rank_times, args=(10,)) == [0, 10]
