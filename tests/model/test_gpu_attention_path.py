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
from tests.model.paged_steps import CASES, attend as _attend, random_step as _random_step

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
    with LLM(model, dtype="float32", kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=48,
             distributed_executor_backend="uni") as llm:
        layers = executor_of(llm).driver_worker.worker.model_runner.attention_layers()
        assert layers
        for layer in layers:
            layer.batched_paged = True
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r.token_ids for r in ref]
    assert len(calls) >= 12 * len(layers)  # every step of every layer took the batched path
