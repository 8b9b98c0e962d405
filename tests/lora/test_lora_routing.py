"""Routing across data-parallel replicas by LoRA adapter (issue 53, item 6):
kv_aware's one cost function credits a core that holds the request's
adapter (ADAPTER_CREDIT_TOKENS), so a request goes there unless that core
has that much more prompt work pending; a core holds an adapter when its slots did at its last report or a
request it has in flight runs with it. On a real two-core engine (mp), a
request follows its adapter to the core that ran it, another adapter goes
by load, every replica reads an adapter it never saw, and every output
equals PEFT's."""

from __future__ import annotations

from types import SimpleNamespace

from raylm import LLM, SamplingParams
from raylm.engine.ledger import Ledger
from raylm.engine.prefix_index import PrefixIndex
from raylm.engine.protocol import EngineCoreRequest, SchedulerStats
from raylm.engine.routing import ADAPTER_CREDIT_TOKENS, CoreLoad, KVAwareRouting, adapters_on
from raylm.lora.request import LoRARequest
from raylm.model.arch_config import ArchConfig
from raylm.testing.lora_oracle import peft_greedy
from tests.conftest import oracle_prompts
from tests.lora.conftest import lora_requests

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def _request(request_id: str, digest: str | None) -> EngineCoreRequest:
    lora = None if digest is None else LoRARequest("a", 1, "/x", content_digest=digest)
    return EngineCoreRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=1), None, lora_request=lora)


def test_the_adapters_holder_wins_unless_much_busier():
    policy = KVAwareRouting(PrefixIndex(), BLOCK)
    request = _request("r", "d1")

    # The credit is in prompt tokens: the holder's queued prompt tokens against it.
    def holder(pending: int) -> CoreLoad:
        return CoreLoad(1, 1, prefilling=1, prefill_tokens=pending, adapters=frozenset({"d1"}))

    holder_busier = [CoreLoad(0, 0), holder(ADAPTER_CREDIT_TOKENS - 1)]
    assert policy.choose(request, holder_busier).index == 1
    much_busier = [CoreLoad(0, 0), holder(ADAPTER_CREDIT_TOKENS + 1)]
    assert policy.choose(request, much_busier).index == 0
    # Another adapter held there earns nothing; nor does a request without one.
    other = [CoreLoad(0, 1), CoreLoad(1, 0, adapters=frozenset({"d2"}))]
    assert policy.choose(request, other).index == 1
    assert policy.choose(_request("b", None), [CoreLoad(0, 1), CoreLoad(1, 0, adapters=frozenset({"d1"}))]).index == 1


def test_a_core_holds_its_reported_slots_and_its_in_flight_requests_adapters():
    ledger = Ledger()
    for request_id, digest in (("a", "d1"), ("b", None), ("c", "d3")):
        ledger.add(_request(request_id, digest), pinned=False)
    channel = SimpleNamespace(stats=SchedulerStats(lora_slots=["d2"]), in_flight={"a", "b", "gone"})
    assert adapters_on(channel, ledger) == {"d1", "d2"}
    assert adapters_on(SimpleNamespace(stats=None, in_flight=set()), ledger) == frozenset()


def test_requests_follow_their_adapter_across_two_mp_replicas(tiny_model_dir, tiny_adapters):
    model, adapters = tiny_model_dir("llama"), tiny_adapters("llama")
    requests = lora_requests(adapters)
    prompts = oracle_prompts(ArchConfig.from_model_dir(model).vocab_size, (5, 6, 7, 8), seed=3)
    with LLM(
        model,
        dtype="float32",
        data_parallel_size=2,
        data_parallel_backend="mp",
        num_threads=1,
        enable_lora=True,
        max_loras=1,
        max_lora_rank=8,
        kv_cache_memory_bytes=16 << 20,
    ) as llm:
        engine, sup = llm.llm_engine, llm.llm_engine.engine_core
        outputs: dict[str, list[int]] = {}

        def run(request_id: str, prompt: list[int], adapter: str, rank: int | None = None) -> int:
            lora = requests[adapter]
            engine.add_request(
                request_id, {"prompt_token_ids": prompt}, GREEDY, data_parallel_rank=rank, lora_request=lora
            )
            core = sup.ledger[request_id].channel
            while engine.has_unfinished_requests():
                for out in engine.step():
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
            return core

        assert run("first", prompts[0], "all", rank=1) == 1
        # Finished, so gone from the ledger: core 1's report names its slot.
        assert sup.channels[1].stats.lora_slots, "core 1 reported no adapter in its slots"
        # Idle cores tie on load: without the adapter's credit, core 0 (the lower index).
        assert run("follows", prompts[1], "all") == 1
        assert run("by-load", prompts[2], "mlp") == 0
        # A replica that never read "all" reads it from its path when sent one.
        assert run("elsewhere", prompts[3], "all", rank=0) == 0
        assert dict(sup.router.decisions) == {"pinned": 2, "adapter": 1, "load": 1}
    runs = {"first": ("all", 0), "follows": ("all", 1), "by-load": ("mlp", 2), "elsewhere": ("all", 3)}
    want = {
        request_id: peft_greedy(model, adapters[name], [prompts[p]], GREEDY.max_tokens)[0].token_ids
        for request_id, (name, p) in runs.items()
    }
    assert outputs == want
