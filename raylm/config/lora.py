"""LoRAConfig: multi-LoRA serving (`enable_lora`), with vLLM's settings.

`max_loras` adapters share one step (each holds a slot of stacked A/B
weights in every worker); `max_cpu_loras` adapters stay loaded in the
workers' host memory (least recently used leaves first); `max_lora_rank`
bounds an adapter's rank and so the size of a slot.
"""

from __future__ import annotations

from dataclasses import dataclass

# The largest rank vLLM accepts; a slot's A/B rows are sized by max_lora_rank.
MAX_LORA_RANK = 512
# Slots in one step: each costs a share of every LoRA matmul (the batch's
# delta is computed against all slots at once, masked per row).
MAX_LORAS = 64


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class LoRAConfig:
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self):
        if not _is_int(self.max_loras) or not 1 <= self.max_loras <= MAX_LORAS:
            raise ValueError(f"max_loras must be an integer from 1 to {MAX_LORAS}, got {self.max_loras!r}")
        if not _is_int(self.max_lora_rank) or not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be an integer from 1 to {MAX_LORA_RANK}, got {self.max_lora_rank!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if not _is_int(self.max_cpu_loras) or self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {self.max_cpu_loras!r}"
            )
