"""Speculative decoding with a draft model (method draft_model,
raylm.worker.draft_model): greedy outputs equal Hugging Face's (and so
decoding without speculation) for every architecture, with the target as its
own draft (every draft accepted: the draft's K/V follows the committed
tokens, across accepted runs, rejections and decode bursts) and with an
unrelated small draft (mostly rejected); a seeded random request gives the
same tokens as without speculation; TP=2 workers draft and verify alike; a
draft that cannot serve the target is refused by name."""

from __future__ import annotations

import json
import shutil

import psutil
import pytest

import raylm.core.spec_decode as spec_decode
from raylm import LLM, SamplingParams
from raylm.config.resolve import resolve_engine_config
from raylm.engine.arg_utils import EngineArgs
from raylm.testing.hf_oracle import hf_greedy
from tests.conftest import ARCHS, process_gone, wait_until
from tests.engine.test_recovery import _is_resource_tracker
from tests.engine.test_spec_decode import _prompts, _run

K = 4
MAX_TOKENS = 24
# An unrelated draft: another seed, one narrow layer, the same tokenizer.
SMALL_DRAFT = {"seed": 7, "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64}


def _draft(model: str, k: int = K) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


def _greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture
def _speculate_at_any_batch_size(monkeypatch):
    monkeypatch.setattr(spec_decode, "MAX_SPECULATIVE_BATCH", 64)


@pytest.mark.usefixtures("_speculate_at_any_batch_size")
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_hf_with_the_target_and_a_small_draft(arch, tiny_model_dir):
    model = tiny_model_dir(arch)
    prompts = list(_prompts(512).values())
    hf = [g.token_ids for g in hf_greedy(model, prompts, MAX_TOKENS)]

    same, stats = _run(model, prompts, _greedy(), _draft(model))
    assert [o[0] for o in same] == hf
    # The target drafting for itself: every draft token accepted (the last
    # drafts are shorter: max_tokens leaves less room).
    assert stats["spec_decode_num_drafts"] >= len(prompts) * ((MAX_TOKENS - 1) // (K + 1))
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    assert stats["spec_decode_num_accepted_tokens_per_pos"][K - 1] >= len(prompts) * ((MAX_TOKENS - 1) // (K + 1))

    small, stats = _run(model, prompts, _greedy(), _draft(tiny_model_dir(arch, **SMALL_DRAFT)))
    assert [o[0] for o in small] == hf
    assert stats["spec_decode_num_drafts"] > 0
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"] / 2


def test_draft_follows_decode_bursts_and_prefill_chunks(tiny_model_dir):
    """Three requests are a large batch (the default rule): they decode in
    bursts without drafts, and the draft's K/V catches up with each burst;
    once the short ones end, the long one drafts, and every draft of the
    target for itself is still accepted. A long prompt is prefilled in chunks."""
    model = tiny_model_dir("llama")
    prompts = list(_prompts(512).values())[:2] + [[(13 * i) % 500 + 3 for i in range(100)]]
    params = [_greedy(8), _greedy(8), _greedy(40)]
    hf = [g.token_ids[: p.max_tokens] for g, p in zip(hf_greedy(model, prompts, 40), params)]
    out, stats = _run(model, prompts, params, _draft(model), max_num_batched_tokens=48, enable_chunked_prefill=True)
    assert [o[0] for o in out] == hf
    assert stats["spec_decode_steps_aside_by_reason"].get("large_batch", 0) > 0
    assert stats["spec_decode_num_drafts"] > 0
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]


@pytest.mark.usefixtures("_speculate_at_any_batch_size")
def test_prefix_cache_blocks_hold_the_drafts_kv_too(tiny_model_dir):
    """A later request reusing a finished one's cached blocks reads the draft's
    K/V of them from the same block ids: the target as its own draft still
    has every draft accepted, and the output is an uncached engine's."""
    model = tiny_model_dir("llama")
    prompt = _prompts(512)["wrong"]
    first = hf_greedy(model, [prompt], MAX_TOKENS + 16)[0].token_ids
    follow_up = prompt + first + [7, 8]
    with LLM(
        model,
        dtype="float32",
        kv_cache_memory_bytes=32 << 20,
        distributed_executor_backend="uni",
        speculative_config=_draft(model),
    ) as llm:
        llm.generate([{"prompt_token_ids": prompt}], _greedy(MAX_TOKENS + 16), use_tqdm=False)
        cached = llm.generate([{"prompt_token_ids": follow_up}], _greedy(), use_tqdm=False)[0]
        stats = llm.llm_engine.stats()
    # Every full block of the first request's prompt and output, those its
    # last accepted run filled included (KVCacheManager.register_verified).
    assert stats["prefix_cache_hits"] == (len(prompt) + len(first) - 1) // 16 * 16
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0
    assert cached.outputs[0].token_ids == hf_greedy(model, [follow_up], MAX_TOKENS)[0].token_ids


@pytest.mark.usefixtures("_speculate_at_any_batch_size")
def test_seeded_sampling_is_the_same_with_a_draft_model(tiny_model_dir):
    model = tiny_model_dir("qwen2")
    prompts = list(_prompts(512).values())
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain, _ = _run(model, prompts, seeded)
    spec, stats = _run(model, prompts, seeded, _draft(model))
    assert spec == plain
    assert stats["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.usefixtures("_speculate_at_any_batch_size")
def test_two_tensor_parallel_workers_draft_alike(tiny_model_dir):
    """The draft is sharded like the target: both ranks run its forwards and
    take the same argmax of the gathered logits. The workers are gone after."""
    model = tiny_model_dir("llama")
    prompts = list(_prompts(512).values())[:2]
    tp = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    hf = [g.token_ids for g in hf_greedy(model, prompts, MAX_TOKENS)]
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    out, stats = _run(model, prompts, _greedy(), _draft(model), **tp)
    assert [o[0] for o in out] == hf
    assert stats["spec_decode_num_drafts"] > 0
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    started = {p.pid for p in psutil.Process().children(recursive=True) if not _is_resource_tracker(p)} - before
    wait_until(lambda: all(process_gone(p) for p in started), 60, message="the TP workers to be gone")


def _other_tokenizer(draft: str, folder) -> str:
    """A copy of `draft` whose tokenizer swaps two tokens' ids (same vocabulary size)."""
    shutil.copytree(draft, folder)
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(data))
    return str(folder)


@pytest.mark.parametrize(
    "case,field",
    [
        ("vocab", "vocabulary size"),
        ("tokenizer", "tokenizer differs"),
        ("context", "max_position_embeddings"),
        ("lora", "enable_lora"),
        ("missing", "speculative_config.model"),
    ],
)
def test_a_draft_that_cannot_serve_the_target_is_refused_by_name(case, field, tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    args = {"model": model, "dtype": "float32"}
    draft = {
        "vocab": lambda: tiny_model_dir("llama", vocab_size=800),
        "tokenizer": lambda: _other_tokenizer(tiny_model_dir("llama", **SMALL_DRAFT), tmp_path / "other"),
        "context": lambda: tiny_model_dir("llama", max_position_embeddings=256),
        "lora": lambda: model,
        "missing": lambda: str(tmp_path / "no-such-folder"),
    }[case]()
    if case == "lora":
        args["enable_lora"] = True
    with pytest.raises(ValueError, match=field):
        resolve_engine_config(EngineArgs(**args, speculative_config=_draft(draft)))
    if case == "context":  # a shorter target context fits the draft
        resolve_engine_config(EngineArgs(**args, max_model_len=256, speculative_config=_draft(draft)))
