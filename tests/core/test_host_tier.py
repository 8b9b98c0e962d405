"""The tier of evicted K/V blocks, in pieces (issue 49, item 4): the core's
directory (raylm.core.host_tier: which slot holds what, LRU, slots being
read never reused) and a rank's file (raylm.kv_transfer.host_tier: blocks
out and back bit for bit; another core's reader sees a slot that was
reused or is being written, by its seqlock and hash). The engine end to
end: tests/engine/test_kv_offloading.py."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from raylm.core.host_tier import HostTierDirectory
from raylm.core.kv_cache_manager import KVCacheManager, KVEventRecorder
from raylm.core.request import Request
from raylm.kv_transfer.host_tier import RankHostTier, rank_path, slots_for_budget
from raylm.sampling_params import SamplingParams


def _h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def test_the_directory_keeps_the_most_recently_used_blocks():
    events = KVEventRecorder()
    tier = HostTierDirectory(2, events)
    tier.offload(10, _h(0))
    tier.offload(11, _h(1))
    assert tier.lookup([_h(0), _h(1)]) == [0, 1]
    tier.offload(12, _h(0))  # already there: only used again (now the newest)
    tier.offload(13, _h(2))  # full: the least recently used, h1, gives its slot
    assert _h(1) not in tier and tier.lookup([_h(0), _h(2)]) == [0, 1]
    copies = tier.take_copies()
    # Slot 1 was given to h2 before anything ran: only the last store to it is done.
    assert sorted(copies.stores) == [(10, 0, _h(0)), (13, 1, _h(2))]
    _, _, _, offloaded, unoffloaded = events.take()
    assert dict(offloaded) == {_h(0): 0, _h(2): 1} and unoffloaded == [_h(1)]


def test_a_slot_being_read_is_never_given_to_a_store():
    tier = HostTierDirectory(1)
    tier.offload(5, _h(0))
    tier.take_copies()
    tier.pin([_h(0)])
    tier.load(_h(0), 7)
    tier.offload(6, _h(1))  # no free slot but the one being read: not kept
    assert _h(1) not in tier
    copies = tier.take_copies()
    assert copies.loads == [(0, 7, _h(0))] and copies.stores == []
    tier.offload(6, _h(1))  # read: free to reuse now
    assert _h(1) in tier and _h(0) not in tier


def _caches(num_blocks=8, layers=2, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, num_blocks, 4, 2, 8, generator=g) for _ in range(layers)]


def test_blocks_go_out_and_come_back_bit_for_bit(tmp_path):
    caches = _caches()
    rank = RankHostTier(0)
    prefix = str(tmp_path / "tier")
    rank.open(caches, prefix, num_slots=4)
    want = [c[:, [1, 3]].clone() for c in caches]
    rank.copy(caches, stores=[(1, 2, _h(1)), (3, 0, _h(3))], loads=[])
    rank.copy(caches, stores=[], loads=[(2, 5, _h(1)), (0, 6, _h(3))])
    for cache, blocks in zip(caches, want):
        assert torch.equal(cache[:, [5, 6]], blocks)
    # A slot that does not hold what the core thinks it does: a bug, never a wrong block read.
    with pytest.raises(RuntimeError, match="does not hold"):
        rank.copy(caches, stores=[], loads=[(2, 4, _h(3))])
    rank.close()
    assert not os.path.exists(rank_path(prefix, 0))


def test_another_core_reads_a_slot_only_while_it_holds_the_expected_block(tmp_path):
    owner_caches, reader_caches = _caches(seed=1), _caches(seed=2)
    owner, reader = RankHostTier(0), RankHostTier(0)
    prefix = str(tmp_path / "owner")
    owner.open(owner_caches, prefix, num_slots=3)
    owner.copy(owner_caches, stores=[(0, 0, _h(0)), (1, 1, _h(1)), (2, 2, _h(2))], loads=[])
    assert reader.read_other(reader_caches, prefix, [0, 1, 2], [_h(0), _h(1), _h(2)], [4, 5, 6]) == 3
    for mine, theirs in zip(reader_caches, owner_caches):
        assert torch.equal(mine[:, [4, 5, 6]], theirs[:, [0, 1, 2]])
    # Slot 1 reused for another block: the read stops before it.
    owner.copy(owner_caches, stores=[(3, 1, _h(9))], loads=[])
    assert reader.read_other(reader_caches, prefix, [0, 1, 2], [_h(0), _h(1), _h(2)], [4, 5, 6]) == 1
    # Slot 0 caught mid-write (its sequence number odd): nothing read is good.
    owner._own.headers[0, 0] += 1
    assert reader.read_other(reader_caches, prefix, [0], [_h(0)], [4]) == 0
    owner._own.headers[0, 0] += 1
    assert reader.read_other(reader_caches, prefix, [0], [_h(0)], [4]) == 1
    # Its owner gone: nothing to read, no error.
    owner.close()
    assert reader.read_other(reader_caches, prefix, [0], [_h(0)], [4]) == 0
    reader.close()


def test_a_budget_holds_whole_slots_and_their_headers():
    caches = _caches()
    per_slot = 2 * 2 * 4 * 2 * 8 * 4  # layers x K/V x block x heads x dim x float32
    assert slots_for_budget(caches, 0) == 0
    n = slots_for_budget(caches, 100 * per_slot)
    assert 90 <= n < 100


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), eos_token_id=None)


def test_the_cache_sends_evicted_blocks_to_the_tier_and_finds_them_there():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.attach_tier(8)
    a = _request("a", [1, 2, 3, 4, 5, 6, 7])  # 3 full blocks, and one token more
    blocks, n = kv.get_computed_blocks(a)
    assert kv.allocate_slots(a, 7 - n, blocks) is not None
    kv.free(a)
    b = _request("b", [9, 9, 8, 8, 7, 7, 6])  # takes every block: a's are evicted to the tier
    blocks, n = kv.get_computed_blocks(b)
    kv.allocate_slots(b, 7 - n, blocks)
    stores = kv.take_tier_copies().stores
    assert len(stores) == 3 and len(kv.tier) == 3
    kv.free(b)
    again = _request("a2", [1, 2, 3, 4, 5, 6, 7])
    blocks, n = kv.get_computed_blocks(again)
    assert blocks == [] and n == 6  # all three of its full blocks, from the tier
    ids = kv.allocate_slots(again, 1, blocks)
    copies = kv.take_tier_copies()
    assert [block for _, block, _ in copies.loads] == ids[:3]
    # b's blocks went to the tier as they were evicted, in that same allocation
    # (stores run before loads on the ranks).
    assert len(copies.stores) == 3
    assert kv.tier_hits == 6
