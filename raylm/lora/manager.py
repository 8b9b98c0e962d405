"""A worker's adapters: the slots of its layers (raylm.lora.layers), which
adapter each slot holds, and the adapters kept loaded in host memory.

Adapters are known by their content digest (stamped at intake,
raylm.lora.registry), never by name or id alone, so one name reloaded with
other weights is another adapter here too. Each step brings the adapters of
its rows into slots (the scheduler admits at most max_loras adapters among
running requests, so a step never needs more); a slot not used by the step
is taken least recently used first, and its adapter stays in host memory
(max_cpu_loras of them, least recently used leaving first) for a quick
return.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from raylm.config import LoRAConfig
from raylm.lora.layers import LAYER_PARTS, LoRALinearSlots
from raylm.lora.peft_loader import LoRAAdapter, load_adapter
from raylm.lora.request import LoRARequest
from raylm.model.arch_config import ArchConfig


class LoRAManager:
    def __init__(self, model: nn.Module, lora_config: LoRAConfig, arch: ArchConfig, device: torch.device):
        self.config, self.arch, self.device = lora_config, arch, device
        num_slots, rank = lora_config.max_loras, lora_config.max_lora_rank
        # (layer index, LAYER_PARTS key) -> the slots installed on that layer.
        self.layers: dict[tuple[int, str], LoRALinearSlots] = {}
        inner = model.model
        for index in range(inner.start_layer, inner.end_layer):
            for path, parts in LAYER_PARTS.items():
                linear = inner.layers[index].get_submodule(path)
                linear.lora = LoRALinearSlots(linear, parts, num_slots, rank)
                self.layers[(index, path)] = linear.lora
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()
        # digest -> slot, least recently used first.
        self._slots: OrderedDict[str, int] = OrderedDict()
        self.num_loads = 0  # adapters read from disk (for tests and metrics)

    def mask_for(self, lora_requests: list[LoRARequest | None], num_tokens: list[int]) -> torch.Tensor | None:
        """The step's row mask [rows, max_loras] for requests in flat order,
        each with its number of rows; None when none has an adapter."""
        if not any(lora_requests):
            return None
        wanted = {lr.content_digest: lr for lr in lora_requests if lr is not None}
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"a step with {len(wanted)} adapters, over max_loras ({self.config.max_loras})")
        slot_of = {digest: self._slot_for(lr, wanted) for digest, lr in wanted.items()}
        per_request = torch.tensor(
            [-1 if lr is None else slot_of[lr.content_digest] for lr in lora_requests], dtype=torch.int64
        )
        per_row = per_request.repeat_interleave(torch.tensor(num_tokens, dtype=torch.int64))
        return (per_row[:, None] == torch.arange(self.config.max_loras)[None, :]).to(self.device)

    def _slot_for(self, lora_request: LoRARequest, step: dict[str, LoRARequest]) -> int:
        digest = lora_request.content_digest
        if digest in self._slots:
            self._slots.move_to_end(digest)
            return self._slots[digest]
        taken = set(self._slots.values())
        free = [s for s in range(self.config.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:
            victim = next(d for d in self._slots if d not in step)  # the step has <= max_loras adapters
            slot = self._slots.pop(victim)
        self._fill(slot, self._adapter(lora_request))
        self._slots[digest] = slot
        return slot

    def _adapter(self, lora_request: LoRARequest) -> LoRAAdapter:
        digest = lora_request.content_digest
        adapter = self._host.get(digest)
        if adapter is None:
            adapter = load_adapter(lora_request.lora_path, self.arch, self.config)
            self.num_loads += 1
            if adapter.digest != digest:
                # Rewritten between intake and this step: its K/V would be
                # cached under the other weights' digest.
                raise ValueError(
                    f"adapter {lora_request.lora_name!r} at {lora_request.lora_path!r} changed since the request "
                    "was accepted; send the request again"
                )
            self._host[digest] = adapter
            while len(self._host) > self.config.max_cpu_loras:
                self._host.popitem(last=False)
        self._host.move_to_end(digest)
        return adapter

    def _fill(self, slot: int, adapter: LoRAAdapter) -> None:
        for (index, _), slots in self.layers.items():
            slots.clear(slot)
            for part, (projection, _) in enumerate(slots.parts):
                pair = adapter.weights.get((index, projection))
                if pair is not None:
                    slots.set_part(slot, part, pair[0], pair[1], adapter.scaling)
