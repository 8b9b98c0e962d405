"""Paged blocks and prefix caching: sharing, reference counts, LRU eviction."""

from __future__ import annotations

from raylm.core.kv_cache_manager import KVCacheManager
from raylm.core.request import Request
from raylm.sampling_params import SamplingParams


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), eos_token_id=None)


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
