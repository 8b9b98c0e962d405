"""At most `max_loras` LoRA adapters among a core's running requests: each
worker holds that many adapter slots (raylm.lora.manager), and every step
draws only on the running requests, so no step needs more.

A waiting request whose adapter would be one too many is set aside for the
step (the requests behind it may go first), as vLLM does, and is admitted
once a running adapter's requests have finished or been preempted.
"""

from __future__ import annotations

from raylm.core.request import Request


class AdapterAdmission:
    def __init__(self, max_loras: int | None):
        self.max_loras = max_loras  # None: LoRA is off, every request fits
        self._in_use: set[str] = set()

    def begin(self, running: list[Request]) -> None:
        """The adapters of the running requests, before the waiting ones are looked at."""
        self._in_use = {r.lora_digest for r in running if r.lora_request is not None}

    def admits(self, request: Request) -> bool:
        digest = request.lora_digest
        if self.max_loras is None or digest is None or digest in self._in_use:
            return True
        return len(self._in_use) < self.max_loras

    def admit(self, request: Request) -> None:
        if request.lora_request is not None:
            self._in_use.add(request.lora_digest)
