"""Recovery frees what it replaces (docs/architecture.md, "The failure model"): the failed
step's traceback holds frames that reference the old executor's model and KV
cache (with the uni backend, in the engine's own process). The old model must
be gone before the new executor is built and sized (on one GPU both would
not fit), and once recovered the process holds what it held before.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from raylm import LLM, SamplingParams
from raylm.executor.uniproc_executor import UniProcExecutor
from tests.conftest import executor_of
from tests.executor.worker_callables import install_poison

POISON = 700
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
GOOD = [[3 + i, 4 + i, 5 + i] for i in range(4)]


class PoisonedUniProcExecutor(UniProcExecutor):
    def _init_executor(self) -> None:
        super()._init_executor()
        self.collective_rpc(install_poison, args=(POISON,))


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage this process can still reach."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if torch.is_tensor(obj) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@pytest.mark.slow
def test_the_old_model_is_freed_before_the_new_executor_is_built(tiny_model_dir):
    model = tiny_model_dir("llama", num_key_value_heads=2)
    llm = LLM(
        model,
        dtype="float32",
        distributed_executor_backend=PoisonedUniProcExecutor,
        num_threads=1,
        kv_cache_memory_bytes=16 << 20,
    )
    try:
        llm.generate([{"prompt_token_ids": p} for p in GOOD], GREEDY, use_tqdm=False)
        before = live_tensor_bytes()
        core = llm.llm_engine.engine_core.engine_core
        old_runner = weakref.ref(executor_of(llm).driver_worker.worker.model_runner)
        old_kv = [weakref.ref(t) for t in old_runner().kv_caches]
        seen_at_rebuild = []
        make_executor = core._make_executor

        def make_executor_and_look():
            gc.collect()  # only what is truly unreachable goes
            seen_at_rebuild.append((old_runner() is None, all(ref() is None for ref in old_kv)))
            return make_executor()

        core._make_executor = make_executor_and_look
        outputs = llm.generate(
            [{"prompt_token_ids": [5, POISON, 6]}] + [{"prompt_token_ids": p} for p in GOOD], GREEDY, use_tqdm=False
        )
        assert outputs[0].outputs[0].finish_reason == "error"
        assert seen_at_rebuild and all(seen == (True, True) for seen in seen_at_rebuild), seen_at_rebuild
        after = live_tensor_bytes()
        # The new model and KV cache replace the old ones: no second copy.
        assert after <= before * 1.05, (before, after)
    finally:
        llm.shutdown()
