"""Paged attention with torch's scaled_dot_product_attention (CPU and CUDA).

The KV cache of one layer is a tensor [2, num_blocks, block_size, num_kv_heads,
head_dim]; viewed flat, a token lives at slot = block_id * block_size + offset.
Decode queries are batched: on CPU a C++ kernel reads each request's context
from its blocks (cpu_kernels.py); otherwise their contexts are gathered block by
block and padded, with a mask (the runner zeroes fresh blocks for these paths so
the padding is finite). Prefill sequences run one by one, so no query attends
past its own position and no padding is spent on long prompts; a chunk after
earlier context attends over that context and over its own keys causally
(`attention_after_context`).
On CUDA, gpu_attention.py's path batched over sequences runs instead.

Under context parallelism (CP) each rank of a CP group stores only its share
of every sequence's K/V (the blocks whose id the worker maps to it, see
raylm.worker.cp_input). A long prefill chunk is split over the group: each
rank computes its share of the tokens, the group all-gathers the K/V its
queries need once per layer, and each rank attends its own queries locally
(raylm.model.layers.cp_prefill). Decode tokens and short chunks run on every
rank: a query attends over the rank's shard (decode tokens on CPU with the C++
kernel's `paged_decode_partial`; on CUDA, or without the kernels, torch's
`partial_decode_attention`; chunks `partial_attention`), and the
group all-gathers (output, log-sum-exp) and merges them exactly
(`merge_partials`), so every rank continues with the same hidden states.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raylm.distributed.parallel_state import get_cp_group
from raylm.model.forward_context import AttentionMetadata, get_attention_metadata
from raylm.model.layers.attention_merge import (
    ContextParallelMetadata,
    attention_after_context,
    merge_partials,
    partial_attention,
    partial_decode_attention,
    sequence_attention,
)
from raylm.model.layers.cp_prefill import exchange_split_kv
from raylm.model.layers.cpu_kernels import get_cpu_kernels, get_paged_decode_kernel
from raylm.model.layers.gpu_attention import PrefillBudget, batched_paged_attention

# Query/cache dtypes the CPU decode kernel is built for.
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Bound by the model runner once the cache is allocated.
        self.kv_cache: torch.Tensor | None = None
        # Paged path: True = batched over sequences (gpu_attention.py), False =
        # this file's per-sequence path; None = by device (batched on CUDA).
        # Tests set True on CPU to prove the GPU path against this one.
        self.batched_paged: bool | None = None
        # How large one call of the batched path's SDPA prefill may get (set
        # by the model runner from the scheduler's limits; None: no limit).
        self.prefill_budget: PrefillBudget | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, num_heads*head_dim], k/v: [T, num_kv_heads*head_dim] -> [T, num_heads*head_dim]."""
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        meta = get_attention_metadata()
        if meta is None:
            # No engine around (e.g. a plain forward in a test): one causal sequence.
            return sequence_attention(q, k, v, self.scale).reshape(num_tokens, -1)

        if meta.context_parallel is not None:
            return self._forward_context_parallel(q, k, v, meta, meta.context_parallel).reshape(num_tokens, -1)

        k_flat = v_flat = None
        if self.kv_cache is not None:
            k_flat = self.kv_cache[0].view(-1, self.num_kv_heads, self.head_dim)
            v_flat = self.kv_cache[1].view(-1, self.num_kv_heads, self.head_dim)
            k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
            v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))

        if k_flat is not None and (self.kv_cache.is_cuda if self.batched_paged is None else self.batched_paged):
            return batched_paged_attention(q, self.kv_cache, meta, self.scale, self.prefill_budget).reshape(
                num_tokens, -1
            )

        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self._decode(q[:nd], meta)
        for seq in meta.prefills:
            qs = q[seq.q_start : seq.q_end]
            if seq.ctx_slots is None:
                out[seq.q_start : seq.q_end] = sequence_attention(
                    qs, k[seq.q_start : seq.q_end], v[seq.q_start : seq.q_end], self.scale
                )
            else:
                out[seq.q_start : seq.q_end] = attention_after_context(
                    qs, k_flat[seq.ctx_slots], v_flat[seq.ctx_slots], seq.num_context, self.scale
                )
        return out.reshape(num_tokens, -1)

    def _forward_context_parallel(self, q, k, v, meta: AttentionMetadata, cp: ContextParallelMetadata):
        k_flat = self.kv_cache[0].view(-1, self.num_kv_heads, self.head_dim)
        v_flat = self.kv_cache[1].view(-1, self.num_kv_heads, self.head_dim)
        k_flat.index_copy_(0, cp.store_slots, k.index_select(0, cp.store_rows).to(k_flat.dtype))
        v_flat.index_copy_(0, cp.store_slots, v.index_select(0, cp.store_rows).to(v_flat.dtype))
        out = torch.empty_like(q)
        if cp.split is not None:
            # Split chunks: one exchange of K/V per layer, then each rank's
            # own queries attend locally over their sequence's keys.
            gathered = exchange_split_kv(k, v, k_flat, v_flat, cp.split, get_cp_group())
            for seq in cp.split.sequences:
                keys = gathered.index_select(0, seq.key_index)  # [end, 2, KVH, D], position order
                for piece in seq.pieces:
                    out[piece.q_start : piece.q_end] = attention_after_context(
                        q[piece.q_start : piece.q_end],
                        keys[: piece.num_keys, 0],
                        keys[: piece.num_keys, 1],
                        piece.num_keys - (piece.q_end - piece.q_start),
                        self.scale,
                    )
        for start, end in cp.local_prefills:
            # A short whole prompt: every rank computed all its keys, so plain
            # causal attention is exact here without the group.
            out[start:end] = sequence_attention(q[start:end], k[start:end], v[start:end], self.scale)
        if not cp.sharded and not cp.num_decodes:
            return out
        # Every rank has the same sharded rows in the same order (the step is
        # the same on all of them), so one all-gather carries them all: the
        # partial output and its log-sum-exp side by side, float32. Decode
        # rows first (rows 0..num_decodes of the batch), then the chunks.
        # Partials and merge stay float32 and the merged rows are rounded to
        # q's dtype once: a bf16 rounding per partial made CP=2 drift from CP=1.
        num_rows = cp.num_decodes + sum(s.q_end - s.q_start for s in cp.sharded)
        parts = torch.empty(num_rows, self.num_heads, self.head_dim + 1, dtype=torch.float32, device=q.device)
        row = cp.num_decodes
        if cp.num_decodes:
            b = cp.num_decodes
            o, lse = self._cp_decode_partials(q[:b], k_flat, v_flat, cp)
            parts[:b, :, : self.head_dim] = o
            parts[:b, :, self.head_dim] = lse
        for s in cp.sharded:
            n = s.q_end - s.q_start
            o, lse = partial_attention(
                q[s.q_start : s.q_end],
                k_flat.index_select(0, s.key_slots),
                v_flat.index_select(0, s.key_slots),
                self.scale,
                s.mask,
            )
            parts[row : row + n, :, : self.head_dim] = o
            parts[row : row + n, :, self.head_dim] = lse
            row += n
        gathered = get_cp_group().all_gather(parts.unsqueeze(0), dim=0)  # [cp, rows, H, D + 1]
        merged = merge_partials(gathered[..., : self.head_dim], gathered[..., self.head_dim])
        out[: cp.num_decodes] = merged[: cp.num_decodes].to(q.dtype)
        row = cp.num_decodes
        for s in cp.sharded:
            n = s.q_end - s.q_start
            out[s.q_start : s.q_end] = merged[row : row + n].to(q.dtype)
            row += n
        return out

    def _cp_decode_partials(self, q, k_flat, v_flat, cp: ContextParallelMetadata):
        """(out [B, H, D], lse [B, H]), both float32, of the decode queries over this
        CP rank's blocks of their sequences."""
        kernels = get_cpu_kernels() if self._kernel_serves(q.dtype) else None
        if kernels is not None:
            # On CPU the C++ kernel walks the rank's blocks as it walks a whole
            # sequence's, returning each head's log-sum-exp beside its output.
            return kernels.paged_decode_partial(
                q, self.kv_cache, cp.decode_block_table, cp.decode_context_lens, self.scale
            )
        # Torch: gather each row's slots, padded. A padding slot repeats the
        # row's first (written, so finite) key: a zero weight times a
        # never-written slot's NaN bits would be NaN.
        table, lens = cp.decode_block_table, cp.decode_context_lens
        block_size = self.kv_cache.shape[2]
        slots = (table.unsqueeze(-1) * block_size + torch.arange(block_size, device=q.device)).flatten(1)
        mask = torch.arange(slots.shape[1], device=q.device) < lens.unsqueeze(1)
        slots = torch.where(mask, slots, slots[:, :1])
        flat, shape = slots.view(-1), (*slots.shape, self.num_kv_heads, self.head_dim)
        # (index_select: several times faster than advanced indexing on CPU.)
        return partial_decode_attention(
            q, k_flat.index_select(0, flat).view(shape), v_flat.index_select(0, flat).view(shape), self.scale, mask
        )

    def _kernel_serves(self, dtype: torch.dtype) -> bool:
        """Whether the C++ decode kernels (CPU), if built, serve this layer's decode queries of `dtype`."""
        return not (
            self.kv_cache is None
            or self.kv_cache.device.type != "cpu"
            or self.batched_paged
            or dtype not in _KERNEL_DTYPES
            or self.head_dim % 8 != 0
            or self.head_dim > 256
        )

    def _decode_kernel(self, dtype: torch.dtype):
        """The C++ decode kernel when it serves this layer's (whole-sequence) decode, else None."""
        if get_cp_group().world_size > 1 or not self._kernel_serves(dtype):
            return None  # under CP a rank holds a shard: _cp_decode_partials
        return get_paged_decode_kernel()

    def reads_unwritten_slots(self) -> bool:
        """Whether decode reads whole cache blocks, past each context's end.

        The padded paths do (masked); a never-written slot may hold NaN bits,
        and NaN survives a zero attention weight, so the runner zeroes fresh
        blocks for them. The CPU kernel stops at each context's end: no need.
        """
        if get_cp_group().world_size > 1:
            return False  # the CP path reads exactly the slots its keys were written to
        return self.kv_cache is None or self._decode_kernel(self.kv_cache.dtype) is None

    def _decode(self, q, meta: AttentionMetadata) -> torch.Tensor:
        # On CPU a C++ kernel walks each request's blocks up to its context
        # length: no padded gather, no mask (csrc/paged_decode_attention.cpp).
        kernel = self._decode_kernel(q.dtype) if meta.decode_context_lens is not None else None
        if kernel is not None:
            return kernel(q, self.kv_cache, meta.decode_block_table, meta.decode_context_lens, self.scale)
        # Gather whole blocks (contiguous runs of block_size tokens) rather than
        # single slots: far fewer, larger copies. q: [B, H, D] -> [B, H, 1, D];
        # context [B, blocks, block_size, KVH, D] -> [B, KVH, L, D].
        # (index_select is several times faster than advanced indexing on CPU.)
        table = meta.decode_block_table
        b = table.shape[0]
        flat = table.view(-1)
        k = self.kv_cache[0].index_select(0, flat).view(b, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.kv_cache[1].index_select(0, flat).view(b, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            k.to(q.dtype),
            v.to(q.dtype),
            attn_mask=meta.decode_mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return o.squeeze(2)
