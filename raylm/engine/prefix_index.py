"""Which data-parallel core holds which prompt prefix: the supervisor's
exact index of the cores' prefix caches, fed by their block events.

Every core reports, with its messages, the block hashes its prefix cache
began to hold and those it dropped, and says when its cache was emptied (a
fresh pool at its start, after an executor rebuild, at a reset):
`protocol.KVCacheEvents`, from `core.kv_cache_manager.KVEventRecorder`.
The index applies them per core, so it equals each core's cached set as of
the core's last message; a core that leaves (dies, drains, is replaced) is
dropped at once, and a new start of it begins empty. No re-attach is asked
of anyone: the index is rebuilt from the reports as they come.

For a new request the supervisor computes the prompt's chained block
hashes itself (`prompt_block_hashes`, the cores' own function, with the
request's `cache_salt`), and asks how many leading blocks each core holds.
That is a hint for routing, checked at the core, which looks its cache up
by hashes it computes itself (the first rule of faults and operations that
interleave): a stale entry costs a recompute, never a wrong block.

The index follows the cores' tiers of evicted blocks too (raylm.core.
host_tier: which slot of which core's tier holds a hash, and where each
core's tier files are), so that a request routed to a core of this node
can load its prefix from any core's tier (raylm.engine.tier_loads).

Memory: one entry per distinct hash held by any core, bounded by the
cores' blocks (sum of `num_blocks`) and their tiers' slots; about 200
bytes an entry (the 32-byte digest, a small set or dict, the dicts' slots),
so ~20 MiB for 100k blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from raylm.core.kv_cache_manager import hash_block, root_hash
from raylm.engine.protocol import KVCacheEvents


def prompt_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    max_blocks: int | None = None,
    lora_digest: str | None = None,
) -> list[bytes]:
    """The chained hashes of the prompt's full blocks (at most `max_blocks`),
    as a core computes them for its prefix cache (salt and adapter digest at
    the root: raylm.core.kv_cache_manager.root_hash)."""
    num_full = len(token_ids) // block_size
    if max_blocks is not None:
        num_full = min(num_full, max_blocks)
    hashes, parent = [], root_hash(cache_salt, lora_digest)
    for i in range(num_full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


def reusable_prefix_hashes(request, block_size: int, max_blocks: int, hashes: list[bytes] | None = None) -> list[bytes]:
    """The hashes of the prompt's leading blocks another core's K/V could
    stand in for (at most `max_blocks`; never the block of its last token,
    which is always computed); `hashes`: already computed by routing. Empty
    for a request that computes every prompt position (prompt logprobs)."""
    if request.sampling_params.prompt_logprobs is not None:
        return []
    max_blocks = min(max_blocks, (len(request.prompt_token_ids) - 1) // block_size)
    if max_blocks <= 0:
        return []
    if hashes is None:
        hashes = prompt_block_hashes(
            request.prompt_token_ids, block_size, request.cache_salt, max_blocks, request.lora_digest
        )
    return hashes[:max_blocks]


class PrefixIndex:
    """Block hash -> the cores whose prefix cache holds it, per core the
    hashes it holds (to drop a core at once)."""

    def __init__(self):
        self._holders: dict[bytes, set[int]] = {}
        self._by_core: dict[int, set[bytes]] = {}
        self._tier: dict[bytes, dict[int, int]] = {}  # hash -> {core: its tier slot}
        self._tier_by_core: dict[int, set[bytes]] = {}
        self.tier_prefix: dict[int, str] = {}  # core -> its tier files' prefix

    def apply(self, core: int, events: KVCacheEvents) -> None:
        """A core's message's changes, in their order: emptied, then dropped
        and held (a hash is in at most one of the two lists)."""
        if events.cleared:
            self.drop_core(core)
        held = self._by_core.setdefault(core, set())
        for block_hash in events.removed:
            if block_hash in held:
                held.discard(block_hash)
                holders = self._holders[block_hash]
                holders.discard(core)
                if not holders:
                    del self._holders[block_hash]
        for block_hash in events.stored:
            if block_hash not in held:
                held.add(block_hash)
                self._holders.setdefault(block_hash, set()).add(core)
        if events.tier_prefix is not None:
            self.tier_prefix[core] = events.tier_prefix
        in_tier = self._tier_by_core.setdefault(core, set())
        for block_hash in events.unoffloaded:
            self._drop_tier_entry(core, block_hash, in_tier)
        for block_hash, slot in events.offloaded:
            in_tier.add(block_hash)
            self._tier.setdefault(block_hash, {})[core] = slot

    def _drop_tier_entry(self, core: int, block_hash: bytes, in_tier: set[bytes]) -> None:
        in_tier.discard(block_hash)
        slots = self._tier.get(block_hash)
        if slots is not None:
            slots.pop(core, None)
            if not slots:
                del self._tier[block_hash]

    def drop_core(self, core: int) -> None:
        """Core `core` left, or its cache was emptied: it holds nothing."""
        for block_hash in self._by_core.pop(core, ()):
            holders = self._holders[block_hash]
            holders.discard(core)
            if not holders:
                del self._holders[block_hash]
        in_tier = self._tier_by_core.pop(core, set())
        for block_hash in list(in_tier):
            self._drop_tier_entry(core, block_hash, in_tier)
        self.tier_prefix.pop(core, None)

    def tier_run(self, hashes: Sequence[bytes], cores) -> list[tuple[int, int]]:
        """(core, slot) of the leading `hashes` that some of `cores`' tiers
        hold (any of them; stops at the first none holds)."""
        run = []
        for block_hash in hashes:
            slots = self._tier.get(block_hash, {})
            core = next((c for c in cores if c in slots), None)
            if core is None:
                break
            run.append((core, slots[core]))
        return run

    def matched_blocks(self, hashes: Sequence[bytes], cores: Sequence[int]) -> dict[int, int]:
        """For each of `cores`, how many of the leading `hashes` it holds
        (a prefix: the first block it lacks ends its match)."""
        matched = dict.fromkeys(cores, 0)
        alive = set(cores)
        for depth, block_hash in enumerate(hashes):
            holders = self._holders.get(block_hash)
            still = alive & holders if holders else set()
            for core in alive - still:
                matched[core] = depth
            alive = still
            if not alive:
                return matched
        for core in alive:
            matched[core] = len(hashes)
        return matched

    def num_blocks(self, core: int | None = None) -> int:
        """Entries held: by `core`, or distinct hashes over all cores."""
        return len(self._by_core.get(core, ())) if core is not None else len(self._holders)

    def holds(self, core: int) -> set[bytes]:
        return set(self._by_core.get(core, ()))

    def tier_entries(self, core: int) -> dict[bytes, int]:
        """What `core`'s tier of evicted blocks holds: hash -> slot."""
        return {h: self._tier[h][core] for h in self._tier_by_core.get(core, ())}
