"""Paged KV-cache blocks with prefix caching.

A request's KV cache is a list of fixed-size blocks (its block table). A block
that is full is identified by a hash chained over the tokens of every block
before it, so two requests with the same prefix share those blocks. Blocks
whose last user finished are not wiped: they sit in an LRU free queue, still
findable by hash, until a new allocation needs the space.

The hash is the only thing compared (never the tokens), so it must not
collide: it is a SHA-256 digest. Python's hash() of a tuple of ints is easy
to collide on purpose (hash(0) == hash(2**61 - 1)), and a collision would
hand one request another's KV cache (vLLM's CVE-2025-25183). A request's
optional cache salt goes into its first block's hash, so salted requests
share blocks only with requests of the same salt: no one can learn from
timing whether another tenant sent a prompt. Hashing costs a few
microseconds per block, once, when the block fills.

The rule that keeps the cache honest across migrations and failures: a block
is shareable only under a hash this engine computed itself from the
request's committed tokens, and only once its K/V were fully written here,
by a forward or by a migration's import whose every stage arrived. Imported
blocks are kept apart (`imports`, by migration) and join a request's table
only when it arrives with exactly as many blocks as its tokens fill
(`adopt_import`); they are registered, under this engine's hashes, once the
request is scheduled. A hash another engine supplies is never a key.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from raylm.core.host_tier import HostTierDirectory, TierCopies
from raylm.core.request import Request


@dataclass
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


# The parent of a first block. Distinct prefixes keep "no salt" apart from
# every salt, the empty one included.
_UNSALTED_ROOT = hashlib.sha256(b"raylm prefix cache: no salt").digest()
_SALTED_ROOT_PREFIX = b"raylm prefix cache: salt\0"
_ADAPTER_ROOT_PREFIX = b"raylm prefix cache: lora\0"


def root_hash(cache_salt: str | None, lora_digest: str | None = None) -> bytes:
    """What a request's first block hash is chained to: its salt's root, and
    with a LoRA adapter, that root hashed with the adapter's content digest
    (the same tokens under two adapters, or under one name reloaded with
    other weights, have other K/V)."""
    root = _UNSALTED_ROOT if cache_salt is None else hashlib.sha256(_SALTED_ROOT_PREFIX + cache_salt.encode()).digest()
    if lora_digest is None:
        return root
    return hashlib.sha256(_ADAPTER_ROOT_PREFIX + root + lora_digest.encode()).digest()


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """SHA-256 of the parent's digest and the block's token ids (int64,
    little-endian). The parent has a fixed length, so the bytes hashed never
    run two different (parent, tokens) pairs together; chaining it makes a
    block's identity include its whole prefix."""
    return hashlib.sha256(parent_hash + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


class KVEventRecorder:
    """What changed in a core's prefix cache since it was last taken: the
    block hashes it began to hold (a full block registered) and those it
    dropped (evicted for another use), and whether it was emptied (a fresh
    pool: at the core's start, after its executor was rebuilt, at a reset).
    The supervisor's prefix index (raylm/engine/prefix_index.py) follows
    each core by these, and routes by what they hold. The same for the
    core's tier of evicted blocks (raylm.core.host_tier): the hashes it
    began to hold, with their slots, and those it dropped.

    Only a block's latest change is kept, so what is pending is bounded by
    the blocks changed since the last take, whatever the traffic."""

    def __init__(self):
        self.cleared = True  # a new pool holds nothing: the index starts over
        self._changes: dict[bytes, bool] = {}  # block hash -> held (True) or dropped
        self._tier_changes: dict[bytes, int | None] = {}  # block hash -> its tier slot, or None: dropped

    def stored(self, block_hash: bytes) -> None:
        self._changes[block_hash] = True

    def removed(self, block_hash: bytes) -> None:
        self._changes[block_hash] = False

    def offloaded(self, block_hash: bytes, slot: int) -> None:
        self._tier_changes[block_hash] = slot

    def unoffloaded(self, block_hash: bytes) -> None:
        self._tier_changes[block_hash] = None

    def clear(self) -> None:
        self.cleared = True
        self._changes.clear()
        self._tier_changes.clear()

    def take(self) -> tuple[bool, list[bytes], list[bytes], list[tuple[bytes, int]], list[bytes]] | None:
        """(emptied first, hashes now held, hashes dropped, (hash, slot) now
        in the tier, hashes dropped from the tier) since the last take; None: nothing."""
        if not self.cleared and not self._changes and not self._tier_changes:
            return None
        changes, tier, cleared = self._changes, self._tier_changes, self.cleared
        self._changes, self._tier_changes, self.cleared = {}, {}, False
        return (
            cleared,
            [h for h, held in changes.items() if held],
            [h for h, held in changes.items() if not held],
            [(h, slot) for h, slot in tier.items() if slot is not None],
            [h for h, slot in tier.items() if slot is None],
        )


class BlockPool:
    """The blocks and their free queues. With `num_shards` > 1 (context
    parallelism: block id g lives on CP rank g % num_shards) each shard has
    its own free queue, least recently freed first, and a request's j-th
    block is taken from shard j % num_shards while it has one free: every
    sequence's KV, and so its attention work, stays spread evenly over the
    ranks however blocks were freed before. Any placement is exact; this
    one is balanced."""

    def __init__(self, num_blocks: int, num_shards: int = 1, events: KVEventRecorder | None = None):
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.events = events  # told of every hash that becomes findable or stops being so
        self.num_shards = num_shards
        # Blocks nobody uses, per shard, least recently freed first (evicted first).
        self.free_queues: list[OrderedDict[int, KVCacheBlock]] = [
            OrderedDict((b.block_id, b) for b in self.blocks[shard::num_shards]) for shard in range(num_shards)
        ]
        self.cached: dict[bytes, KVCacheBlock] = {}
        # Where evicted blocks go instead of being lost (--kv-offloading-size), if anywhere.
        self.tier: HostTierDirectory | None = None

    @property
    def num_free_blocks(self) -> int:
        return sum(len(queue) for queue in self.free_queues)

    def _queue_of(self, block: KVCacheBlock) -> OrderedDict[int, KVCacheBlock]:
        return self.free_queues[block.block_id % self.num_shards]

    def allocate(self, n: int, first_index: int = 0) -> list[KVCacheBlock]:
        """`n` free blocks for a request's blocks first_index, first_index + 1, ..."""
        assert n <= self.num_free_blocks
        out = []
        for i in range(n):
            queue = self.free_queues[(first_index + i) % self.num_shards]
            if not queue:  # that shard is full: the fullest other one gives
                queue = max(self.free_queues, key=len)
            _, block = queue.popitem(last=False)
            if block.block_hash is not None:
                # Evicting a cached block: it can no longer be found by hash.
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                    if self.events is not None:
                        self.events.removed(block.block_hash)
                    if self.tier is not None:
                        self.tier.offload(block.block_id, block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                del self._queue_of(block)[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVCacheBlock]) -> None:
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._queue_of(block)[block.block_id] = block

    def register(self, block: KVCacheBlock, block_hash: bytes) -> None:
        block.block_hash = block_hash
        # If another block already holds this content keep the first one;
        # this one is simply not findable (it is freed like any other).
        if self.cached.setdefault(block_hash, block) is block and self.events is not None:
            self.events.stored(block_hash)

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.clear()


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_shards: int = 1,
        events: KVEventRecorder | None = None,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_shards = num_shards
        if events is not None:
            events.clear()  # a new pool: whatever the last one held is gone
        self.pool = BlockPool(num_blocks, num_shards, events)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        # Blocks reserved for the K/V a migration brings in, by migration id,
        # until its request arrives (`adopt_import`). Apart from req_blocks:
        # a request of the same id that comes another way (resubmitted after
        # a failure, while an abandoned import still writes its blocks) must
        # never find them in its block table.
        self.imports: dict[str, list[KVCacheBlock]] = {}
        # Number of a request's leading blocks already registered in the cache.
        self.num_registered: dict[str, int] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found (in the cache, or in the tier of evicted blocks)
        self.tier_hits = 0  # of which found in the tier
        # A new request's prefix the tier holds, after what the cache holds:
        # found by get_computed_blocks, loaded by the allocate_slots after it.
        self._tier_prefix: dict[str, list[bytes]] = {}

    def attach_tier(self, num_slots: int) -> None:
        """Keep evicted blocks in a tier of `num_slots` slots (its ranks' files are open)."""
        self.pool.tier = HostTierDirectory(num_slots, self.pool.events)

    @property
    def tier(self) -> HostTierDirectory | None:
        return self.pool.tier

    def take_tier_copies(self) -> TierCopies | None:
        """The tier's copies queued since the last take, for the ranks to run before the next forward."""
        if self.pool.tier is None:
            return None
        copies = self.pool.tier.take_copies()
        return copies or None

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def _update_block_hashes(self, request: Request) -> None:
        # Only blocks that filled since the last call are hashed: a decode
        # step hashes nothing, except once every block_size tokens.
        hashes = request.block_hashes
        bs = self.block_size
        while (len(hashes) + 1) * bs <= request.num_tokens:
            start = len(hashes) * bs
            parent = hashes[-1] if hashes else root_hash(request.cache_salt, request.lora_digest)
            hashes.append(hash_block(parent, request.all_token_ids[start : start + bs]))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a new request: (blocks, number of tokens)."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs come from the logits of every prompt position,
            # which a cached prefix skips: such a request computes them all.
            return [], 0
        self._update_block_hashes(request)
        # Always leave at least one token to compute: its logits start decoding.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        tier_hits: list[bytes] = []
        if self.pool.tier is not None:
            rest = request.block_hashes[len(hits) : max_blocks]
            tier_hits = rest[: len(self.pool.tier.lookup(rest))]
        self._tier_prefix[request.request_id] = tier_hits
        return hits, (len(hits) + len(tier_hits)) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_cached: int) -> None:
        """Count a lookup once its request is admitted (a lookup that found no
        room is repeated next step and must not count twice)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_cached

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVCacheBlock] | None = None
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens; returns the new block ids,
        or None (and changes nothing) when the pool cannot hold them."""
        # The tier's part of a new request's prefix (get_computed_blocks found
        # it): new blocks, filled from the tier before this step's forward.
        from_tier = self._tier_prefix.pop(request.request_id, []) if computed_blocks is not None else []
        computed_blocks = computed_blocks or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        cached_tokens = (len(computed_blocks) + len(from_tier)) * self.block_size
        num_tokens_after = request.num_computed_tokens + cached_tokens + num_new_tokens
        num_needed = -(-num_tokens_after // self.block_size) - len(blocks) - len(computed_blocks)
        # Cached blocks about to be reused are counted as free until touched.
        reusable = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - reusable:
            if not blocks:
                del self.req_blocks[request.request_id]
            return None
        self.pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        tier = self.pool.tier
        if from_tier:
            tier.pin(from_tier)  # the evictions this allocation makes must not take their slots
        new_blocks = self.pool.allocate(max(num_needed, 0), first_index=len(blocks))
        for block_hash, block in zip(from_tier, new_blocks):
            tier.load(block_hash, block.block_id)
        self.tier_hits += len(from_tier) * self.block_size
        blocks.extend(new_blocks)
        if self.enable_prefix_caching:
            self._register_full_blocks(request, blocks, num_tokens_after)
        return [b.block_id for b in computed_blocks + new_blocks]

    def register_verified(self, request: Request) -> None:
        """After a verified speculative draft: register the blocks its accepted
        tokens filled. The verification step wrote their K/V (the same tokens
        as committed), but `allocate_slots` registered only the tokens
        committed before it, and a request that ends in this step allocates no
        more: without this, a finished request's last blocks never reach the
        prefix cache. The last committed token's K/V is not written yet."""
        blocks = self.req_blocks.get(request.request_id)
        if self.enable_prefix_caching and blocks:
            self._register_full_blocks(request, blocks, request.num_tokens - 1)

    def _register_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        # A block is registered once every token in it will have been computed
        # by the end of this step; attention writes a step's K/V before any
        # query of that step reads it, so a request scheduled later can share it.
        # Only committed tokens count: positions past request.num_tokens hold a
        # speculative draft this step (raylm.core.spec_decode), and a rejected
        # draft token's K/V stays in its slot until a later step overwrites it.
        self._update_block_hashes(request)
        num_committed = min(num_tokens, request.num_tokens)
        num_full = min(num_committed // self.block_size, len(request.block_hashes))
        start = self.num_registered.get(request.request_id, 0)
        for i in range(start, num_full):
            if blocks[i].block_hash is None:
                self.pool.register(blocks[i], request.block_hashes[i])
        self.num_registered[request.request_id] = max(start, num_full)

    def free(self, request: Request) -> None:
        # Tail blocks first, so a shared prefix outlives the request's own suffix in the LRU.
        self.free_by_id(request.request_id)

    def allocate_for_import(self, migration_id: str, num_blocks: int) -> list[int] | None:
        """`num_blocks` more blocks for migration `migration_id`'s K/V (its
        request arrives with the last stage); None (and nothing changed)
        when the pool cannot hold them."""
        if num_blocks > self.pool.num_free_blocks:
            return None
        blocks = self.imports.setdefault(migration_id, [])
        new_blocks = self.pool.allocate(num_blocks, first_index=len(blocks))
        blocks.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def adopt_import(self, migration_id: str, request_id: str, num_computed_tokens: int) -> str | None:
        """The blocks a migration imported become `request_id`'s block table,
        its first `num_computed_tokens` tokens' K/V in them. None, or why
        not (nothing changed then): the blocks must be exactly those tokens'
        (a stage lost on the way would leave the request reading blocks
        nobody wrote), and the request must have no blocks here yet."""
        blocks = self.imports.get(migration_id, [])
        needed = -(-num_computed_tokens // self.block_size)
        if len(blocks) != needed:
            return f"{len(blocks)} KV blocks were imported, its {num_computed_tokens} tokens fill {needed}"
        if request_id in self.req_blocks:
            return "a request with this id holds KV blocks here already"
        self.req_blocks[request_id] = self.imports.pop(migration_id, [])
        return None

    def free_import(self, migration_id: str) -> None:
        """Free what an import that never became a request reserved."""
        self.pool.free(list(reversed(self.imports.pop(migration_id, []))))

    def free_by_id(self, request_id: str) -> None:
        self.num_registered.pop(request_id, None)
        self._tier_prefix.pop(request_id, None)
        self.pool.free(list(reversed(self.req_blocks.pop(request_id, []))))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        if self.pool.num_free_blocks != self.num_blocks:
            return False
        self.pool.reset_prefix_cache()
        return True
