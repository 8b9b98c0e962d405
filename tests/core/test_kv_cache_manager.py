"""Paged blocks and prefix caching: sharing, reference counts, LRU eviction;
blocks keyed by a collision-resistant hash, optionally salted per request."""

from __future__ import annotations

from raylm.core.kv_cache_manager import KVCacheManager
from raylm.core.request import Request
from raylm.sampling_params import SamplingParams


def _request(rid: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(), eos_token_id=None, cache_salt=cache_salt)


def _admit(manager: KVCacheManager, request: Request) -> list[int]:
    blocks, cached = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - cached, blocks) is not None
    request.num_computed_tokens = request.num_tokens
    return manager.get_block_ids(request.request_id)


def test_shared_prefix_reuses_full_blocks_only():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    a = _request("a", list(range(10)))  # blocks [0..3] [4..7] and a partial one
    ids_a = _admit(manager, a)
    b = _request("b", list(range(8)) + [99, 98, 97])
    blocks, cached = manager.get_computed_blocks(b)
    assert cached == 8 and [x.block_id for x in blocks] == ids_a[:2]
    assert manager.allocate_slots(b, b.num_tokens - cached, blocks) is not None
    assert manager.get_block_ids("b")[:2] == ids_a[:2]
    assert all(manager.pool.blocks[i].ref_cnt == 2 for i in ids_a[:2])


def test_a_whole_cached_prompt_still_leaves_one_token_to_compute():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    _admit(manager, _request("a", list(range(8))))
    _, cached = manager.get_computed_blocks(_request("b", list(range(8))))
    assert cached == 4  # not 8: the last token's logits are needed


def test_freed_blocks_stay_findable_until_evicted_lru():
    manager = KVCacheManager(num_blocks=4, block_size=2)
    a = _request("a", [1, 2, 3, 4, 5])
    _admit(manager, a)
    manager.free(a)
    assert manager.pool.num_free_blocks == 4
    # Still cached after being freed.
    assert manager.get_computed_blocks(_request("x", [1, 2, 3, 4, 9]))[1] == 4
    # A request needing every block evicts them all; the old prefix is gone.
    _admit(manager, _request("c", [7, 7, 7, 7, 7, 7, 7, 7]))
    assert manager.get_computed_blocks(_request("y", [1, 2, 3, 4, 9]))[1] == 0


def test_allocation_fails_cleanly_when_full():
    manager = KVCacheManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    a = _request("a", list(range(8)))
    _admit(manager, a)
    b = _request("b", [1])
    assert manager.allocate_slots(b, 1) is None
    assert manager.get_block_ids("b") == [] and manager.pool.num_free_blocks == 0
    manager.free(a)
    assert manager.allocate_slots(b, 1) is not None


def test_prefix_caching_off_shares_nothing():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    _admit(manager, _request("a", list(range(8))))
    assert manager.get_computed_blocks(_request("b", list(range(8)))) == ([], 0)


def test_a_request_wanting_prompt_logprobs_computes_its_whole_prompt():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    _admit(manager, _request("a", list(range(9))))
    wants = Request("b", list(range(9)), SamplingParams(prompt_logprobs=0), eos_token_id=None)
    assert manager.get_computed_blocks(wants) == ([], 0)
    # Its own blocks are still shared with the next request.
    _admit(manager, wants)
    assert manager.get_computed_blocks(_request("c", list(range(9))))[1] == 8


def test_equal_prefixes_hit_with_or_without_the_same_salt():
    for salt in (None, "tenant-a"):
        manager = KVCacheManager(num_blocks=8, block_size=4)
        _admit(manager, _request("a", list(range(9)), cache_salt=salt))
        assert manager.get_computed_blocks(_request("b", list(range(9)), cache_salt=salt))[1] == 8


def test_different_salts_miss_each_other():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    _admit(manager, _request("a", list(range(9)), cache_salt="tenant-a"))
    assert manager.get_computed_blocks(_request("b", list(range(9)), cache_salt="tenant-b"))[1] == 0
    # Neither the unsalted world nor an empty salt sees a salted block, nor the other way round.
    assert manager.get_computed_blocks(_request("c", list(range(9))))[1] == 0
    _admit(manager, _request("d", list(range(9))))
    assert manager.get_computed_blocks(_request("e", list(range(9)), cache_salt=""))[1] == 0
    assert manager.get_computed_blocks(_request("f", list(range(9)), cache_salt="tenant-a"))[1] == 8


def test_a_python_hash_collision_no_longer_shares_a_block():
    # Python hashes an int modulo 2**61 - 1, so these two blocks collide
    # under hash() of their token tuples; their KV caches must not be shared.
    mersenne = 2**61 - 1
    first, second = [0, 1, 2, 3, 4], [mersenne, 1, 2, 3, 4]
    assert hash((None, tuple(first[:4]))) == hash((None, tuple(second[:4])))
    manager = KVCacheManager(num_blocks=8, block_size=4)
    _admit(manager, _request("a", first))
    assert manager.get_computed_blocks(_request("b", second)) == ([], 0)


def test_block_hashes_chain_over_the_whole_prefix():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    _admit(manager, _request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block, different first block: nothing is shared.
    assert manager.get_computed_blocks(_request("b", [9, 2, 3, 4, 5, 6, 7, 8, 9]))[1] == 0


def test_only_blocks_that_fill_are_hashed(monkeypatch):
    import raylm.core.kv_cache_manager as kv

    calls = []
    real = kv.hash_block
    monkeypatch.setattr(kv, "hash_block", lambda parent, tokens: calls.append(len(tokens)) or real(parent, tokens))
    manager = KVCacheManager(num_blocks=16, block_size=4)
    request = _request("a", list(range(6)))
    _admit(manager, request)
    assert calls == [4]  # one full block of the prompt
    for token in range(6, 14):  # eight decode steps
        request.append_output_token(token)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
    assert calls == [4, 4, 4]  # two more blocks filled, each hashed once
