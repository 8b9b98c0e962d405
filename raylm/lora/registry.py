"""The front end's view of adapters: a request's LoRARequest checked once
(the adapter loaded and checked against the base model, raylm.lora.peft_loader)
and stamped with its content digest before it leaves for a core.

Checked adapters are remembered by their files' identity (real path, size,
modification time, inode), so a request for an adapter already checked costs
a stat, and files rewritten in place are read and checked again (a new
digest: their K/V is never shared with the old weights')."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from raylm.config import LoRAConfig
from raylm.lora.peft_loader import files_key, load_adapter
from raylm.lora.request import LoRARequest
from raylm.model.arch_config import ArchConfig

# Checked adapters remembered (a digest each: a few bytes).
MAX_REMEMBERED = 1024


class AdapterRegistry:
    def __init__(self, arch: ArchConfig, lora_config: LoRAConfig):
        self.arch, self.lora_config = arch, lora_config
        self._digests: OrderedDict[tuple, str] = OrderedDict()
        # Told the seconds each adapter's files took to read and check (a
        # server's load-time histogram); called in the thread that read them.
        self.on_load: Callable[[float], None] | None = None

    def resolve(self, lora_request: LoRARequest) -> LoRARequest:
        """`lora_request` with its content digest; ValueError if its adapter is refused."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        key = files_key(lora_request.lora_path)
        digest = self._digests.get(key)
        if digest is None:
            start = time.perf_counter()
            digest = load_adapter(lora_request.lora_path, self.arch, self.lora_config).digest
            if self.on_load is not None:
                self.on_load(time.perf_counter() - start)
            self._digests[key] = digest
            while len(self._digests) > MAX_REMEMBERED:
                self._digests.popitem(last=False)
        self._digests.move_to_end(key)
        return lora_request.with_digest(digest)
