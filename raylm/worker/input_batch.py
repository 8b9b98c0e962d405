"""Turn one SchedulerOutput into flat model inputs and attention metadata.

Tokens of all scheduled requests are laid flat (no padding): decode requests
(one new token each) first, so attention can batch them, then prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from raylm.model.forward_context import AttentionMetadata, PrefillSeq
from raylm.model.layers.attention_merge import ContextParallelMetadata, ShardedQueries
from raylm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """A worker's copy of one request, kept across steps."""

    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # prompt + output tokens known so far
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    # Requests in flat order, with how many tokens each contributes.
    req_ids: list[str]
    num_tokens: list[int]
    # Requests that reach the end of their known tokens and so sample now,
    # with the flat index of the row whose logits they sample from.
    sample_req_ids: list[str] = field(default_factory=list)
    sample_indices: list[int] = field(default_factory=list)
    # Prompt-logprob work: req_id -> (flat rows, target token ids).
    prompt_logprob_rows: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)


def _slots(block_ids: list[int], positions: np.ndarray, block_size: int) -> np.ndarray:
    table = np.asarray(block_ids, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size


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
    exact, since the merge weighs each shard by its own log-sum-exp. Returns (indices into the
    table, local block ids)."""
    mine = np.nonzero(block_ids % cp_size == cp_rank)[0]
    return mine, block_ids[mine] // cp_size


def _cp_local_slots(block_ids: list[int], num_tokens: int, block_size: int, cp_rank: int, cp_size: int):
    """(positions, local slots) of this rank's keys among a sequence's first `num_tokens`."""
    table = np.asarray(block_ids[: -(-num_tokens // block_size)], dtype=np.int64)
    indices, local = cp_shard_of_blocks(table, cp_rank, cp_size)
    offsets = np.arange(block_size, dtype=np.int64)
    positions = (indices[:, None] * block_size + offsets).ravel()
    slots = (local[:, None] * block_size + offsets).ravel()
    keep = positions < num_tokens
    return positions[keep], slots[keep]


def _context_parallel_metadata(
    states: dict[str, CachedRequestState],
    order: list[str],
    num_scheduled_tokens: dict[str, int],
    block_size: int,
    cp_rank: int,
    cp_size: int,
    device: torch.device,
) -> ContextParallelMetadata:
    store_rows, store_slots = [], []
    sharded: list[ShardedQueries] = []
    decode_keys: list[np.ndarray] = []
    offset = 0
    for rid in order:
        state = states[rid]
        n = num_scheduled_tokens[rid]
        start, end = state.num_computed_tokens, state.num_computed_tokens + n
        # This step's tokens that this rank stores: those of its blocks.
        table = np.asarray(state.block_ids, dtype=np.int64)
        pos = np.arange(start, end, dtype=np.int64)
        owner_blocks = table[pos // block_size]
        mine = owner_blocks % cp_size == cp_rank
        store_rows.append(offset + np.nonzero(mine)[0])
        store_slots.append(owner_blocks[mine] // cp_size * block_size + pos[mine] % block_size)
        if n == 1:
            # A decode token (a one-token prompt runs as one too): every key
            # of this rank's shard precedes it; batched with the others.
            decode_keys.append(_cp_local_slots(state.block_ids, end, block_size, cp_rank, cp_size)[1])
        elif start > 0:
            # A later chunk or a prefix-cache hit: earlier context lives
            # across the group, so attend over this rank's shard, merged.
            key_pos, key_slots = _cp_local_slots(state.block_ids, end, block_size, cp_rank, cp_size)
            mask = torch.from_numpy(key_pos[None, :] <= pos[:, None]).to(device)
            sharded.append(ShardedQueries(offset, offset + n, torch.from_numpy(key_slots).to(device), mask))
        offset += n
    meta = ContextParallelMetadata(
        store_rows=torch.from_numpy(np.concatenate(store_rows) if store_rows else np.zeros(0, np.int64)).to(device),
        store_slots=torch.from_numpy(np.concatenate(store_slots) if store_slots else np.zeros(0, np.int64)).to(device),
        sharded=sharded,
        num_decodes=len(decode_keys),
    )
    if decode_keys:
        width = max(1, max(len(keys) for keys in decode_keys))
        slots = np.zeros((len(decode_keys), width), dtype=np.int64)
        valid = np.zeros((len(decode_keys), width), dtype=bool)
        for i, keys in enumerate(decode_keys):
            slots[i, : len(keys)] = keys
            # Padding repeats a key the row owns (written, so finite): a zero
            # weight times a never-written slot's NaN bits would be NaN.
            slots[i, len(keys) :] = keys[0] if len(keys) else 0
            valid[i, : len(keys)] = True
        meta.decode_key_slots = torch.from_numpy(slots).to(device)
        meta.decode_key_mask = torch.from_numpy(valid).to(device)
    return meta


def prepare_batch(
    states: dict[str, CachedRequestState],
    num_scheduled_tokens: dict[str, int],
    block_size: int,
    device: torch.device,
    cp_rank: int = 0,
    cp_size: int = 1,
) -> PreparedBatch:
    order = sorted(num_scheduled_tokens, key=lambda rid: num_scheduled_tokens[rid] != 1)
    num_decodes = sum(1 for rid in order if num_scheduled_tokens[rid] == 1)

    input_ids: list[int] = []
    positions: list[np.ndarray] = []
    slot_mapping: list[np.ndarray] = []
    batch = PreparedBatch(None, None, None, order, [num_scheduled_tokens[r] for r in order])  # type: ignore[arg-type]

    decode_positions: list[int] = []
    decode_slots: list[int] = []
    decode_ctx_lens = []
    decode_tables = []
    prefills: list[PrefillSeq] = []
    offset = 0
    for idx, rid in enumerate(order):
        state = states[rid]
        n = num_scheduled_tokens[rid]
        start = state.num_computed_tokens
        end = start + n
        input_ids.extend(state.token_ids[start:end])
        if idx < num_decodes:
            # One token: its position and slot in plain integers (decodes are
            # most steps' only work, and arrays per request cost more than it).
            decode_positions.append(start)
            decode_slots.append(state.block_ids[start // block_size] * block_size + start % block_size)
            decode_ctx_lens.append(end)
            decode_tables.append(state.block_ids)
        else:
            pos = np.arange(start, end, dtype=np.int64)
            positions.append(pos)
            slot_mapping.append(_slots(state.block_ids, pos, block_size))
            if start == 0:
                prefills.append(PrefillSeq(offset, offset + n))
            else:
                ctx_pos = np.arange(0, end, dtype=np.int64)
                ctx_slots = torch.from_numpy(_slots(state.block_ids, ctx_pos, block_size)).to(device)
                prefills.append(PrefillSeq(offset, offset + n, ctx_slots, num_context=start))
        if end == len(state.token_ids):
            batch.sample_req_ids.append(rid)
            batch.sample_indices.append(offset + n - 1)
        want_prompt_lps = state.sampling_params.prompt_logprobs is not None
        num_prompt = len(state.prompt_token_ids)
        # Every prompt position computed gives its logprobs, again after a
        # preemption or a rebuilt executor: the front end keeps one of each.
        if want_prompt_lps and start < min(end, num_prompt - 1):
            # Position p predicts prompt token p+1.
            last = min(end, num_prompt - 1)
            rows = list(range(offset, offset + last - start))
            targets = state.prompt_token_ids[start + 1 : last + 1]
            batch.prompt_logprob_rows[rid] = (rows, targets)
        offset += n

    # Decodes come first in the flat order.
    positions.insert(0, np.asarray(decode_positions, dtype=np.int64))
    slot_mapping.insert(0, np.asarray(decode_slots, dtype=np.int64))
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(np.concatenate(slot_mapping)).to(device),
        num_decode_tokens=num_decodes,
        prefills=prefills,
    )
    if num_decodes:
        ctx = np.asarray(decode_ctx_lens, dtype=np.int64)
        max_blocks = -(-int(ctx.max()) // block_size)
        # Padding entries repeat the request's first block: any real block
        # will do, the mask hides it.
        table = np.empty((num_decodes, max_blocks), dtype=np.int64)
        for i, blocks in enumerate(decode_tables):
            nb = min(len(blocks), max_blocks)
            table[i, :nb] = blocks[:nb]
            table[i, nb:] = blocks[0]
        valid = np.arange(max_blocks * block_size)[None, :] < ctx[:, None]
        meta.decode_block_table = torch.from_numpy(table).to(device)
        meta.decode_mask = torch.from_numpy(valid).to(device)[:, None, None, :]
        meta.decode_context_lens = torch.from_numpy(ctx).to(device)

    if cp_size > 1:
        meta.context_parallel = _context_parallel_metadata(
            states, order, num_scheduled_tokens, block_size, cp_rank, cp_size, device
        )
    batch.input_ids = torch.tensor(input_ids, dtype=torch.int64, device=device)
    batch.positions = torch.from_numpy(np.concatenate(positions)).to(device)
    batch.attn_metadata = meta
    return batch
