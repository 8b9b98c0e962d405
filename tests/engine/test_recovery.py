"""Recovery in place (docs/architecture.md, "The failure model"): a worker killed, a worker
hung, a step that raises, a node lost, a budget spent. Each failure strikes
while requests are in flight (every request has generated tokens and none has
finished), and each test ends with nothing left behind: no process, actor,
placement group or shared-memory segment of the failed executor or the new one.

The oracle is an uninterrupted run: greedy outputs equal Hugging Face's, and
seeded sampling equals the same engine's run without a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

import psutil
import pytest

from raylm import LLM, SamplingParams
from raylm.engine.errors import EngineDeadError
from raylm.engine.protocol import RecoveryKind
from raylm.testing.hf_oracle import hf_greedy
from tests.conftest import executor_of, our_live_ray_state, process_gone, wait_until
from tests.engine.faulty_executors import (
    POISON,
    CorruptCopyOnRank1Executor,
    PoisonedMultiprocExecutor,
    PoisonedUniProcExecutor,
)

NUM_REQUESTS = 16
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Varied lengths: some prompts span several KV blocks, some are one token.
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(1 + 5 * i)] for i in range(NUM_REQUESTS)]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", num_key_value_heads=2)


@pytest.fixture(scope="module")
def reference(model):
    return [r.token_ids for r in hf_greedy(model, PROMPTS, MAX_TOKENS)]


def _llm(model, backend, tp=1, pp=1, **kwargs) -> LLM:
    return LLM(
        model,
        dtype="float32",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend=backend,
        num_threads=1,
        kv_cache_memory_bytes=16 << 20,
        **kwargs,
    )


def _core(llm: LLM):
    return llm.llm_engine.engine_core.engine_core


def generate_with_strike(llm: LLM, prompts, params, strike, min_tokens: int = 4) -> list[list[int]]:
    """Generate, calling `strike()` once every request has at least
    `min_tokens` output tokens and none has finished: mid-decode whatever the
    machine's speed. Returns each request's token ids."""
    engine = llm.llm_engine
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params_list)):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, p)
    scheduler = _core(llm).scheduler
    results, struck = {}, False
    while engine.has_unfinished_requests():
        for output in engine.step():
            results[output.request_id] = output
        if not struck and all(r.num_output_tokens >= min_tokens for r in scheduler.requests.values()):
            assert len(scheduler.requests) == len(prompts), "a request finished before the strike"
            strike()
            struck = True
    assert struck
    return [results[f"r{i}"].outputs[0] for i in range(len(prompts))]


def _left_in_dev_shm(names) -> set[str]:
    return set(names) & set(os.listdir("/dev/shm"))


def _executor_traces(executor) -> tuple[list[int], list[str], set[str], str | None]:
    """(worker pids, shm segments, Ray actor ids, placement group id) to check gone later."""
    actors = {w._actor_id.hex() for w in getattr(executor, "workers", [])}
    pg = getattr(executor, "_created_pg", None)
    return list(executor.worker_pids), list(executor.shm_segment_names), actors, pg.id.hex() if pg else None


def assert_gone(traces) -> None:
    pids, segments, actors, pg = traces
    # A Ray actor's process exits a moment after ray.kill.
    wait_until(
        lambda: all(process_gone(p) for p in pids),
        10,
        message=lambda: f"worker processes to exit; left: {[p for p in pids if not process_gone(p)]}",
    )
    assert not _left_in_dev_shm(segments)
    if actors or pg:
        live_actors, live_pgs = our_live_ray_state()
        assert not actors & {a["ActorID"] for a in live_actors}
        assert pg not in {g["placement_group_id"] for g in live_pgs}


BACKENDS = [
    pytest.param("mp", {}, id="mp", marks=pytest.mark.slow),
    pytest.param("ray", {"ray_step_transport": "mq"}, id="ray-mq", marks=pytest.mark.ray),
    pytest.param("ray", {"ray_step_transport": "cgraph"}, id="ray-cgraph", marks=pytest.mark.ray),
]


@pytest.mark.parametrize("backend, extra", BACKENDS)
def test_killed_worker_mid_decode_loses_no_request(request, model, reference, backend, extra):
    if backend == "ray":
        request.getfixturevalue("ray_session")
    llm = _llm(model, backend, tp=2, **extra)
    try:
        old = executor_of(llm)
        old_traces = _executor_traces(old)
        outputs = generate_with_strike(llm, PROMPTS, GREEDY, lambda: os.kill(old.worker_pids[1], signal.SIGKILL))
        assert [o.token_ids for o in outputs] == reference
        assert all(o.finish_reason == "length" for o in outputs)
        core = _core(llm)
        assert [e.kind for e in core.recoveries] == [RecoveryKind.WORKER_DIED]
        assert "rank 1" in core.recoveries[0].cause and f"pid {old_traces[0][1]}" in core.recoveries[0].cause
        assert core.recoveries[0].num_requests == NUM_REQUESTS
        assert executor_of(llm) is not old
        assert_gone(old_traces)
        new_traces = _executor_traces(executor_of(llm))
    finally:
        llm.shutdown()
    assert_gone(new_traces)


@pytest.mark.slow
def test_seeded_sampling_continues_its_stream_after_recovery(model):
    """Workers that replace dead ones fast-forward each request's generator."""
    seeded = [
        SamplingParams(temperature=1.0, top_k=50, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
        for i in range(8)
    ]
    prompts = PROMPTS[:8]
    with _llm(model, "mp", tp=2) as llm:
        uninterrupted = [
            o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], seeded, use_tqdm=False)
        ]
        old = executor_of(llm)
        outputs = generate_with_strike(llm, prompts, seeded, lambda: os.kill(old.worker_pids[0], signal.SIGKILL))
        assert [e.kind for e in _core(llm).recoveries] == [RecoveryKind.WORKER_DIED]
    assert [o.token_ids for o in outputs] == uninterrupted


@pytest.mark.slow
def test_hung_worker_is_caught_by_the_step_deadline(model, reference):
    llm = _llm(model, "mp", tp=2, execute_model_timeout=3.0)
    try:
        old = executor_of(llm)
        old_traces = _executor_traces(old)
        outputs = generate_with_strike(llm, PROMPTS, GREEDY, lambda: os.kill(old.worker_pids[1], signal.SIGSTOP))
        assert [o.token_ids for o in outputs] == reference
        core = _core(llm)
        assert [e.kind for e in core.recoveries] == [RecoveryKind.WORKER_HUNG]
        assert f"rank 1 (pid {old_traces[0][1]}, node" in core.recoveries[0].cause
        assert "stopped" in core.recoveries[0].cause
        assert_gone(old_traces)  # a stopped process is killed all the same
        new_traces = _executor_traces(executor_of(llm))
    finally:
        for pid in old.worker_pids:
            if not process_gone(pid):
                os.kill(pid, signal.SIGKILL)
        llm.shutdown()
    assert_gone(new_traces)


@pytest.mark.slow
def test_idle_heartbeat_replaces_a_hung_worker_before_the_next_request(model, reference):
    llm = _llm(model, "mp", tp=2, health_check_interval=0.1, health_check_timeout=1.0)
    try:
        old = executor_of(llm)
        old_traces = _executor_traces(old)
        os.kill(old.worker_pids[1], signal.SIGSTOP)
        time.sleep(0.2)
        _core(llm).check_health_if_due()  # what the idle engine-core loop calls
        assert [e.kind for e in _core(llm).recoveries] == [RecoveryKind.WORKER_HUNG]
        assert_gone(old_traces)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference[:4]
        new_traces = _executor_traces(executor_of(llm))
    finally:
        llm.shutdown()
    assert_gone(new_traces)


@pytest.mark.slow
@pytest.mark.parametrize(
    "executor_class, tp", [(PoisonedUniProcExecutor, 1), (PoisonedMultiprocExecutor, 2)], ids=["uni", "mp-tp2"]
)
def test_a_request_that_breaks_its_step_fails_alone(model, reference, executor_class, tp):
    prompts = PROMPTS[:3] + [[5, 6, POISON, 7]]
    # One restart allowed: a rebuild pinned on a request that was failed is
    # forgiven, so bad requests cannot use the budget up.
    llm = _llm(model, executor_class, tp=tp, max_restarts=1)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs[:3]] == reference[:3]
        bad = outs[3].outputs[0]
        assert bad.finish_reason == "error" and "poisoned" in bad.error
        core = _core(llm)
        # Batched with others twice (each is then quarantined), then alone:
        # that third failure names it, and only it.
        assert [e.kind for e in core.recoveries] == [RecoveryKind.STEP_ERROR] * 3
        assert [e.culprits for e in core.recoveries] == [[], [], ["3"]]
        assert not core.scheduler.quarantined
        # The engine goes on serving, and a second bad request is failed too.
        again = llm.generate([{"prompt_token_ids": p} for p in (PROMPTS[0], [POISON])], GREEDY, use_tqdm=False)
        assert again[0].outputs[0].token_ids == reference[0]
        assert again[1].outputs[0].finish_reason == "error"
        assert core.restart_budget.num_recent == 0
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_failures_past_the_budget_end_the_engine_cleanly(model):
    llm = _llm(model, "mp", tp=2, max_restarts=1)
    traces = []
    try:

        def kill_rank_1():
            executor = executor_of(llm)
            traces.append(_executor_traces(executor))
            os.kill(executor.worker_pids[1], signal.SIGKILL)

        kill_rank_1()
        first = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], GREEDY, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in first)  # within budget: recovered
        with pytest.raises(EngineDeadError, match="max_restarts"):
            generate_with_strike(llm, PROMPTS[:4], GREEDY, kill_rank_1)
    finally:
        llm.shutdown()
    for trace in traces:
        assert_gone(trace)


@pytest.mark.slow
def test_start_up_failure_on_one_rank_names_it_and_leaves_nothing(model, tmp_path, monkeypatch):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(model, corrupt)
    for shard in corrupt.glob("*.safetensors"):
        shard.write_bytes(shard.read_bytes()[:100])  # truncated: not a safetensors file any more
    monkeypatch.setattr(CorruptCopyOnRank1Executor, "corrupt_dir", str(corrupt))
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    segments_before = set(os.listdir("/dev/shm"))
    with pytest.raises(RuntimeError, match="rank 1") as info:
        _llm(model, CorruptCopyOnRank1Executor, tp=2)
    assert "load_model" in str(info.value) and "corrupt or truncated safetensors file" in str(info.value)
    new_children = {
        p.pid for p in psutil.Process().children(recursive=True) if not _is_resource_tracker(p)
    } - children_before
    # A killed worker is reaped a moment after the error; the bound only stops a wait that never ends.
    wait_until(
        lambda: all(process_gone(p) for p in new_children),
        60,
        message=lambda: f"the workers to be gone: {[p for p in new_children if not process_gone(p)]}",
    )
    # Only the segments this test's processes made: other tests may run beside this one.
    ours = {str(os.getpid())} | {str(pid) for pid in new_children}
    left = {
        name
        for name in set(os.listdir("/dev/shm")) - segments_before
        if name.startswith("raylm_mq_") and name.split("_")[2] in ours
    }
    assert not left


def _is_resource_tracker(process: psutil.Process) -> bool:
    """multiprocessing's resource tracker: started by the first spawn of the
    session, it lives as long as the test process."""
    try:
        return "resource_tracker" in " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return False
