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
