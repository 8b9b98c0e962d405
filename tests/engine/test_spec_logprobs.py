"""Sample logprobs with speculative decoding (raylm.worker.spec_verify): a
request asking for `logprobs` speculates like any other, and each committed
token's entry (the same ids in the same order, the same ranks, the values)
equals what decoding without speculation reports for it, greedy and seeded
at temperature > 0, with drafts always accepted, always rejected, found by
n-gram lookup, by suffix decoding and by a draft model. Values are compared
within 1e-5 relative (and absolute): a verification forward scores 1 + k
rows of a request where a plain step scores one, through other matmul
blockings and attention kernels, so float32 sums round differently (seen:
1.1e-5 apart at -4.58, 2.4e-6 relative); the ids, their order and the
ranks are compared exactly."""

from __future__ import annotations

import pytest

import raylm.core.spec_decode as spec_decode
from raylm import LLM, SamplingParams
from tests.engine.test_spec_decode import NGRAM, ScriptedProposer, _prompts, _use_proposer

MAX_TOKENS = 16
TOLERANCE = 1e-5
MAX_DIFF = [0.0]  # the largest relative difference seen (printed with -s)


@pytest.fixture(autouse=True)
def _speculate_at_any_batch_size(monkeypatch):
    monkeypatch.setattr(spec_decode, "MAX_SPECULATIVE_BATCH", 64)


def _params() -> list[SamplingParams]:
    """Greedy and seeded random, with the top 3 and with the sampled token only."""
    greedy = {"temperature": 0.0}
    seeded = {"temperature": 0.8, "top_p": 0.95, "seed": 1234}
    return [
        SamplingParams(**kind, logprobs=n, max_tokens=MAX_TOKENS, ignore_eos=True)
        for kind in (greedy, seeded)
        for n in (3, 0)
    ]


def _requests(names: list[str]) -> tuple[list[list[int]], list[SamplingParams]]:
    """Each prompt with each of _params(), the prompts made distinct by a
    first token per params (a scripted draft is looked up by prompt)."""
    base = _prompts(512)
    prompts, params = [], []
    for i, p in enumerate(_params()):
        for name in names:
            prompts.append([400 + i, *base[name]])
            params.append(p)
    return prompts, params


def _generate(model, prompts, params, speculative_config=None):
    engine_args = {"dtype": "float32", "distributed_executor_backend": "uni", "kv_cache_memory_bytes": 32 << 20}
    with LLM(model, speculative_config=speculative_config, **engine_args) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.llm_engine.stats()
    return [o.outputs[0] for o in outs], stats


def _assert_same_logprobs(spec, plain):
    for s, p in zip(spec, plain, strict=True):
        assert s.token_ids == p.token_ids
        assert len(s.logprobs) == len(p.logprobs) == len(s.token_ids)
        for token, s_pos, p_pos in zip(s.token_ids, s.logprobs, p.logprobs):
            assert token in s_pos
            assert list(s_pos) == list(p_pos)  # the sampled token, then the top-N in order
            for tid in p_pos:
                assert s_pos[tid].rank == p_pos[tid].rank
                a, b = s_pos[tid].logprob, p_pos[tid].logprob
                MAX_DIFF[0] = max(MAX_DIFF[0], abs(a - b) / max(abs(b), 1.0))
                assert a == pytest.approx(b, rel=TOLERANCE, abs=TOLERANCE)
        assert s.cumulative_logprob == pytest.approx(p.cumulative_logprob, rel=TOLERANCE, abs=TOLERANCE)
    print(f"largest relative logprob difference so far: {MAX_DIFF[0]:.2e}")


def _assert_speculated(stats):
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]  # some rejected too
    assert "logprobs" not in stats["spec_decode_steps_aside_by_reason"]


def test_ngram_drafts_accepted_rejected_and_looked_up(tiny_model_dir, monkeypatch):
    model = tiny_model_dir("llama")
    prompts, params = _requests(["right", "wrong", "repeating"])
    plain, _ = _generate(model, prompts, params)
    proposer = ScriptedProposer(512)
    for prompt, out, name in zip(prompts, plain, ["right", "wrong", "repeating"] * 4):
        if name != "repeating":  # (n-gram lookup)
            proposer.add(prompt, name, out.token_ids)
    _use_proposer(monkeypatch, proposer)
    spec, stats = _generate(model, prompts, params, NGRAM)
    _assert_same_logprobs(spec, plain)
    _assert_speculated(stats)
    # The right drafts alone: each request of the four commits runs of K + 1.
    runs = (MAX_TOKENS - 1) // (NGRAM["num_speculative_tokens"] + 1)
    assert stats["spec_decode_num_accepted_tokens_per_pos"][-1] >= 4 * runs


def test_suffix_and_draft_model(tiny_model_dir):
    model = tiny_model_dir("qwen2")
    prompts, params = _requests(["repeating", "random"])
    plain, _ = _generate(model, prompts, params)
    draft = {"method": "draft_model", "model": model, "num_speculative_tokens": 4}
    for config in ({**NGRAM, "method": "suffix"}, draft):
        spec, stats = _generate(model, prompts, params, config)
        _assert_same_logprobs(spec, plain)
        _assert_speculated(stats)
