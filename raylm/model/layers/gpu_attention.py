"""Paged attention for GPUs, batched over sequences: FlashInfer where it is
installed and works, else torch SDPA on K/V gathered block by block.

The CPU path (attention.py) runs prefill sequences one by one; on a GPU a
Python loop per sequence per layer would leave the device idle between tiny
kernels. Here a step's sequences form two groups, each one batched call:

- decodes (one query each): the padded block table and mask the runner
  already builds;
- prefills (first chunks, later chunks, prefix-cache hits): queries padded to
  the longest chunk, every context read from the paged cache (this step's K/V
  were written there just before), with a causal mask offset by each
  sequence's context length.

The per-step description of these groups (`PagedLayout`) is built once, by the
first attention layer of a forward, and reused by the others.

Grouped-query attention is done without repeating K/V: the query heads that
share a KV head are stacked as extra query rows of that head, so SDPA sees
plain multi-head attention with KVH heads (and can pick its memory-efficient
masked kernel on CUDA, which `enable_gqa` would rule out).
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from raylm.model.forward_context import AttentionMetadata, PrefillSeq

logger = logging.getLogger(__name__)

# Set to 1 to keep the SDPA path even where FlashInfer imports (a GPU machine
# without the CUDA toolkit cannot JIT-compile FlashInfer's kernels).
DISABLE_FLASHINFER_ENV = "RAYLM_DISABLE_FLASHINFER"
_FLASHINFER_WORKSPACE_BYTES = 128 << 20


# ---- the per-step layout --------------------------------------------------------


@dataclass(frozen=True)
class PrefillBudget:
    """How large one batched SDPA prefill call may get. A call pads every
    sequence to the longest query and the longest context of its batch, so
    its masks and gathered K/V grow with sequences x query x context, not with
    the tokens of the step: prefills beside one long chunk (later chunks,
    prefix-cache hits) could make it many times the size of any one sequence.
    The calls of a step are therefore cut to at most `context_rows` gathered
    context rows (sequences x padded context) and `elements` mask rows x
    columns (sequences x padded queries x padded context). The KV-cache
    sizing profiles one call at exactly these limits (`prefill_budget`)."""

    context_rows: int
    elements: int

    def fits(self, num_seqs: int, max_query: int, padded_context: int) -> bool:
        """Whether one call of `num_seqs` sequences, padded to these sizes, is within the budget."""
        return num_seqs * padded_context <= self.context_rows and num_seqs * max_query * padded_context <= self.elements


def full_length_prefill_geometry(num_tokens: int, max_model_len: int) -> tuple[int, int]:
    """(sequences, tokens each) of the largest prefill step: `num_tokens` tokens
    as fresh sequences of max_model_len (the last one shorter)."""
    seq_len = max(1, min(num_tokens, max_model_len))
    return -(-num_tokens // seq_len), seq_len


def prefill_budget(num_tokens: int, max_model_len: int, block_size: int) -> PrefillBudget:
    """The budget of an engine whose steps hold at most `num_tokens` tokens:
    the size of the largest prefill step's single call, padded as the call
    pads it, which every lone sequence fits."""
    num_seqs, seq_len = full_length_prefill_geometry(num_tokens, max_model_len)
    context = -(-seq_len // block_size) * block_size
    return PrefillBudget(context_rows=num_seqs * context, elements=num_seqs * seq_len * context)


@dataclass
class PagedLayout:
    """A step's sequences as batched tensors (decodes first, then prefills)."""

    block_size: int
    num_decodes: int
    decode_block_table: torch.Tensor | None  # [B, max_blocks] int64
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] bool
    decode_context_lens: torch.Tensor | None  # [B] int64
    num_prefills: int = 0
    max_query_len: int = 0
    # Flat rows of q that make the padded [P, max_query_len] query batch (a
    # padding row repeats its sequence's last real row, so it stays finite).
    prefill_query_index: torch.Tensor | None = None
    # Position of each flat prefill token in the padded batch, flattened.
    prefill_unpad_index: torch.Tensor | None = None
    prefill_block_table: torch.Tensor | None = None  # [P, max_blocks] int64
    prefill_mask: torch.Tensor | None = None  # [P, 1, max_query_len, max_blocks * block_size] bool
    # Host-side sizes, for FlashInfer's plan (no device sync needed).
    prefill_query_lens: list[int] = field(default_factory=list)
    prefill_seq_lens: list[int] = field(default_factory=list)
    # The prefill mask repeated for `group` query heads per KV head, by group.
    _grouped_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    # FlashInfer plans for this step (built by the first layer that runs them).
    flashinfer_planned: bool = False
    # Where the prefills are over the budget: the SDPA calls they are cut
    # into, each a layout of its own and the flat rows of q it answers.
    sdpa_batches: list[tuple[PagedLayout, torch.Tensor]] | None = None

    def grouped_prefill_mask(self, group: int) -> torch.Tensor:
        mask = self._grouped_masks.get(group)
        if mask is None:
            p, _, q_len, k_len = self.prefill_mask.shape
            mask = self.prefill_mask.unsqueeze(2).expand(p, 1, group, q_len, k_len).reshape(p, 1, group * q_len, k_len)
            self._grouped_masks[group] = mask
        return mask


def build_paged_layout(meta: AttentionMetadata, block_size: int, budget: PrefillBudget | None = None) -> PagedLayout:
    """Batch the step's prefill sequences; the decode group comes ready-made.

    A sequence's context slots are `ctx_slots` when it has context before this
    chunk, else this chunk's own slots (it starts at position 0). Either way,
    every block_size-th slot starts a block, in position order.
    """
    layout = PagedLayout(
        block_size=block_size,
        num_decodes=meta.num_decode_tokens,
        decode_block_table=meta.decode_block_table,
        decode_mask=meta.decode_mask,
        decode_context_lens=meta.decode_context_lens,
    )
    prefills = meta.prefills
    if not prefills:
        return layout
    device = meta.slot_mapping.device
    slots = [p.ctx_slots if p.ctx_slots is not None else meta.slot_mapping[p.q_start : p.q_end] for p in prefills]
    q_starts = [p.q_start for p in prefills]
    q_lens = [p.q_end - p.q_start for p in prefills]
    seq_lens = [int(s.shape[0]) for s in slots]
    num_prefills, max_q = len(prefills), max(q_lens)

    # Block tables, padded with each sequence's first block: a real block
    # (finite values), hidden by the mask.
    blocks = [torch.div(s[::block_size], block_size, rounding_mode="floor") for s in slots]
    table = torch.nn.utils.rnn.pad_sequence(blocks, batch_first=True, padding_value=-1)
    table = torch.where(table < 0, table[:, :1], table)

    starts = torch.tensor(q_starts, dtype=torch.int64)
    lens = torch.tensor(q_lens, dtype=torch.int64)
    ctx_before = torch.tensor(seq_lens, dtype=torch.int64) - lens
    row = torch.minimum(torch.arange(max_q)[None, :], (lens - 1)[:, None])  # [P, max_q]
    query_index = starts[:, None] + row
    # Query `row` of a sequence sits at position ctx_before + row and sees keys 0..that.
    key_pos = torch.arange(table.shape[1] * block_size)
    mask = key_pos[None, None, :] <= (ctx_before[:, None] + row)[:, :, None]
    padded_start = torch.arange(num_prefills, dtype=torch.int64) * max_q
    unpad_index = torch.cat([torch.arange(n, dtype=torch.int64) + s for n, s in zip(q_lens, padded_start.tolist())])

    layout.num_prefills = num_prefills
    layout.max_query_len = max_q
    layout.prefill_query_index = query_index.reshape(-1).to(device, non_blocking=True)
    layout.prefill_unpad_index = unpad_index.to(device, non_blocking=True)
    layout.prefill_block_table = table
    layout.prefill_mask = mask[:, None].to(device, non_blocking=True)
    layout.prefill_query_lens = q_lens
    layout.prefill_seq_lens = seq_lens
    if budget is not None and not budget.fits(num_prefills, max_q, table.shape[1] * block_size):
        layout.sdpa_batches = [
            (
                build_paged_layout(AttentionMetadata(slot_mapping=meta.slot_mapping, prefills=batch), block_size),
                torch.cat([torch.arange(p.q_start, p.q_end) for p in batch]).to(device, non_blocking=True),
            )
            for batch in split_prefills(prefills, block_size, budget)
        ]
    return layout


def split_prefills(prefills: list[PrefillSeq], block_size: int, budget: PrefillBudget) -> list[list[PrefillSeq]]:
    """The prefills in batches within `budget` (a sequence alone always
    forms one), longest queries first so that a batch pads little."""

    def sizes(p: PrefillSeq) -> tuple[int, int]:
        context = p.ctx_slots.shape[0] if p.ctx_slots is not None else p.q_end - p.q_start
        return p.q_end - p.q_start, -(-int(context) // block_size) * block_size

    batches: list[list[PrefillSeq]] = []
    max_q = max_context = 0
    for p in sorted(prefills, key=sizes, reverse=True):
        q, context = sizes(p)
        if batches and budget.fits(len(batches[-1]) + 1, max(max_q, q), max(max_context, context)):
            batches[-1].append(p)
            max_q, max_context = max(max_q, q), max(max_context, context)
        else:
            batches.append([p])
            max_q, max_context = q, context
    return batches


# One layout per step: the first layer builds it, the next ones find it here.
_cached: tuple[weakref.ref, int, PrefillBudget | None, PagedLayout] | None = None


def paged_layout_for(meta: AttentionMetadata, block_size: int, budget: PrefillBudget | None = None) -> PagedLayout:
    global _cached
    if _cached is not None and _cached[0]() is meta and _cached[1:3] == (block_size, budget):
        return _cached[3]
    layout = build_paged_layout(meta, block_size, budget)
    _cached = (weakref.ref(meta), block_size, budget, layout)
    return layout


# ---- torch SDPA on gathered blocks ------------------------------------------------


def _gather_context(kv_cache: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every block in `table` [N, max_blocks] -> each [N, KVH, max_blocks*block_size, D]."""
    n = table.shape[0]
    _, _, block_size, kv_heads, head_dim = kv_cache.shape
    flat = table.reshape(-1)
    k = kv_cache[0].index_select(0, flat).view(n, -1, kv_heads, head_dim).transpose(1, 2)
    v = kv_cache[1].index_select(0, flat).view(n, -1, kv_heads, head_dim).transpose(1, 2)
    return k, v


def sdpa_decode(q: torch.Tensor, kv_cache: torch.Tensor, layout: PagedLayout, scale: float) -> torch.Tensor:
    """q [B, H, D] (one query per request) -> [B, H, D]."""
    b, num_heads, head_dim = q.shape
    kv_heads = kv_cache.shape[3]
    group = num_heads // kv_heads
    k, v = _gather_context(kv_cache, layout.decode_block_table)
    # Query heads of one KV head become `group` query rows of it.
    o = F.scaled_dot_product_attention(
        q.view(b, kv_heads, group, head_dim), k, v, attn_mask=layout.decode_mask, scale=scale
    )
    return o.reshape(b, num_heads, head_dim)


def sdpa_prefill(q: torch.Tensor, kv_cache: torch.Tensor, layout: PagedLayout, scale: float) -> torch.Tensor:
    """q [T, H, D], the whole flat batch -> [num_prefill_tokens, H, D] for the prefill rows."""
    _, num_heads, head_dim = q.shape
    kv_heads = kv_cache.shape[3]
    group = num_heads // kv_heads
    p, max_q = layout.num_prefills, layout.max_query_len
    qp = q.index_select(0, layout.prefill_query_index).view(p, max_q, kv_heads, group, head_dim)
    # [P, max_q, KVH, G, D] -> [P, KVH, G*max_q, D]: rows ordered (head in group, query).
    qp = qp.permute(0, 2, 3, 1, 4).reshape(p, kv_heads, group * max_q, head_dim)
    k, v = _gather_context(kv_cache, layout.prefill_block_table)
    o = F.scaled_dot_product_attention(qp, k, v, attn_mask=layout.grouped_prefill_mask(group), scale=scale)
    o = o.view(p, kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4).reshape(p * max_q, num_heads, head_dim)
    return o.index_select(0, layout.prefill_unpad_index)


def sdpa_paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, layout: PagedLayout, scale: float) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D]: decodes and prefills, one batched call each."""
    out = torch.empty_like(q)
    nd = layout.num_decodes
    if nd:
        out[:nd] = sdpa_decode(q[:nd], kv_cache, layout, scale)
    if layout.sdpa_batches is not None:
        for batch, rows in layout.sdpa_batches:
            out.index_copy_(0, rows, sdpa_prefill(q, kv_cache, batch, scale))
    elif layout.num_prefills:
        out[nd:] = sdpa_prefill(q, kv_cache, layout, scale)
    return out


# ---- FlashInfer --------------------------------------------------------------------


class FlashInferPagedAttention:
    """FlashInfer's paged decode and prefill kernels, planned once per step.

    The cache layout [2, num_blocks, block_size, KVH, D] is FlashInfer's "NHD"
    layout, passed as a (K, V) pair of views, so no copy is made.
    """

    def __init__(self, device: torch.device, num_heads: int, num_kv_heads: int):
        import flashinfer

        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(_FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device),
            "NHD",
            # Its CUDA-core decode kernels cover only small head groups.
            use_tensor_cores=num_heads // num_kv_heads > 4,
        )
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            torch.empty(_FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device), "NHD"
        )
        self._planned_for: weakref.ref | None = None

    @staticmethod
    def _csr(table: torch.Tensor, seq_lens: list[int], block_size: int):
        """(indptr, indices, last_page_len) of FlashInfer's page table, from a padded block table."""
        pages = [-(-n // block_size) for n in seq_lens]
        indptr = torch.zeros(len(pages) + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(torch.tensor(pages, dtype=torch.int32), 0)
        keep = torch.arange(table.shape[1])[None, :] < torch.tensor(pages)[:, None]
        indices = table.cpu()[keep].to(torch.int32)
        last = torch.tensor([n - (k - 1) * block_size for n, k in zip(seq_lens, pages)], dtype=torch.int32)
        return indptr, indices, last

    def _plan(self, layout: PagedLayout, num_heads, num_kv_heads, head_dim, scale, dtype, device) -> None:
        bs = layout.block_size
        if layout.num_decodes:
            ctx = layout.decode_context_lens.tolist()
            indptr, indices, last = self._csr(layout.decode_block_table, ctx, bs)
            self._decode.plan(
                indptr.to(device),
                indices.to(device),
                last.to(device),
                num_heads,
                num_kv_heads,
                head_dim,
                bs,
                q_data_type=dtype,
                kv_data_type=dtype,
                sm_scale=scale,
            )
        if layout.num_prefills:
            indptr, indices, last = self._csr(layout.prefill_block_table, layout.prefill_seq_lens, bs)
            qo_indptr = torch.zeros(layout.num_prefills + 1, dtype=torch.int32)
            qo_indptr[1:] = torch.cumsum(torch.tensor(layout.prefill_query_lens, dtype=torch.int32), 0)
            self._prefill.plan(
                qo_indptr.to(device),
                indptr.to(device),
                indices.to(device),
                last.to(device),
                num_heads,
                num_kv_heads,
                head_dim,
                bs,
                causal=True,
                sm_scale=scale,
                q_data_type=dtype,
                kv_data_type=dtype,
            )

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, layout: PagedLayout, scale: float) -> torch.Tensor:
        _, num_heads, head_dim = q.shape
        if self._planned_for is None or self._planned_for() is not layout:
            self._plan(layout, num_heads, kv_cache.shape[3], head_dim, scale, q.dtype, q.device)
            self._planned_for = weakref.ref(layout)
        paged = (kv_cache[0], kv_cache[1])
        out = torch.empty_like(q)
        nd = layout.num_decodes
        if nd:
            out[:nd] = self._decode.run(q[:nd].contiguous(), paged)
        if layout.num_prefills:
            out[nd:] = self._prefill.run(q[nd:].contiguous(), paged)
        return out


_flashinfer: FlashInferPagedAttention | None = None
_flashinfer_failed = os.environ.get(DISABLE_FLASHINFER_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _flashinfer_for(q: torch.Tensor, kv_cache: torch.Tensor) -> FlashInferPagedAttention | None:
    global _flashinfer, _flashinfer_failed
    if _flashinfer_failed or q.device.type != "cuda":
        return None
    if _flashinfer is None:
        try:
            _flashinfer = FlashInferPagedAttention(q.device, q.shape[1], kv_cache.shape[3])
        except Exception as e:  # not installed, or no kernels for this GPU/toolkit
            _flashinfer_failed = True
            logger.info("FlashInfer unavailable (%s: %s); paged attention uses torch SDPA", type(e).__name__, e)
            return None
    return _flashinfer


def active_backend_name() -> str:
    """What the GPU path runs now: 'flashinfer' or 'sdpa' (for logs and reports)."""
    return "flashinfer" if _flashinfer is not None and not _flashinfer_failed else "sdpa"


def batched_paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    budget: PrefillBudget | None = None,
) -> torch.Tensor:
    """q [T, H, D] (the step's flat batch; its K/V already in `kv_cache`) -> [T, H, D].
    `budget`: how large one SDPA prefill call may get (None: no limit)."""
    global _flashinfer_failed
    layout = paged_layout_for(meta, kv_cache.shape[2], budget)
    flashinfer = _flashinfer_for(q, kv_cache)
    if flashinfer is not None:
        try:
            return flashinfer(q, kv_cache, layout, scale)
        except Exception as e:  # a kernel that fails to compile or launch: keep serving
            _flashinfer_failed = True
            logger.warning("FlashInfer failed (%s: %s); switching to torch SDPA", type(e).__name__, e)
    return sdpa_paged_attention(q, kv_cache, layout, scale)
