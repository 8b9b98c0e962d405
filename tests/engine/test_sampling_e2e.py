"""Sampling behaviour through the whole engine: seeds, stops, lengths, n, logprobs."""

from __future__ import annotations

import math

import pytest

from raylm import LLM, SamplingParams
from raylm.testing.hf_oracle import hf_greedy, hf_prompt_logprobs


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(tiny_model_dir("llama"), dtype="float32", kv_cache_memory_bytes=64 << 20) as engine:
        yield engine


def _ids(llm, text):
    return llm.get_tokenizer().encode(text)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    prompt = "The quick brown fox"
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    neighbours = [
        SamplingParams(temperature=0.9, max_tokens=30, ignore_eos=True),
        params,
        SamplingParams(temperature=0.0, max_tokens=5),
        SamplingParams(temperature=1.0, seed=7, max_tokens=24),
    ]
    batched = llm.generate(["hello there", prompt, "a b c", prompt], neighbours, use_tqdm=False)
    assert alone == again == batched[1].outputs[0].token_ids
    assert batched[3].outputs[0].token_ids != alone  # another seed, another text
    # Unseeded sampling at temperature 1 differs between runs.
    free = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    assert (
        llm.generate(prompt, free, use_tqdm=False)[0].outputs[0].token_ids
        != llm.generate(prompt, free, use_tqdm=False)[0].outputs[0].token_ids
    )


def test_top_k_1_equals_greedy(llm):
    greedy = llm.generate("Once upon", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    top_k_1 = SamplingParams(temperature=1.5, top_k=1, max_tokens=16, ignore_eos=True, seed=3)
    topk1 = llm.generate("Once upon", top_k_1, use_tqdm=False)
    assert greedy[0].outputs[0].token_ids == topk1[0].outputs[0].token_ids


def test_max_tokens_and_min_tokens(llm):
    out = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    # Make EOS the greedy choice from the first step by stopping on every token
    # the model would emit: min_tokens must hold them back.
    greedy = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    stop_ids = sorted(set(greedy.outputs[0].token_ids))
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=stop_ids)
    out = llm.generate("Hi", params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 6
    assert not set(out.outputs[0].token_ids[:5]) & set(stop_ids)


# Seeded sampling gives varied yet reproducible text even from a random model.
VARIED = dict(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)


def test_stop_token_ids(llm):
    base = llm.generate("Hello", SamplingParams(**VARIED), use_tqdm=False)[0]
    tokens = base.outputs[0].token_ids
    stop_at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    params = SamplingParams(**VARIED, stop_token_ids=[tokens[stop_at]])
    out = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: stop_at + 1]
    assert out.finish_reason == "stop" and out.stop_reason == tokens[stop_at]


def test_stop_strings(llm):
    base = llm.generate("Hello", SamplingParams(**VARIED), use_tqdm=False)[0]
    text = base.outputs[0].text
    # A 3-character stop string that first occurs a few characters in.
    cut = next(k for k in range(3, len(text) - 3) if text.index(text[k : k + 3]) == k)
    stop = text[cut : cut + 3]
    out = llm.generate("Hello", SamplingParams(**VARIED, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(
        "Hello", SamplingParams(**VARIED, stop=[stop], include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert kept.text == text[: cut + len(stop)]


def test_n_greater_than_one(llm):
    seeded = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    out = llm.generate("Tell me", seeded, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate(
        "Tell me", SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    greedy = llm.generate("Tell me", SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[
        0
    ]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_logprobs_top_k_and_prompt_logprobs(llm, tiny_model_dir):
    model = tiny_model_dir("llama")
    prompt_ids = _ids(llm, "The rain in Spain stays mainly")
    out = llm.generate(
        {"prompt_token_ids": prompt_ids},
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2),
        use_tqdm=False,
    )[0]
    ref = hf_greedy(model, [prompt_ids], 6)[0]
    completion = out.outputs[0]
    assert completion.token_ids == ref.token_ids
    for token, position, hf_lp in zip(completion.token_ids, completion.logprobs, ref.logprobs):
        assert token in position and position[token].rank == 1  # greedy picks the top token
        assert abs(position[token].logprob - hf_lp) < 1e-3
        assert len(position) == 3  # the sampled token is also the top-1
        values = sorted((lp.logprob for lp in position.values()), reverse=True)
        assert [lp.rank for lp in sorted(position.values(), key=lambda x: x.rank)] == [1, 2, 3]
        assert values == sorted(values, reverse=True)
    assert math.isclose(completion.cumulative_logprob, sum(ref.logprobs), abs_tol=1e-2)
    # Prompt logprobs: None for the first token, then HF's values for each prompt token.
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt_ids)
    hf_prompt = hf_prompt_logprobs(model, prompt_ids)
    for token, position, hf_lp in zip(prompt_ids[1:], out.prompt_logprobs[1:], hf_prompt):
        assert abs(position[token].logprob - hf_lp) < 1e-3
        assert len(position) <= 3


def test_prompt_logprobs_across_prefill_chunks(tiny_model_dir):
    model = tiny_model_dir("llama")
    with LLM(model, dtype="float32", kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=8) as llm:
        ids = llm.get_tokenizer().encode("A long prompt that is split into several prefill chunks of eight")
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[
            0
        ]
    hf_prompt = hf_prompt_logprobs(model, ids)
    assert len(out.prompt_logprobs) == len(ids)
    for token, position, hf_lp in zip(ids[1:], out.prompt_logprobs[1:], hf_prompt):
        assert abs(position[token].logprob - hf_lp) < 1e-3


def test_chat_applies_template(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt == expected
    assert "Hello!" in out.prompt and "Be brief." in out.prompt
    plain = llm.generate(
        {"prompt_token_ids": out.prompt_token_ids},
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids
