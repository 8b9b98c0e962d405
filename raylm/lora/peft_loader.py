"""Read one LoRA adapter in PEFT's format (adapter_config.json +
adapter_model.safetensors) and check it against the base model.

raylm's own reader: PEFT is only the tests' oracle. Nothing in the files is
evaluated: `target_modules` is matched against the projection names raylm's
models have, and every tensor name is parsed against one pattern. A feature
raylm does not run is refused by name (DoRA, bias training, modules to save,
per-module ranks or alphas, ...), never run as something else; so are
ranks past max_lora_rank, NaN or infinite weights (a masked row of a mixed
batch must stay exactly zero for the other adapters' rows), oversized files
and files that leave the adapter's folder through a symlink.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors.torch import load as load_safetensors

from raylm.config import LoRAConfig
from raylm.model.arch_config import ArchConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# adapter_config.json is a few hundred bytes; anything near this is not one.
MAX_CONFIG_BYTES = 1 << 20
# Slack over the largest adapter the model admits (header, metadata).
_WEIGHTS_SLACK_BYTES = 1 << 20

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT's spelling of "every linear layer but the output head".
_ALL_LINEAR = "all-linear"
_TENSOR_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])\.weight"
)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Keys whose any set value is a feature raylm does not run: key -> why.
_REFUSED_IF_SET = {
    "use_dora": "DoRA (use_dora) is not supported",
    "modules_to_save": "modules_to_save (fully trained modules beside the adapter) is not supported",
    "rank_pattern": "rank_pattern (per-module ranks) is not supported",
    "alpha_pattern": "alpha_pattern (per-module alphas) is not supported",
    "layer_replication": "layer_replication is not supported",
    "lora_bias": "lora_bias (a trained bias on lora_B) is not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D weights) does not fit raylm's models",
    "target_parameters": "target_parameters is not supported",
    "trainable_token_indices": "trainable_token_indices is not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
}


@dataclass
class LoRAAdapter:
    """One adapter's weights, unsharded, in float32: (layer, projection) ->
    (A [r, in], B [out, r]); `scaling` multiplies B A x."""

    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: str  # hex SHA-256 of the two files

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def projection_shape(arch: ArchConfig, projection: str) -> tuple[int, int]:
    """(in, out) of a projection of the base model, unsharded."""
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    hidden, inter = arch.hidden_size, arch.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[projection]


def max_weights_bytes(arch: ArchConfig, max_rank: int) -> int:
    """The largest adapter_model.safetensors the model admits: float32, rank
    max_rank, every projection of every layer, plus slack."""
    per_layer = sum(sum(projection_shape(arch, p)) for p in PROJECTIONS) * max_rank * 4
    return per_layer * arch.num_hidden_layers + _WEIGHTS_SLACK_BYTES


def adapter_files(path: str) -> tuple[str, str]:
    """The adapter's two files, each a regular file inside `path` once every
    symlink is resolved (a link may not lead out of the folder)."""
    if not isinstance(path, str) or not os.path.isdir(path):
        raise ValueError(f"lora_path {path!r} is not a folder")
    root = os.path.realpath(path)
    found = []
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        real = os.path.realpath(os.path.join(path, name))
        if os.path.commonpath([root, real]) != root:
            raise ValueError(f"{name} in {path!r} is a symlink that leads out of the adapter's folder")
        if not os.path.isfile(real):
            raise ValueError(f"{path!r} has no {name} (a PEFT LoRA adapter has {CONFIG_FILE} and {WEIGHTS_FILE})")
        found.append(real)
    return found[0], found[1]


def files_key(path: str) -> tuple:
    """What identifies the files' content cheaply (for caches of checked
    adapters): their real paths, sizes, modification times and inodes."""
    key = []
    for real in adapter_files(path):
        st = os.stat(real)
        key.append((real, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(key)


def load_adapter(path: str, arch: ArchConfig, lora_config: LoRAConfig) -> LoRAAdapter:
    """Read and check the adapter at `path`; a ValueError names the file and field."""
    config_path, weights_path = adapter_files(path)
    config_bytes = _read_bounded(config_path, MAX_CONFIG_BYTES)
    rank, scaling, targets = _check_config(config_bytes, config_path, lora_config)
    weights_bytes = _read_bounded(weights_path, max_weights_bytes(arch, lora_config.max_lora_rank))
    digest = hashlib.sha256(
        b"raylm lora\0" + hashlib.sha256(config_bytes).digest() + hashlib.sha256(weights_bytes).digest()
    ).hexdigest()
    weights = _read_weights(weights_path, weights_bytes, arch, rank, targets)
    return LoRAAdapter(rank, scaling, weights, digest)


def _read_bounded(path: str, limit: int) -> bytes:
    size = os.path.getsize(path)
    if size > limit:
        raise ValueError(f"{path}: {size} bytes, over the bound of {limit} for this model and max_lora_rank")
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:  # it grew while read
        raise ValueError(f"{path}: over the bound of {limit} bytes")
    return data


def _check_config(data: bytes, where: str, lora_config: LoRAConfig) -> tuple[int, float, set[str]]:
    """(rank, scaling, target projections) of adapter_config.json."""
    try:
        config = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type {peft_type!r} is not supported (only LORA)")
    for key, why in _REFUSED_IF_SET.items():
        if config.get(key):
            raise ValueError(f"{where}: {why}")
    bias = config.get("bias", "none")
    if bias != "none":
        raise ValueError(f"{where}: bias {bias!r} (trained biases) is not supported; only 'none'")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{where}: r must be an integer >= 1, got {rank!r}")
    if rank > lora_config.max_lora_rank:
        raise ValueError(f"{where}: r {rank} is over max_lora_rank ({lora_config.max_lora_rank})")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"{where}: lora_alpha must be a finite number, got {alpha!r}")
    # PEFT's rule: alpha / r, or alpha / sqrt(r) with rank-stabilized LoRA.
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling), _targets(config.get("target_modules"), where)


def _targets(targets, where: str) -> set[str]:
    """target_modules as names of raylm's projections: a list of names (a
    name may carry its parents' path, e.g. self_attn.q_proj), one name, or
    'all-linear'. A regular expression is not evaluated: refused by name."""
    if targets == _ALL_LINEAR:
        return set(PROJECTIONS)
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"{where}: target_modules must be a list of module names, got {targets!r}")
    found = set()
    for target in targets:
        name = target.rpartition(".")[2]
        if name not in PROJECTIONS:
            raise ValueError(
                f"{where}: target_modules entry {target!r} is not one of this model's projections "
                f"({', '.join(PROJECTIONS)}); regular expressions are not supported"
            )
        found.add(name)
    return found


def _read_weights(
    path: str, data: bytes, arch: ArchConfig, rank: int, targets: set[str]
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    try:
        tensors = load_safetensors(data)
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"{path}: not a safetensors file ({e})") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        layer, projection, half = _parse_name(name, path, arch, targets)
        halves.setdefault((layer, projection), {})[half] = _checked_tensor(
            tensor, name, path, arch, rank, projection, half
        )
    weights = {}
    for (layer, projection), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise ValueError(f"{path}: layers.{layer}.{projection} has no {missing}.weight")
        weights[(layer, projection)] = (pair["A"], pair["B"])
    if not weights:
        raise ValueError(f"{path}: no LoRA weights")
    return weights


def _parse_name(name: str, path: str, arch: ArchConfig, targets: set[str]) -> tuple[int, str, str]:
    match = _TENSOR_NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"{path}: tensor {name!r} is not a LoRA weight of this model's projections")
    layer, projection, half = int(match.group(1)), match.group(2), match.group(3)
    if layer >= arch.num_hidden_layers:
        raise ValueError(f"{path}: tensor {name!r} names layer {layer}; the model has {arch.num_hidden_layers}")
    if projection not in targets:
        raise ValueError(f"{path}: tensor {name!r} is for {projection}, not in target_modules")
    return layer, projection, half


def _checked_tensor(
    tensor: torch.Tensor, name: str, path: str, arch: ArchConfig, rank: int, projection: str, half: str
) -> torch.Tensor:
    if tensor.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{path}: tensor {name!r} has dtype {tensor.dtype}; float32, float16 or bfloat16 expected")
    fan_in, fan_out = projection_shape(arch, projection)
    expected = (rank, fan_in) if half == "A" else (fan_out, rank)
    if tuple(tensor.shape) != expected:
        raise ValueError(
            f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}; the base model and r={rank} need {expected}"
        )
    tensor = tensor.float()
    if not torch.isfinite(tensor).all():
        raise ValueError(f"{path}: tensor {name!r} holds NaN or infinite values")
    return tensor
