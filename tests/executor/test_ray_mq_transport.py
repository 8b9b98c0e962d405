"""The Ray executor's `mq` step transport: HF-equal outputs for TP, PP and both
(over shared memory, and over ZMQ as for ranks on other nodes), the
collective_rpc contract, liveness, and a shutdown that leaves nothing behind."""

from __future__ import annotations

import os

import pytest

from raylm import LLM, SamplingParams
from raylm.distributed.shm_broadcast import SEGMENT_PREFIX
from raylm.executor.ray_executor import RayDistributedExecutor
from raylm.executor.ray_mq_transport import MqStepTransport
from raylm.testing.hf_oracle import hf_greedy
from tests.conftest import executor_of, our_live_ray_state, wait_until_unhealthy
from tests.executor.worker_callables import fail_on_rank_1, rank_times, sleep_then_rank, wait_for_release

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 100)), [3]]


def _mq_llm(model, tp=1, pp=1) -> LLM:
    return LLM(
        model,
        dtype="float32",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend="ray",
        ray_step_transport="mq",
        num_threads=1,
        kv_cache_memory_bytes=32 << 20,
    )


def _executor(llm: LLM) -> RayDistributedExecutor:
    executor = executor_of(llm)
    assert isinstance(executor, RayDistributedExecutor) and isinstance(executor.transport, MqStepTransport)
    return executor


def _left_in_dev_shm(names) -> set[str]:
    return set(names) & set(os.listdir("/dev/shm"))


def _assert_nothing_left(ex: RayDistributedExecutor, segments: list[str]) -> None:
    live_actors, live_pgs = our_live_ray_state()
    assert not {w._actor_id.hex() for w in ex.workers} & {a["ActorID"] for a in live_actors}
    assert ex._created_pg.id.hex() not in {g["placement_group_id"] for g in live_pgs}
    assert segments and all(name.startswith(SEGMENT_PREFIX) for name in segments)
    assert not _left_in_dev_shm(segments)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", num_key_value_heads=2)


@pytest.fixture(scope="module")
def reference(model):
    return [r.token_ids for r in hf_greedy(model, PROMPTS, GREEDY.max_tokens)]


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)])
def test_layouts_match_hf(ray_session, model, reference, tp, pp):
    llm = _mq_llm(model, tp, pp)
    ex = _executor(llm)
    segments = ex.shm_segment_names
    # One broadcast segment plus one response segment per rank, all local.
    assert len(_left_in_dev_shm(segments)) == tp * pp + 1
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == reference
    _assert_nothing_left(ex, segments)


def test_ranks_on_other_nodes_use_zmq(ray_session, model, reference, monkeypatch):
    # Pretend the driver is on a node of its own: every rank becomes a remote
    # reader of the broadcast and answers on a ZMQ response queue.
    monkeypatch.setattr(RayDistributedExecutor, "_driver_node_id", lambda self: "a-node-with-no-workers")
    llm = _mq_llm(model, tp=2)
    ex = _executor(llm)
    try:
        assert ex.shm_segment_names == []
        assert ex.transport.queues.broadcast.export_handle().remote_address is not None
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert our_live_ray_state() == ([], [])


@pytest.fixture(scope="module")
def tp2(model):
    import ray

    if not ray.is_initialized():
        # "local": a Ray of our own, never a cluster another process left running.
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    llm = _mq_llm(model, tp=2)
    ex = _executor(llm)
    segments = ex.shm_segment_names
    yield llm
    llm.shutdown()
    _assert_nothing_left(ex, segments)


@pytest.mark.ray
def test_collective_rpc_by_name_and_callable(tp2):
    ex = _executor(tp2)
    pids = ex.collective_rpc("check_health")
    assert len(pids) == 2 and len(set(pids)) == 2 and os.getpid() not in pids
    assert ex.collective_rpc(rank_times, args=(10,), kwargs={"offset": 1}) == [1, 11]
    assert ex.collective_rpc(rank_times, args=(10,), unique_reply_rank=1) == 10
    first = ex.collective_rpc(sleep_then_rank, args=(0.2,), non_block=True)
    second = ex.collective_rpc("check_health", non_block=True, unique_reply_rank=0)
    assert second.result(timeout=30) == pids[0]
    assert first.done() and first.result() == [0, 1]


@pytest.mark.ray
def test_timeout_names_the_silent_rank_and_the_executor_recovers(tp2, tmp_path):
    ex = _executor(tp2)
    released = str(tmp_path / "released")
    with pytest.raises(TimeoutError, match=r"rank 1 \(pid \d+"):
        ex.collective_rpc(wait_for_release, timeout=0.3, args=(released, (1,)))
    open(released, "w").close()
    # The late reply to the timed-out call is discarded, not taken for this one.
    assert ex.collective_rpc(rank_times, args=(1,), timeout=30) == [0, 1]


@pytest.mark.ray
def test_exception_carries_rank_and_traceback(tp2):
    ex = _executor(tp2)
    with pytest.raises(RuntimeError, match="rank 1") as err:
        ex.collective_rpc(fail_on_rank_1)
    assert "in fail_on_rank_1" in str(err.value) and "ValueError: rank one says no" in str(err.value)
    assert len(tp2.generate("still alive", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 16


def test_killed_worker_is_noticed_and_everything_is_cleaned_up(ray_session, model):
    import ray

    llm = _mq_llm(model, tp=2)
    ex = _executor(llm)
    segments = ex.shm_segment_names
    try:
        assert llm.generate("warm up", GREEDY, use_tqdm=False)
        ray.kill(ex.workers[1])
        assert "rank 1" in wait_until_unhealthy(ex, within_s=60)
        # The engine replaces the dead executor before the next step, and the
        # old one (actors, placement group, segments) is gone entirely.
        assert len(llm.generate("after the death", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 16
        assert _executor(llm) is not ex
        _assert_nothing_left(ex, segments)
        new_ex = _executor(llm)
        new_segments = new_ex.shm_segment_names
    finally:
        llm.shutdown()
    llm.shutdown()  # idempotent
    _assert_nothing_left(new_ex, new_segments)


def test_cli_flag_and_default_choose_the_transport():
    import argparse

    from raylm.config import ParallelConfig
    from raylm.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    cgraph = EngineArgs.from_cli_args(parser.parse_args(["--ray-step-transport", "cgraph"]))
    assert cgraph.ray_step_transport == "cgraph"
    # Unset, the engine's default applies: mq, the faster in benchmarks/bench_ray_transport.py.
    assert EngineArgs.from_cli_args(parser.parse_args([])).ray_step_transport == "mq"
    assert ParallelConfig().ray_step_transport == "mq"
    with pytest.raises(SystemExit):
        parser.parse_args(["--ray-step-transport", "nccl"])
