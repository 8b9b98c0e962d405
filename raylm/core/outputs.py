"""What the engine core reports per request after each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from raylm.messages import PositionLogprobsLists


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobsLists] = field(default_factory=list)
    # Logprobs for prompt positions computed this step (chunked prefill may
    # deliver them over several steps).
    new_prompt_logprobs: list[PositionLogprobsLists] = field(default_factory=list)
    # The prompt token the first of them scores (1: the second prompt token,
    # since the first has no logprob). Workers that lost their state compute
    # a prompt's logprobs again from its start; the front end keeps one each.
    prompt_logprobs_start: int = 1
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # With finish_reason "error": what went wrong, for the client.
    error: str | None = None
    # On a request's first output token only: seconds it waited in this core's
    # queue before it was first scheduled, then from that to its first token.
    queue_seconds: float | None = None
    prefill_seconds: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
