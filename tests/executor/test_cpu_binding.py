"""CPU placement applied for real: each rank's affinity and torch thread count,
read from inside the worker, are what the planner chose (mp, Ray and the
in-process uni backend), outputs still equal the Hugging Face oracle, the
start-up log names the placement, and bad settings fail naming the field."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import cloudpickle
import psutil
import pytest
import ray.cloudpickle

from raylm import LLM, SamplingParams
from raylm.testing.hf_oracle import hf_greedy
from raylm.worker.cpu_placement import plan_cpu_placement
from raylm.worker.cpu_topology import read_topology
from tests.conftest import executor_of, our_live_ray_state

# Workers cannot import this test module by name: its callables travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 60))]
USABLE = sorted(os.sched_getaffinity(0))

needs_two_cpus = pytest.mark.skipif(len(USABLE) < 2, reason="needs two usable CPUs")


def thread_placement(worker):
    """(this thread's CPUs, torch threads, OMP_NUM_THREADS) inside a worker."""
    import torch

    return sorted(os.sched_getaffinity(0)), torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


def process_affinities(worker):
    """The CPUs of every thread of the worker's process (pinning is per thread)."""
    return sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")})


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", num_key_value_heads=2)


@pytest.fixture(scope="module")
def reference(model):
    return [r.token_ids for r in hf_greedy(model, PROMPTS, GREEDY.max_tokens)]


def _generate(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _gone(pids) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


@pytest.mark.slow
@needs_two_cpus
def test_mp_tp2_explicit_bind_pins_each_rank(model, reference, caplog):
    bind = f"{USABLE[0]}|{USABLE[1]}"
    with caplog.at_level(logging.INFO, logger="raylm.executor.multiproc_executor"):
        llm = LLM(
            model,
            dtype="float32",
            tensor_parallel_size=2,
            distributed_executor_backend="mp",
            cpu_bind=bind,
            kv_cache_memory_bytes=16 << 20,
        )
    executor = executor_of(llm)
    pids = list(executor.worker_pids)
    try:
        assert executor.collective_rpc(thread_placement) == [([USABLE[0]], 1, "1"), ([USABLE[1]], 1, "1")]
        # Every thread of each worker process, not only the one that answered.
        assert executor.collective_rpc(process_affinities) == [[(USABLE[0],)], [(USABLE[1],)]]
        assert _generate(llm) == reference
    finally:
        llm.shutdown()
    assert _gone(pids)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU placement:"))
    assert f"rank 0 -> cores [{USABLE[0]}] (1 thread)" in line and f"rank 1 -> cores [{USABLE[1]}] (1 thread)" in line
    # The driver itself is never pinned.
    assert os.sched_getaffinity(0) == set(USABLE)


def _planned_cpus(rank_placement) -> list[int]:
    """The CPUs a rank should find itself on: its own, or (unpinned) all usable."""
    return USABLE if rank_placement.cpus is None else sorted(rank_placement.cpus)


@pytest.mark.slow
def test_mp_tp2_default_follows_the_plan(model, reference):
    plan = plan_cpu_placement(read_topology(), 2)
    llm = LLM(
        model,
        dtype="float32",
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        kv_cache_memory_bytes=16 << 20,
    )
    executor = executor_of(llm)
    pids = list(executor.worker_pids)
    try:
        got = executor.collective_rpc(thread_placement)
        for (cpus, threads, omp), planned in zip(got, plan.ranks):
            assert cpus == _planned_cpus(planned)
            assert threads == planned.num_threads and omp == str(planned.num_threads)
        assert _generate(llm) == reference
    finally:
        llm.shutdown()
    assert _gone(pids)


def make_the_watch_fire(worker):
    """A contention watch whose bar no process clears: the next pass unpins."""
    from raylm.worker.thread_governance import ContentionWatch

    assert worker.contention_watch is not None  # the plan pinned this rank
    worker.contention_watch = ContentionWatch(
        worker.cpu_placement.num_threads, window_s=0.0, min_steps=1, min_cpu_share=2.0
    )


def is_watching(worker):
    return worker.contention_watch is not None


@pytest.mark.slow
@needs_two_cpus
def test_a_starved_rank_unpins_itself_and_keeps_its_outputs(model, reference):
    llm = LLM(
        model,
        dtype="float32",
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        kv_cache_memory_bytes=16 << 20,
    )
    executor = executor_of(llm)
    pids = list(executor.worker_pids)
    try:
        assert [cpus for cpus, _, _ in executor.collective_rpc(thread_placement)] == [[USABLE[0]], [USABLE[1]]]
        executor.collective_rpc(make_the_watch_fire)
        assert _generate(llm) == reference
        # Every thread of both ranks may now run on any usable CPU, and stays so.
        assert executor.collective_rpc(process_affinities) == [[tuple(USABLE)], [tuple(USABLE)]]
        assert executor.collective_rpc(is_watching) == [False, False]
        assert _generate(llm) == reference
    finally:
        llm.shutdown()
    assert _gone(pids)


@needs_two_cpus
@pytest.mark.parametrize("cpu_bind", [None, "explicit"])
def test_ray_tp2_ranks_follow_the_plan(ray_session, model, reference, caplog, cpu_bind):
    """By default the ranks follow the planner (on a 2-core machine: not pinned,
    the engine loop shares their cores); an explicit bind pins each rank's
    every thread to its own group."""
    cpu_bind = f"{USABLE[0]}|{USABLE[1]}" if cpu_bind == "explicit" else None
    plan = plan_cpu_placement(read_topology(), 2, cpu_bind=cpu_bind or "auto")
    with caplog.at_level(logging.INFO, logger="raylm.executor.ray_executor"):
        llm = LLM(
            model,
            dtype="float32",
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
            kv_cache_memory_bytes=16 << 20,
            cpu_bind=cpu_bind,
        )
    executor = executor_of(llm)
    try:
        got = executor.collective_rpc(thread_placement)
        assert [cpus for cpus, _, _ in got] == [_planned_cpus(r) for r in plan.ranks]
        if cpu_bind:
            assert got[0][0] == [USABLE[0]] and got[1][0] == [USABLE[1]]
            assert executor.collective_rpc(process_affinities) == [[(USABLE[0],)], [(USABLE[1],)]]
        assert [(threads, omp) for _, threads, omp in got] == [(r.num_threads, str(r.num_threads)) for r in plan.ranks]
        assert _generate(llm) == reference
    finally:
        llm.shutdown()
    assert our_live_ray_state() == ([], [])
    assert any(r.getMessage().startswith("CPU placement:") for r in caplog.records)


def test_uni_sets_threads_and_leaves_the_engine_thread_unpinned(model, reference):
    plan = plan_cpu_placement(read_topology(), 1)
    omp_before = os.environ.get("OMP_NUM_THREADS")
    llm = LLM(model, dtype="float32", kv_cache_memory_bytes=16 << 20)
    try:
        # Uni runs the model on this very thread, and leaves this process's environment alone.
        assert executor_of(llm).collective_rpc(thread_placement) == [(USABLE, plan.ranks[0].num_threads, omp_before)]
        # Every core, one given back to the engine loop when other work needs it.
        assert plan.ranks[0].num_threads == len(USABLE)
        assert plan.ranks[0].contended_threads == (len(USABLE) - 1 if len(USABLE) > 1 else None)
        assert _generate(llm) == reference
    finally:
        llm.shutdown()


def make_the_governor_drop(worker):
    """A governor whose every window counts as waiting, where fewer threads
    always count as paying (any slowdown is within its min_gain), and that
    never probes again."""
    from raylm.worker.thread_governance import ThreadGovernor

    assert isinstance(worker.contention_watch, ThreadGovernor)
    worker.contention_watch = ThreadGovernor(
        worker.cpu_placement,
        window_s=0.0,
        min_steps=1,
        max_wait_share=-1.0,
        probe_after_s=3600.0,
        min_gain=-float("inf"),
    )


@needs_two_cpus
def test_uni_under_contention_gives_the_engine_loop_its_core_back(model, reference):
    llm = LLM(model, dtype="float32", kv_cache_memory_bytes=16 << 20)
    executor = executor_of(llm)
    try:
        assert executor.collective_rpc(thread_placement)[0][1] == len(USABLE)
        executor.collective_rpc(make_the_governor_drop)
        assert _generate(llm) == reference
        assert executor.collective_rpc(thread_placement)[0][1] == len(USABLE) - 1
        assert _generate(llm) == reference
    finally:
        llm.shutdown()


@needs_two_cpus
def test_uni_explicit_bind_pins_the_model_thread_until_shutdown(model, reference):
    llm = LLM(model, dtype="float32", kv_cache_memory_bytes=16 << 20, cpu_bind=str(USABLE[1]))
    try:
        assert executor_of(llm).collective_rpc(thread_placement)[0][:2] == ([USABLE[1]], 1)
        assert _generate(llm) == reference
    finally:
        llm.shutdown()
    assert os.sched_getaffinity(0) == set(USABLE)


def test_vllm_env_alias_and_cli_flag(monkeypatch, model):
    from raylm.config import create_engine_config
    from raylm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    assert create_engine_config(model, tensor_parallel_size=2).cpu_bind == "0|1"
    # The flag wins over the environment.
    assert create_engine_config(model, tensor_parallel_size=2, cpu_bind="all").cpu_bind == "all"
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    assert create_engine_config(model).cpu_bind == "auto"

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--cpu-bind", "0-3|4-7"])).cpu_bind == "0-3|4-7"
    # Unset, the engine decides (from VLLM_CPU_OMP_THREADS_BIND, else auto).
    assert EngineArgs.from_cli_args(parser.parse_args([])).cpu_bind is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"cpu_bind": "0|zero"}, "cpu_bind"),
        ({"cpu_bind": "0|1|2"}, "cpu_bind has 3 CPU groups for 1 rank"),
        ({"cpu_bind": "0-1|1-2", "tensor_parallel_size": 2}, "cpu_bind groups 0 and 1"),
        ({"cpu_bind": 3}, "cpu_bind must be a string"),
        ({"num_threads": 0}, "num_threads must be an integer >= 1"),
    ],
)
def test_bad_settings_name_the_field(model, kwargs, message):
    from raylm.config import create_engine_config

    with pytest.raises(ValueError, match=message):
        create_engine_config(model, **kwargs)


def test_cpus_outside_the_affinity_are_refused(model):
    missing = max(USABLE) + 1
    with pytest.raises(ValueError, match=rf"cpu_bind group 0 names CPUs \[{missing}\]"):
        LLM(model, dtype="float32", kv_cache_memory_bytes=16 << 20, cpu_bind=str(missing))
