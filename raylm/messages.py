"""Messages that cross layer and process boundaries in one step.

They sit below every layer (scheduler, executor and worker all import them)
and hold only plain, serialisable fields, so any transport can carry them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raylm.lora.request import LoRARequest
from raylm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the workers have not seen (or must rebuild after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    # Non-empty for a preempted request resumed by recompute.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Its LoRA adapter (raylm.lora), None for the base model.
    lora_request: LoRARequest | None = None


@dataclass
class CachedRequestData:
    """A request the workers already hold: what changed since its last step."""

    req_id: str
    # Tokens sampled since the request was last scheduled; workers that did
    # not sample them (non-last PP stages) learn them here.
    new_token_ids: list[int]
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # req_id -> number of tokens to compute this step.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests finished or aborted since the last step: workers drop their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # A decode burst (raylm.core.decode_burst): this many decode steps in a
    # row, each step's sampled tokens the next one's input; every request
    # then has one token scheduled and KV slots for this many.
    num_decode_steps: int = 1
    # Speculative decoding (raylm.core.spec_decode): req_id -> the draft
    # tokens scheduled after its last committed token (they are the last of
    # its num_scheduled_tokens); the workers verify them and return the
    # committed tokens, one or more. With a draft model the core sends
    # MODEL_DRAFT_TOKEN in each place and the workers write the tokens.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class GrammarOutput:
    """Which tokens the constrained requests of a step may sample (structured
    outputs); rows of requests not listed are unconstrained."""

    # The constrained requests that sample this step, their rows in this order.
    req_ids: list[str] = field(default_factory=list)
    # The rows, packed: int32 little-endian, `num_words` = ceil(vocab_size / 32)
    # per row; bit j of word w allows token 32 * w + j (xgrammar's layout).
    # Plain bytes, so every transport carries them as they are.
    bitmask: bytes = b""
    num_words: int = 0
    # Rows of each request in req_ids: 1 + the length of its speculative draft
    # (row j: the tokens allowed after the draft's first j tokens, for the
    # draft's verification row j). Empty: one row each (no drafts).
    num_rows: list[int] = field(default_factory=list)

    def row_spans(self) -> dict[str, tuple[int, int]]:
        """req_id -> (its first row, its number of rows)."""
        counts = self.num_rows or [1] * len(self.req_ids)
        spans, first = {}, 0
        for rid, count in zip(self.req_ids, counts):
            spans[rid] = (first, count)
            first += count
        return spans


# (token ids, logprobs, rank of the first id) for one position: column 0 is the
# sampled (or prompt) token, then the top-k.
PositionLogprobsLists = tuple[list[int], list[float], int]


# A draft position whose token the workers' draft model writes
# (raylm.worker.draft_model): the core knows only how long the draft may be.
# Not a token id, so an embedding lookup of one left unwritten fails.
MODEL_DRAFT_TOKEN = -1


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # One list per request in req_ids; empty when the request only ran a
    # partial prefill chunk and nothing was sampled; several tokens for a
    # decode burst or a verified speculative draft.
    sampled_token_ids: list[list[int]]
    # req_id -> one entry per token of sampled_token_ids (a verified draft
    # commits several), for the requests that asked for logprobs.
    logprobs: dict[str, list[PositionLogprobsLists]] = field(default_factory=dict)
    # req_id -> logprobs of the prompt positions computed this step.
    prompt_logprobs: dict[str, list[PositionLogprobsLists]] = field(default_factory=dict)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])


@dataclass
class KVCacheConfig:
    """The KV cache every rank allocates: decided once by the engine from the
    smallest rank's free memory, so all ranks hold the same block ids."""

    num_blocks: int
    block_size: int
