"""One context-parallel (CP) rank's share of a step (issue 26).

The step's tokens are laid flat as for one rank (raylm.worker.input_batch:
decodes first, then prefill chunks); this module says which of those rows a
CP rank computes, where their K/V goes in its cache, what its queries attend
to, and brings the rows the sampler reads to every rank after the forward.

- Decode tokens and chunks too short to split run whole on every rank (their
  attention over the ranks' K/V shards is merged by log-sum-exp,
  raylm.model.layers.attention_merge).
- Longer prefill chunks are split (raylm.model.layers.cp_prefill): each rank
  computes its share of the tokens, and per layer the group exchanges the K/V
  its queries need.

Block id g lives on CP rank g % cp as that rank's block g // cp, so the
block table alone, the same on every rank, says where any token's K/V is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raylm.model.layers.attention_merge import ContextParallelMetadata, ShardedQueries
from raylm.model.layers.cp_prefill import (
    SplitPiece,
    SplitPrefillMetadata,
    SplitSequence,
    is_split,
    prefill_share,
)


def cp_shard_of_blocks(block_ids: np.ndarray, cp_rank: int, cp_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Which of a block table's entries live on `cp_rank`, and where.

    Under context parallelism the scheduler counts the blocks of the whole CP
    group (cp_size times one rank's); block id g lives on rank g % cp_size as
    that rank's block g // cp_size. So the block's id alone says where it is:
    every rank reads the same table, the prefix cache shares blocks by id as
    ever, and a freed block returns to its own rank's share. The pool hands
    out a sequence's j-th block from rank j % cp_size while that rank has a
    free one (raylm.core.kv_cache_manager.BlockPool), so its blocks alternate
    between ranks and the ranks' caches fill evenly; any placement would be
    exact. Returns (indices into the table, local block ids)."""
    mine = np.nonzero(block_ids % cp_size == cp_rank)[0]
    return mine, block_ids[mine] // cp_size


def _shard_of_sequence(block_ids: list[int], num_tokens: int, block_size: int, cp_rank: int, cp_size: int):
    """cp_shard_of_blocks over the blocks that hold a sequence's first `num_tokens`."""
    table = np.asarray(block_ids[: -(-num_tokens // block_size)], dtype=np.int64)
    return cp_shard_of_blocks(table, cp_rank, cp_size)


def cp_local_slots(block_ids: list[int], num_tokens: int, block_size: int, cp_rank: int, cp_size: int):
    """(positions, local slots) of `cp_rank`'s keys among a sequence's first `num_tokens`."""
    indices, local = _shard_of_sequence(block_ids, num_tokens, block_size, cp_rank, cp_size)
    offsets = np.arange(block_size, dtype=np.int64)
    positions = (indices[:, None] * block_size + offsets).ravel()
    slots = (local[:, None] * block_size + offsets).ravel()
    keep = positions < num_tokens
    return positions[keep], slots[keep]


def _local_blocks(
    block_ids: list[int], num_tokens: int, block_size: int, cp_rank: int, cp_size: int
) -> tuple[np.ndarray, int]:
    """`cp_rank`'s local block ids of a sequence's first `num_tokens`, and how
    many of those tokens they hold (only the sequence's last block is partly
    filled, and if this rank has it, it is the last here too)."""
    indices, local = _shard_of_sequence(block_ids, num_tokens, block_size, cp_rank, cp_size)
    return local, int(np.minimum(block_size, num_tokens - indices * block_size).sum())


def _share_offsets(num_tokens: int, cp_rank: int, cp_size: int) -> np.ndarray:
    """A split chunk's token offsets that `cp_rank` computes, ascending."""
    return np.concatenate([np.arange(lo, hi, dtype=np.int64) for lo, hi in prefill_share(num_tokens, cp_rank, cp_size)])


def _stored_here(block_ids: list[int], start: int, end: int, block_size: int, cp_rank: int, cp_size: int):
    """(mask over positions start..end-1 stored on `cp_rank`, their local slots)."""
    table = np.asarray(block_ids, dtype=np.int64)
    pos = np.arange(start, end, dtype=np.int64)
    owner_blocks = table[pos // block_size]
    mine = owner_blocks % cp_size == cp_rank
    return mine, owner_blocks[mine] // cp_size * block_size + pos[mine] % block_size


@dataclass
class CPRows:
    """Where each row of a step's flat layout (one rank's, input_batch) is
    computed when some chunk is split."""

    local_rows: np.ndarray  # rows this rank computes, ascending: its local rows in order
    owner: np.ndarray  # per row: the one CP rank that computes it, or -1 (every rank does)
    local_of_row: np.ndarray  # per row: its index among this rank's local rows, or -1


@dataclass
class _SplitChunk:
    block_ids: list[int]
    start: int
    end: int
    local_start: int  # this rank's first local row of the chunk


def build_cp_step(
    states, order: list[str], num_scheduled_tokens: dict[str, int], block_size: int, cp_rank: int, cp_size: int, device
) -> tuple[ContextParallelMetadata, CPRows | None]:
    """This rank's ContextParallelMetadata, and its CPRows (None when every
    rank computes every row: nothing split)."""
    total = sum(num_scheduled_tokens[rid] for rid in order)
    owner = np.full(total, -1, dtype=np.int64)
    local_rows: list[np.ndarray] = []
    store_rows, store_slots = [], []
    sharded: list[ShardedQueries] = []
    decode_blocks: list[np.ndarray] = []  # per decode row: its local block ids here
    decode_lens: list[int] = []  # per decode row: its keys in them
    local_prefills: list[tuple[int, int]] = []
    split: list[_SplitChunk] = []
    row = local = 0
    for rid in order:
        state = states[rid]
        n = num_scheduled_tokens[rid]
        start, end = state.num_computed_tokens, state.num_computed_tokens + n
        if is_split(n, cp_size):
            for q in range(cp_size):
                owner[row + _share_offsets(n, q, cp_size)] = q
            mine = _share_offsets(n, cp_rank, cp_size)
            local_rows.append(row + mine)
            split.append(_SplitChunk(state.block_ids, start, end, local))
            local += len(mine)
            row += n
            continue
        local_rows.append(np.arange(row, row + n, dtype=np.int64))
        # This step's tokens that this rank stores: those of its blocks.
        stored, slots = _stored_here(state.block_ids, start, end, block_size, cp_rank, cp_size)
        store_rows.append(local + np.nonzero(stored)[0])
        store_slots.append(slots)
        if n == 1:
            # A decode token (a one-token prompt runs as one too): every key
            # of this rank's shard precedes it; batched with the others.
            blocks, num_keys = _local_blocks(state.block_ids, end, block_size, cp_rank, cp_size)
            decode_blocks.append(blocks)
            decode_lens.append(num_keys)
        elif start > 0:
            # A short later chunk or prefix-cache hit: earlier context lives
            # across the group, so attend over this rank's shard, merged.
            key_pos, key_slots = cp_local_slots(state.block_ids, end, block_size, cp_rank, cp_size)
            pos = np.arange(start, end, dtype=np.int64)
            mask = torch.from_numpy(key_pos[None, :] <= pos[:, None]).to(device)
            sharded.append(ShardedQueries(local, local + n, torch.from_numpy(key_slots).to(device), mask))
        else:
            # A short whole prompt: every rank has all its keys, fresh.
            local_prefills.append((local, local + n))
        local += n
        row += n

    def tensor(parts: list[np.ndarray]) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64)).to(device)

    meta = ContextParallelMetadata(
        store_rows=tensor(store_rows),
        store_slots=tensor(store_slots),
        sharded=sharded,
        num_decodes=len(decode_blocks),
        local_prefills=local_prefills,
    )
    if decode_blocks:
        table = np.zeros((len(decode_blocks), max(1, max(len(b) for b in decode_blocks))), dtype=np.int64)
        for i, blocks in enumerate(decode_blocks):
            table[i, : len(blocks)] = blocks
        meta.decode_block_table = torch.from_numpy(table).to(device)
        meta.decode_context_lens = torch.tensor(decode_lens, dtype=torch.int64, device=device)
    if not split:
        return meta, None
    meta.split = _split_metadata(split, block_size, cp_rank, cp_size, device)
    all_local = np.concatenate(local_rows)
    local_of_row = np.full(total, -1, dtype=np.int64)
    local_of_row[all_local] = np.arange(len(all_local))
    return meta, CPRows(all_local, owner, local_of_row)


def _split_metadata(
    chunks: list[_SplitChunk], block_size: int, cp_rank: int, cp_size: int, device
) -> SplitPrefillMetadata:
    """The per-layer K/V exchange of the split chunks (see SplitPrefillMetadata).

    Rank q's send buffer holds its fresh rows of every split chunk, in chunk
    order, then its cache shard of every chunk's earlier context; each rank
    works out every rank's layout from the block tables, so all agree on
    where each position's K/V lands in the gathered buffer."""
    shares = [[_share_offsets(c.end - c.start, q, cp_size) for q in range(cp_size)] for c in chunks]
    old = [
        [cp_local_slots(c.block_ids, c.start, block_size, q, cp_size) if c.start else None for q in range(cp_size)]
        for c in chunks
    ]
    fresh_len = [sum(len(s[q]) for s in shares) for q in range(cp_size)]
    old_len = [sum(len(o[q][0]) for o in old if o[q] is not None) for q in range(cp_size)]
    send_len = max(f + o for f, o in zip(fresh_len, old_len))
    fresh_at, old_at = [0] * cp_size, list(fresh_len)
    send_rows, send_slots, store_index, store_slots = [], [], [], []
    sequences = []
    for chunk, chunk_shares, chunk_old in zip(chunks, shares, old):
        where = np.empty(chunk.end, dtype=np.int64)  # position -> row of the gathered buffer
        for q in range(cp_size):
            base = q * send_len
            offsets = chunk_shares[q]
            where[chunk.start + offsets] = base + fresh_at[q] + np.arange(len(offsets))
            fresh_at[q] += len(offsets)
            if chunk_old[q] is not None:
                positions, slots = chunk_old[q]
                where[positions] = base + old_at[q] + np.arange(len(positions))
                old_at[q] += len(positions)
                if q == cp_rank:
                    send_slots.append(slots)
        mine = chunk_shares[cp_rank]
        send_rows.append(chunk.local_start + np.arange(len(mine)))
        stored, slots = _stored_here(chunk.block_ids, chunk.start, chunk.end, block_size, cp_rank, cp_size)
        store_index.append(where[chunk.start : chunk.end][stored])
        store_slots.append(slots)
        pieces, q_start = [], chunk.local_start
        for lo, hi in prefill_share(chunk.end - chunk.start, cp_rank, cp_size):
            pieces.append(SplitPiece(q_start, q_start + hi - lo, chunk.start + hi))
            q_start += hi - lo
        sequences.append(SplitSequence(torch.from_numpy(where).to(device), pieces))

    def tensor(parts: list[np.ndarray]) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64)).to(device)

    return SplitPrefillMetadata(
        send_rows=tensor(send_rows),
        send_slots=tensor(send_slots),
        send_len=send_len,
        store_index=tensor(store_index),
        store_slots=tensor(store_slots),
        sequences=sequences,
    )


def gather_rows(hidden: torch.Tensor, rows: list[int], cp_rows: CPRows, group) -> torch.Tensor:
    """Hidden states [len(rows), H] of the step's flat `rows` (the sampler's
    and the prompt logprobs'), on every CP rank: a row computed by one rank
    alone comes from it by one all-gather. Every rank of the group must call
    this with the same rows (it does: the step is the same on all of them)."""
    index = np.asarray(rows, dtype=np.int64)
    owner = cp_rows.owner[index]
    alone = owner >= 0
    out = hidden.new_empty(len(rows), hidden.shape[-1])
    everywhere = np.nonzero(~alone)[0]
    if len(everywhere):
        out[torch.from_numpy(everywhere)] = hidden[torch.from_numpy(cp_rows.local_of_row[index[everywhere]])]
    if not alone.any():
        return out
    # Each owner sends its rows in order, padded to the longest share.
    counts = np.bincount(owner[alone], minlength=group.world_size)
    order_in_owner = np.zeros(len(rows), dtype=np.int64)
    for q in range(group.world_size):
        order_in_owner[owner == q] = np.arange(counts[q])
    send = hidden.new_zeros(int(counts.max()), hidden.shape[-1])
    mine = np.nonzero(owner == group.rank_in_group)[0]
    if len(mine):
        send[: len(mine)] = hidden[torch.from_numpy(cp_rows.local_of_row[index[mine]])]
    gathered = group.all_gather(send.unsqueeze(0), dim=0)  # [cp, longest, H]
    picked = np.nonzero(alone)[0]
    out[torch.from_numpy(picked)] = gathered[torch.from_numpy(owner[picked]), torch.from_numpy(order_in_owner[picked])]
    return out
