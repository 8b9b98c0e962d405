"""Turn one SchedulerOutput into flat model inputs and attention metadata.

Tokens of all scheduled requests are laid flat (no padding): decode requests
(one new token each) first, so attention can batch them, then prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from raylm.lora.request import LoRARequest
from raylm.model.forward_context import AttentionMetadata, PrefillSeq
from raylm.sampling_params import SamplingParams
from raylm.worker.cp_input import CPRows, build_cp_step


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
    lora_request: LoRARequest | None = None

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
    # Under context parallelism with a split chunk: which rows this rank
    # computes (input_ids and positions hold only those; the row numbers
    # above stay those of the whole flat layout). None: every row here.
    cp_rows: CPRows | None = None


def _slots(block_ids: list[int], positions: np.ndarray, block_size: int) -> np.ndarray:
    table = np.asarray(block_ids, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size


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

    if 0 < num_decodes == len(order) and cp_size == 1:
        # A step of decodes only (most steps): the same tensors straight from
        # the Python lists, without the numpy round trips prefills need.
        _finish_decode_batch(
            batch, input_ids, decode_positions, decode_slots, decode_ctx_lens, decode_tables, block_size, device
        )
        return batch

    # Decodes come first in the flat order.
    positions.insert(0, np.asarray(decode_positions, dtype=np.int64))
    slot_mapping.insert(0, np.asarray(decode_slots, dtype=np.int64))
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(np.concatenate(slot_mapping)).to(device),
        num_decode_tokens=num_decodes,
        prefills=prefills,
    )
    if num_decodes:
        _set_decode_tensors(meta, decode_ctx_lens, decode_tables, block_size, device)

    batch.input_ids = torch.tensor(input_ids, dtype=torch.int64, device=device)
    batch.positions = torch.from_numpy(np.concatenate(positions)).to(device)
    batch.attn_metadata = meta
    if cp_size > 1:
        meta.context_parallel, batch.cp_rows = build_cp_step(
            states, order, num_scheduled_tokens, block_size, cp_rank, cp_size, device
        )
        if batch.cp_rows is not None:
            local = torch.from_numpy(batch.cp_rows.local_rows).to(device)
            batch.input_ids, batch.positions = batch.input_ids[local], batch.positions[local]
    return batch


def _int64_tensor(values, device: torch.device) -> torch.Tensor:
    # np.asarray + torch.from_numpy costs a third of torch.tensor's time on small lists.
    return _on(torch.from_numpy(np.asarray(values, dtype=np.int64)), device)


def _on(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    # A CPU step skips .to(): even a no-op costs a dispatch, several per step.
    return t if getattr(device, "type", device) == "cpu" else t.to(device)


def padded_block_table(tables: list[list[int]], num_blocks: int) -> list[list[int]]:
    """Each request's first `num_blocks` block ids, a shorter table padded
    with its first block: any real block will do, attention reads no slot past
    the request's context."""
    return [blocks[:num_blocks] + [blocks[0]] * (num_blocks - len(blocks)) for blocks in tables]


def _set_decode_tensors(
    meta: AttentionMetadata, ctx_lens: list[int], tables: list[list[int]], block_size: int, device: torch.device
) -> None:
    """The decodes' block table, key mask and context lengths."""
    max_blocks = -(-max(ctx_lens) // block_size)
    table = padded_block_table(tables, max_blocks)
    ctx = np.asarray(ctx_lens, dtype=np.int64)
    valid = np.arange(max_blocks * block_size)[None, :] < ctx[:, None]
    meta.decode_block_table = _int64_tensor(table, device)
    meta.decode_mask = _on(torch.from_numpy(valid), device)[:, None, None, :]
    meta.decode_context_lens = _on(torch.from_numpy(ctx), device)


def _finish_decode_batch(
    batch: PreparedBatch,
    input_ids: list[int],
    positions: list[int],
    slots: list[int],
    ctx_lens: list[int],
    tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> None:
    """prepare_batch's tensors for a step whose every token is a decode: equal
    to the general path's (same values, dtypes and shapes), without its
    per-request arrays and concatenations."""
    meta = AttentionMetadata(slot_mapping=_int64_tensor(slots, device), num_decode_tokens=len(slots), prefills=[])
    _set_decode_tensors(meta, ctx_lens, tables, block_size, device)
    batch.input_ids = _int64_tensor(input_ids, device)
    batch.positions = _int64_tensor(positions, device)
    batch.attn_metadata = meta
