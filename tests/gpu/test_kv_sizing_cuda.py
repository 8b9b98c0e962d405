"""On CUDA the KV cache is sized from memory: the share gpu_memory_utilization
gives, less weights, context and the activation peak of a profiling step that
is measured on the device."""

from __future__ import annotations

import torch

from raylm import LLM, SamplingParams
from raylm.worker.memory_profiling import CudaMemory, measure_peak_activation_bytes, run_profiling_step
from tests.conftest import executor_of

UTILIZATION = 0.25


def test_profiled_peak_grows_with_the_batch(tiny_model_dir):
    with LLM(
        tiny_model_dir("llama"), dtype="float32", distributed_executor_backend="uni", gpu_memory_utilization=UTILIZATION
    ) as llm:
        worker = executor_of(llm).driver_worker.worker
        memory = CudaMemory(worker.device)
        peaks = [
            measure_peak_activation_bytes(lambda n=n: run_profiling_step(worker.model_runner, n, 8, 1024), memory)
            for n in (256, 4096)
        ]
    # fp32 hidden states of 4096 tokens alone take 1 MiB; 256 tokens a 16th of that.
    assert 0 < peaks[0] < peaks[1]
    assert peaks[1] >= 4096 * 64 * 4


def test_cache_fills_the_share_and_a_full_step_fits(tiny_model_dir):
    total = torch.cuda.mem_get_info()[1]
    model = tiny_model_dir("mistral")
    with LLM(
        model,
        dtype="bfloat16",
        distributed_executor_backend="uni",
        gpu_memory_utilization=UTILIZATION,
        max_num_batched_tokens=4096,
        max_num_seqs=64,
        max_model_len=1024,
    ) as llm:
        worker = executor_of(llm).driver_worker.worker
        runner = worker.model_runner
        kv_bytes = sum(c.numel() * c.element_size() for c in runner.kv_caches)
        # Tiny weights: the cache takes nearly all of the share.
        assert 0.6 * UTILIZATION * total < kv_bytes < UTILIZATION * total
        torch.cuda.reset_peak_memory_stats()
        prompts = [{"prompt_token_ids": [i % 500 + 1] * 900} for i in range(40)]
        outs = llm.generate(
            prompts, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True), use_tqdm=False
        )
        assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
        peak = torch.cuda.max_memory_allocated()
    # Everything this process allocated stayed within the share (plus the
    # CUDA context, which torch's allocator does not count).
    assert peak <= UTILIZATION * total
