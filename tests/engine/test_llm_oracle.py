"""Greedy generation equals Hugging Face transformers token for token, for every
architecture, and stays identical under prefix caching, chunked prefill,
preemption, batch size and decode bursts."""

from __future__ import annotations

import pytest

from raylm import LLM, SamplingParams
from raylm.testing.hf_oracle import hf_greedy
from tests.conftest import ARCHS, oracle_prompts

MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def _generate(model, prompts, **engine_kwargs):
    engine_kwargs.setdefault("kv_cache_memory_bytes", 64 << 20)
    with LLM(model, dtype="float32", **engine_kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        stats = llm.llm_engine.stats()
    return outs, stats


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    cache = {}

    def get(arch):
        if arch not in cache:
            model = tiny_model_dir(arch)
            from raylm.model.arch_config import ArchConfig

            prompts = oracle_prompts(ArchConfig.from_model_dir(model).vocab_size)
            cache[arch] = (model, prompts, hf_greedy(model, prompts, MAX_TOKENS))
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf(arch, reference):
    model, prompts, ref = reference(arch)
    outs, _ = _generate(model, prompts)
    for out, hf in zip(outs, ref):
        completion = out.outputs[0]
        assert completion.token_ids == hf.token_ids
        assert completion.finish_reason == "length"
        ours = [next(iter(pos.values())).logprob for pos in completion.logprobs]
        assert max(abs(a - b) for a, b in zip(ours, hf.logprobs)) < 1e-3


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({"enable_prefix_caching": False}, id="no-prefix-cache"),
        pytest.param({"max_num_batched_tokens": 24}, id="chunked-prefill-tiny-budget"),
        # 40 blocks of 16 tokens: far less than 8 prompts need, so requests are
        # preempted and recomputed repeatedly.
        pytest.param({"kv_cache_memory_bytes": None, "num_gpu_blocks_override": 40}, id="forced-preemption"),
        pytest.param({"max_num_seqs": 1}, id="batch-1"),
        pytest.param({"async_scheduling": True}, id="async-scheduling"),
        pytest.param({"async_scheduling": True, "max_num_batched_tokens": 24}, id="async-chunked-prefill"),
    ],
)
def test_same_outputs_under_scheduling_pressure(engine_kwargs, reference):
    model, prompts, ref = reference("llama")
    if "num_gpu_blocks_override" in engine_kwargs:
        engine_kwargs = dict(engine_kwargs)
        blocks = engine_kwargs.pop("num_gpu_blocks_override")
        engine_kwargs.pop("kv_cache_memory_bytes")
        engine_kwargs["kv_cache_memory_bytes"] = blocks * _bytes_per_block(model)
        engine_kwargs["max_model_len"] = 400
    outs, stats = _generate(model, prompts, **engine_kwargs)
    assert [o.outputs[0].token_ids for o in outs] == [r.token_ids for r in ref]
    if "max_model_len" in engine_kwargs:
        assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("arch,pressure", [*((a, False) for a in ARCHS), ("llama", True)])
def test_decode_bursts_match_hf(arch, pressure, reference):
    """Without logprobs, greedy decoding runs in decode bursts
    (raylm.core.decode_burst): still Hugging Face's tokens, with the KV cache
    roomy or so small that requests are preempted between bursts."""
    model, prompts, ref = reference(arch)
    engine_kwargs = {"num_scheduler_steps": 8}
    if pressure:
        engine_kwargs.update(kv_cache_memory_bytes=40 * _bytes_per_block(model), max_model_len=400)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model, dtype="float32", **{"kv_cache_memory_bytes": 64 << 20, **engine_kwargs}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        bursts = llm.llm_engine.engine_core.engine_core.scheduler.burst_planner.num_bursts
        preemptions = llm.llm_engine.stats()["num_preemptions"]
    assert [o.outputs[0].token_ids for o in outs] == [r.token_ids for r in ref]
    assert bursts > 0
    assert preemptions > 0 if pressure else True


def _bytes_per_block(model) -> int:
    from raylm.model.arch_config import ArchConfig

    a = ArchConfig.from_model_dir(model)
    return 2 * 16 * a.num_key_value_heads * a.head_dim * 4 * a.num_hidden_layers


def test_prefix_cache_hits_give_same_outputs(reference):
    """Prompts sharing a long prefix: later ones reuse cached blocks."""
    model, prompts, _ = reference("qwen2")
    shared = prompts[-1][:200]
    family = [shared + p[:20] for p in prompts[:4]] + [shared]
    ref = hf_greedy(model, family, MAX_TOKENS)
    with LLM(model, dtype="float32", kv_cache_memory_bytes=64 << 20) as llm:
        first = llm.generate([{"prompt_token_ids": family[0]}], GREEDY, use_tqdm=False)
        rest = llm.generate([{"prompt_token_ids": p} for p in family[1:]], GREEDY, use_tqdm=False)
        assert all(o.metrics["num_cached_tokens"] >= 192 for o in rest)
        assert llm.llm_engine.stats()["prefix_cache_hit_rate"] > 0.5
    assert [o.outputs[0].token_ids for o in first + rest] == [r.token_ids for r in ref]


def test_batch_of_32_equals_batch_of_1(reference):
    model, prompts, _ = reference("mistral")
    many = [p[: 5 + 9 * i] for i, p in enumerate(prompts * 4)][:32]
    batched, _ = _generate(model, many)
    single, _ = _generate(model, many[:3], max_num_seqs=1)
    assert [o.outputs[0].token_ids for o in batched[:3]] == [o.outputs[0].token_ids for o in single]


def test_async_scheduling_stops_exactly(reference):
    """With async scheduling a request's next step is in flight when it stops:
    the extra token must be dropped, and stop tokens / max_tokens still hold."""
    model, prompts, ref = reference("llama")
    stop_token = ref[2].token_ids[5]
    params = [
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop_token_ids=[stop_token]),
    ]
    with LLM(model, dtype="float32", kv_cache_memory_bytes=64 << 20, async_scheduling=True) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == ref[0].token_ids[:3]
    for out, hf in zip(outs[1:], ref[1:3]):
        expected = hf.token_ids[: hf.token_ids.index(stop_token) + 1] if stop_token in hf.token_ids else hf.token_ids
        assert out.outputs[0].token_ids == expected
