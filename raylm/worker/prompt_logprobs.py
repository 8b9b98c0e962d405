"""Prompt logprobs (echo with logprobs, prompt_logprobs) in bounded memory.

Each prompt position needs a log_softmax over the whole vocabulary, yet only
a few numbers of it are kept: the logprob and rank of the prompt's next token
and the top-k alternatives. Computed for every position of a step at once, a
prefill of 8k positions of a 128k-token vocabulary would hold 4 GiB of float32
logits, as much again for their log_softmax, and a quarter of that for the
rank comparison. Computed over chunks of at most CHUNK_ROWS positions, the
peak is that of one chunk, whatever the prompt's length, and the results are
those of the whole computation: every row is computed on its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from raylm.worker.sampler import LogprobsTensors, compute_prompt_logprobs

# 256 rows of a 128k vocabulary: 128 MiB per float32 [rows, vocab] tensor.
CHUNK_ROWS = 256


def prompt_logprobs_in_chunks(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    rows: list[int],
    target_token_ids: list[int],
    num_top: int,
    chunk_rows: int | None = None,
) -> LogprobsTensors:
    """Logprobs of each prompt token given the positions before it.

    `hidden`: the step's hidden states; `rows`: the ones at prompt positions
    whose next prompt token is `target_token_ids` (same order); `num_top`:
    how many of the most likely tokens to keep besides the target. Every
    rank of a tensor-parallel group makes the same calls in the same order
    (compute_logits may gather across them)."""
    chunk_rows = chunk_rows or CHUNK_ROWS
    parts = []
    for start in range(0, len(rows), chunk_rows):
        chunk = rows[start : start + chunk_rows]
        logits = compute_logits(hidden[chunk])
        targets = torch.tensor(target_token_ids[start : start + chunk_rows], dtype=torch.int64, device=logits.device)
        parts.append(compute_prompt_logprobs(logits, targets, num_top))
        del logits  # before the next chunk's are allocated
    return LogprobsTensors(
        token_ids=torch.cat([p.token_ids for p in parts]),
        logprobs=torch.cat([p.logprobs for p in parts]),
        ranks=torch.cat([p.ranks for p in parts]),
    )
