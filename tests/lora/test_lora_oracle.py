"""Greedy outputs with LoRA adapters equal Hugging Face + PEFT's (PeftModel)
for every architecture, in one batch that mixes three adapters and the base
model as when each runs alone; float32, tiny random models and adapters."""

from __future__ import annotations

import asyncio

import pytest
import torch

from raylm import LLM, SamplingParams
from raylm.config import create_engine_config
from raylm.core import spec_decode
from raylm.engine.async_llm import AsyncLLM
from raylm.model.arch_config import ArchConfig
from raylm.testing.lora_oracle import peft_greedy
from tests.conftest import ARCHS, executor_of, oracle_prompts
from tests.lora.conftest import lora_requests

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
LENGTHS = (1, 7, 33)


def _vocab(llm: LLM) -> int:
    return llm.llm_engine.config.model_config.vocab_size


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _expected(model: str, adapters: dict[str, str], prompts: list[list[int]]) -> dict[str | None, list[list[int]]]:
    """PEFT's greedy tokens of every prompt, per adapter name (None: the base model)."""
    runs = {name: path for name, path in adapters.items()} | {None: None}
    return {
        name: [g.token_ids for g in peft_greedy(model, path, prompts, GREEDY.max_tokens)] for name, path in runs.items()
    }


def _mixed(llm: LLM, prompts: list[list[int]], requests: dict) -> dict[str | None, list[list[int]]]:
    """One generate() with every prompt under every adapter and the base
    model, interleaved so that each step mixes them all."""
    names = [*requests, None]
    order = [(name, p) for p in range(len(prompts)) for name in names]
    outputs = llm.generate(
        [{"prompt_token_ids": prompts[p]} for _, p in order],
        GREEDY,
        use_tqdm=False,
        lora_request=[None if name is None else requests[name] for name, _ in order],
    )
    got: dict[str | None, list[list[int]]] = {name: [] for name in names}
    for (name, _), tokens in zip(order, _tokens(outputs)):
        got[name].append(tokens)
    return got


@pytest.mark.parametrize("arch", ARCHS)
def test_a_batch_mixing_three_adapters_and_the_base_model_equals_peft(arch, tiny_model_dir, tiny_adapters):
    model, adapters = tiny_model_dir(arch), tiny_adapters(arch)
    requests = lora_requests(adapters)
    with LLM(
        model, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8, kv_cache_memory_bytes=16 << 20
    ) as llm:
        prompts = oracle_prompts(_vocab(llm), LENGTHS)
        expected = _expected(model, adapters, prompts)
        assert all(expected[name] != expected[None] for name in adapters), "an adapter that changes nothing"
        assert _mixed(llm, prompts, requests) == expected
        # Each alone (one adapter per generate) gives the same.
        for name, request in requests.items():
            alone = llm.generate(
                [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=request
            )
            assert _tokens(alone) == expected[name], name


def test_more_adapters_than_slots_wait_their_turn_and_stay_correct(tiny_model_dir, tiny_adapters):
    """max_loras=1: the scheduler runs one adapter at a time beside the base
    model; max_cpu_loras=2 keeps two loaded on the host, evicting the least
    recently used."""
    model, adapters = tiny_model_dir("llama"), tiny_adapters("llama")
    requests = lora_requests(adapters)
    with LLM(
        model,
        dtype="float32",
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=2,
        max_lora_rank=8,
        kv_cache_memory_bytes=16 << 20,
    ) as llm:
        prompts = oracle_prompts(_vocab(llm), LENGTHS)
        assert _mixed(llm, prompts, requests) == _expected(model, adapters, prompts)
        manager = executor_of(llm).driver_worker.worker.model_runner.lora
        assert len(manager._host) == 2 and len(manager._slots) == 1
        assert manager.num_loads == 3


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_model_parallel_ranks_hold_their_share_of_the_adapters(tiny_model_dir, tiny_adapters, parallel):
    """TP: each rank's slots are cut as its layers are (qwen2: q/k/v biases
    beside the adapters). PP: each stage holds its own layers' slots."""
    model, adapters = tiny_model_dir("qwen2"), tiny_adapters("qwen2")
    requests = lora_requests(adapters)
    with LLM(
        model,
        dtype="float32",
        enable_lora=True,
        max_loras=3,
        max_lora_rank=8,
        distributed_executor_backend="mp",
        kv_cache_memory_bytes=16 << 20,
        **parallel,
    ) as llm:
        prompts = oracle_prompts(_vocab(llm), (7, 20))
        assert _mixed(llm, prompts, requests) == _expected(model, adapters, prompts)


def test_chat_takes_a_lora_request_as_generate_does(tiny_model_dir, tiny_adapters):
    model, adapters = tiny_model_dir("llama"), tiny_adapters("llama")
    request = lora_requests(adapters)["attn"]
    messages = [{"role": "user", "content": "Hello there"}]
    with LLM(model, dtype="float32", enable_lora=True, max_lora_rank=8, kv_cache_memory_bytes=16 << 20) as llm:
        chat = llm.chat(messages, GREEDY, use_tqdm=False, lora_request=request)[0]
        ids = list(chat.prompt_token_ids)
    assert (
        list(chat.outputs[0].token_ids) == peft_greedy(model, adapters["attn"], [ids], GREEDY.max_tokens)[0].token_ids
    )


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_bf16_steps_with_an_adapter_run_around_the_fused_decode_path(tiny_model_dir, tiny_adapters, quantization):
    """The fused C++ decode path applies no LoRA delta: a step with an adapter
    row runs the modules, a step without keeps the fused path; base rows are
    the same whether an adapter's rows share their steps or not. The same on
    int8 weights (the delta is added to the quantized matmul's output)."""
    model, adapters = tiny_model_dir("llama"), tiny_adapters("llama")
    requests = lora_requests(adapters)
    with LLM(
        model,
        dtype="bfloat16",
        quantization=quantization,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=8,
        kv_cache_memory_bytes=16 << 20,
    ) as llm:
        prompts = oracle_prompts(_vocab(llm), (5, 18))
        base_alone = _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
        adapter_alone = _tokens(
            llm.generate(
                [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=requests["all"]
            )
        )
        mixed = _mixed(llm, prompts, {"all": requests["all"]})
        assert mixed[None] == base_alone and mixed["all"] == adapter_alone
        assert adapter_alone != base_alone
        assert next(executor_of(llm).driver_worker.worker.model_runner.model.parameters()).dtype == torch.bfloat16


def test_async_llm_serves_adapters_from_a_core_process(tiny_model_dir, tiny_adapters):
    """The adapter crosses the socket to a spawned core with the request."""
    model, adapters = tiny_model_dir("qwen3"), tiny_adapters("qwen3")
    requests = lora_requests(adapters)
    config = create_engine_config(
        model,
        dtype="float32",
        num_threads=1,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        kv_cache_memory_bytes=16 << 20,
    )
    prompt = oracle_prompts(config.model_config.vocab_size, (9,))[0]
    expected = {
        name: peft_greedy(model, adapters[name], [prompt], GREEDY.max_tokens)[0].token_ids for name in ("all", "mlp")
    }
    engine = AsyncLLM(config)

    async def one(name: str) -> list[int]:
        tokens: list[int] = []  # streamed: each output carries the new tokens
        stream = engine.generate({"prompt_token_ids": prompt}, GREEDY, f"r-{name}", lora_request=requests[name])
        async for out in stream:
            tokens.extend(out.outputs[0].token_ids)
        return tokens

    async def run() -> dict[str, list[int]]:
        got = await asyncio.gather(one("all"), one("mlp"))
        return dict(zip(("all", "mlp"), got))

    try:
        assert asyncio.run(run()) == expected
    finally:
        engine.shutdown()


class _ScriptedDrafts:
    """Drafts the known continuation of a prompt ("right") or it with every
    token changed (wrong), so that the test knows what must be accepted."""

    def __init__(self, vocab_size: int, scripts: list[tuple[list[int], list[int], bool]]):
        self.vocab_size, self.scripts = vocab_size, scripts

    def request_finished(self, request) -> None:
        pass

    def propose(self, request, max_tokens: int) -> list[int]:
        ids = request.all_token_ids
        for prompt, continuation, right in self.scripts:
            if list(ids[: len(prompt)]) == prompt:
                draft = continuation[len(ids) - len(prompt) :][:max_tokens]
                return draft if right else [(t + 1) % self.vocab_size for t in draft]
        return []


def test_speculative_drafts_are_verified_with_the_adapter(tiny_model_dir, tiny_adapters, monkeypatch):
    """A draft's positions run with their request's adapter (the row mask
    covers every scheduled token): PEFT's continuation drafted is accepted,
    a wrong one rejected, and the output is PEFT's."""
    model, adapters = tiny_model_dir("llama"), tiny_adapters("llama")
    requests = lora_requests(adapters)
    prompts = oracle_prompts(ArchConfig.from_model_dir(model).vocab_size, (6, 9), seed=5)
    expected = [
        peft_greedy(model, adapters[name], [p], GREEDY.max_tokens)[0].token_ids
        for name, p in zip(("all", "mlp"), prompts)
    ]
    vocab = ArchConfig.from_model_dir(model).vocab_size
    drafts = _ScriptedDrafts(vocab, [(prompts[0], expected[0], True), (prompts[1], expected[1], False)])
    monkeypatch.setattr(spec_decode, "make_proposer", lambda config: drafts)
    with LLM(
        model,
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        kv_cache_memory_bytes=16 << 20,
    ) as llm:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            GREEDY,
            use_tqdm=False,
            lora_request=[requests["all"], requests["mlp"]],
        )
        stats = llm.llm_engine.stats()
    assert _tokens(outputs) == expected
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"]
