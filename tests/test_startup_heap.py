"""A serving process exempts its start-up objects from Python's garbage
collector (raylm.startup_heap): full collections then walk only what came
after, instead of pausing the process for hundreds of milliseconds."""

from __future__ import annotations

import gc
import subprocess
import sys

from raylm import LLM


def test_freezing_leaves_only_later_objects_to_the_collector():
    # A fresh interpreter: freezing this test process would change its neighbours.
    script = """
import gc
from raylm.startup_heap import freeze_startup_heap
held = [[i] for i in range(200_000)]  # start-up's objects (lists: always tracked)
freeze_startup_heap()
later = [[j] for j in range(1_000)]
tracked = len(gc.get_objects())
print(gc.get_freeze_count(), tracked)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    frozen, tracked = map(int, out.stdout.split())
    assert frozen >= 200_000
    assert 1_000 <= tracked < 20_000  # the later objects and a few others, not start-up's


def test_a_worker_process_freezes_its_start_up_heap_before_serving(tiny_model_dir):
    llm = LLM(
        tiny_model_dir("llama"),
        dtype="float32",
        distributed_executor_backend="mp",
        num_threads=1,
        kv_cache_memory_bytes=8 << 20,
    )
    try:
        executor = llm.llm_engine.engine_core.engine_core.executor
        assert all(count > 10_000 for count in executor.collective_rpc(lambda worker: gc.get_freeze_count()))
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) > 0
    finally:
        llm.llm_engine.engine_core.shutdown()
