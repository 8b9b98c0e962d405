"""Attention over key shards merged by log-sum-exp (attention_merge.py, the math
of context parallelism) against one attention over all keys (float64 SDPA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raylm.model.layers.attention_merge import attention_after_context, merge_partials, partial_attention


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


def _rounded_merge_error(partials, reference, dtype) -> float:
    """What the merge missed by when each partial was rounded to the model's `dtype` first (the old way)."""
    outs = torch.stack([o.to(dtype) for o, _ in partials])
    merged = merge_partials(outs, torch.stack([lse for _, lse in partials]))
    return float((merged.double() - reference).abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_partials_stay_float32_and_merge_to_the_float_reference(dtype):
    """bf16/fp16 queries and keys (a CP rank of a bf16 model): the shards'
    partial outputs are float32 and so is their merge, equal to the attention
    over all keys computed in float64 from the same inputs to float32
    precision. Rounding each partial to the model's dtype before the merge
    (what CP once did) misses by far more: the test fails on that code."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 4, 16, generator=g).to(dtype)
    k = torch.randn(40, 4, 16, generator=g).to(dtype)
    v = torch.randn(40, 4, 16, generator=g).to(dtype)
    mask = torch.ones(3, 40, dtype=torch.bool)
    parts = [partial_attention(q, k[idx], v[idx], 0.25, mask[:, idx]) for idx in _shards(40, "round_robin", 2)]
    assert all(o.dtype == torch.float32 and lse.dtype == torch.float32 for o, lse in parts)
    merged = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert merged.dtype == torch.float32
    reference = _full_attention(q, k, v, 0.25, mask)
    torch.testing.assert_close(merged.double(), reference, rtol=1e-5, atol=1e-5)
    assert _rounded_merge_error(parts, reference, dtype) > 1e-4


# ---- the C++ decode kernel's partials (CP decode on CPU) -------------------------------


def _paged_decode_partial():
    from raylm.model.layers.cpu_kernels import get_cpu_kernels

    module = get_cpu_kernels()
    if module is None:
        pytest.skip("the CPU kernels are not built here")
    return module.paged_decode_partial


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (8, 2, 64), (4, 4, 32)])
def test_kernel_partials_merged_over_rank_shards_equal_attention_over_all_keys(dtype, heads, kv_heads, head_dim):
    """Decode queries whose sequences' blocks alternate between two CP ranks
    (block j on rank j % 2, as the pool hands them out): the kernel's
    (out, lse) over each rank's blocks equals partial_attention's (the torch
    path) and the merge equals attention over the whole sequence. Sequences
    of one block leave rank 1 empty (out 0, lse -inf), a partly filled last
    block sits on either rank."""
    kernel = _paged_decode_partial()
    g = torch.Generator().manual_seed(heads * head_dim)
    block_size, num_blocks = 16, 24
    lengths = [1, 16, 17, 40, 55, 64]
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(len(lengths), heads, head_dim, generator=g).to(dtype)
    tables = [torch.randperm(num_blocks, generator=g)[: -(-n // block_size)] for n in lengths]
    k_flat, v_flat = (cache[i].view(-1, kv_heads, head_dim) for i in (0, 1))
    scale = head_dim**-0.5
    partials = []
    for rank in (0, 1):
        shard = [t[rank::2] for t in tables]
        lens = [
            int(sum(min(block_size, n - j * block_size) for j in range(rank, len(t), 2)))
            for n, t in zip(lengths, tables)
        ]
        table = torch.zeros(len(lengths), max(len(s) for s in shard), dtype=torch.int64)
        for i, s in enumerate(shard):
            table[i, : len(s)] = s
        out, lse = kernel(q, cache, table, torch.tensor(lens), scale)
        # float32 whatever the dtype: a partial is merged before it is rounded.
        assert out.dtype == torch.float32 and lse.dtype == torch.float32
        for i, n in enumerate(lens):
            slots = (shard[i][:, None] * block_size + torch.arange(block_size)).flatten()[:n]
            ref_out, ref_lse = partial_attention(q[i : i + 1], k_flat[slots], v_flat[slots], scale)
            torch.testing.assert_close(out[i : i + 1], ref_out, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse[i : i + 1], ref_lse, rtol=1e-5, atol=1e-4)
        partials.append((out, lse))
    assert torch.all(partials[1][0][0] == 0) and torch.all(torch.isinf(partials[1][1][0]))  # the 1-token row
    merged = merge_partials(torch.stack([o for o, _ in partials]), torch.stack([lse for _, lse in partials]))
    expected = torch.cat(
        [
            _full_attention(q[i : i + 1], k_flat[slots], v_flat[slots], scale, torch.ones(1, n, dtype=torch.bool))
            for i, n in enumerate(lengths)
            for slots in [(tables[i][:, None] * block_size + torch.arange(block_size)).flatten()[:n]]
        ]
    )
    torch.testing.assert_close(merged.double(), expected, rtol=1e-5, atol=1e-5)
    if dtype != torch.float32:
        assert _rounded_merge_error(partials, expected, dtype) > 1e-4


def test_kernel_refuses_an_empty_context_outside_a_shard():
    """paged_decode (a whole sequence) still requires a context; only the partial allows none."""
    kernel = _paged_decode_partial()
    from raylm.model.layers.cpu_kernels import get_paged_decode_kernel

    cache, q = torch.randn(2, 2, 16, 2, 8), torch.randn(1, 2, 8)
    table, empty = torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="context length 0 out of range"):
        get_paged_decode_kernel()(q, cache, table, empty, 0.3)
    out, lse = kernel(q, cache, table, empty, 0.3)
    assert torch.all(out == 0) and torch.all(torch.isinf(lse) & (lse < 0))
    with pytest.raises(RuntimeError, match="block id 5 out of range"):
        kernel(q, cache, torch.full((1, 1), 5), torch.ones(1, dtype=torch.int64), 0.3)


@pytest.mark.parametrize("num_context", [0, 1, 45, 300])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_attention_after_context_is_causal_attention_over_context_and_chunk(num_context, heads, kv_heads, dtype, tol):
    """A chunk after earlier context (a later prefill chunk, a prefix-cache hit,
    a CP rank's piece of a split prompt): on CPU two attentions merged, the
    context unmasked and the chunk's own keys causal, equal one causal
    attention with the offset mask. The chunk is long enough (200 queries) for
    torch's flash kernel to skip blocks above the diagonal."""
    g = torch.Generator().manual_seed(num_context + heads)
    num_queries, head_dim = 200, 32
    total = num_context + num_queries
    q = torch.randn(num_queries, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    positions = torch.arange(num_context, total)
    mask = torch.arange(total)[None, :] <= positions[:, None]
    out = attention_after_context(q, k, v, num_context, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), _full_attention(q, k, v, scale, mask), rtol=tol, atol=tol)


def test_attention_after_context_refuses_a_key_count_that_does_not_add_up():
    q, k = torch.randn(3, 2, 8), torch.randn(10, 2, 8)
    with pytest.raises(ValueError, match="10 keys for 5 of context and 3 queries"):
        attention_after_context(q, k, k, 5, 0.3)
