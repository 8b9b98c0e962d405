"""Tiny random LoRA adapters of the tiny models, written by PEFT, built once
per session: three per architecture, each a different shape of adapter."""

from __future__ import annotations

import pytest

from raylm.lora.request import LoRARequest
from raylm.testing.lora_oracle import make_tiny_adapter

# name -> how PEFT builds it: every projection; attention only, rank-stabilized
# scaling, a smaller rank; the MLP only.
ADAPTER_SHAPES = {
    "all": dict(rank=8, alpha=16.0),
    "attn": dict(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj"), use_rslora=True),
    "mlp": dict(rank=8, alpha=32.0, target_modules=("gate_proj", "up_proj", "down_proj")),
}


@pytest.fixture(scope="session")
def tiny_adapters(tiny_model_dir, tmp_path_factory):
    """arch -> {name: adapter folder} for the tiny model of `arch` (built lazily, once)."""
    root = tmp_path_factory.mktemp("tiny_adapters")
    cache: dict[str, dict[str, str]] = {}

    def get(arch: str) -> dict[str, str]:
        if arch not in cache:
            model = tiny_model_dir(arch)
            cache[arch] = {
                name: make_tiny_adapter(model, root / f"{arch}-{name}", seed=seed, **shape)
                for seed, (name, shape) in enumerate(ADAPTER_SHAPES.items(), start=1)
            }
        return cache[arch]

    return get


def lora_requests(adapters: dict[str, str]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(adapters.items(), start=1)}
