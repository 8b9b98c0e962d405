"""Speculative decoding, the scheduler's side: who drafts, how long a draft
may be, when speculation steps aside, and the counts.

A decoding request whose proposer finds a draft of k tokens is scheduled
1 + k tokens (its last committed token and the draft, like a short prefill
chunk). The workers compute the logits of all those positions in one forward
through the paged KV cache and verify the draft by sample-and-match
(raylm.worker.spec_verify): at each position they sample the target's token
exactly as decoding without speculation would (greedy: argmax; otherwise the
same sampler and the request's own generator, one draw per committed token),
commit it, and go on only while it equals the draft's token there. So the
committed tokens are those decoding one at a time would give, a seeded
request's text included, for any deterministic drafter; a request's
logprobs are taken from the sampling of each committed row, one entry per
committed token, as a plain step takes them. The scheduler then
takes the committed tokens one by one (stop tokens, max_tokens, min_tokens
cut inside the run as between steps) and rolls `num_computed_tokens` back
over the rejected positions: their K/V slots hold draft tokens' K/V and are
simply written again by a later step. The prefix cache registers only blocks
of committed tokens (KVCacheManager._register_full_blocks).

Structured outputs: a constrained request's draft is grammar-checked, cut
before its first token the grammar forbids (StructuredOutputManager.fit_draft),
and its bitmask has 1 + k rows, row j the tokens allowed after the draft's
first j tokens (the matcher advanced over them, then rolled back); the
workers mask verification row j with it before sampling, so each committed
token is sampled under the mask decoding one at a time would apply. The
matcher then advances over the committed tokens only. A draft model's tokens
are written in the workers, after the rows are built: with it, constrained
requests step aside.

Speculation steps aside (the request decodes one token, as without it) where
it is not built yet or would cost: see `engine_step_aside_reason` (the whole
engine), `request_step_aside_reason` (one request), MAX_SPECULATIVE_BATCH
(a large batch) and LOW_ACCEPTANCE (a request whose drafts are mostly
rejected). Each step in which some decoding request stepped aside is
counted, by reason.

Proposers plug in through `DraftProposer` (raylm.core.spec_propose): a
request in, a draft out, and each finished request shown to it. Built:
n-gram prompt lookup (`ngram`), suffix decoding from earlier outputs of
the same cache_salt (`suffix`, raylm.core.spec_suffix), and a draft model
(`draft_model`), whose draft the core only sizes: the workers write its
tokens (raylm.worker.draft_model).
"""

from __future__ import annotations

import logging
import os

from raylm.config import EngineConfig, SpeculativeConfig
from raylm.config.engine_config import engine_step_aside_reason
from raylm.core.request import Request
from raylm.core.spec_propose import DraftModelProposer, DraftProposer, NgramProposer
from raylm.core.spec_suffix import SuffixProposer

logger = logging.getLogger(__name__)

# Speculation steps aside while more requests than this run: a verification
# step of many requests computes (1 + k) x as many rows, once a batch is
# large the step is bound by compute rather than by the per-step overhead
# that accepted drafts amortise, and one request's draft takes the decode
# burst from all the others (llama.cpp's lookup decoding: 1.10x with one
# slot, 0.86x with 4, 0.77x with 8). Provisional, from a few noisy rounds on a
# shared 2-core EPYC (benchmarks/bench_spec_decode.py --batch N
# --max-speculative-batch 64, ngram k=4, with/without, median of 3 rounds):
# 2 streams 1.39x self-quoting, 0.97x short greedy, 1.01x sampled; 4 streams
# 1.25x, 0.83x, 0.84x; 8 streams 0.97x, 0.61x, 1.13x (spread up to 0.1-2x).
# RAYLM_SPECULATIVE_MAX_BATCH sets it (read by each core process at its
# import: a machine that measures otherwise, or a test that wants every step
# to speculate).
MAX_SPECULATIVE_BATCH = int(os.environ.get("RAYLM_SPECULATIVE_MAX_BATCH", "2"))
# A request whose drafts were mostly rejected stops drafting for a while: a
# verification step that commits one token costs more than a decode step
# (1 + k rows, and no decode burst beside it). Judged over each
# ACCEPTANCE_WINDOW draft tokens: below LOW_ACCEPTANCE accepted, no drafts
# for the next LOW_ACCEPTANCE_PAUSE output tokens, then a fresh window; each
# low window in a row doubles the pause (text where lookup keeps missing
# stops paying for it), a good one resets it.
# Provisional: at k = 4 a step commits 1 + 4a tokens for acceptance a, and a
# verification step cost about 1.5x a decode step of a burst on the embedded
# model (a profile of bench_spec_decode.py's self-quoting set: 7.5 ms against
# 5.2 ms), so below a ~ 0.15-0.25 drafting loses.
ACCEPTANCE_WINDOW = 8
LOW_ACCEPTANCE = 0.25
LOW_ACCEPTANCE_PAUSE = 32

# Why speculation steps aside: the batch, a request's features, the engine's layout.
STEP_ASIDE_REASONS = (
    "large_batch",
    "low_acceptance",
    "penalties",
    "min_tokens",
    "structured_output",
    "pipeline_parallel",
    "context_parallel",
    "async_scheduling",
    "cpu_kernels",
)


def request_step_aside_reason(request: Request, constrained: bool, drafts_in_core: bool = True) -> str | None:
    """Why this request decodes without a draft this step, or None.
    `drafts_in_core`: the core knows the draft's tokens (not a draft model's)."""
    params = request.sampling_params
    if params.uses_penalties or params.bad_words_token_ids:
        return "penalties"  # sampling reads the output so far, which grows inside a run
    if request.num_output_tokens < params.min_tokens:
        return "min_tokens"  # stop tokens are masked until then: the mask would change inside a run
    if constrained and not drafts_in_core:
        # A draft model's tokens are written in the workers, after the core
        # built the step's grammar rows: the core can neither cut the draft at
        # a token its grammar forbids nor fill each row's mask after the
        # draft's tokens before it (see StructuredOutputManager.fit_draft).
        return "structured_output"
    return None


class SpecDecodeStats:
    """Running totals since the core started (vLLM's counters), and the steps
    in which speculation stepped aside, by reason."""

    def __init__(self, num_speculative_tokens: int):
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_speculative_tokens
        self.num_steps_aside = 0
        self.steps_aside_by_reason: dict[str, int] = {}

    def as_dict(self) -> dict:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
            "spec_decode_num_steps_aside": self.num_steps_aside,
            "spec_decode_steps_aside_by_reason": dict(self.steps_aside_by_reason),
        }


class Speculator:
    """Drafts for one step's decoding requests, and the counts."""

    def __init__(self, config: SpeculativeConfig, engine_reason: str | None, proposer: DraftProposer | None = None):
        self.num_speculative_tokens = config.num_speculative_tokens
        self.proposer = proposer or make_proposer(config)
        # Whether the core knows the draft's tokens: a draft model's are written in the workers.
        self.drafts_in_core = not isinstance(self.proposer, DraftModelProposer)
        self.engine_reason = engine_reason
        self.stats = SpecDecodeStats(config.num_speculative_tokens)
        self._step_reason: str | None = None  # why the whole step steps aside
        self._reasons: set[str] = set()  # why requests of this step stepped aside

    def begin_step(self, num_running: int) -> None:
        self._reasons = set()
        self._step_reason = self.engine_reason
        if self._step_reason is None and num_running > MAX_SPECULATIVE_BATCH:
            self._step_reason = "large_batch"

    def draft(
        self, request: Request, constrained: bool, max_model_len: int, budget: int, after_last: bool = True
    ) -> list[int]:
        """The draft of a request about to decode one token (maybe empty);
        `after_last`: the token is its last committed one (not one in flight).
        A constrained request's draft is then cut to what its grammar allows
        (StructuredOutputManager.fit_draft, by the scheduler)."""
        reason = self._step_reason or request_step_aside_reason(request, constrained, self.drafts_in_core)
        if reason is not None:
            self._reasons.add(reason)
            return []
        if request.num_output_tokens < request.spec_paused_until:
            self._reasons.add("low_acceptance")
            return []
        if not after_last:
            return []
        params = request.sampling_params
        # Every draft token accepted commits 1 + len(draft) tokens: no more than
        # max_tokens and max_model_len leave room for, nor than the step's budget.
        room = min(self.num_speculative_tokens, max_model_len - request.num_tokens - 1, budget - 1)
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - request.num_output_tokens - 1)
        if room <= 0:
            return []
        return self.proposer.propose(request, room)

    def end_step(self) -> None:
        if not self._reasons:
            return
        self.stats.num_steps_aside += 1
        for reason in self._reasons:
            self.stats.steps_aside_by_reason[reason] = self.stats.steps_aside_by_reason.get(reason, 0) + 1

    def record_verified(self, request: Request, num_draft_tokens: int, num_committed: int) -> None:
        """A draft of `num_draft_tokens` was verified and `num_committed`
        tokens came back (sample-and-match: the accepted ones plus one)."""
        stats = self.stats
        accepted = max(0, min(num_committed - 1, num_draft_tokens))
        _judge_acceptance(request, num_draft_tokens, accepted)
        stats.num_drafts += 1
        stats.num_draft_tokens += num_draft_tokens
        stats.num_accepted_tokens += accepted
        for position in range(accepted):
            stats.accepted_per_position[position] += 1


def _judge_acceptance(request: Request, num_draft_tokens: int, accepted: int) -> None:
    request.spec_drafted += num_draft_tokens
    request.spec_accepted += accepted
    if request.spec_drafted < ACCEPTANCE_WINDOW:
        return
    if request.spec_accepted < LOW_ACCEPTANCE * request.spec_drafted:
        request.spec_paused_until = request.num_output_tokens + (LOW_ACCEPTANCE_PAUSE << request.spec_low_windows)
        request.spec_low_windows = min(request.spec_low_windows + 1, 8)
    else:
        request.spec_low_windows = 0
    request.spec_drafted = request.spec_accepted = 0


def make_proposer(config: SpeculativeConfig) -> DraftProposer:
    if config.method == "suffix":
        return SuffixProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft_model":
        return DraftModelProposer()
    raise ValueError(f"speculative_config.method {config.method!r} has no proposer")


def make_speculator(config: EngineConfig) -> Speculator | None:
    """The engine's Speculator, or None without a speculative_config."""
    spec = config.speculative_config
    if spec is None:
        return None
    reason = engine_step_aside_reason(config)
    if reason is not None:
        logger.warning("speculative decoding steps aside on this engine (%s): every request decodes plainly", reason)
    return Speculator(spec, reason)
