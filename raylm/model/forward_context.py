"""Per-step attention metadata, reachable from every attention layer.

The model runner sets it around each forward so the model's forward signature
stays (input_ids, positions) like a plain Hugging Face model.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSeq:
    """One sequence whose step has more than one query token (or a first chunk).

    Queries are rows [q_start, q_end) of the flat batch. When the sequence has
    context before this chunk (prefix-cache hit or a later prefill chunk),
    `ctx_slots` lists the cache slots of the whole context (old + new tokens),
    the first `num_context` of them before the chunk; otherwise it is None and
    the fresh keys are used directly, plain causal.
    """

    q_start: int
    q_end: int
    ctx_slots: torch.Tensor | None = None
    num_context: int = 0  # tokens before this chunk


@dataclass
class AttentionMetadata:
    """Where each new token's K/V goes and what each query attends to.

    The flat batch holds the decode tokens first (one query each, rows
    [0, num_decode_tokens)), then the prefill sequences.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, flat index into the paged cache
    num_decode_tokens: int = 0
    # Block table of the decode requests, padded: [num_decodes, max_blocks] int64.
    decode_block_table: torch.Tensor | None = None
    # [num_decodes, 1, 1, max_blocks * block_size] bool, True = attend.
    decode_mask: torch.Tensor | None = None
    # [num_decodes] int64: context length (tokens, including this step's) per request.
    decode_context_lens: torch.Tensor | None = None
    prefills: list[PrefillSeq] = field(default_factory=list)
    # Under context parallelism, this rank's share of the step
    # (raylm.model.layers.attention_merge.ContextParallelMetadata); None otherwise.
    context_parallel: object | None = None
    # LoRA adapters (raylm.lora.layers): [num_tokens, max_loras] bool, True
    # where a row runs with the adapter of that slot; None when no row of
    # the step has an adapter (the fused decode path runs only then).
    lora_mask: torch.Tensor | None = None
    # The same, per adapter the step uses: (slot, its rows; None: every row),
    # found once a step for all layers (raylm.lora.layers.lora_segments).
    lora_segments: list | None = None


_CURRENT: AttentionMetadata | None = None


@contextmanager
def set_forward_context(metadata: AttentionMetadata | None):
    global _CURRENT
    previous, _CURRENT = _CURRENT, metadata
    try:
        yield
    finally:
        _CURRENT = previous


def get_attention_metadata() -> AttentionMetadata | None:
    return _CURRENT
