"""At most `max_loras` LoRA adapters among a core's running requests: each
worker holds that many adapter slots (raylm.lora.manager), and every step
draws only on the running requests, so no step needs more.

A waiting request whose adapter would be one too many is set aside for the
step (the requests behind it may go first), as vLLM does, and is admitted
once a running adapter's requests have finished or been preempted.

`resident` follows what the workers' slots hold: the adapters of the
running requests, then those that ran last, up to max_loras (a worker takes
the least recently used slot no step needs, raylm.lora.manager). The core
reports it, so that the supervisor routes a request to a replica holding
its adapter (raylm.engine.routing).
"""

from __future__ import annotations

from collections import OrderedDict

from raylm.core.request import Request


class AdapterAdmission:
    def __init__(self, max_loras: int | None):
        self.max_loras = max_loras  # None: LoRA is off, every request fits
        self._in_use: set[str] = set()
        self.resident: OrderedDict[str, None] = OrderedDict()  # digests, least recently run first

    def begin(self, running: list[Request]) -> None:
        """The adapters of the running requests, before the waiting ones are looked at."""
        self._in_use = {r.lora_digest for r in running if r.lora_request is not None}
        for digest in self._in_use:
            self._touch(digest)

    def _touch(self, digest: str) -> None:
        self.resident[digest] = None
        self.resident.move_to_end(digest)
        while self.max_loras is not None and len(self.resident) > self.max_loras:
            victim = next((d for d in self.resident if d not in self._in_use), None)
            if victim is None:
                return
            del self.resident[victim]

    def admits(self, request: Request) -> bool:
        digest = request.lora_digest
        if self.max_loras is None or digest is None or digest in self._in_use:
            return True
        return len(self._in_use) < self.max_loras

    def admit(self, request: Request) -> None:
        if request.lora_request is not None:
            self._in_use.add(request.lora_digest)
            self._touch(request.lora_digest)
