"""cache_salt (vLLM's prompt field): requests share prefix-cache blocks only
with requests of the same salt, and their output is unchanged by it."""

from __future__ import annotations

import msgspec
import pytest

from raylm import LLM, SamplingParams
from raylm.engine.protocol import EngineCoreRequest
from raylm.testing.hf_oracle import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompt(ids: list[int], salt: str | None) -> dict:
    prompt = {"prompt_token_ids": ids}
    if salt is not None:
        prompt["cache_salt"] = salt
    return prompt


def test_salted_requests_hit_only_their_own_salt_and_stay_greedy_correct(tiny_model_dir):
    model = tiny_model_dir("llama")
    ids = list(range(3, 70))  # several full blocks
    expected = hf_greedy(model, [ids], GREEDY.max_tokens)[0].token_ids
    with LLM(model, dtype="float32", kv_cache_memory_bytes=16 << 20) as llm:

        def run(salt):
            out = llm.generate(_prompt(ids, salt), GREEDY, use_tqdm=False)[0]
            assert out.outputs[0].token_ids == expected, salt
            return out.metrics["num_cached_tokens"]

        assert run("tenant-a") == 0  # first of its salt
        assert run("tenant-b") == 0  # same prompt, another salt: a miss
        assert run(None) == 0  # unsalted requests do not see salted blocks
        assert run("tenant-a") > 0  # its own salt: a hit
        assert run(None) > 0
        # Text prompts carry the salt too.
        text = llm.generate({"prompt": "Hello there, salt", "cache_salt": "tenant-c"}, GREEDY, use_tqdm=False)[0]
        assert text.metrics["num_cached_tokens"] == 0


@pytest.mark.parametrize("salt", ["", 7])
def test_a_salt_that_is_not_a_non_empty_string_is_refused(tiny_model_dir, salt):
    with LLM(tiny_model_dir("llama"), dtype="float32", kv_cache_memory_bytes=16 << 20) as llm:
        with pytest.raises(ValueError, match="cache_salt"):
            llm.generate({"prompt": "Hi", "cache_salt": salt}, GREEDY, use_tqdm=False)


def test_the_salt_travels_to_the_engine_core_process():
    request = EngineCoreRequest("r", [1, 2, 3], SamplingParams(), eos_token_id=None, cache_salt="pepper")
    wire = msgspec.msgpack.encode(request)
    assert msgspec.msgpack.decode(wire, type=EngineCoreRequest).to_request().cache_salt == "pepper"
