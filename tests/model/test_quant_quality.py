"""Quality on real text: the perplexity raylm computes (prompt log-probs) on a
passage the embedded Shakespeare model never trained on (the epilogue of The
Tempest: the last 5% of each work was held out) stays within 1% of the bf16
model's with the model written as Q8_0, and within 3% as a Q4_K_M-like mix
(issue 24). The comparison with llama.cpp's llama-perplexity on the same files
is a benchmark's, not this test's: it needs the peer's binaries."""

from __future__ import annotations

import math

import pytest

from raylm import LLM, SamplingParams
from raylm.config import DEFAULT_MODEL_DIR
from raylm.testing.gguf_writer import write_gguf
from raylm.testing.held_out import HELD_OUT, q4_k_m


def perplexity(model: str) -> float:
    with LLM(model, dtype="bfloat16", num_threads=1, kv_cache_memory_bytes=16 << 20) as llm:
        ids = llm.get_tokenizer().encode(HELD_OUT)
        params = SamplingParams(max_tokens=1, prompt_logprobs=0)
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    logprobs = [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], ids[1:])]
    assert len(logprobs) == len(ids) - 1 > 150
    return math.exp(-sum(logprobs) / len(logprobs))


@pytest.fixture(scope="module")
def bf16_perplexity() -> float:
    return perplexity(str(DEFAULT_MODEL_DIR))


@pytest.mark.parametrize("variant,bound", [("Q8_0", 0.01), ("Q4_K_M", 0.03)])
def test_quantized_perplexity_stays_near_bf16(variant, bound, bf16_perplexity, tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLM_GGUF_CACHE", str(tmp_path / "cache"))
    path = write_gguf(
        DEFAULT_MODEL_DIR,
        tmp_path / "m.gguf",
        "Q8_0" if variant == "Q8_0" else "Q4_K",
        tensor_type=q4_k_m if variant == "Q4_K_M" else None,
    )
    assert abs(perplexity(str(path)) / bf16_perplexity - 1) < bound
