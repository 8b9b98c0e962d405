"""The GPU attention path (gpu_attention.py, batched over sequences), run on CPU
tensors, against the CPU path (per-sequence prefill) on random paged caches:
fresh prefills, later prefill chunks with context, decodes, and mixes of all
three in one step; then greedy generation through the whole engine with the
GPU path forced on, against Hugging Face."""

from __future__ import annotations

import pytest
import torch

from raylm import LLM, SamplingParams
from raylm.model.layers import gpu_attention
from raylm.model.layers.cpu_kernels import DISABLE_ENV
from raylm.testing.hf_oracle import hf_greedy
from tests.conftest import executor_of, oracle_prompts
from tests.model.paged_steps import CASES
from tests.model.paged_steps import attend as _attend
from tests.model.paged_steps import random_step as _random_step


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 32), (4, 4, 64), (8, 1, 16)])
def test_batched_path_equals_per_sequence_path(case, num_heads, num_kv_heads, head_dim, monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "1")  # the reference is the torch path, not the C++ decode kernel
    batch, cache, gen = _random_step(CASES[case], num_kv_heads, head_dim, torch.float32, seed=len(case) + head_dim)
    t = batch.input_ids.shape[0]
    q = torch.randn(t, num_heads * head_dim, generator=gen)
    k = torch.randn(t, num_kv_heads * head_dim, generator=gen)
    v = torch.randn(t, num_kv_heads * head_dim, generator=gen)
    args = (batch, cache, q, k, v, num_heads, num_kv_heads, head_dim)
    ref, ref_cache = _attend(False, *args)
    out, out_cache = _attend(True, *args)
    assert torch.equal(out_cache, ref_cache)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


# Small enough that the mixed steps' prefills go in several SDPA calls.
SMALL_BUDGET = gpu_attention.PrefillBudget(context_rows=160, elements=64 * 128)


@pytest.mark.parametrize("case", ["fresh-prefills", "chunks-with-context", "mixed", "one-prefill"])
def test_prefills_cut_to_the_budget_equal_the_per_sequence_path(case, monkeypatch):
    """Over the budget the prefills go in several SDPA calls, each within it
    (a sequence alone always goes), and the step's result is the same."""
    monkeypatch.setenv(DISABLE_ENV, "1")
    batch, cache, gen = _random_step(CASES[case], 2, 32, torch.float32, seed=len(case))
    t = batch.input_ids.shape[0]
    q, k, v = (torch.randn(t, n * 32, generator=gen) for n in (8, 2, 2))
    calls = []
    real_prefill = gpu_attention.sdpa_prefill

    def watch(q, kv_cache, layout, scale):
        padded_context = layout.prefill_block_table.shape[1] * layout.block_size
        calls.append((layout.num_prefills, layout.max_query_len, padded_context))
        return real_prefill(q, kv_cache, layout, scale)

    monkeypatch.setattr(gpu_attention, "sdpa_prefill", watch)
    ref, _ = _attend(False, batch, cache, q, k, v, 8, 2, 32)
    out, _ = _attend(True, batch, cache, q, k, v, 8, 2, 32, prefill_budget=SMALL_BUDGET)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    prefills = len(batch.attn_metadata.prefills)
    assert sum(n for n, _, _ in calls) == prefills  # each prefill in exactly one call
    for n, max_q, context in calls:
        assert n == 1 or (n * context <= SMALL_BUDGET.context_rows and n * max_q * context <= SMALL_BUDGET.elements)
    if case in ("fresh-prefills", "mixed"):
        assert len(calls) > 1, calls  # these steps are over the budget as one call
    if case == "one-prefill":
        assert calls == [(1, 257, 272)]  # one sequence goes alone, whatever its size


def test_the_budget_fits_the_largest_step_in_one_call():
    """The largest prefill step (the one the KV-cache sizing profiles) is
    exactly one call at the budget: 4096 tokens at max_model_len 1024 are four
    sequences of 1024, 2000 tokens are one of 1024 and one of 976."""
    budget = gpu_attention.prefill_budget(4096, 1024, 16)
    assert budget == gpu_attention.PrefillBudget(context_rows=4 * 1024, elements=4 * 1024 * 1024)
    assert gpu_attention.prefill_budget(2000, 1024, 16) == gpu_attention.PrefillBudget(2 * 1024, 2 * 1024 * 1024)
    assert gpu_attention.prefill_budget(100, 1024, 16) == gpu_attention.PrefillBudget(112, 100 * 112)


def test_batched_path_bf16_close_to_fp32(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "1")
    batch, cache, gen = _random_step(CASES["mixed"], 2, 32, torch.float32, seed=7)
    t = batch.input_ids.shape[0]
    q, k, v = (torch.randn(t, n * 32, generator=gen) for n in (8, 2, 2))
    ref, _ = _attend(False, batch, cache, q, k, v, 8, 2, 32)
    out, _ = _attend(True, batch, cache.bfloat16(), q.bfloat16(), k.bfloat16(), v.bfloat16(), 8, 2, 32)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_layout_is_built_once_per_step(monkeypatch):
    """Every layer of a forward reuses the first layer's layout; a new step gets a new one."""
    builds = []
    real = gpu_attention.build_paged_layout
    monkeypatch.setattr(gpu_attention, "build_paged_layout", lambda *a: builds.append(1) or real(*a))
    batch, cache, gen = _random_step(CASES["mixed"], 2, 32, torch.float32, seed=3)
    t = batch.input_ids.shape[0]
    q, k, v = (torch.randn(t, n * 32, generator=gen) for n in (8, 2, 2))
    for _ in range(3):
        _attend(True, batch, cache, q, k, v, 8, 2, 32)
    assert len(builds) == 1
    batch2, *_ = _random_step(CASES["mixed"], 2, 32, torch.float32, seed=3)
    _attend(True, batch2, cache, q, k, v, 8, 2, 32)
    assert len(builds) == 2


def test_flashinfer_is_not_used_on_cpu():
    q = torch.zeros(1, 4, 8)
    assert gpu_attention._flashinfer_for(q, torch.zeros(2, 1, 16, 2, 8)) is None
    assert gpu_attention.active_backend_name() == "sdpa"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_with_batched_path_matches_hf(arch, tiny_model_dir, monkeypatch):
    """Whole engine on CPU with every attention layer on the GPU path: greedy
    tokens equal HF under chunked prefill (a tiny token budget) and batching."""
    model = tiny_model_dir(arch)
    from raylm.model.arch_config import ArchConfig

    prompts = oracle_prompts(ArchConfig.from_model_dir(model).vocab_size, lengths=(1, 7, 16, 33, 130))
    ref = hf_greedy(model, prompts, 12)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    calls = []
    real = gpu_attention.sdpa_paged_attention
    monkeypatch.setattr(gpu_attention, "sdpa_paged_attention", lambda *a: calls.append(1) or real(*a))
    with LLM(
        model,
        dtype="float32",
        kv_cache_memory_bytes=32 << 20,
        max_num_batched_tokens=48,
        distributed_executor_backend="uni",
    ) as llm:
        layers = executor_of(llm).driver_worker.worker.model_runner.attention_layers()
        assert layers
        for layer in layers:
            layer.batched_paged = True
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r.token_ids for r in ref]
    assert len(calls) >= 12 * len(layers)  # every step of every layer took the batched path
