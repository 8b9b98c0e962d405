"""The model's generation_config.json, read as vLLM reads it.

Its sampling settings become the default SamplingParams of requests that do
not set them (`--generation-config auto`, the default; `vllm` ignores them;
a folder reads that folder's file instead), and the end-of-sequence ids it
lists beyond the tokenizer's are stop tokens whatever the setting.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json keys whose values become request defaults, and the
# SamplingParams field each one sets.
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


@dataclass
class GenerationDefaults:
    # SamplingParams fields and their defaults for requests that leave them unset.
    sampling: dict[str, Any] = field(default_factory=dict)
    # End-of-sequence ids the file lists (one id or several).
    eos_token_ids: list[int] = field(default_factory=list)
    # The file read, if any (for logs).
    source: str | None = None


def read_generation_config(folder: str) -> dict[str, Any]:
    """The file's contents; {} when the folder has none."""
    path = os.path.join(folder, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"generation_config: cannot read {path!r}: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"generation_config: {path!r} is not a JSON object")
    return raw


def load_generation_defaults(model_dir: str, generation_config: str = "auto") -> GenerationDefaults:
    """Request defaults for `generation_config` = "auto" | "vllm" | a folder."""
    if generation_config in ("auto", "vllm"):
        folder = model_dir
    elif os.path.isdir(generation_config):
        folder = generation_config
    else:
        raise ValueError(
            f"generation_config must be 'auto', 'vllm' or a folder holding {GENERATION_CONFIG_FILE}, "
            f"got {generation_config!r}"
        )
    raw = read_generation_config(folder)
    source = os.path.join(folder, GENERATION_CONFIG_FILE) if raw else None
    eos = raw.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else [t for t in (eos or []) if isinstance(t, int)]
    if generation_config == "vllm":
        return GenerationDefaults(eos_token_ids=eos_ids, source=source)
    sampling = {}
    for key, param in SAMPLING_KEYS.items():
        value = raw.get(key)
        if value is not None:
            sampling[param] = value
    if sampling.get("top_k") == 0:  # transformers' "no top-k"
        sampling["top_k"] = -1
    # A file value SamplingParams would reject fails at start-up, not on every request.
    from raylm.sampling_params import SamplingParams

    try:
        SamplingParams(**sampling)
    except (ValueError, TypeError) as e:
        raise ValueError(f"generation_config: {source} holds a bad sampling default: {e}") from e
    return GenerationDefaults(sampling=sampling, eos_token_ids=eos_ids, source=source)
