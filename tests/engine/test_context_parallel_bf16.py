"""bf16 under context parallelism (issue 26): CP=2's greedy tokens equal
CP=1's. Each rank's partial attention stays float32 through the log-sum-exp
merge and is rounded to bf16 once, as CP=1's attention is; rounding each
partial first made bf16 CP=2 drift from CP=1 (tests/model/test_attention_merge
shows the merge's error against a float reference, old and new).

Two float computations of the same attention (one softmax over all keys, or
two merged) may still round a value to neighbouring bf16 numbers, and a tiny
random model has exact near-ties: its logits are bf16, so two candidates
one bf16 step apart (1/16 for logits of 8 to 16) are a coin toss for any
change of summation order. So: equal token for token, up to a step where
CP=1's own top two were at most one bf16 step apart, where the runs may part.
(float32 CP runs are checked against Hugging Face in test_context_parallel.)"""

from __future__ import annotations

import random

import pytest

from raylm import LLM, SamplingParams
from raylm.model.arch_config import ArchConfig
from tests.conftest import executor_of, process_gone

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
# One bf16 step of a logit in [8, 16): the margin of a tie that rounding may break either way.
NEAR_TIE = 1 / 16


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("qwen2", num_key_value_heads=2)


def _prompts(model: str) -> list[list[int]]:
    rng = random.Random(3)
    vocab = ArchConfig.from_model_dir(model).vocab_size
    # A long prompt (its blocks alternate between the ranks), a short one, one token.
    return [[rng.randrange(vocab) for _ in range(n)] for n in (150, 9, 1)]


def _greedy(model: str, **engine) -> list:
    with LLM(model, dtype="bfloat16", num_threads=1, kv_cache_memory_bytes=8 << 20, max_model_len=256, **engine) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(model)], GREEDY, use_tqdm=False)
        pids = getattr(executor_of(llm), "worker_pids", [])
    assert all(process_gone(p) for p in pids)
    return [o.outputs[0] for o in outs]


def _margin(step_logprobs: dict) -> float:
    best, second = sorted((e.logprob for e in step_logprobs.values()), reverse=True)[:2]
    return best - second


def test_bf16_cp2_decodes_the_tokens_cp1_does(model):
    cp1 = _greedy(model)
    cp2 = _greedy(model, context_parallel_size=2, distributed_executor_backend="mp")
    for ours, ref in zip(cp2, cp1):
        for i, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids)):
            if a != b:
                margin = _margin(ref.logprobs[i])
                assert margin <= NEAR_TIE + 1e-6, f"step {i}: CP=2 chose {a}, CP=1 {b} by a margin of {margin}"
                break  # the sequences differ from here on
