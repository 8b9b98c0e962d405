"""The node-local tier of evicted K/V blocks, the core's side
(`--kv-offloading-size`; the ranks' side, which holds the bytes in shared
memory, is raylm.kv_transfer.host_tier).

When the prefix cache evicts a full block to reuse its memory, its K/V goes
to a slot of this core's tier instead of being lost, under the block's
hash; a later prompt with that prefix finds it there (after the blocks its
cache still holds) and the block is copied back instead of recomputed. The
tier is an LRU of slots, bounded by the size the user gave.

The directory here decides everything: which slot a block goes to (the
least recently used one when the tier is full), and which slots a new
request's prefix reads. The copies themselves run on the ranks before the
step that would otherwise overwrite (or need) the blocks: the scheduler
queues them (`take_copies`), and the engine core hands them to its ranks
ahead of the step's forward. A slot a queued load reads is never given to a
store until the copies are taken.

A block comes back only under the hash this core computes from the
request's tokens (the interleavings' first rule), and a slot is only ever
filled from a block this core computed or imported whole.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class TierCopies:
    """What the ranks copy before a step: stores (block id, slot, hash)
    first, then loads (slot, block id, hash)."""

    stores: list[tuple[int, int, bytes]] = field(default_factory=list)
    loads: list[tuple[int, int, bytes]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads)


class HostTierDirectory:
    def __init__(self, num_slots: int, events=None):
        self.num_slots = num_slots
        self.events = events  # KVEventRecorder: the supervisor's index follows the tier too
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self._stores: dict[int, tuple[int, bytes]] = {}  # slot -> (block id, hash), queued
        self._loads: list[tuple[int, int, bytes]] = []
        self._reading: set[int] = set()  # slots queued loads read: never reused until taken
        self.stored_blocks = 0
        self.loaded_blocks = 0

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slots

    def offload(self, block_id: int, block_hash: bytes) -> None:
        """The pool evicts `block_id` (holding `block_hash`): keep its K/V
        here, unless the tier has it already or every slot is being read."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            return
        self._slots[block_hash] = slot
        self._stores[slot] = (block_id, block_hash)  # a queued store to this slot is superseded
        self.stored_blocks += 1
        if self.events is not None:
            self.events.offloaded(block_hash, slot)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for block_hash, slot in self._slots.items():
            if slot not in self._reading:
                del self._slots[block_hash]
                if self.events is not None:
                    self.events.unoffloaded(block_hash)
                return slot
        return None

    def lookup(self, block_hashes) -> list[int]:
        """The slots of the leading `block_hashes` the tier holds (stops at the first it lacks)."""
        slots = []
        for block_hash in block_hashes:
            slot = self._slots.get(block_hash)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def pin(self, block_hashes) -> None:
        """Their slots (found by `lookup`) are about to be loaded: no store takes them meanwhile."""
        self._reading.update(self._slots[h] for h in block_hashes)

    def load(self, block_hash: bytes, block_id: int) -> None:
        """Queue the copy of `block_hash`'s slot (pinned) into `block_id`."""
        slot = self._slots[block_hash]
        self._slots.move_to_end(block_hash)
        self._loads.append((slot, block_id, block_hash))
        self.loaded_blocks += 1

    def take_copies(self) -> TierCopies:
        copies = TierCopies([(b, s, h) for s, (b, h) in self._stores.items()], self._loads)
        self._stores, self._loads, self._reading = {}, [], set()
        return copies

    def entries(self) -> dict[bytes, int]:
        return dict(self._slots)
