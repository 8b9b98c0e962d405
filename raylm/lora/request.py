"""`LoRARequest`: which adapter a request runs with, importable as vLLM's is
(`from raylm.lora.request import LoRARequest`).

A plain value: it travels with the request from intake to the workers
(EngineCoreRequest, the scheduler's Request, NewRequestData). The engine
fills `content_digest` at intake (raylm.lora.registry): the SHA-256 of the
adapter's files, which keys its prefix-cache blocks and its worker slots, so
two adapters, or one name reloaded with other weights, never share K/V.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    # vLLM's field, kept for the signature: the base model is the engine's.
    base_model_name: str | None = None
    # Set by the engine at intake (hex SHA-256 of the adapter's files); a
    # user leaves it empty.
    content_digest: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request.lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_request.lora_path must name the adapter's folder, got {self.lora_path!r}")

    def with_digest(self, digest: str) -> LoRARequest:
        return replace(self, content_digest=digest)
