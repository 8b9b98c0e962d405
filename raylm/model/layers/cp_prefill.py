"""A prefill chunk split across the ranks of a context-parallel (CP) group.

Under CP every sequence's K/V is stored sharded by block over the group
(block id g on rank g % cp). A prefill chunk of n tokens is also *computed*
sharded: it is cut into 2 * cp near-equal pieces and rank r computes pieces
r and 2 * cp - 1 - r. Causal attention costs more for later tokens, so one
piece from each end gives every rank about the same work (the "zigzag"
split), and cp rank 0 holds the chunk's last token, the one the sampler reads.

Attention needs, for a rank's queries, the keys of every earlier position:
the chunk's own tokens (computed by all the ranks) and any earlier context
(a prefix-cache hit or earlier chunks, in the ranks' caches). Per layer each
rank contributes its fresh K/V and its cache shard of the earlier context to
one all-gather; every rank then holds the sequence's keys 0..end in position
order, stores the fresh ones its blocks own, and attends its own queries
locally, exactly. (Ring attention would overlap the transfer with compute;
on a shared-memory node the all-gather is one copy and simpler.)

A chunk of fewer than MIN_TOKENS_PER_RANK tokens per rank is not split:
every rank computes it whole, as it does decode tokens. Splitting it would
save little compute and still cost a per-layer exchange; and no rank ever
has an empty share of a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# A split chunk gives every rank at least this many tokens (two pieces of 8).
MIN_TOKENS_PER_RANK = 16


def is_split(num_tokens: int, cp_size: int) -> bool:
    """Whether a step's chunk of `num_tokens` tokens is split over the CP group."""
    return cp_size > 1 and num_tokens >= MIN_TOKENS_PER_RANK * cp_size


def prefill_share(num_tokens: int, cp_rank: int, cp_size: int) -> list[tuple[int, int]]:
    """The ranges [lo, hi) of a split chunk's tokens that `cp_rank` computes,
    in order: piece cp_rank and piece 2 * cp_size - 1 - cp_rank."""
    pieces = 2 * cp_size
    base, extra = divmod(num_tokens, pieces)
    starts = [i * base + min(i, extra) for i in range(pieces + 1)]
    first, last = cp_rank, pieces - 1 - cp_rank
    return [(starts[first], starts[first + 1]), (starts[last], starts[last + 1])]


def num_rows_on_rank(num_tokens_per_request, cp_rank: int, cp_size: int) -> int:
    """Rows of a step that `cp_rank` computes: a split chunk's share, every
    other request's tokens whole."""
    total = 0
    for n in num_tokens_per_request:
        if is_split(n, cp_size):
            total += sum(hi - lo for lo, hi in prefill_share(n, cp_rank, cp_size))
        else:
            total += n
    return total


@dataclass
class SplitPiece:
    """One of this rank's query ranges of a split sequence: local rows
    [q_start, q_end), the last of the sequence's first `num_keys` positions,
    attending causally to those keys."""

    q_start: int
    q_end: int
    num_keys: int


@dataclass
class SplitSequence:
    """A split chunk on this rank: `key_index` picks its keys 0..end-1, in
    position order, out of the group's gathered K/V (rows of the flattened
    [cp * send_len] buffer); `pieces` are this rank's queries."""

    key_index: torch.Tensor
    pieces: list[SplitPiece] = field(default_factory=list)


@dataclass
class SplitPrefillMetadata:
    """This rank's part of the per-layer K/V exchange of a step's split chunks.

    Each rank sends `send_len` rows (padded): the fresh K/V of its local rows
    `send_rows`, then its cache's K/V at `send_slots` (its shard of the
    chunks' earlier context). After the gather, rows `store_index` of it go to
    this rank's cache slots `store_slots` (the fresh tokens its blocks own).
    """

    send_rows: torch.Tensor
    send_slots: torch.Tensor
    send_len: int
    store_index: torch.Tensor
    store_slots: torch.Tensor
    sequences: list[SplitSequence] = field(default_factory=list)


def exchange_split_kv(
    k: torch.Tensor, v: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, meta: SplitPrefillMetadata, group
) -> torch.Tensor:
    """All-gather the split chunks' K/V over the CP group and store this rank's
    share of the fresh tokens. Returns the gathered K/V, [cp * send_len, 2, KVH, D]."""
    num_fresh, num_old = meta.send_rows.numel(), meta.send_slots.numel()
    send = k.new_zeros(meta.send_len, 2, *k.shape[1:])
    send[:num_fresh, 0] = k.index_select(0, meta.send_rows)
    send[:num_fresh, 1] = v.index_select(0, meta.send_rows)
    if num_old:
        send[num_fresh : num_fresh + num_old, 0] = k_flat.index_select(0, meta.send_slots).to(k.dtype)
        send[num_fresh : num_fresh + num_old, 1] = v_flat.index_select(0, meta.send_slots).to(v.dtype)
    gathered = group.all_gather(send.unsqueeze(0), dim=0).flatten(0, 1)
    if meta.store_index.numel():
        mine = gathered.index_select(0, meta.store_index)
        k_flat.index_copy_(0, meta.store_slots, mine[:, 0].to(k_flat.dtype))
        v_flat.index_copy_(0, meta.store_slots, mine[:, 1].to(v_flat.dtype))
    return gathered
