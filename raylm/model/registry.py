"""Which model class serves which Hugging Face architecture name.

The Llama family (Llama, Mistral, Qwen2, Qwen3) shares one implementation whose
differences come from ArchConfig flags."""

from __future__ import annotations

from torch import nn

from raylm.model.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(MODEL_REGISTRY)


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None
