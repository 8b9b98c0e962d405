"""Prompt logprobs in chunks of positions: the same values, ids and ranks as
the whole computation, the logits never computed for more than a chunk of
positions at a time."""

from __future__ import annotations

import random

import pytest
import torch

from raylm import LLM, SamplingParams
from raylm.testing.hf_oracle import hf_prompt_logprobs, load_hf_model
from raylm.worker import prompt_logprobs as chunked_module
from raylm.worker.prompt_logprobs import prompt_logprobs_in_chunks
from raylm.worker.sampler import compute_prompt_logprobs


@pytest.fixture(scope="module")
def tiny_hidden(tiny_model_dir):
    """A tiny model's lm_head and the final hidden states of a 40-token prompt."""
    model = load_hf_model(tiny_model_dir("llama"), torch.float32)
    vocab = model.config.vocab_size
    rng = random.Random(1)
    prompt = [rng.randrange(vocab) for _ in range(40)]
    with torch.inference_mode():
        hidden = model.model(input_ids=torch.tensor([prompt])).last_hidden_state[0]
    return model.lm_head, hidden, prompt


def _whole(lm_head, hidden, rows, targets, num_top):
    """The computation before chunking: every row's logits at once."""
    with torch.inference_mode():
        logits = lm_head(hidden[rows]).float()
        return compute_prompt_logprobs(logits, torch.tensor(targets), num_top)


@pytest.mark.parametrize("num_top", [0, 1, 5])
@pytest.mark.parametrize("chunk_rows", [1, 7, 16, 256])
def test_chunks_give_the_whole_computations_results(tiny_hidden, num_top, chunk_rows):
    lm_head, hidden, prompt = tiny_hidden
    # Positions 3..38 predict prompt tokens 4..39, as a later prefill chunk asks.
    rows, targets = list(range(3, 39)), prompt[4:40]
    expected = _whole(lm_head, hidden, rows, targets, num_top)
    with torch.inference_mode():
        got = prompt_logprobs_in_chunks(lm_head, hidden, rows, targets, num_top, chunk_rows=chunk_rows)
        # The same logits for both (the lm_head's matmul may round differently
        # for another number of rows): then chunking changes no bit.
        logits = lm_head(hidden)
        exact = prompt_logprobs_in_chunks(lambda x: x, logits, rows, targets, num_top, chunk_rows=chunk_rows)
        exact_whole = compute_prompt_logprobs(logits[rows], torch.tensor(targets), num_top)
    for field in ("token_ids", "logprobs", "ranks"):
        assert torch.equal(getattr(exact, field), getattr(exact_whole, field)), field
    assert got.token_ids.shape == (len(rows), num_top + 1)
    assert torch.equal(got.token_ids, expected.token_ids)
    assert torch.equal(got.ranks, expected.ranks)
    torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=1e-5, atol=1e-5)


def test_logits_are_never_computed_for_more_than_a_chunk(tiny_hidden):
    lm_head, hidden, prompt = tiny_hidden
    seen = []

    def spy(h: torch.Tensor) -> torch.Tensor:
        seen.append(h.shape[0])
        return lm_head(h)

    with torch.inference_mode():
        prompt_logprobs_in_chunks(spy, hidden, list(range(39)), prompt[1:], 2, chunk_rows=8)
    assert seen == [8, 8, 8, 8, 7]


def test_engine_prompt_logprobs_with_chunks_that_split_the_prompt(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(chunked_module, "CHUNK_ROWS", 5)
    model = tiny_model_dir("llama")
    rng = random.Random(2)
    ids = [rng.randrange(3, 700) for _ in range(37)]
    with LLM(model, dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=16) as llm:
        outs = {
            k: llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=k), use_tqdm=False)[
                0
            ]
            for k in (0, 3)
        }
    hf = hf_prompt_logprobs(model, ids)
    for k, out in outs.items():
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for token, position, hf_lp in zip(ids[1:], out.prompt_logprobs[1:], hf):
            assert abs(position[token].logprob - hf_lp) < 1e-3
            assert len(position) <= k + 1
