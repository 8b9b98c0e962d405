"""Attention over a sequence whose keys are split into shards, merged exactly.

The building block of context parallelism (issue 26): when the K/V of a
sequence is spread over the ranks of a context-parallel group, each rank
attends over its own shard and returns its partial output together with the
log-sum-exp (LSE) of its scores. Softmax over all keys is then recovered
exactly, without any rank seeing the others' keys:

    out = sum_i exp(lse_i - lse) * out_i,   lse = log(sum_i exp(lse_i))

A shard with no key a query may attend to (an empty shard, or keys all in the
query's future) has out_i = 0 and lse_i = -inf and so weighs nothing.

The partial outputs stay float32 whatever the model's dtype, and so does the
merge: the caller rounds once, after it. Rounding each out_i to bf16 first
(as this did once) adds a rounding per shard, and bf16 CP=2 drifted from
CP=1 token-wise on the ~111M model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [T, H, D] over one shard's k/v [S, KVH, D] (GQA: H a multiple of KVH).

    mask [T, S] bool (True = may attend) or None (all). Returns (out [T, H, D],
    lse [T, H]), both float32; rows with nothing to attend give out 0, lse -inf.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    if k.shape[0] == 0:
        return (
            q.new_zeros(q.shape, dtype=torch.float32),
            torch.full((num_tokens, num_heads), float("-inf"), device=q.device),
        )
    # Query head h reads kv head h // group. The group's queries are stacked
    # against their kv head ([KVH, group * T, D]) rather than the keys
    # repeated per query head: no copy of the shard's K/V.
    qf = q.float().view(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    qf = qf.reshape(num_kv_heads, group * num_tokens, head_dim)
    kf, vf = k.float().transpose(0, 1), v.float().transpose(0, 1)  # [KVH, S, D]
    scores = torch.matmul(qf, kf.transpose(1, 2)).mul_(scale)  # [KVH, group * T, S]
    if mask is not None:
        scores = scores.view(num_kv_heads, group, num_tokens, -1).masked_fill(~mask, float("-inf"))
        scores = scores.view(num_kv_heads, group * num_tokens, -1)
    lse = torch.logsumexp(scores, dim=-1)  # [KVH, group * T]
    empty = torch.isinf(lse)
    probs = torch.exp(scores - torch.where(empty, 0.0, lse).unsqueeze(-1))
    out = torch.matmul(probs, vf)  # [KVH, group * T, D]; a row of an empty shard is all zeros
    out = out.view(num_kv_heads, group, num_tokens, head_dim).permute(2, 0, 1, 3).reshape(q.shape)
    lse = lse.view(num_kv_heads, group, num_tokens).permute(2, 0, 1).reshape(num_tokens, num_heads)
    return out, lse


def partial_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`partial_attention` of B decode queries at once, one per sequence: q
    [B, H, D] over each sequence's shard k/v [B, S, KVH, D], padded to S keys;
    mask [B, S] bool, True = a real key. Padding must hold finite values (a
    zero weight times NaN is NaN), except in a row with no real key at all,
    which gives out 0 and lse -inf whatever it holds. out and lse float32."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    qf = q.float().view(batch, num_kv_heads, group, head_dim)
    kf, vf = k.float().permute(0, 2, 1, 3), v.float().permute(0, 2, 1, 3)  # [B, KVH, S, D]
    scores = torch.matmul(qf, kf.transpose(-1, -2)).mul_(scale)  # [B, KVH, group, S]
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, KVH, group]
    empty = torch.isinf(lse)
    probs = torch.exp(scores - torch.where(empty, 0.0, lse).unsqueeze(-1))
    out = torch.matmul(probs, vf)  # [B, KVH, group, D]
    out = torch.where(empty.unsqueeze(-1), 0.0, out)
    return out.reshape(batch, num_heads, head_dim), lse.reshape(batch, num_heads)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """outs [shards, T, H, D], lses [shards, T, H] -> the attention over all shards [T, H, D], float32
    (the caller rounds it to the model's dtype: one rounding for the whole attention).

    Exact up to float rounding; a query no shard has a key for gets zeros.
    """
    lses = lses.float()
    total = torch.logsumexp(lses, dim=0)  # [T, H]
    nothing = torch.isinf(total)
    weights = torch.exp(lses - torch.where(nothing, 0.0, total).unsqueeze(0))  # [shards, T, H]
    weights = torch.where(torch.isinf(lses), 0.0, weights)
    return (weights.unsqueeze(-1) * outs.float()).sum(dim=0)


def _heads_first(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[S, heads, D] -> [1, heads, S, D] in `dtype` (a view when it already is)."""
    return x.transpose(0, 1).unsqueeze(0).to(dtype)


def sequence_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """One sequence: q [Tq, H, D] over k/v [Tk, KVH, D] -> [Tq, H, D] in q's
    dtype; causal unless a mask [Tq, Tk] (True = attend) is given."""
    o = torch.nn.functional.scaled_dot_product_attention(
        _heads_first(q, q.dtype),
        _heads_first(k, q.dtype),
        _heads_first(v, q.dtype),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return o.squeeze(0).transpose(0, 1)


def attention_after_context(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_context: int, scale: float
) -> torch.Tensor:
    """Causal attention of a chunk that follows `num_context` tokens of context:
    q [T, H, D] at positions num_context .. num_context + T - 1 over k/v
    [num_context + T, KVH, D] in position order (GQA: H a multiple of KVH).
    Every query sees the whole context and the chunk's keys up to its own.
    Returns [T, H, D] in q's dtype.

    One attention with a mask would compute the chunk's upper triangle only to
    mask it away (for a CP rank's share of an 8k prompt, a fifth of its
    attention); torch skips masked blocks only for a plain causal mask. So on
    CPU it is two attentions, merged by their log-sum-exp: the context with
    no mask, the chunk's own keys plain causal.
    """
    num_queries = q.shape[0]
    if k.shape[0] != num_context + num_queries:
        raise ValueError(f"{k.shape[0]} keys for {num_context} of context and {num_queries} queries")
    if q.device.type != "cpu" or num_context == 0:
        mask = None
        if num_context:
            positions = torch.arange(num_context, num_context + num_queries, device=q.device)
            mask = torch.arange(k.shape[0], device=q.device)[None, :] <= positions[:, None]
        return sequence_attention(q, k, v, scale, mask)
    # torch's CPU flash kernel returns the log-sum-exp beside the output and
    # takes grouped K/V heads as they are. (It must not see zero keys: it
    # divides by the key count.)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    qh = _heads_first(q, q.dtype)
    ctx_k, ctx_v = (_heads_first(t[:num_context], q.dtype) for t in (k, v))
    own_k, own_v = (_heads_first(t[num_context:], q.dtype) for t in (k, v))
    ctx_out, ctx_lse = flash(qh, ctx_k, ctx_v, scale=scale)
    own_out, own_lse = flash(qh, own_k, own_v, is_causal=True, scale=scale)
    outs = torch.stack((ctx_out[0], own_out[0])).transpose(1, 2)  # [2, T, H, D]
    lses = torch.stack((ctx_lse[0], own_lse[0])).transpose(1, 2)  # [2, T, H]
    return merge_partials(outs, lses).to(q.dtype)


@dataclass
class ShardedQueries:
    """Queries (rows [q_start, q_end) of the flat batch) of one sequence whose
    context is spread over the CP group: this rank's keys of it sit at
    `key_slots` of its own cache; `mask` [queries, keys] bool (True = attend),
    or None when every key precedes every query (a decode token)."""

    q_start: int
    q_end: int
    key_slots: torch.Tensor
    mask: torch.Tensor | None = None


@dataclass
class ContextParallelMetadata:
    """One CP rank's view of a step (built by raylm.worker.cp_input); row
    numbers are this rank's local rows.

    A prefill chunk long enough is split over the group (`split`, see
    raylm.model.layers.cp_prefill): each rank computes its share of the
    tokens and the group exchanges their K/V per layer. Every other token
    (decodes, short chunks) is computed whole by every rank, which stores
    only the K/V of its own blocks: rows `store_rows` go to `store_slots` of
    its cache. A short prompt with no earlier context attends over its fresh
    keys locally (`local_prefills`, every rank has them all); decode tokens and
    short chunks with earlier context attend over the rank's shard and are
    merged across the group (`sharded`).
    """

    store_rows: torch.Tensor
    store_slots: torch.Tensor
    sharded: list[ShardedQueries] = field(default_factory=list)
    # The step's decode tokens (its first rows), attended in one batch over
    # this rank's blocks of each: [decodes, blocks] local block ids (padded
    # with 0) and [decodes] the number of keys in them, int64. Only a
    # sequence's last block is partly filled, so a row's keys are the first
    # `decode_context_lens` slots of its blocks here, as the paged decode
    # kernel reads a whole sequence's (0 when the rank holds none of it).
    num_decodes: int = 0
    decode_block_table: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    # Local rows [start, end) of short whole prompts, computed on every rank.
    local_prefills: list[tuple[int, int]] = field(default_factory=list)
    # The split chunks (raylm.model.layers.cp_prefill.SplitPrefillMetadata), or None.
    split: object | None = None
