"""Draft proposers of speculative decoding (raylm.core.spec_decode): a
request in, the tokens it will likely generate next out.

A proposer must be deterministic in what it has seen (the same tokens and
the same earlier outputs give the same draft): verification by
sample-and-match is exact for any draft. Every proposer has the two methods
of DraftProposer: `propose`, and `request_finished` for one that learns from
earlier outputs (suffix decoding, raylm.core.spec_suffix). A draft model
runs in the workers: its proposer here only sizes the draft.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Protocol

from raylm.core.request import Request
from raylm.messages import MODEL_DRAFT_TOKEN

# Token ids packed as C ints (4 bytes): a vocabulary is far below 2**31.
_ITEM = array("i").itemsize


class DraftProposer(Protocol):
    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Up to `max_tokens` (>= 1) tokens likely to follow the request's
        tokens (its prompt and output so far); [] when there is no guess."""
        ...

    def request_finished(self, request: Request) -> None:
        """The request ended (its output is final): what a proposer learns from it."""
        ...


class NgramProposer:
    """Prompt lookup: the last n tokens (n from `max_n` down to `min_n`) are
    looked for earlier in the request's tokens, latest occurrence first, and
    the tokens that followed it are the draft. The search runs in C
    (bytes.rfind over the tokens packed as ints), so a 512-token context
    costs microseconds."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        return prompt_lookup(request.all_token_ids, max_tokens, self.min_n, self.max_n)

    def request_finished(self, request: Request) -> None:
        """Lookup reads only the request's own tokens."""


class DraftModelProposer:
    """A draft model's draft (method draft_model): `max_tokens` places the
    workers fill, each with the draft model's greedy next token after the
    ones before it (raylm.worker.draft_model), just before the target
    verifies them. Deciding there rather than here needs no extra round trip
    and no K/V slots beyond the ones the scheduler gives the draft anyway."""

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        return [MODEL_DRAFT_TOKEN] * max_tokens

    def request_finished(self, request: Request) -> None:
        """The draft model keeps nothing of a request beyond its K/V blocks."""


def prompt_lookup(token_ids: Sequence[int], max_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `max_tokens` tokens that followed the latest earlier occurrence of
    the last n tokens, for the largest n from `max_n` down to `min_n` that has one."""
    num_tokens = len(token_ids)
    if max_tokens <= 0 or num_tokens <= min_n:
        return []
    packed = array("i", token_ids).tobytes()
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        start = _latest_earlier_occurrence(packed, num_tokens, n)
        if start is not None:
            follow = start + n
            return list(token_ids[follow : follow + max_tokens])
    return []


def _latest_earlier_occurrence(packed: bytes, num_tokens: int, n: int) -> int | None:
    """Where the latest occurrence of the last n tokens starts, among those
    followed by at least one token (so not the suffix itself); None if none."""
    pattern = packed[-n * _ITEM :]
    end = (num_tokens - 1) * _ITEM  # the occurrence must end before the last token
    while True:
        at = packed.rfind(pattern, 0, end)
        if at < 0:
            return None
        if at % _ITEM == 0:
            return at // _ITEM
        # A match across token boundaries (bytes of two tokens): look before it.
        end = at + len(pattern) - 1
