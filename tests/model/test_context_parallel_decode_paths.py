"""CP decode's two paths (issue 26): a rank's partial attention over its
blocks of each sequence by the C++ kernel (CPU) and by torch (what CUDA runs,
and CPU without the kernels), from the same metadata the worker builds
(raylm.worker.cp_input). Both give float32 partials that agree, and merged
over the ranks they equal attention over the whole sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raylm.model.layers.attention import Attention
from raylm.model.layers.attention_merge import merge_partials
from raylm.model.layers.cpu_kernels import DISABLE_ENV, get_cpu_kernels
from raylm.sampling_params import SamplingParams
from raylm.worker.input_batch import CachedRequestState, prepare_batch

BLOCK = 16
CP = 2
LENGTHS = [1, 16, 17, 40, 55, 64]  # 1: one rank holds none of it; 17, 40, 55: a partly filled last block


def _step(num_blocks: int, gen: torch.Generator):
    """Decode states of LENGTHS with random distinct block ids (id g on rank g % CP)."""
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    states, taken = {}, 0
    for i, n in enumerate(LENGTHS):
        blocks = ids[taken : taken + -(-n // BLOCK)]
        taken += len(blocks)
        states[f"r{i}"] = CachedRequestState(
            f"r{i}", list(range(n)), list(range(n)), SamplingParams(), blocks, num_computed_tokens=n - 1
        )
    return states


def _rank_partials(attn: Attention, q: torch.Tensor, cache: torch.Tensor, states, rank: int):
    attn.kv_cache = cache
    cp = prepare_batch(
        states, {rid: 1 for rid in states}, BLOCK, "cpu", cp_rank=rank, cp_size=CP
    ).attn_metadata.context_parallel
    assert cp.num_decodes == len(LENGTHS)
    k_flat, v_flat = (cache[i].view(-1, attn.num_kv_heads, attn.head_dim) for i in (0, 1))
    return attn._cp_decode_partials(q, k_flat, v_flat, cp)


def _whole_sequence_attention(q, caches, states, scale):
    """float64 attention of each decode query over its sequence's keys, read from the rank owning each block."""
    rows = []
    for i, state in enumerate(states.values()):
        n = len(state.prompt_token_ids)
        keys = []
        for p in range(n):
            g = state.block_ids[p // BLOCK]
            keys.append(caches[g % CP][:, g // CP, p % BLOCK])  # [2, KVH, D]
        kv = torch.stack(keys, dim=1).double()  # [2, n, KVH, D]
        group = q.shape[1] // kv.shape[2]
        k, v = (kv[j].repeat_interleave(group, dim=1).transpose(0, 1) for j in (0, 1))
        rows.append(F.scaled_dot_product_attention(q[i].double().unsqueeze(1), k, v, scale=scale).squeeze(1))
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (8, 2, 64)])
def test_torch_path_equals_the_kernel_and_merges_to_whole_attention(dtype, heads, kv_heads, head_dim, monkeypatch):
    if get_cpu_kernels() is None:
        pytest.skip("the CPU kernels are not built here")
    gen = torch.Generator().manual_seed(head_dim)
    blocks_per_rank = 8
    states = _step(CP * blocks_per_rank, gen)
    caches = [torch.randn(2, blocks_per_rank, BLOCK, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(CP)]
    q = torch.randn(len(LENGTHS), heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    attn = Attention(heads, kv_heads, head_dim, scale)
    by_path = {}
    for path in ("kernel", "torch"):
        if path == "torch":
            monkeypatch.setenv(DISABLE_ENV, "1")
        by_path[path] = [_rank_partials(attn, q, caches[rank], states, rank) for rank in range(CP)]
    for (k_out, k_lse), (t_out, t_lse) in zip(by_path["kernel"], by_path["torch"]):
        assert k_out.dtype == t_out.dtype == torch.float32 and k_lse.dtype == t_lse.dtype == torch.float32
        torch.testing.assert_close(t_out, k_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(t_lse, k_lse, rtol=1e-5, atol=1e-4)
    # The one-token sequence has no key on the rank its one block is not on: out 0, lse -inf on both paths.
    empty = 1 - states["r0"].block_ids[0] % CP
    for path in by_path.values():
        assert torch.all(path[empty][0][0] == 0) and torch.all(torch.isinf(path[empty][1][0]))
    expected = _whole_sequence_attention(q, caches, states, scale)
    for path in by_path.values():
        merged = merge_partials(torch.stack([o for o, _ in path]), torch.stack([lse for _, lse in path]))
        torch.testing.assert_close(merged.double(), expected, rtol=1e-5, atol=1e-5)
