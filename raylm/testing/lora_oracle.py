"""Tiny random LoRA adapters in PEFT's format, and PEFT's `PeftModel` as the
oracle of greedy outputs with an adapter (PEFT is a test-time dependency
only; raylm reads adapters with its own loader, raylm.lora.peft_loader)."""

from __future__ import annotations

import pathlib
import warnings

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from raylm.testing.hf_oracle import HFGeneration, greedy_of

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _fresh_base(model_dir: str | pathlib.Path) -> torch.nn.Module:
    # PEFT wraps the base model's modules in place: never the oracle's shared copy.
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def make_tiny_adapter(
    model_dir: str | pathlib.Path,
    out_dir: str | pathlib.Path,
    seed: int,
    rank: int = 8,
    alpha: float = 16.0,
    target_modules: tuple[str, ...] = ALL_PROJECTIONS,
    std: float = 0.1,
    **config: object,
) -> str:
    """A random adapter (A and B both nonzero, so it changes the outputs),
    written by PEFT's save_pretrained; returns its folder."""
    peft_config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), **config)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = get_peft_model(_fresh_base(model_dir), peft_config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(out_dir)
    return str(out_dir)


@torch.inference_mode()
def peft_greedy(
    model_dir: str | pathlib.Path, adapter_dir: str | pathlib.Path | None, prompts: list[list[int]], max_new_tokens: int
) -> list[HFGeneration]:
    """Greedy tokens of the base model with the adapter (None: without), through PeftModel."""
    model = _fresh_base(model_dir)
    if adapter_dir is not None:
        with warnings.catch_warnings():
            # PEFT asks transformers a deprecated question; not ours to fix.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    return greedy_of(model, prompts, max_new_tokens)
