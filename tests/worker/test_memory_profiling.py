"""KV cache sizing from a measured profiling step, on CPU with a fake memory
source (the same code reads torch.cuda on a GPU; tests/gpu/ checks it there)."""

from __future__ import annotations

import pytest
import torch

from raylm import LLM
from raylm.worker import memory_profiling
from raylm.worker import worker as worker_module
from raylm.worker.memory_profiling import (
    kv_cache_budget_bytes,
    largest_prefill_attention,
    measure_peak_activation_bytes,
    run_profiling_step,
)
from tests.conftest import executor_of

GiB = 1 << 30


class FakeMemory:
    """An allocator that counts bytes, with a peak, and logs the calls made to it."""

    def __init__(self, allocated: int = 0):
        self.allocated = allocated
        self.peak = allocated
        self.calls: list[str] = []

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n

    def memory_allocated(self) -> int:
        return self.allocated

    def max_memory_allocated(self) -> int:
        return self.peak

    def reset_peak_memory_stats(self) -> None:
        self.calls.append("reset")
        self.peak = self.allocated

    def synchronize(self) -> None:
        self.calls.append("sync")

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")


def test_peak_is_measured_above_what_was_allocated_before():
    memory = FakeMemory(allocated=5 * GiB)  # the weights
    memory.peak = 9 * GiB  # an earlier peak (loading) must not count

    def step():
        memory.alloc(1 * GiB)
        memory.alloc(2 * GiB)  # the widest moment: 3 GiB above the weights
        memory.free(2 * GiB)
        memory.alloc(512 << 20)
        memory.free((1 * GiB) + (512 << 20))

    assert measure_peak_activation_bytes(step, memory) == 3 * GiB
    # The peak is reset before the step, and the step's cached blocks are
    # handed back after it (else free memory would count them again).
    assert memory.calls.index("reset") < memory.calls.index("sync", 2)
    assert memory.calls[-1] == "empty_cache"


def test_budget_arithmetic():
    # 80 GiB device at 0.9 = 72 GiB; the rank holds 10 GiB (weights, context); its step peaks at 4 GiB.
    assert kv_cache_budget_bytes(80 * GiB, 0.9, 10 * GiB, 4 * GiB) == int(80 * GiB * 0.9) - 14 * GiB
    assert kv_cache_budget_bytes(80 * GiB, 0.5, 30 * GiB, 20 * GiB) == 0  # never negative


@pytest.fixture(scope="module")
def uni_llm(tiny_model_dir):
    with LLM(
        tiny_model_dir("llama"),
        dtype="float32",
        kv_cache_memory_bytes=8 << 20,
        max_num_batched_tokens=96,
        max_num_seqs=5,
        distributed_executor_backend="uni",
    ) as llm:
        yield llm


def test_profiling_step_runs_the_largest_batch(uni_llm):
    runner = executor_of(uni_llm).driver_worker.worker.model_runner
    seen = {}
    # (Under inference mode: no autograd state kept, as in a real step.)
    hook = runner.model.register_forward_pre_hook(
        lambda m, args: seen.update(tokens=args[0].shape[0], inference=torch.is_inference_mode_enabled())
    )
    real_sampler = runner.sampler
    try:
        runner.sampler = lambda logits, meta: (
            seen.setdefault("rows", tuple(logits.shape)) and real_sampler(logits, meta)
        )
        # More tokens than the model has positions: positions wrap, nothing breaks.
        run_profiling_step(runner, num_tokens=1500, num_seqs=5, max_model_len=1024)
    finally:
        hook.remove()
        runner.sampler = real_sampler
    assert seen == {"tokens": 1500, "inference": True, "rows": (5, runner.vocab_size)}


def test_profiling_step_runs_the_paged_attention_of_full_length_prefills(uni_llm, monkeypatch):
    """On a GPU the step's attention is the batched paged path with its masks
    (not one causal sequence): 1500 tokens at max_model_len 1024 are two
    prefills, 1024 and 476 tokens, over scratch caches; the layers get their
    own caches back afterwards."""
    from raylm.model.layers import gpu_attention

    runner = executor_of(uni_llm).driver_worker.worker.model_runner
    layers = runner.attention_layers()
    own = [layer.kv_cache for layer in layers]
    # The runner bounds the layers' SDPA prefill calls by the engine's limits.
    max_model_len = uni_llm.llm_engine.config.model_config.max_model_len
    assert {layer.prefill_budget for layer in layers} == {
        gpu_attention.prefill_budget(96, max_model_len, runner.block_size)
    }
    seen = []
    real_prefill = gpu_attention.sdpa_prefill

    def watch(q, kv_cache, layout, scale):
        seen.append((layout.num_prefills, layout.max_query_len, layout.prefill_seq_lens, kv_cache.shape[1]))
        return real_prefill(q, kv_cache, layout, scale)

    monkeypatch.setattr(gpu_attention, "sdpa_prefill", watch)
    for layer in layers:
        monkeypatch.setattr(layer, "batched_paged", True)  # the GPU's path, on this CPU
        # As the runner sets it for an engine of 1500-token steps: the profile is one call.
        monkeypatch.setattr(layer, "prefill_budget", gpu_attention.prefill_budget(1500, 1024, runner.block_size))
    with largest_prefill_attention(runner, num_tokens=1500, max_model_len=1024) as attention:
        assert all(layer.kv_cache is not cache for layer, cache in zip(layers, own))
        run_profiling_step(runner, num_tokens=1500, num_seqs=5, max_model_len=1024, attention=attention)
    blocks = 2 * -(-1024 // runner.block_size)
    assert seen == [(2, 1024, [1024, 476], blocks)] * len(layers)
    assert all(layer.kv_cache is cache for layer, cache in zip(layers, own))


def test_worker_sizes_the_cache_from_the_profile(uni_llm, monkeypatch):
    """The worker's CUDA sizing with torch.cuda replaced by the fake: it runs
    the profiling step at max_num_batched_tokens / max_num_seqs, and gives the
    KV cache the utilization share less what it holds and the measured peak."""
    worker = executor_of(uni_llm).driver_worker.worker
    memory = FakeMemory(allocated=2 * GiB)
    total, free_at_start, held = 80 * GiB, 79 * GiB, 3 * GiB
    asked = {}

    def fake_step(runner, num_tokens, num_seqs, max_model_len, attention=None):
        asked.update(tokens=num_tokens, seqs=num_seqs, prefills=len(attention.prefills))
        memory.alloc(6 * GiB)
        memory.free(6 * GiB)

    monkeypatch.setattr(worker_module, "run_profiling_step", fake_step)
    monkeypatch.setattr(worker_module, "CudaMemory", lambda device: memory)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_at_start - held, total))
    monkeypatch.setattr(worker, "_cuda_free_at_start", free_at_start)
    monkeypatch.setattr(worker.config.cache_config, "kv_cache_memory_bytes", None)
    monkeypatch.setattr(worker.config.cache_config, "gpu_memory_utilization", 0.5)
    monkeypatch.setattr(worker, "device", torch.device("cuda", 0))
    assert worker.determine_available_memory() == int(total * 0.5) - held - 6 * GiB
    assert asked == {"tokens": 96, "seqs": 5, "prefills": 1}


def test_memory_module_uses_no_cuda_at_import():
    # Importable and usable on a machine without a GPU (this one).
    assert memory_profiling.CudaMemory(torch.device("cpu")).device.type == "cpu"
