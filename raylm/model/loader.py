"""Build a model from a Hugging Face folder: ArchConfig, then the model on its
device, then weights streamed from safetensors, each rank reading only its slice."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from raylm.model.arch_config import ArchConfig

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint files, from the index when there is one."""
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"cannot read safetensors index {index_path!r}: {e}") from e
        files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"{index_path!r} lists files that do not exist: {missing}")
        return files
    single = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    others = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if others:
        return [os.path.join(model_dir, f) for f in others]
    present = sorted(f for f in os.listdir(model_dir) if f.endswith((".bin", ".pt", ".pth", ".gguf")))
    raise ValueError(
        f"no safetensors weights in {model_dir!r} (raylm loads safetensors only"
        + (f"; found {', '.join(present)}" if present else "")
        + ")"
    )


def iterate_weights(files: list[str]) -> Iterator[tuple[str, object]]:
    """(name, lazy slice) for every tensor; a slice reads from disk only what is indexed,
    and is valid until the next file is opened."""
    for path in files:
        try:
            handle = safe_open(path, framework="pt")
        except (SafetensorError, OSError) as e:
            raise ValueError(f"corrupt or truncated safetensors file {path!r}: {e}") from e
        with handle as f:
            for name in f.keys():
                try:
                    weight = f.get_slice(name)
                except (SafetensorError, OSError) as e:
                    raise ValueError(f"cannot read {name!r} from safetensors file {path!r}: {e}") from e
                yield name, weight


def load_model(model_dir: str | os.PathLike, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """The model for `model_dir`, built in `dtype` on `device` with this rank's weight shards."""
    model_dir = os.fspath(model_dir)
    arch = ArchConfig.from_model_dir(model_dir)
    files = safetensors_files(model_dir)
    with torch.device(device):
        model = arch.model_class(arch, dtype)
    model.load_weights(iterate_weights(files))
    logger.info("loaded %s from %s (%d file(s)) as %s on %s", arch.architecture, model_dir, len(files), dtype, device)
    return model.eval()
