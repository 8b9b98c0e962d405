"""How much GPU memory the KV cache may take: measured, not estimated.

A worker runs one profiling step at the largest size the scheduler allows
(max_num_batched_tokens tokens through the model, then max_num_seqs rows
through the logits and the sampler) and reads the allocator's peak. The KV
cache gets what is left of `total * gpu_memory_utilization` after the weights,
the CUDA context (everything this rank holds) and that peak.

The memory source is an object rather than torch.cuda itself so that the
arithmetic can be tested on a machine without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from raylm.distributed.parallel_state import get_pp_group
from raylm.model.forward_context import AttentionMetadata, PrefillSeq, set_forward_context
from raylm.model.layers.gpu_attention import full_length_prefill_geometry
from raylm.sampling_params import SamplingParams
from raylm.worker.sampling_metadata import SamplingRow, build_sampling_metadata

logger = logging.getLogger(__name__)


class DeviceMemory(Protocol):
    """The few allocator readings the profile needs (torch.cuda's names)."""

    def memory_allocated(self) -> int: ...
    def max_memory_allocated(self) -> int: ...
    def reset_peak_memory_stats(self) -> None: ...
    def synchronize(self) -> None: ...
    def empty_cache(self) -> None: ...


class CudaMemory:
    """DeviceMemory of one CUDA device."""

    def __init__(self, device: torch.device):
        self.device = device

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


def measure_peak_activation_bytes(run_step: Callable[[], None], memory: DeviceMemory) -> int:
    """Bytes allocated at the peak of `run_step` beyond what was allocated before it."""
    memory.synchronize()
    memory.empty_cache()
    memory.reset_peak_memory_stats()
    before = memory.memory_allocated()
    run_step()
    memory.synchronize()
    peak = memory.max_memory_allocated()
    # Hand the step's cached blocks back, so that the free memory read after
    # this counts only what stays (weights, context), not the peak twice.
    memory.empty_cache()
    return max(peak - before, 0)


def kv_cache_budget_bytes(total: int, utilization: float, held_by_rank: int, peak_activation: int) -> int:
    """What the KV cache may take: the rank's share of the device (total *
    utilization) less what it holds already (weights, CUDA context) and the
    activation peak of its largest step; never negative."""
    return max(int(total * utilization) - held_by_rank - peak_activation, 0)


@contextmanager
def largest_prefill_attention(model_runner, num_tokens: int, max_model_len: int) -> Iterator[AttentionMetadata]:
    """The attention of the largest prefill step, for `run_profiling_step`:
    `num_tokens` tokens as fresh sequences of `max_model_len` tokens (the last
    one shorter), over scratch paged caches bound to the attention layers for
    the duration (their own caches, if any, are put back after).

    Without it the profiling step runs each layer's attention as one plain
    causal sequence, which on a GPU takes a fused kernel with no score
    matrix; the paged path a real step takes builds masks of
    sequences x query length x context length, and a KV cache sized without
    them overran gpu_memory_utilization (by 70 MB on a 40 GiB share, in the
    first run of tests/gpu on an H200). This step is the largest SDPA
    prefill call the layers allow (gpu_attention.prefill_budget): a real
    step's calls are cut to fit it. The scratch caches are allocated before
    the caller measures, so they are not counted as activations."""
    block_size = model_runner.block_size
    _, seq_len = full_length_prefill_geometry(num_tokens, max_model_len)
    blocks_per_seq = -(-seq_len // block_size)
    # Each sequence starts on a block of its own, as a scheduled one does.
    starts = range(0, num_tokens, seq_len)
    slot_mapping = torch.cat(
        [
            torch.arange(min(seq_len, num_tokens - start)) + i * blocks_per_seq * block_size
            for i, start in enumerate(starts)
        ]
    ).to(model_runner.device)
    prefills = [PrefillSeq(start, min(start + seq_len, num_tokens)) for start in starts]
    layers = model_runner.attention_layers()
    own = [layer.kv_cache for layer in layers]
    dtype = model_runner.config.model_config.dtype
    try:
        for layer in layers:
            layer.kv_cache = torch.empty(
                (2, len(prefills) * blocks_per_seq, block_size, layer.num_kv_heads, layer.head_dim),
                dtype=dtype,
                device=model_runner.device,
            )
        yield AttentionMetadata(slot_mapping=slot_mapping, prefills=prefills)
    finally:
        for layer, cache in zip(layers, own):
            layer.kv_cache = cache


@torch.inference_mode()
def run_profiling_step(
    model_runner, num_tokens: int, num_seqs: int, max_model_len: int, attention: AttentionMetadata | None = None
) -> None:
    """The largest step this rank can be given, on dummy inputs: `num_tokens`
    tokens through its layers, and on the last PP stage the logits of
    `num_seqs` rows through the sampler with top-k/top-p, its most
    memory-hungry settings (it sorts the vocabulary). `attention`: the
    step's layout (`largest_prefill_attention`); None runs each layer's
    attention as one causal sequence, without a KV cache."""
    device = model_runner.device
    model = model_runner.model
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    # Positions must stay inside the rotary table; their values do not matter here.
    positions = torch.arange(num_tokens, device=device) % max_model_len
    pp = get_pp_group()
    intermediate = None if pp.is_first_rank else model_runner.make_empty_intermediate(num_tokens)
    with set_forward_context(attention):
        hidden = model(input_ids, positions, intermediate)
    if not pp.is_last_rank:
        return
    num_rows = min(num_seqs, num_tokens)
    logits = model.compute_logits(hidden[:num_rows]).float()
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=0)
    rows = [SamplingRow(params, [0], []) for _ in range(num_rows)]
    metadata = build_sampling_metadata(rows, model_runner.vocab_size, device)
    model_runner.sampler(logits, metadata)
