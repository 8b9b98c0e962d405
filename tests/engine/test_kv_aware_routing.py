"""KV-aware routing (issue 49, items 1-2): the cores' block events, the
supervisor's exact prefix index they feed, and the routing policies behind
`--routing-policy`. The chaos harness's fast tier checks after every
schedule that the index equals each serving core's cache (sim.World.check);
here the parts alone, and a real two-core engine routing a shared prefix to
the core that holds it."""

from __future__ import annotations

import random

import pytest

from raylm import LLM, SamplingParams
from raylm.core.kv_cache_manager import BlockPool, KVEventRecorder
from raylm.engine.prefix_index import PrefixIndex, prompt_block_hashes
from raylm.engine.protocol import EngineCoreRequest, KVCacheEvents
from raylm.engine.routing import (
    MAX_PREFIX_CREDIT,
    PREFIX_TOKENS_PER_REQUEST,
    CoreLoad,
    KVAwareRouting,
    LoadRouting,
    VllmRouting,
    routing_policy,
)
from raylm.testing.hf_oracle import hf_greedy

BLOCK = 16


def _take(recorder: KVEventRecorder) -> KVCacheEvents | None:
    taken = recorder.take()
    return None if taken is None else KVCacheEvents(*taken)


@pytest.mark.parametrize("seed", range(5))
def test_the_index_fed_by_block_events_equals_the_pool(seed):
    """Random registrations, evictions (allocations over cached blocks),
    frees and resets on two pools; events taken at random moments (a core's
    messages): after every take the index equals each pool's cached set."""
    rng = random.Random(seed)
    pools = {core: BlockPool(24, events=KVEventRecorder()) for core in (0, 1)}
    held: dict[int, list] = {0: [], 1: []}
    index = PrefixIndex()
    for step in range(600):
        core = rng.randrange(2)
        pool, op = pools[core], rng.random()
        if op < 0.4 and pool.num_free_blocks:
            blocks = pool.allocate(rng.randint(1, min(3, pool.num_free_blocks)))
            for block in blocks:  # a small hash space: the same content recurs, on either core
                pool.register(block, bytes([rng.randrange(40)]) * 32)
            held[core] += blocks
        elif op < 0.7 and held[core]:
            pool.free([held[core].pop(rng.randrange(len(held[core])))])
        elif op < 0.72 and not held[core]:
            pool.reset_prefix_cache()
        else:
            events = _take(pool.events)
            if events is not None:
                index.apply(core, events)
            assert index.holds(core) == set(pool.cached), f"step {step}, core {core}"


def test_a_core_dropped_or_emptied_holds_nothing_and_matches_are_prefixes():
    hashes = prompt_block_hashes(list(range(100)), BLOCK)  # 6 full blocks
    index = PrefixIndex()
    index.apply(0, KVCacheEvents(cleared=True, stored=hashes))
    index.apply(1, KVCacheEvents(cleared=True, stored=hashes[:2] + hashes[3:]))  # a gap at block 2
    assert index.matched_blocks(hashes, [0, 1, 2]) == {0: 6, 1: 2, 2: 0}
    index.apply(0, KVCacheEvents(cleared=True, stored=hashes[:1]))  # its pool was remade
    assert index.matched_blocks(hashes, [0, 1]) == {0: 1, 1: 2}
    index.drop_core(1)
    assert index.matched_blocks(hashes, [0, 1]) == {0: 1, 1: 0}
    assert index.num_blocks() == 1
    # The salt keeps tenants apart: another salt's hashes match nothing.
    assert index.matched_blocks(prompt_block_hashes(list(range(100)), BLOCK, "tenant-b"), [0]) == {0: 0}


def _request(tokens: list[int], salt: str | None = None) -> EngineCoreRequest:
    return EngineCoreRequest("r", tokens, SamplingParams(max_tokens=1), None, cache_salt=salt)


def test_kv_aware_takes_the_holder_unless_it_is_much_busier():
    prompt = list(range(2048 + 5))
    index = PrefixIndex()
    index.apply(1, KVCacheEvents(cleared=True, stored=prompt_block_hashes(prompt, BLOCK)))
    policy = KVAwareRouting(index, BLOCK)
    credit = min(2048 / PREFIX_TOKENS_PER_REQUEST, MAX_PREFIX_CREDIT)
    assert credit == MAX_PREFIX_CREDIT
    busy = [CoreLoad(0, 0), CoreLoad(1, int(credit) - 1)]
    assert policy.choose(_request(prompt), busy).index == 1
    assert policy.last_matched == {0: 0, 1: 128}
    assert policy.choose(_request(prompt), [CoreLoad(0, 0), CoreLoad(1, int(credit) + 1)]).index == 0
    # Another tenant's salt: the same tokens are not its cache.
    assert policy.choose(_request(prompt, "tenant-b"), busy).index == 0
    # Short prompts (the embedded model's 512 positions) earn credit too.
    short = list(range(64 + 1))
    index.apply(1, KVCacheEvents(stored=prompt_block_hashes(short, BLOCK)))
    assert policy.choose(_request(short), [CoreLoad(0, 0), CoreLoad(1, 0)]).index == 1


def test_load_and_vllm_policies():
    loads = [CoreLoad(0, in_flight=3, num_waiting=0), CoreLoad(1, in_flight=2, num_waiting=1)]
    # load: 3 + 0 against 2 + 2 * 1; vLLM: 4 * 0 + 3 against 4 * 1 + 1.
    assert LoadRouting().choose(_request([1]), loads).index == 0
    assert VllmRouting().choose(_request([1]), loads).index == 0
    loads = [CoreLoad(0, in_flight=5, num_waiting=0), CoreLoad(1, in_flight=2, num_waiting=1)]
    assert LoadRouting().choose(_request([1]), loads).index == 1  # 5 against 4
    assert VllmRouting().choose(_request([1]), loads).index == 0  # 5 against 5: the lower index
    with pytest.raises(ValueError, match="routing_policy must be one of kv_aware, load, vllm"):
        routing_policy("round_robin", PrefixIndex(), BLOCK)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["kv_aware", "load"])
def test_a_shared_prefix_goes_to_the_core_that_holds_it(tiny_model_dir, policy):
    """Two local cores; a request pinned to core 1 leaves its prompt's blocks
    there; a later request sharing that prefix goes to core 1 under kv_aware
    (whose cache then hits), to core 0 under load (the lower index of two
    idle cores). Outputs equal Hugging Face's either way."""
    model = tiny_model_dir("llama")
    prefix = [(13 * j) % 250 + 3 for j in range(96)]
    first, second = prefix + [7, 8], prefix + [9, 10, 11]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(
        model,
        dtype="float32",
        data_parallel_size=2,
        data_parallel_backend="mp",
        num_threads=1,
        kv_cache_memory_bytes=16 << 20,
        routing_policy=policy,
    ) as llm:
        engine, sup = llm.llm_engine, llm.llm_engine.engine_core
        outputs = {}

        def run(rid: str, prompt: list[int], rank: int | None = None) -> int:
            engine.add_request(rid, {"prompt_token_ids": prompt}, greedy, data_parallel_rank=rank)
            core = sup.ledger[rid].channel
            while engine.has_unfinished_requests():
                for out in engine.step():
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
            return core

        assert run("first", first, rank=1) == 1
        hits_before = sup.channels[1].stats.prefix_cache_hits
        core = run("second", second)
        assert core == (1 if policy == "kv_aware" else 0)
        if policy == "kv_aware":
            assert sup.router.policy.last_matched[1] == len(prefix) // BLOCK
            assert sup.channels[1].stats.prefix_cache_hits - hits_before == len(prefix) // BLOCK * BLOCK
        # Why each went where it went (raylm:routing_decisions_total): the
        # first pinned; the second to the holder for its prefix, or by load.
        assert dict(sup.router.decisions) == {"pinned": 1, ("prefix" if policy == "kv_aware" else "load"): 1}
        # Per replica: the second's core found its prefix (cached there, or
        # pulled there under load), the first's computed everything.
        rates = {s["replica"]: s["prefix_cache_hit_rate"] for s in sup.replica_states()}
        assert rates[core] > 0 and rates[1 - core] == 0
    assert [outputs["first"], outputs["second"]] == [r.token_ids for r in hf_greedy(model, [first, second], 6)]
