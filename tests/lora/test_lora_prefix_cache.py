"""The prefix cache keys blocks by the adapter's content: two adapters with
the same prompt never share a cached block, nor one name reloaded with other
weights (a copy of the same files does: the same K/V); the routing index
hashes prompts as the cores do."""

from __future__ import annotations

import shutil

import msgspec

from raylm import LLM, SamplingParams
from raylm.core.kv_cache_manager import KVCacheManager, root_hash
from raylm.core.request import Request
from raylm.distributed.message_codec import MessageCodec
from raylm.engine.prefix_index import prompt_block_hashes
from raylm.engine.protocol import EngineCoreRequest
from raylm.lora.request import LoRARequest
from raylm.messages import NewRequestData, SchedulerOutput
from raylm.testing.lora_oracle import peft_greedy
from tests.lora.conftest import lora_requests

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(3, 70))  # several full blocks


def test_two_adapters_never_share_a_cached_block(tiny_model_dir, tiny_adapters, tmp_path):
    model, adapters = tiny_model_dir("llama"), tiny_adapters("llama")
    requests = lora_requests(adapters)
    with LLM(
        model, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, kv_cache_memory_bytes=16 << 20
    ) as llm:

        def cached(lora_request):
            out = llm.generate({"prompt_token_ids": PROMPT}, GREEDY, use_tqdm=False, lora_request=lora_request)[0]
            return out.metrics["num_cached_tokens"], list(out.outputs[0].token_ids)

        assert cached(requests["all"])[0] == 0
        assert cached(requests["mlp"])[0] == 0  # same prompt, another adapter: a miss
        assert cached(None)[0] == 0  # the base model sees no adapter's blocks
        assert cached(requests["all"])[0] > 0  # its own: a hit
        assert cached(requests["mlp"])[0] > 0

        # One name and id, its files rewritten with other weights: another adapter.
        folder = tmp_path / "reloaded"
        shutil.copytree(adapters["all"], folder)
        reloaded = LoRARequest("reloaded", 9, str(folder))
        assert cached(reloaded)[0] > 0  # the same content as "all": the same K/V, by content not by name
        shutil.rmtree(folder)
        shutil.copytree(adapters["attn"], folder)
        hits, tokens = cached(reloaded)
        assert hits == 0
        assert tokens == peft_greedy(model, adapters["attn"], [PROMPT], GREEDY.max_tokens)[0].token_ids


def test_the_adapter_digest_roots_the_chain_as_the_routing_index_hashes_it():
    lora = LoRARequest("a", 1, "/nowhere", content_digest="ab" * 32)
    request = Request("r", PROMPT, SamplingParams(), None, lora_request=lora)
    kv = KVCacheManager(num_blocks=64, block_size=16, enable_prefix_caching=True)
    kv.get_computed_blocks(request)
    assert request.block_hashes == prompt_block_hashes(PROMPT, 16, None, None, lora.content_digest)
    assert request.block_hashes[0] != prompt_block_hashes(PROMPT, 16)[0]
    # Salt and adapter both count, and apart from each other.
    roots = {root_hash(s, d) for s in (None, "x") for d in (None, "ab", "cd")}
    assert len(roots) == 6


def test_the_adapter_travels_with_the_request_to_the_core_and_the_workers():
    lora = LoRARequest("a", 3, "/adapters/a", content_digest="cd" * 32)
    request = EngineCoreRequest("r", [1, 2, 3], SamplingParams(), eos_token_id=None, lora_request=lora)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    assert decoded.to_request().lora_request == lora
    assert decoded.continuation([7]).lora_request == lora
    new = NewRequestData("r", [1, 2, 3], [], SamplingParams(), [0], 0, lora_request=lora)
    so = SchedulerOutput([new], [], {"r": 3}, 3)
    codec = MessageCodec()
    assert codec.decode(codec.encode(so)).scheduled_new_reqs[0].lora_request == lora
