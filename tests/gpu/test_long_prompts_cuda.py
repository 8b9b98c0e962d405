"""Long prompts on CUDA through chunked prefill (a small token budget) and
preemption (a KV cache too small for the batch), against Hugging Face (fp32)."""

from __future__ import annotations

import pytest
import torch

from raylm import LLM, SamplingParams
from tests.conftest import oracle_prompts
from tests.gpu.conftest import hf_greedy_cuda

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def long_model(tiny_model_dir):
    return tiny_model_dir("qwen3", max_position_embeddings=4096)


def _bytes_per_block(model) -> int:
    from raylm.model.arch_config import ArchConfig

    a = ArchConfig.from_model_dir(model)
    return 2 * 16 * a.num_key_value_heads * a.head_dim * 4 * a.num_hidden_layers


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({"max_num_batched_tokens": 256}, id="chunked-prefill"),
        pytest.param({"max_num_batched_tokens": 512, "num_blocks": 260}, id="chunked-prefill-and-preemption"),
    ],
)
def test_long_prompts_match_hf(long_model, engine_kwargs):
    from raylm.model.arch_config import ArchConfig

    prompts = oracle_prompts(ArchConfig.from_model_dir(long_model).vocab_size, lengths=(3000, 1500, 900, 2048, 17))
    ref = hf_greedy_cuda(long_model, prompts, MAX_TOKENS, torch.float32)
    kwargs = dict(engine_kwargs)
    num_blocks = kwargs.pop("num_blocks", None)
    # 260 blocks of 16 = 4160 tokens: room for the longest request, not for all at once.
    kwargs["kv_cache_memory_bytes"] = (num_blocks or 2000) * _bytes_per_block(long_model)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(long_model, dtype="float32", distributed_executor_backend="uni", max_model_len=4096, **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.llm_engine.stats()
    assert [o.outputs[0].token_ids for o in outs] == [[s.token_id for s in steps] for steps in ref]
    if num_blocks is not None:
        assert stats["num_preemptions"] > 0
