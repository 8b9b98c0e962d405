"""The float model that `--quantization int8` stands for, written independently
of raylm's quantizer: each linear weight rounded to int8 with one scale per
output row (max |w| / 127), then multiplied back."""

from __future__ import annotations

import pathlib
import shutil

import torch
from safetensors.torch import load_file, save_file

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_int8_reference(folder: str | pathlib.Path, out: str | pathlib.Path) -> pathlib.Path:
    out = pathlib.Path(out)
    shutil.copytree(folder, out)
    weights = load_file(out / "model.safetensors")
    for name, w in weights.items():
        if any(f".{part}.weight" in name for part in LINEAR):
            scale = w.float().abs().amax(dim=1, keepdim=True) / 127
            weights[name] = (torch.round(w.float() / scale).clamp(-127, 127) * scale).to(w.dtype)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out
