"""The Ray executor: HF-equal outputs for every layout, the collective_rpc
contract, liveness, and a clean shutdown."""

from __future__ import annotations

import os

import pytest

from raylm import LLM, SamplingParams
from raylm.testing.hf_oracle import hf_greedy
from tests.conftest import executor_of as _executor
from tests.conftest import our_live_ray_state, wait_until_unhealthy
from tests.executor.worker_callables import fail_on_rank_1, marker_env, rank_of, sleep_then_rank, wait_for_release

pytestmark = pytest.mark.ray

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 100)), [3]]


def _ray_llm(model, tp=1, pp=1, **kwargs):
    kwargs.setdefault("kv_cache_memory_bytes", 32 << 20)
    # This module covers the compiled-graph transport; test_ray_mq_transport.py the default, mq.
    kwargs.setdefault("ray_step_transport", "cgraph")
    return LLM(
        model,
        dtype="float32",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend="ray",
        num_threads=1,
        **kwargs,
    )


@pytest.mark.parametrize(
    "arch, overrides, tp, pp",
    [
        # One KV head with TP=2: the KV head is replicated across TP ranks; tied embeddings.
        pytest.param("llama", {"num_key_value_heads": 1}, 1, 1, id="llama-kv1-tp1-pp1"),
        pytest.param("llama", {"num_key_value_heads": 1}, 2, 1, id="llama-kv1-tp2-pp1"),
        pytest.param("llama", {"num_key_value_heads": 1}, 1, 2, id="llama-kv1-tp1-pp2"),
        # TP and PP together once (four actors on two cores: the costliest
        # layout); the replicated KV head is a TP matter, covered above.
        pytest.param("qwen3", {}, 2, 1, id="qwen3-tp2-pp1"),
        pytest.param("qwen3", {}, 2, 2, id="qwen3-tp2-pp2"),
    ],
)
def test_ray_layouts_match_hf(ray_session, tiny_model_dir, arch, overrides, tp, pp):
    model = tiny_model_dir(arch, **overrides)
    with _ray_llm(model, tp, pp) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    ref = hf_greedy(model, PROMPTS, 16)
    assert [o.outputs[0].token_ids for o in outs] == [r.token_ids for r in ref]
    assert our_live_ray_state() == ([], [])


@pytest.fixture(scope="module")
def tp2_llm(tiny_model_dir):
    import ray

    if not ray.is_initialized():
        # address="local": a private instance even if a cluster runs on this machine.
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    # Set after Ray started: they reach the workers only through their runtime_env.
    # "0" is RAYLM_ALLOW_SHARED_NODE_IP's default: a marker that changes nothing.
    os.environ["RAYLM_ALLOW_SHARED_NODE_IP"] = "0"
    os.environ["RAYLM_API_KEY"] = "not-for-the-workers"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        llm = _ray_llm(tiny_model_dir("llama"), tp=2)
    finally:
        del os.environ["RAYLM_ALLOW_SHARED_NODE_IP"]
        del os.environ["RAYLM_API_KEY"]
        del os.environ["CUDA_VISIBLE_DEVICES"]
    yield llm
    llm.shutdown()


def test_collective_rpc_by_name_and_callable(tp2_llm):
    ex = _executor(tp2_llm)
    pids = ex.collective_rpc("check_health")
    assert len(pids) == 2 and len(set(pids)) == 2 and os.getpid() not in pids
    assert ex.collective_rpc(rank_of) == [0, 1]
    assert ex.collective_rpc(rank_of, unique_reply_rank=1) == 1
    future = ex.collective_rpc(sleep_then_rank, args=(0.2,), non_block=True)
    assert future.result(timeout=30) == [0, 1]


def test_collective_rpc_timeout_names_ranks(tp2_llm, tmp_path):
    ex = _executor(tp2_llm)
    released = str(tmp_path / "released")
    with pytest.raises(TimeoutError, match=r"rank 0 \(pid \d+.*rank 1 \(pid \d+"):
        ex.collective_rpc(wait_for_release, timeout=0.3, args=(released,))
    open(released, "w").close()
    # The waiters answer now; the next call is served after them, as the next test's are.
    assert ex.collective_rpc(rank_of, timeout=60) == [0, 1]


def test_collective_rpc_exception_carries_rank_and_traceback(tp2_llm):
    ex = _executor(tp2_llm)
    with pytest.raises(RuntimeError, match="rank 1") as err:
        ex.collective_rpc(fail_on_rank_1)
    # The worker-side traceback: the failing frame and the original error.
    assert "in fail_on_rank_1" in str(err.value) and "ValueError: rank one says no" in str(err.value)
    # The engine still works afterwards.
    assert len(tp2_llm.generate("still alive", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 16


def test_environment_reaches_workers_but_not_per_worker_vars_nor_the_api_key(tp2_llm):
    assert _executor(tp2_llm).collective_rpc(marker_env) == [("0", False, False)] * 2


def test_two_phase_step_order_is_enforced(tp2_llm):
    ex = _executor(tp2_llm)
    with pytest.raises(RuntimeError, match="without a preceding execute_model"):
        ex.sample_tokens(None)


def test_dead_worker_is_noticed_and_reported(ray_session, tiny_model_dir):
    import ray

    llm = _ray_llm(tiny_model_dir("llama"), tp=2)
    ex = _executor(llm)
    assert llm.generate("warm up", GREEDY, use_tqdm=False)
    ray.kill(ex.workers[1])
    assert "rank 1" in wait_until_unhealthy(ex, within_s=60)
    # The engine replaces the dead executor before the next step.
    assert llm.generate("after the death", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    new_ex = _executor(llm)
    assert new_ex is not ex
    llm.shutdown()
    llm.shutdown()  # idempotent
    live_actors, live_pgs = our_live_ray_state()
    for old_or_new in (ex, new_ex):
        assert not {w._actor_id.hex() for w in old_or_new.workers} & {a["ActorID"] for a in live_actors}
        assert old_or_new._created_pg.id.hex() not in {g["placement_group_id"] for g in live_pgs}


def test_cleanup_returns_once_ray_reports_the_killed_actors_dead(ray_session, monkeypatch):
    """ray.kill only asks the GCS, which reports the actor dead later (under
    load, later than a caller's next look: CI once saw an engine that failed
    to start leave an actor ALIVE). Here every kill lands 0.5 s late; the
    cleanup returns with both actors reported dead all the same."""
    import threading

    import ray
    from ray._private.state import actors

    from raylm.executor.ray_executor import RayDistributedExecutor

    @ray.remote(num_cpus=0)
    class Idle:
        def ready(self):
            return True

    idle = [Idle.remote() for _ in range(2)]
    assert ray.get([a.ready.remote() for a in idle]) == [True, True]
    kill = ray.kill
    monkeypatch.setattr(ray, "kill", lambda actor: threading.Timer(0.5, kill, (actor,)).start())
    RayDistributedExecutor._cleanup(idle, [])
    assert [actors(actor_id=a._actor_id.hex())["State"] for a in idle] == ["DEAD", "DEAD"]
