"""A rank's part of the node-local tier of evicted K/V blocks
(`--kv-offloading-size`; the core's side, which decides what goes where, is
raylm.core.host_tier).

Each rank of an engine core keeps one file in shared memory
(`<prefix>.rank<i>`), a row of fixed-size slots, each holding one block's
K/V of this rank's layers and heads. The owner core writes a block there
when its prefix cache evicts it, and reads it back into a block of its
paged cache on a prefix hit; the other cores of the node read it too (by
the path the supervisor names), without asking the owner.

A slot's header is a sequence number and the block's hash. The owner makes
the number odd before it writes a slot and even after (a seqlock), so a
reader in another process, which never locks anything, checks that the
number was even and the same before and after its copy, and that the hash
is the one it expects: a slot reused meanwhile is seen, and its copy
dropped. The owner's own reads need no check (it decides when its slots are
reused, after its reads), but make it anyway: a mismatch there is a bug,
and the step that hits it fails into recovery instead of reading wrong K/V.
"""

from __future__ import annotations

import contextlib
import mmap
import os

import torch

# Per slot: the sequence number and the 32-byte hash, as int64 words, padded.
_HEADER_WORDS = 8
_HEADER_BYTES = _HEADER_WORDS * 8
_PAGE = mmap.PAGESIZE


def rank_path(prefix: str, rank: int) -> str:
    return f"{prefix}.rank{rank}"


def slot_bytes(kv_caches: list[torch.Tensor]) -> int:
    """One block's K/V over this rank's layers (each cache: [2, blocks, block_size, heads, head_dim])."""
    first = kv_caches[0]
    return len(kv_caches) * 2 * first[0, 0].numel() * first.element_size()


def _hash_words(block_hash: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(block_hash), dtype=torch.int64)


class _Mapping:
    """A tier file mapped: its headers [slots, 8] (int64) and its slots
    [slots, layers, 2, block_size, heads, head_dim] in the caches' dtype."""

    def __init__(self, path: str, kv_caches: list[torch.Tensor], num_slots: int | None = None):
        first = kv_caches[0]
        per_slot = slot_bytes(kv_caches)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if num_slots is not None else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if num_slots is not None:
                os.ftruncate(fd, _total_bytes(num_slots, per_slot))
            size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if num_slots is None:
            num_slots = _slots_in(size, per_slot)
        self.num_slots = num_slots
        head_bytes = _header_area(num_slots)
        raw = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.headers = raw[: num_slots * _HEADER_BYTES].view(torch.int64).view(num_slots, _HEADER_WORDS)
        shape = (num_slots, len(kv_caches), 2, *first.shape[2:])
        self.slots = raw[head_bytes : head_bytes + num_slots * per_slot].view(first.dtype).view(shape)
        if _total_bytes(num_slots, per_slot) != size:
            raise ValueError(f"{path}: {size} bytes is not a K/V tier of this layout")

    def close(self) -> None:
        self.headers = self.slots = None
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with it
            self.mm.close()


def _header_area(num_slots: int) -> int:
    return -(-num_slots * _HEADER_BYTES // _PAGE) * _PAGE


def _total_bytes(num_slots: int, per_slot: int) -> int:
    return _header_area(num_slots) + num_slots * per_slot


def _slots_in(size: int, per_slot: int) -> int:
    """The most slots (with their headers) that fit in `size` bytes."""
    n = size // (per_slot + _HEADER_BYTES)
    while n > 0 and _total_bytes(n, per_slot) > size:
        n -= 1
    return n


def slots_for_budget(kv_caches: list[torch.Tensor], budget_bytes: int) -> int:
    return _slots_in(budget_bytes, slot_bytes(kv_caches))


class RankHostTier:
    """This rank's tier file (and the reads of other cores' files)."""

    def __init__(self, rank: int):
        self.rank = rank
        self._own: _Mapping | None = None
        self._own_path: str | None = None

    def open(self, kv_caches: list[torch.Tensor], prefix: str, num_slots: int) -> None:
        """Make this rank's file of `num_slots` slots (a fresh one: a new
        executor's ranks never reuse the files of the last)."""
        self.close()
        path = rank_path(prefix, self.rank)
        self._own = _Mapping(path, kv_caches, num_slots)
        self._own_path = path

    def copy(self, kv_caches: list[torch.Tensor], stores: list, loads: list) -> None:
        """Stores first: (block id, slot, hash) evicted blocks into their
        slots; then loads: (slot, block id, hash) slots into blocks. In this
        order because a block evicted in a step may be the one a load of the
        same step fills; the core never reuses a slot a load still reads."""
        tier = self._own
        if tier is None:
            raise RuntimeError("this rank has no K/V tier open")
        if stores:
            _store(tier, kv_caches, *zip(*stores, strict=True))
        if loads:
            slots, block_ids, hashes = zip(*loads, strict=True)
            if _read(tier, kv_caches, slots, block_ids, hashes) != len(slots):
                raise RuntimeError("a K/V tier slot this core reads does not hold the block it wrote there")

    def read_other(self, kv_caches: list[torch.Tensor], prefix: str, slots, hashes, block_ids) -> int:
        """Another core's slots into our blocks: how many of them, from the
        first, were what the supervisor said (the rest were reused
        meanwhile). Mapped for this read only: a core that left must not
        keep its memory alive in every reader's mappings."""
        path = rank_path(prefix, self.rank)
        if path == self._own_path:
            return _read(self._own, kv_caches, slots, block_ids, hashes)
        try:
            tier = _Mapping(path, kv_caches)
        except (OSError, ValueError):
            return 0  # gone (its core left), or not a tier of our layout: nothing read
        try:
            if max(slots, default=-1) >= tier.num_slots:
                return 0
            return _read(tier, kv_caches, slots, block_ids, hashes)
        finally:
            tier.close()

    def close(self) -> None:
        if self._own is not None:
            self._own.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._own_path)
        self._own = self._own_path = None


def _store(tier: _Mapping, kv_caches, block_ids, slots, hashes) -> None:
    index = torch.tensor(block_ids, dtype=torch.int64)
    where = torch.tensor(slots, dtype=torch.int64)
    tier.headers[where, 0] += 1  # odd: being written
    for layer, cache in enumerate(kv_caches):
        tier.slots[:, layer].index_copy_(0, where, cache.index_select(1, index).transpose(0, 1))
    tier.headers[where, 1:5] = torch.stack([_hash_words(h) for h in hashes])
    tier.headers[where, 0] += 1  # even: whole


def _read(tier: _Mapping, kv_caches, slots, block_ids, hashes) -> int:
    """Slots into blocks; the number of leading slots that held their
    expected hash, unchanged, through the copy (those blocks are good)."""
    where = torch.tensor(slots, dtype=torch.int64)
    before = tier.headers[where, 0].clone()
    expected = torch.stack([_hash_words(h) for h in hashes])
    named = (tier.headers[where, 1:5] == expected).all(dim=1)
    index = torch.tensor(block_ids, dtype=torch.int64)
    for layer, cache in enumerate(kv_caches):
        cache.index_copy_(1, index, tier.slots[where, layer].transpose(0, 1))
    after = tier.headers[where, 0]
    good = named & (before == after) & (before % 2 == 0)
    bad = (~good).nonzero()
    return int(bad[0, 0]) if len(bad) else len(slots)
