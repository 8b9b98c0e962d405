"""The model runner: keeps per-request state, runs the forward, samples.

The step has two phases, `execute_model` (forward up to the logits) and
`sample_tokens` (sampling), so that the engine can compute structured-output
grammar masks while the forward runs, and so every executor backend splits a
step at the same place.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from raylm.config import EngineConfig
from raylm.config.engine_config import engine_step_aside_reason
from raylm.distributed.parallel_state import get_cp_group, get_pp_group
from raylm.lora.layers import lora_segments
from raylm.lora.manager import LoRAManager
from raylm.messages import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from raylm.model.forward_context import set_forward_context
from raylm.model.layers.attention import Attention
from raylm.model.layers.cp_prefill import num_rows_on_rank
from raylm.model.layers.gpu_attention import prefill_budget
from raylm.model.loader import load_model, pack_weights
from raylm.worker.cp_input import gather_rows
from raylm.worker.draft_model import DraftModel
from raylm.worker.input_batch import CachedRequestState, PreparedBatch, padded_block_table, prepare_batch
from raylm.worker.prompt_logprobs import prompt_logprobs_in_chunks
from raylm.worker.sampler import Sampler, advance_generator, apply_draft_grammar_bitmask, apply_grammar_bitmask
from raylm.worker.sampling_metadata import SamplingMetadata, SamplingRow, build_sampling_metadata, same_every_step
from raylm.worker.spec_verify import verify_draft

logger = logging.getLogger(__name__)


def _logprob_lists(token_ids: torch.Tensor, logprobs: torch.Tensor, ranks: torch.Tensor) -> list[tuple]:
    ids, lps, rks = token_ids.tolist(), logprobs.tolist(), ranks.tolist()
    return [(ids[i], lps[i], rks[i]) for i in range(len(ids))]


@dataclass
class RowCounts:
    """Rows (tokens) this rank's forward passes ran, against the steps' rows:
    under context parallelism a split prefill chunk's rows are shared out
    over the CP group (raylm.model.layers.cp_prefill)."""

    computed: int = 0
    scheduled: int = 0
    split_computed: int = 0  # this rank's rows of split prefill chunks
    split_scheduled: int = 0  # the split chunks' rows in all
    mixed_split_steps: int = 0  # steps with decode tokens beside a split chunk


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device):
        self.config = config
        self.device = device
        self.block_size = config.cache_config.block_size
        self.vocab_size = config.model_config.vocab_size
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self._kv_cache_layers: list[Attention] = []  # the layers bound to kv_caches
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        self.row_counts = RowCounts()
        # The last step's sampling metadata and the requests it was built for,
        # when it can serve the next step of the same requests (see _sampling_metadata).
        self._reusable_metadata: tuple[list[str], SamplingMetadata] | None = None
        # One-row metadata of requests whose speculative drafts are verified,
        # kept while it stays the same from step to step.
        self._draft_metadata: dict[str, SamplingMetadata] = {}
        # Between execute_model and sample_tokens.
        self._pending: tuple[SchedulerOutput, PreparedBatch, torch.Tensor | None] | None = None
        # LoRA adapters' slots on the model's layers (enable_lora), set at load_model.
        self.lora: LoRAManager | None = None
        # Speculative decoding's draft model (method draft_model), set at load_model;
        # the step's drafts it wrote, for sample_tokens.
        self.draft_model: DraftModel | None = None
        self._model_drafts: dict[str, list[int]] = {}

    # ---- set-up ------------------------------------------------------------------

    def load_model(self) -> None:
        mc = self.config.model_config
        self.model = load_model(mc.model, mc.dtype, self.device, quantization=mc.quantization)
        self.model.eval()
        pack_weights(self.model)
        # The KV-cache sizing profiles one SDPA prefill call of this size
        # (memory_profiling.largest_prefill_attention); no step's may be larger.
        budget = prefill_budget(self.config.scheduler_config.max_num_batched_tokens, mc.max_model_len, self.block_size)
        for layer in self.attention_layers():
            layer.prefill_budget = budget
        if self.config.lora_config is not None:
            self.lora = LoRAManager(self.model, self.config.lora_config, mc.arch, self.device)
        spec = self.config.speculative_config
        # An engine that never speculates (engine_step_aside_reason) needs no draft forwards.
        if spec is not None and spec.method == "draft_model" and engine_step_aside_reason(self.config) is None:
            self.draft_model = DraftModel(self.config, self.device, budget)

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def kv_cache_bytes_per_block(self) -> int:
        layers = self.attention_layers()
        if not layers:
            return 0
        a = layers[0]
        dtype_size = torch.empty((), dtype=self.config.model_config.dtype).element_size()
        draft = 0 if self.draft_model is None else self.draft_model.kv_cache_bytes_per_block()
        return 2 * self.block_size * a.num_kv_heads * a.head_dim * dtype_size * len(layers) + draft

    def initialize_kv_cache(self, num_blocks: int) -> None:
        dtype = self.config.model_config.dtype
        self.kv_caches = []
        self._kv_cache_layers = self.attention_layers()
        for layer in self._kv_cache_layers:
            # torch.empty: pages are only touched (and counted in RSS) once used.
            # (Not on huge pages yet: see csrc/huge_pages.h.)
            cache = torch.empty(
                (2, num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim), dtype=dtype, device=self.device
            )
            layer.kv_cache = cache
            self.kv_caches.append(cache)
        if self.draft_model is not None:
            self.draft_model.initialize_kv_cache(num_blocks)

    def release_device_memory(self) -> None:
        """Drop the KV caches and the weights (at shutdown): the runner is not used again."""
        for layer in self.attention_layers():
            layer.kv_cache = None
        self.kv_caches = []
        self._kv_cache_layers = []
        self.model = None
        if self.draft_model is not None:
            self.draft_model.release()
            self.draft_model = None

    # ---- one step -----------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        fresh_blocks: list[int] = []
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self._draft_metadata.pop(rid, None)
            if self.draft_model is not None:
                self.draft_model.forget(rid)
        for new in so.scheduled_new_reqs:
            self._draft_metadata.pop(new.req_id, None)
            old = self.requests.get(new.req_id)
            generator = old.generator if old is not None else None
            params = new.sampling_params
            if generator is None and params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
                if params.temperature != 0.0 and new.output_token_ids:
                    # Resumed here after a failure elsewhere: its earlier
                    # tokens were sampled by workers that are gone.
                    advance_generator(generator, len(new.output_token_ids), self.vocab_size)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                sampling_params=params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=generator,
                lora_request=new.lora_request,
            )
            # Blocks from the prefix cache (whole) or imported by a migration
            # (the last one maybe partly) hold K/V already; the rest are fresh.
            fresh_blocks.extend(new.block_ids[-(-new.num_computed_tokens // self.block_size) :])
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.token_ids.extend(cached.new_token_ids)
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            fresh_blocks.extend(cached.new_block_ids)
        self._zero_blocks(fresh_blocks)
        drafts = so.spec_token_ids
        if self.draft_model is not None and so.total_num_scheduled_tokens:
            # The draft model's forwards over the step's tokens, and its drafts
            # in the places the core sized (raylm.worker.draft_model).
            lengths = {rid: len(draft) for rid, draft in drafts.items()}
            drafts = self.draft_model.step(self.requests, so.num_scheduled_tokens, lengths)
        self._model_drafts = drafts
        for rid, draft in drafts.items():
            # Input of this step only: sample_tokens takes them off again (the
            # committed tokens come back from the scheduler, like any step's).
            self.requests[rid].token_ids.extend(draft)

    def _zero_blocks(self, block_ids: list[int]) -> None:
        # A padded decode path reads whole blocks, masked past each context's
        # end. A never-written slot of an uninitialised cache may hold NaN bits,
        # and NaN survives a zero attention weight, so for those layers fresh
        # blocks start at zero. (The CPU decode kernel never reads past a
        # context: zeroing there would only cost time, 6% of a prefill step.)
        if not block_ids:
            return
        caches = [layer.kv_cache for layer in self._kv_cache_layers if layer.reads_unwritten_slots()]
        if self.draft_model is not None:
            caches += self.draft_model.caches_read_unwritten()
        if not caches:
            return
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        for cache in caches:
            cache.index_fill_(1, index, 0)

    def make_empty_intermediate(self, num_tokens: int) -> torch.Tensor:
        return self.model.make_empty_intermediate(num_tokens, self.device)

    def num_rows_on_this_rank(self, so: SchedulerOutput) -> int:
        """Rows of the step this rank computes (and a later PP stage receives):
        under context parallelism a long prefill chunk is split over the CP
        group (raylm.model.layers.cp_prefill), so only this rank's share."""
        cp = get_cp_group()
        return num_rows_on_rank(so.num_scheduled_tokens.values(), cp.rank_in_group, cp.world_size)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, intermediate: torch.Tensor | None = None):
        """Run the forward. A non-first PP stage gets the previous stage's
        intermediate state; a non-last stage returns its own, else None."""
        if self._pending is not None:
            raise RuntimeError("execute_model called twice without sample_tokens in between")
        self._update_states(so)
        if so.scheduled_new_reqs or so.finished_req_ids:
            self._reusable_metadata = None  # requests came or went (or came back)
        if so.total_num_scheduled_tokens == 0:
            if get_pp_group().is_last_rank:
                self._pending = (so, None, None)
            return None
        cp = get_cp_group()
        batch = prepare_batch(
            self.requests,
            so.num_scheduled_tokens,
            self.block_size,
            self.device,
            cp_rank=cp.rank_in_group,
            cp_size=cp.world_size,
        )
        self._attach_lora(batch)
        with set_forward_context(batch.attn_metadata):
            hidden = self.model(batch.input_ids, batch.positions, intermediate)
        self._count_rows(so, batch)
        if not get_pp_group().is_last_rank:
            # Nothing to sample on this stage: the step ends here for it.
            return hidden
        if batch.cp_rows is not None:
            hidden = self._gather_sampled_rows(batch, hidden, cp)
        self._pending = (so, batch, hidden)
        return None

    def _attach_lora(self, batch: PreparedBatch) -> None:
        """The step's LoRA row mask (its adapters brought into slots), if any row has an adapter."""
        if self.lora is not None:
            loras = [self.requests[rid].lora_request for rid in batch.req_ids]
            mask = self.lora.mask_for(loras, batch.num_tokens)
            batch.attn_metadata.lora_mask = mask
            batch.attn_metadata.lora_segments = None if mask is None else lora_segments(mask)

    def _count_rows(self, so: SchedulerOutput, batch: PreparedBatch) -> None:
        counts = self.row_counts
        computed = batch.input_ids.numel()
        counts.computed += computed
        counts.scheduled += so.total_num_scheduled_tokens
        if batch.cp_rows is not None:
            split = batch.cp_rows.owner >= 0
            counts.split_scheduled += int(split.sum())
            counts.split_computed += int((batch.cp_rows.owner == get_cp_group().rank_in_group).sum())
            counts.mixed_split_steps += batch.attn_metadata.num_decode_tokens > 0

    def _gather_sampled_rows(self, batch: PreparedBatch, hidden: torch.Tensor, cp) -> torch.Tensor:
        """A split chunk's rows live on the CP rank that computed them; every
        rank samples (with async scheduling each fills in its own sampled
        token), so the rows the sampler and prompt logprobs read are gathered
        to every rank, and the batch's row numbers renumbered into them."""
        rows = sorted(set(batch.sample_indices).union(*(r for r, _ in batch.prompt_logprob_rows.values())))
        where = {row: i for i, row in enumerate(rows)}
        batch.sample_indices = [where[row] for row in batch.sample_indices]
        batch.prompt_logprob_rows = {
            rid: ([where[row] for row in r], targets) for rid, (r, targets) in batch.prompt_logprob_rows.items()
        }
        return gather_rows(hidden, rows, batch.cp_rows, cp)

    def _sampling_metadata(self, req_ids: list[str], states: list[CachedRequestState]) -> SamplingMetadata:
        """The step's SamplingMetadata. Steady decoding samples the same
        requests step after step; when none of them reads its output so far
        (penalties, bad words, min_tokens), the metadata of the previous step
        is the same and is reused instead of rebuilt."""
        reusable = self._reusable_metadata
        if reusable is not None and reusable[0] == req_ids:
            return reusable[1]
        rows = [SamplingRow(s.sampling_params, s.prompt_token_ids, s.output_token_ids, s.generator) for s in states]
        metadata = build_sampling_metadata(rows, self.vocab_size, self.device)
        if all(same_every_step(s.sampling_params) for s in states):
            self._reusable_metadata = (list(req_ids), metadata)
        else:
            self._reusable_metadata = None
        return metadata

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput | None:
        if not get_pp_group().is_last_rank:
            return None  # a non-last PP stage samples nothing
        if self._pending is None:
            raise RuntimeError("sample_tokens called without a preceding execute_model")
        so, batch, hidden = self._pending
        self._pending = None
        if batch is None:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])

        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[tuple]] = {}  # one entry per sampled token
        if self._model_drafts:
            self._verify_drafts(self._model_drafts, batch, hidden, grammar_output, sampled, logprobs)
        if batch.sample_req_ids:
            # A decode step samples every row in order: no gather needed.
            sample_hidden = hidden
            if len(batch.sample_indices) != hidden.shape[0] or batch.sample_indices[-1] != hidden.shape[0] - 1:
                sample_hidden = hidden[batch.sample_indices]
            logits = self.model.compute_logits(sample_hidden)
            apply_grammar_bitmask(logits, batch.sample_req_ids, grammar_output)
            states = [self.requests[rid] for rid in batch.sample_req_ids]
            metadata = self._sampling_metadata(batch.sample_req_ids, states)
            out = self.sampler(logits.float(), metadata)  # a plain greedy step is one argmax there
            tokens = out.sampled_token_ids.tolist()
            if so.num_decode_steps > 1:
                return self._finish_burst(so, batch, states, metadata, tokens)
            lp_lists = None
            if out.logprobs is not None:
                lp_lists = _logprob_lists(out.logprobs.token_ids, out.logprobs.logprobs, out.logprobs.ranks)
            fill_in = self.config.scheduler_config.async_scheduling
            for i, (rid, state) in enumerate(zip(batch.sample_req_ids, states)):
                sampled[rid] = [tokens[i]]
                if fill_in:
                    # Async scheduling: the next step of this request is already
                    # scheduled with a placeholder for this token.
                    state.token_ids.append(tokens[i])
                num_lps = state.sampling_params.logprobs
                if lp_lists is not None and num_lps is not None:
                    ids, lps, rank = lp_lists[i]
                    logprobs[rid] = [(ids[: num_lps + 1], lps[: num_lps + 1], rank)]

        prompt_logprobs = {}
        for rid, (rows, targets) in batch.prompt_logprob_rows.items():
            num_top = self.requests[rid].sampling_params.prompt_logprobs
            lp = prompt_logprobs_in_chunks(self.model.compute_logits, hidden, rows, targets, num_top)
            prompt_logprobs[rid] = _logprob_lists(lp.token_ids, lp.logprobs, lp.ranks)

        return ModelRunnerOutput(
            req_ids=batch.req_ids,
            sampled_token_ids=[sampled.get(rid, []) for rid in batch.req_ids],
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _verify_drafts(
        self,
        drafts: dict[str, list[int]],
        batch: PreparedBatch,
        hidden: torch.Tensor,
        grammar_output: GrammarOutput | None,
        sampled: dict[str, list[int]],
        logprobs: dict[str, list[tuple]],
    ) -> None:
        """Fills in `sampled` the committed tokens of the step's requests with
        a speculative draft (raylm.worker.spec_verify), whose rows are its
        last 1 + len(draft), and in `logprobs` one entry per committed token
        where asked; the batch keeps the other requests' rows to sample as
        usual. A constrained request's row j is masked first with its grammar
        row j (the tokens allowed after the draft's first j tokens): each
        committed token is sampled, and its logprobs taken, under the mask
        decoding would have applied there."""
        plain_ids, plain_rows, rows, spans = [], [], [], []
        for rid, row in zip(batch.sample_req_ids, batch.sample_indices):
            draft = drafts.get(rid)
            if draft is None:
                plain_ids.append(rid)
                plain_rows.append(row)
                continue
            spans.append((rid, len(rows), draft))
            rows.extend(range(row - len(draft), row + 1))
        batch.sample_req_ids, batch.sample_indices = plain_ids, plain_rows
        logits = self.model.compute_logits(hidden[rows]).float()
        apply_draft_grammar_bitmask(
            logits, [(rid, first, len(draft) + 1) for rid, first, draft in spans], grammar_output
        )
        for rid, first, draft in spans:
            state = self.requests[rid]
            del state.token_ids[len(state.token_ids) - len(draft) :]
            rows_of = logits[first : first + len(draft) + 1]
            metadata = self._draft_sampling_metadata(state)
            sampled[rid], lp_rows = verify_draft(rows_of, draft, metadata, self.sampler)
            if lp_rows:  # (its own one-row metadata: the request's top-N exactly)
                logprobs[rid] = [e for r in lp_rows for e in _logprob_lists(r.token_ids, r.logprobs, r.ranks)]

    def _draft_sampling_metadata(self, state: CachedRequestState) -> SamplingMetadata:
        metadata = self._draft_metadata.get(state.req_id)
        if metadata is None:
            row = SamplingRow(state.sampling_params, state.prompt_token_ids, state.output_token_ids, state.generator)
            metadata = build_sampling_metadata([row], self.vocab_size, self.device)
            if same_every_step(state.sampling_params):
                self._draft_metadata[state.req_id] = metadata
        return metadata

    def _finish_burst(
        self,
        so: SchedulerOutput,
        batch: PreparedBatch,
        states: list[CachedRequestState],
        metadata: SamplingMetadata,
        tokens: list[int],
    ) -> ModelRunnerOutput:
        """The rest of a decode burst (raylm.core.decode_burst), whose first
        step sampled `tokens`: each further step computes the last step's
        tokens, with the same sampling inputs (the scheduler admits only
        requests whose inputs stay the same). Greedy steps run in one call
        where the model can (the same kernels, so the same tokens). The
        workers keep every token they sampled; the scheduler does not send
        them back."""
        if len(batch.sample_req_ids) != len(batch.req_ids):
            raise RuntimeError("a decode burst whose every request does not sample each step")
        remaining = so.num_decode_steps - 1
        later = self._greedy_steps_at_once(states, tokens, remaining) if metadata.plain_greedy else None
        if later is not None:
            sampled = [[token, *rest] for token, rest in zip(tokens, later)]
            for state, row in zip(states, sampled):
                state.token_ids.extend(row)
                state.num_computed_tokens += remaining
            self.row_counts.computed += remaining * len(states)
            self.row_counts.scheduled += remaining * len(states)
        else:
            sampled = self._burst_step_by_step(so, states, metadata, tokens, remaining)
        if self.draft_model is not None:
            self.draft_model.catch_up_burst(states, so.num_decode_steps)
        by_request = dict(zip(batch.sample_req_ids, sampled))
        return ModelRunnerOutput(req_ids=batch.req_ids, sampled_token_ids=[by_request[rid] for rid in batch.req_ids])

    def _greedy_steps_at_once(
        self, states: list[CachedRequestState], tokens: list[int], steps: int
    ) -> list[list[int]] | None:
        """Each row's tokens of `steps` greedy decode steps after one that
        sampled `tokens`, run by the model in one call; None where it cannot."""
        greedy = getattr(self.model, "greedy_decode_steps", None)
        if greedy is None or any(state.lora_request is not None for state in states):
            return None  # (the fused steps apply no LoRA delta: step by step, through the modules)
        size = self.block_size
        positions = [state.num_computed_tokens + 1 for state in states]  # of `tokens`
        num_blocks = (max(positions) + steps - 1) // size + 1
        for state, position in zip(states, positions):
            if (position + steps - 1) // size >= len(state.block_ids):
                raise RuntimeError(f"request {state.req_id}: a decode burst past its KV blocks")
        table = padded_block_table([state.block_ids for state in states], num_blocks)
        out = greedy(
            torch.tensor(tokens, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            torch.tensor(table, dtype=torch.int64),
            torch.tensor([p + 1 for p in positions], dtype=torch.int64),
            size,
            steps,
        )
        return None if out is None else out.t().tolist()

    def _burst_step_by_step(
        self,
        so: SchedulerOutput,
        states: list[CachedRequestState],
        metadata: SamplingMetadata,
        tokens: list[int],
        steps: int,
    ) -> list[list[int]]:
        sampled = [[token] for token in tokens]
        for _ in range(steps):
            for state, token in zip(states, tokens):
                state.token_ids.append(token)
                state.num_computed_tokens += 1
            batch = prepare_batch(self.requests, so.num_scheduled_tokens, self.block_size, self.device)
            self._attach_lora(batch)
            with set_forward_context(batch.attn_metadata):
                hidden = self.model(batch.input_ids, batch.positions, None)
            self._count_rows(so, batch)
            logits = self.model.compute_logits(hidden)
            tokens = self.sampler(logits.float(), metadata).sampled_token_ids.tolist()
            for row, token in zip(sampled, tokens):
                row.append(token)
        for state, token in zip(states, tokens):
            state.token_ids.append(token)
        return sampled
