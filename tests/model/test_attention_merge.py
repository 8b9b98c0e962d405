"""Attention over key shards merged by log-sum-exp (attention_merge.py, the math
of context parallelism) against one attention over all keys (float64 SDPA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raylm.model.layers.attention_merge import merge_partials, partial_attention


def _full_attention(q, k, v, scale, mask):
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1),
        k.double().repeat_interleave(group, dim=1).transpose(0, 1),
        v.double().repeat_interleave(group, dim=1).transpose(0, 1),
        attn_mask=mask.unsqueeze(0),
        scale=scale,
    )
    return out.transpose(0, 1)


def _shards(num_keys: int, how: str, count: int) -> list[torch.Tensor]:
    """Key indices per shard: contiguous runs, round robin (decode's "in turn"),
    or with an empty shard in the middle."""
    keys = torch.arange(num_keys)
    if how == "contiguous":
        return list(torch.tensor_split(keys, count))
    if how == "round_robin":
        return [keys[i::count] for i in range(count)]
    if how == "with_empty":
        parts = list(torch.tensor_split(keys, count - 1))
        return parts[:1] + [keys[:0]] + parts[1:]
    raise ValueError(how)


@pytest.mark.parametrize("how", ["contiguous", "round_robin", "with_empty"])
@pytest.mark.parametrize("count", [2, 3, 4])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_merged_shards_equal_attention_over_all_keys(how, count, heads, kv_heads):
    g = torch.Generator().manual_seed(count * 10 + heads)
    num_queries, num_keys, head_dim = 7, 37, 16
    q = torch.randn(num_queries, heads, head_dim, generator=g)
    k = torch.randn(num_keys, kv_heads, head_dim, generator=g)
    v = torch.randn(num_keys, kv_heads, head_dim, generator=g)
    # Causal: the queries are the last tokens, each sees keys up to its position.
    positions = torch.arange(num_keys - num_queries, num_keys)
    mask = torch.arange(num_keys)[None, :] <= positions[:, None]
    scale = head_dim**-0.5
    partials = [partial_attention(q, k[idx], v[idx], scale, mask[:, idx]) for idx in _shards(num_keys, how, count)]
    merged = merge_partials(torch.stack([o for o, _ in partials]), torch.stack([lse for _, lse in partials]))
    expected = _full_attention(q, k, v, scale, mask)
    assert merged.dtype == q.dtype
    torch.testing.assert_close(merged.double(), expected, rtol=1e-5, atol=1e-5)


def test_a_shard_with_only_future_keys_weighs_nothing():
    """Early queries see none of a late shard's keys (lse -inf, out 0)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(4, 2, 8, generator=g), torch.randn(12, 2, 8, generator=g), torch.randn(12, 2, 8, generator=g)
    mask = torch.arange(12)[None, :] <= torch.tensor([0, 3, 5, 11])[:, None]
    late = torch.arange(6, 12)
    out, lse = partial_attention(q, k[late], v[late], 0.3, mask[:, late])
    assert torch.isinf(lse[:3]).all() and (lse[:3] < 0).all() and not torch.isinf(lse[3]).any()
    assert torch.equal(out[:3], torch.zeros_like(out[:3]))
    early = torch.arange(0, 6)
    parts = [partial_attention(q, k[early], v[early], 0.3, mask[:, early]), (out, lse)]
    merged = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    torch.testing.assert_close(merged.double(), _full_attention(q, k, v, 0.3, mask), rtol=1e-5, atol=1e-5)


def test_no_key_anywhere_gives_zeros_not_nan():
    q = torch.randn(2, 2, 8)
    parts = [partial_attention(q, torch.empty(0, 2, 8), torch.empty(0, 2, 8), 0.3) for _ in range(3)]
    merged = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert torch.equal(merged, torch.zeros_like(merged))


def test_bf16_partials_merge_in_float():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 4, 16, generator=g).to(torch.bfloat16)
    k = torch.randn(20, 4, 16, generator=g).to(torch.bfloat16)
    v = torch.randn(20, 4, 16, generator=g).to(torch.bfloat16)
    mask = torch.ones(3, 20, dtype=torch.bool)
    parts = [partial_attention(q, k[idx], v[idx], 0.25, mask[:, idx]) for idx in _shards(20, "round_robin", 2)]
    merged = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert merged.dtype == torch.bfloat16
    torch.testing.assert_close(merged.double(), _full_attention(q, k, v, 0.25, mask), rtol=2e-2, atol=2e-2)
