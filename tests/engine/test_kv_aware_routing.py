"""KV-aware routing (issue 49, items 1-2): the cores' block events, the
supervisor's exact prefix index they feed, and the routing policies behind
`--routing-policy`. The chaos harness's fast tier checks after every
schedule that the index equals each serving core's cache (sim.World.check);
here the parts alone, and a real two-core engine routing a shared prefix to
the core that holds it."""

from __future__ import annotations

import random

import pytest
import zmq

from raylm import LLM, SamplingParams
from raylm.core.kv_cache_manager import BlockPool, KVEventRecorder
from raylm.engine.core_channel import CoreChannel
from raylm.engine.ledger import Ledger
from raylm.engine.prefix_index import PrefixIndex, prompt_block_hashes
from raylm.engine.protocol import EngineCoreRequest, KVCacheEvents
from raylm.engine.routing import (
    DECODE_REQUEST_TOKENS,
    PULL_TOKEN_WEIGHT,
    CoreLoad,
    KVAwareRouting,
    LoadRouting,
    Router,
    VllmRouting,
    load_of,
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


def _queued(index: int, prompt_tokens: int, decoding: int = 0) -> CoreLoad:
    """A core with one request waiting to compute `prompt_tokens` and `decoding` more."""
    return CoreLoad(index, 1 + decoding, prefilling=1, prefill_tokens=prompt_tokens)


def test_kv_aware_takes_the_holder_unless_its_queue_exceeds_the_recompute():
    """The cost is in prompt tokens: a holder of a 2048-token prefix wins
    unless its pending prompt tokens exceed the idle core's by more than the
    2048 it would recompute (with pulls: more than the pull's cost)."""
    prompt = list(range(2048 + 5))
    index = PrefixIndex()
    index.apply(1, KVCacheEvents(cleared=True, stored=prompt_block_hashes(prompt, BLOCK)))
    policy = KVAwareRouting(index, BLOCK)
    assert policy.choose(_request(prompt), [CoreLoad(0, 0), _queued(1, 2047)]).index == 1
    assert policy.last_matched == {0: 0, 1: 128}
    assert policy.tokens_to_compute(_request(prompt), 1) == 5
    assert policy.tokens_to_compute(_request(prompt), 0) == 2048 + 5
    assert policy.choose(_request(prompt), [CoreLoad(0, 0), _queued(1, 2049)]).index == 0
    # Queues on both: only the difference counts.
    assert policy.choose(_request(prompt), [_queued(0, 3000), _queued(1, 5000)]).index == 1
    # Another tenant's salt: the same tokens are not its cache.
    assert policy.choose(_request(prompt, "tenant-b"), [CoreLoad(0, 0), _queued(1, 10)]).index == 0
    # Short prompts (the embedded model's 512 positions) count too.
    short = list(range(64 + 1))
    index.apply(1, KVCacheEvents(stored=prompt_block_hashes(short, BLOCK)))
    assert policy.choose(_request(short), [CoreLoad(0, 0), CoreLoad(1, 0)]).index == 1

    # With pulls, the other core would pull the prefix (at PULL_TOKEN_WEIGHT
    # of its recompute): the holder wins by that much less.
    pulling = KVAwareRouting(index, BLOCK, pulls=True)
    pull_cost = int(PULL_TOKEN_WEIGHT * 2048)
    assert pulling.choose(_request(prompt), [CoreLoad(0, 0), _queued(1, pull_cost - 1)]).index == 1
    assert pulling.choose(_request(prompt), [CoreLoad(0, 0), _queued(1, pull_cost + 1)]).index == 0
    # The ledger counts, at the core that pulls, only what is left to compute.
    assert pulling.tokens_to_compute(_request(prompt), 0) == 5


def test_a_long_queue_of_prompt_tokens_sends_new_sessions_elsewhere():
    """Counted in requests, one long queued prompt weighs less than three
    decodes; counted in tokens, the core with 4000 prompt tokens queued is
    the busier, and new sessions (no prefix held anywhere) go to the other."""
    policy = KVAwareRouting(PrefixIndex(), BLOCK, pulls=True)
    long_queue, decodes = _queued(0, 4000), CoreLoad(1, 3)
    assert long_queue.score < decodes.score  # load would take core 0
    assert LoadRouting().choose(_request([1] * 300), [long_queue, decodes]).index == 0
    for i in range(3):
        session = [100 + i] * 300
        assert policy.choose(_request(session), [long_queue, decodes]).index == 1
    # Decodes alone: DECODE_REQUEST_TOKENS each, so fewer decodes win.
    assert policy.choose(_request([1] * 300), [CoreLoad(0, 3), CoreLoad(1, 2)]).index == 1
    assert DECODE_REQUEST_TOKENS * 3 < 4000


def test_the_ledger_counts_each_cores_pending_prompt_tokens():
    """The router records, for each request it sends, the prompt tokens it
    is expected to compute there (its prompt less the prefix held there);
    load_of sums them per core until the first token comes back."""
    held = list(range(256 + 7))
    index = PrefixIndex()
    index.apply(0, KVCacheEvents(cleared=True, stored=prompt_block_hashes(held, BLOCK)))
    ledger = Ledger()
    ctx = zmq.Context()
    try:
        for i in range(2):
            socket = ctx.socket(zmq.PUSH)  # nothing connected: sent frames wait in `unsent`
            socket.setsockopt(zmq.LINGER, 0)
            ledger.adopt(CoreChannel(i, socket, f"inproc://core{i}"))
        router = Router(ledger, KVAwareRouting(index, BLOCK), encode=bytes)
        router.add(EngineCoreRequest("a", held, SamplingParams(max_tokens=4), None), b"a", None)
        assert ledger["a"].channel == 0 and ledger["a"].prefill_tokens == 7
        # A long prompt nobody holds goes to the idle core 1 (a 7-token
        # queue on core 0 is less than 400 new tokens, but core 0 would
        # compute all 400 too): counted whole there.
        router.add(EngineCoreRequest("b", [3] * 400, SamplingParams(max_tokens=4), None), b"b", None)
        assert ledger["b"].channel == 1 and ledger["b"].prefill_tokens == 400
        loads = {c.index: load_of(c, ledger=ledger) for c in ledger.channels.values()}
        assert (loads[0].prefilling, loads[0].prefill_tokens, loads[1].prefill_tokens) == (1, 7, 400)
        ledger["a"].prefill_tokens = 0  # its first token came back (the supervisor's reader)
        assert load_of(ledger.channels[0], ledger=ledger).decoding == 1
        for channel in ledger.channels.values():
            channel.input.close()
    finally:
        ctx.term()


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
