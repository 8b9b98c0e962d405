"""One step of paged attention on random data, for the attention-path tests:
a cache with scattered blocks, the batch the runner would prepare, and the
forward of one Attention layer over it."""

from __future__ import annotations

import random

import torch

from raylm.model.forward_context import set_forward_context
from raylm.model.layers.attention import Attention
from raylm.sampling_params import SamplingParams as Params
from raylm.worker.input_batch import CachedRequestState, prepare_batch

BLOCK_SIZE = 16


def random_step(specs, num_kv_heads, head_dim, dtype, seed):
    """A paged cache with random contents and the batch of one step.

    specs: (tokens already computed, tokens scheduled now) per request; one
    scheduled token with context is a decode. Blocks of all requests are
    scattered over the cache, as after a while of serving.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(done + now) // BLOCK_SIZE) for done, now in specs]
    num_blocks = sum(need) + 5
    order = list(range(num_blocks))
    rng.shuffle(order)
    states, scheduled, used = {}, {}, 0
    for i, ((done, now), n) in enumerate(zip(specs, need)):
        rid = f"r{i}"
        tokens = [rng.randrange(100) for _ in range(done + now)]
        states[rid] = CachedRequestState(
            req_id=rid,
            prompt_token_ids=tokens,
            token_ids=list(tokens),
            sampling_params=Params(),
            block_ids=order[used : used + n],
            num_computed_tokens=done,
        )
        scheduled[rid] = now
        used += n
    batch = prepare_batch(states, scheduled, BLOCK_SIZE, torch.device("cpu"))
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype)
    return batch, cache, gen


def attend(batched: bool, batch, cache, q, k, v, num_heads, num_kv_heads, head_dim, prefill_budget=None):
    attn = Attention(num_heads, num_kv_heads, head_dim, scale=head_dim**-0.5)
    attn.kv_cache = cache.clone()  # forward writes this step's K/V into it
    attn.batched_paged = batched
    attn.prefill_budget = prefill_budget
    with set_forward_context(batch.attn_metadata):
        return attn(q, k, v), attn.kv_cache


CASES = {
    "fresh-prefills": [(0, 1), (0, 7), (0, 16), (0, 33), (0, 100)],
    "chunks-with-context": [(16, 16), (5, 40), (64, 3), (31, 17)],
    "decodes": [(1, 1), (15, 1), (16, 1), (47, 1), (200, 1)],
    "mixed": [(40, 1), (0, 50), (7, 1), (33, 20), (0, 2), (128, 1), (100, 64)],
    "one-prefill": [(0, 257)],
}
