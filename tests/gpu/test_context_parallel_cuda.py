"""Context parallelism on CUDA (issue 26): CP decode where the C++ kernel
does not run, torch's partial attention plus the log-sum-exp merge.

- On any GPU: a rank's partials over its blocks of each sequence, on CUDA
  tensors from the metadata the worker builds, merged over the ranks, equal
  attention over the whole sequence (fp32 and bf16 inputs; float32 partials).
- With two GPUs or more (one rank per GPU, NCCL): CP=2's greedy tokens equal
  CP=1's on a tiny model, fp32 and bf16.

Untested on a GPU so far (written without one); the CPU suite runs the same
torch path against the C++ kernel (tests/model/test_context_parallel_decode_paths.py)."""

from __future__ import annotations

import random

import pytest
import torch

from raylm import LLM, SamplingParams
from raylm.model.arch_config import ArchConfig
from raylm.model.layers.attention import Attention
from raylm.model.layers.attention_merge import merge_partials
from raylm.worker.input_batch import prepare_batch
from tests.model.test_context_parallel_decode_paths import BLOCK, CP, LENGTHS, _step, _whole_sequence_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_partials_merge_to_whole_sequence_attention(dtype):
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, blocks_per_rank = 8, 2, 64, 8
    states = _step(CP * blocks_per_rank, gen)
    caches = [torch.randn(2, blocks_per_rank, BLOCK, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(CP)]
    q = torch.randn(len(LENGTHS), heads, head_dim, generator=gen).to(dtype)
    attn = Attention(heads, kv_heads, head_dim, head_dim**-0.5)
    partials = []
    for rank in range(CP):
        attn.kv_cache = caches[rank].cuda()
        cp = prepare_batch(
            states, {rid: 1 for rid in states}, BLOCK, "cuda", cp_rank=rank, cp_size=CP
        ).attn_metadata.context_parallel
        k_flat, v_flat = (attn.kv_cache[i].view(-1, kv_heads, head_dim) for i in (0, 1))
        out, lse = attn._cp_decode_partials(q.cuda(), k_flat, v_flat, cp)
        assert out.is_cuda and out.dtype == torch.float32 and lse.dtype == torch.float32
        partials.append((out, lse))
    merged = merge_partials(torch.stack([o for o, _ in partials]), torch.stack([lse for _, lse in partials]))
    expected = _whole_sequence_attention(q, caches, states, head_dim**-0.5)
    # TF32 may serve float32 matmuls on CUDA: a looser bound than the CPU test's.
    torch.testing.assert_close(merged.double().cpu(), expected, rtol=2e-3, atol=2e-3)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="CP=2 on CUDA needs two GPUs (one rank each, NCCL)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cp2_greedy_equals_cp1_on_cuda(dtype, tiny_model_dir):
    model = tiny_model_dir("qwen2", num_key_value_heads=2)
    rng = random.Random(3)
    vocab = ArchConfig.from_model_dir(model).vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (150, 9, 1)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def greedy(**engine):
        with LLM(model, dtype=dtype, gpu_memory_utilization=0.3, max_model_len=256, **engine) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    assert greedy(context_parallel_size=2, distributed_executor_backend="mp") == greedy()
