"""A draft model beside the target (speculative decoding, method draft_model):
its weights and K/V on the same worker, its drafts written just before the
target verifies them.

Layout. The draft's K/V lives in its own paged cache with as many blocks as
the target's, addressed by the target's block tables and slot mapping: a
request's block i holds the target's K/V of those positions in the target's
cache and the draft's in the draft's. So the draft needs no allocator, no
table of its own and nothing from the core: whatever the scheduler allocates,
frees, shares through the prefix cache or preempts, it does so for both. Each
block costs the draft's bytes per block on top (ModelRunner sizes the pool
with the sum). Under tensor parallelism the draft is sharded like the target
(the same loader, the same TP group): every rank runs the draft's forwards,
its logits are gathered to every rank, and every rank takes the same argmax,
so all ranks verify the same draft.

The draft's K/V follows the target's positions. Each step the draft runs
over the step's scheduled tokens as the target does (prefill chunks, plain
decodes, and the last committed token of each request with a draft), and
after a decode burst over the burst's tokens. A request with a draft of k
places then takes k - 1 more one-token forwards (batched over the step's
drafting requests), each the argmax of the one before; they write the draft
tokens' K/V at positions the scheduler already allocated for the draft. The
target's verification commits the accepted prefix of the draft plus one
token: the draft's K/V of the accepted positions is right (the same tokens),
and that of rejected ones is overwritten by the next step's forwards before
anything reads it, as in the target's cache. The last draft token was never
an input of the draft: when the whole draft is accepted, the next step's
forward over the request starts one position earlier (`written`). A block the prefix cache
registers holds only committed tokens, whose draft K/V is written too.

K/V that came into the target's cache from elsewhere (the host tier, a
migration, a prefix pull) has no draft K/V beside it: the draft reads stale
rows there and drafts worse. Verification by sample-and-match keeps the
output exact for any draft, so this costs acceptance, never correctness.
"""

from __future__ import annotations

import torch

from raylm.config import EngineConfig
from raylm.model.forward_context import set_forward_context
from raylm.model.layers.attention import Attention
from raylm.model.loader import load_model, pack_weights
from raylm.worker.input_batch import CachedRequestState, prepare_batch


class DraftModel:
    def __init__(self, config: EngineConfig, device: torch.device, prefill_budget: int):
        self.block_size = config.cache_config.block_size
        self.device = device
        self.dtype = config.model_config.dtype
        self.model = load_model(config.speculative_config.model, self.dtype, device)
        self.model.eval()
        pack_weights(self.model)
        self.layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.layers:
            layer.prefill_budget = prefill_budget
        self.num_forwards = 0  # forwards run, for tests and profiles
        # req_id -> the draft's K/V is written below this position, for the
        # requests whose last step drafted (elsewhere it is num_computed_tokens).
        self.written: dict[str, int] = {}

    def forget(self, req_id: str) -> None:
        self.written.pop(req_id, None)

    def kv_cache_bytes_per_block(self) -> int:
        a = self.layers[0]
        dtype_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * a.num_kv_heads * a.head_dim * dtype_size * len(self.layers)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        for layer in self.layers:
            layer.kv_cache = torch.empty(
                (2, num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim),
                dtype=self.dtype,
                device=self.device,
            )

    def caches_read_unwritten(self) -> list[torch.Tensor]:
        """The caches whose fresh blocks must start at zero (see ModelRunner._zero_blocks)."""
        return [layer.kv_cache for layer in self.layers if layer.reads_unwritten_slots()]

    def release(self) -> None:
        for layer in self.layers:
            layer.kv_cache = None
        self.model = None

    def _forward(self, states: dict[str, CachedRequestState], num_scheduled: dict[str, int]):
        """A forward of the draft over `num_scheduled` tokens of each request
        from its num_computed_tokens: (batch, hidden)."""
        batch = prepare_batch(states, num_scheduled, self.block_size, self.device)
        with set_forward_context(batch.attn_metadata):
            hidden = self.model(batch.input_ids, batch.positions, None)
        self.num_forwards += 1
        return batch, hidden

    def _greedy(self, hidden: torch.Tensor, rows: list[int]) -> list[int]:
        return self.model.compute_logits(hidden[rows]).float().argmax(dim=-1).tolist()

    @torch.inference_mode()
    def step(
        self, states: dict[str, CachedRequestState], num_scheduled: dict[str, int], lengths: dict[str, int]
    ) -> dict[str, list[int]]:
        """The step's draft forwards: the scheduled tokens (`num_scheduled`,
        which counts the draft places of `lengths`, req_id -> places) through
        the draft, and the drafts. Called before the target's forward, with
        the states holding committed tokens only."""
        catch_up, behind = {}, {}
        for rid, n in num_scheduled.items():
            state = states[rid]
            behind[rid] = max(0, state.num_computed_tokens - self.written.pop(rid, state.num_computed_tokens))
            state.num_computed_tokens -= behind[rid]
            catch_up[rid] = behind[rid] + (1 if rid in lengths else n)
        try:
            batch, hidden = self._forward(states, catch_up)
        finally:
            for rid, n in behind.items():
                states[rid].num_computed_tokens += n
        if not lengths:
            return {}
        row_of = dict(zip(batch.sample_req_ids, batch.sample_indices))
        order = list(lengths)
        drafts = {rid: [token] for rid, token in zip(order, self._greedy(hidden, [row_of[rid] for rid in order]))}
        # k - 1 more one-token forwards; the states are put back afterwards.
        start = {rid: states[rid].num_computed_tokens for rid in order}
        try:
            for i in range(1, max(lengths.values())):
                active = [rid for rid in order if lengths[rid] > i]
                for rid in active:
                    states[rid].token_ids.append(drafts[rid][-1])
                    states[rid].num_computed_tokens = start[rid] + i
                batch, hidden = self._forward(states, dict.fromkeys(active, 1))
                row_of = dict(zip(batch.sample_req_ids, batch.sample_indices))
                for rid, token in zip(active, self._greedy(hidden, [row_of[rid] for rid in active])):
                    drafts[rid].append(token)
        finally:
            for rid in order:
                state = states[rid]
                del state.token_ids[start[rid] + 1 :]
                state.num_computed_tokens = start[rid]
                self.written[rid] = start[rid] + lengths[rid]
        return drafts

    @torch.inference_mode()
    def catch_up_burst(self, states: list[CachedRequestState], steps: int) -> None:
        """After a decode burst of `steps` steps (the first of which step()
        saw): the draft's K/V of the burst's later tokens, in one forward."""
        if steps <= 1:
            return
        later = steps - 1
        for state in states:
            state.num_computed_tokens -= later - 1  # at the burst's second token
        try:
            self._forward({s.req_id: s for s in states}, {s.req_id: later for s in states})
        finally:
            for state in states:
                state.num_computed_tokens += later - 1
