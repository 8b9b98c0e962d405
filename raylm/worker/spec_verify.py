"""Verification of a speculative draft by sample-and-match (raylm.core.spec_decode).

The logits of a request's 1 + k verified positions come from one forward:
row j scores the token after the last committed one and the draft's first j
tokens. At each row the target's token is sampled exactly as decoding
without speculation would sample it there (greedy: the argmax; otherwise the
request's own sampler inputs and generator, one draw per committed token),
and committed; the next row counts only while the committed token equals
the draft's. Each committed token is thus drawn from the target's
distribution given the committed tokens before it (the rows it reads hold
exactly those tokens), and a seeded request's generator advances by one draw
per committed token, as it does without speculation: its text is the same.
A request with logprobs gets them from the same sampler call that drew each
committed token, from the row that token was sampled from: one entry per
committed token, none for the rejected positions.
"""

from __future__ import annotations

import torch

from raylm.worker.sampler import LogprobsTensors, Sampler, greedy_tokens
from raylm.worker.sampling_metadata import SamplingMetadata


def verify_draft(
    logits: torch.Tensor, draft: list[int], metadata: SamplingMetadata, sampler: Sampler
) -> tuple[list[int], list[LogprobsTensors]]:
    """The committed tokens (1 to len(draft) + 1) of one request, from its
    rows' logits [len(draft) + 1, V] and its one-row sampling metadata, and
    the sampler's logprobs of each (one row each; none unless requested)."""
    if metadata.plain_greedy:
        # No generator to advance and no logprobs: every row's argmax at once, then the match.
        return _commit_while_matching(greedy_tokens(logits).tolist(), draft), []
    committed: list[int] = []
    logprobs: list[LogprobsTensors] = []
    for j in range(len(draft) + 1):
        out = sampler(logits[j : j + 1], metadata)
        token = int(out.sampled_token_ids[0])
        committed.append(token)
        if out.logprobs is not None:
            logprobs.append(out.logprobs)
        if j == len(draft) or token != draft[j]:
            break
    return committed, logprobs


def _commit_while_matching(targets: list[int], draft: list[int]) -> list[int]:
    for j, token in enumerate(draft):
        if targets[j] != token:
            return targets[: j + 1]
    return targets[: len(draft) + 1]
