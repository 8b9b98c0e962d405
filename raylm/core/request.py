"""A request as the scheduler sees it: tokens so far and progress."""

from __future__ import annotations

import enum
import time

from raylm.lora.request import LoRARequest
from raylm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    # Being migrated to another engine (raylm.engine.migration): it keeps its
    # blocks but is not scheduled until it leaves (or resumes here).
    PAUSED = "paused"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # Its step raised (it alone, see Scheduler.blame_failed_step): the request
    # ends with the error; the engine goes on with the others.
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        output_token_ids: list[int] | None = None,
        num_recoveries: int = 0,
        quarantined: bool = False,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ):
        """`output_token_ids`: tokens this request already generated elsewhere
        (a core that died, say); it continues after them, recomputing their
        KV cache, and counts them against max_tokens and min_tokens.
        `num_recoveries`, `quarantined`: its record of failures so far, kept
        across cores (see raylm.core.quarantine).
        `cache_salt`: mixed into the hash of its first block, so the request
        shares prefix-cache blocks only with requests of the same salt.
        `lora_request`: its adapter (content digest stamped at intake), which
        enters the first block's hash too."""
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = list(output_token_ids or [])
        self.all_token_ids: list[int] = self.prompt_token_ids + self.output_token_ids
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache at first scheduling.
        self.num_cached_tokens = -1
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # Recoveries it was exposed to, and whether it must run alone (raylm.core.quarantine).
        self.num_recoveries = num_recoveries
        self.quarantined = quarantined
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        # Hashes of this request's full blocks (sha256 digests, chained),
        # extended as tokens arrive.
        self.block_hashes: list[bytes] = []
        # Output tokens the workers have not been told about yet.
        self.unsent_token_ids: list[int] = []
        # Async scheduling: tokens being sampled by steps still in flight.
        self.num_output_placeholders = 0
        # Speculative decoding (raylm.core.spec_decode): draft tokens verified
        # and accepted since its acceptance was last judged, and the output
        # length before which it drafts no more (its drafts were mostly
        # rejected), and how many windows in a row were so.
        self.spec_drafted = 0
        self.spec_accepted = 0
        self.spec_paused_until = 0
        self.spec_low_windows = 0
        # This core's clock (time.monotonic), for the queue and prefill metrics:
        # when it received the request, first scheduled it, and produced its first token.
        self.received_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None

    @property
    def lora_digest(self) -> str | None:
        return None if self.lora_request is None else self.lora_request.content_digest

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.unsent_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
