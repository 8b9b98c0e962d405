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
from raylm.model.gguf import is_gguf_path, iterate_gguf_weights, open_gguf
from raylm.model.layers.linear import LinearBase
from raylm.model.quantization.load_time import METHODS, prepare_weights

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


def load_arch_config(model: str) -> ArchConfig:
    """The ArchConfig of a model folder (config.json) or a GGUF file (its metadata)."""
    if is_gguf_path(model):
        return ArchConfig.from_dict(open_gguf(model).config_dict(), source=model)
    return ArchConfig.from_model_dir(model)


def pack_weights(model: nn.Module) -> None:
    """Lay out the weights for the CPU kernels that want their own layout, once loaded."""
    for module in model.modules():
        if hasattr(module, "pack_weights"):
            module.pack_weights()


def load_model(
    model: str | os.PathLike, dtype: torch.dtype, device: torch.device | str, quantization: str | None = None
) -> nn.Module:
    """The model in `model` (a folder, or a GGUF file), built in `dtype` on `device`
    with this rank's weight shards; `quantization` "int8" quantizes a float
    checkpoint's linear weights at load (GGUF files come quantized)."""
    model = os.fspath(model)
    if quantization not in (None, "none", *METHODS):
        raise ValueError(f"quantization {quantization!r} is not supported; supported: {', '.join(METHODS)}")
    if is_gguf_path(model):
        gguf_file = open_gguf(model)
        arch = ArchConfig.from_dict(gguf_file.config_dict(), source=model)
        weights = iterate_gguf_weights(gguf_file, arch.num_attention_heads, arch.num_key_value_heads)
        source = f"GGUF file, tensors {gguf_file.type_counts()}"
    else:
        arch = ArchConfig.from_model_dir(model)
        files = safetensors_files(model)
        weights = iterate_weights(files)
        source = f"{len(files)} file(s)"
    with torch.device(device):
        built = arch.model_class(arch, dtype)
    built.load_weights(prepare_weights(weights, quantization))
    for module in built.modules():
        if isinstance(module, LinearBase):
            module.finish_loading()
    logger.info(
        "loaded %s from %s (%s) as %s on %s%s",
        arch.architecture,
        model,
        source,
        dtype,
        device,
        f", weights quantized to {quantization}" if quantization == "int8" else "",
    )
    return built.eval()
