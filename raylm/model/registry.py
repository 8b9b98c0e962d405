"""Which model class serves which Hugging Face architecture name.

The registry holds names only ("module:Class") and imports a model's module
when that architecture is asked for, so reading a config.json (arch_config,
which needs the supported names) never pulls in the model code, and the model
code can import arch_config without a circle.

The Llama family (Llama, Mistral, Qwen2, Qwen3) shares one implementation whose
differences come from ArchConfig flags."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

MODEL_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "raylm.model.llama:LlamaForCausalLM",
    "MistralForCausalLM": "raylm.model.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "raylm.model.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "raylm.model.llama:Qwen3ForCausalLM",
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(MODEL_REGISTRY)


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        target = MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)
