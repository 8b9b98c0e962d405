"""The model's shape and quirks, read from a Hugging Face `config.json` by our
own code (no transformers import), so a worker knows what to build."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from raylm.model.registry import SUPPORTED_ARCHITECTURES, get_model_class

logger = logging.getLogger(__name__)

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class RopeScaling:
    """How rotary frequencies are stretched for long context ("default" = not at all)."""

    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm per head on q and k before rotary
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    dtype: str | None = None
    sliding_window: int | None = None

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike) -> ArchConfig:
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise ValueError(f"model path {path!r} is not a folder")
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ValueError(f"no config.json in model folder {path!r}")
        try:
            with open(config_path, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read {config_path!r}: {e}") from e
        return cls.from_dict(raw, source=config_path)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> ArchConfig:
        archs = raw.get("architectures") or []
        supported = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
        if not supported:
            raise ValueError(
                f"{source}: unsupported architecture {archs or '(none given)'}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = supported[0]

        def need(key: str) -> Any:
            if key not in raw or raw[key] is None:
                raise ValueError(f"{source}: missing required field {key!r}")
            return raw[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        rope_theta, rope_scaling = _parse_rope(raw, source)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = True if is_qwen2 else bool(raw.get("attention_bias", False))
        # Llama and Qwen3 put the same flag on o_proj; Qwen2 and Mistral never have one.
        o_proj_bias = arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and attention_bias
        config = cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=arch == "LlamaForCausalLM" and bool(raw.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            dtype=raw.get("dtype") or raw.get("torch_dtype"),
            sliding_window=raw.get("sliding_window"),
        )
        if heads % kv_heads:
            raise ValueError(f"{source}: num_attention_heads {heads} not a multiple of num_key_value_heads {kv_heads}")
        if _needs_sliding_window(raw, config):
            raise ValueError(
                f"{source}: this model uses sliding-window attention (sliding_window="
                f"{config.sliding_window} < max_position_embeddings={config.max_position_embeddings}), "
                "which raylm does not support"
            )
        return config

    @property
    def model_class(self):
        return get_model_class(self.architecture)


def _parse_rope(raw: dict[str, Any], source: str) -> tuple[float, RopeScaling]:
    # transformers >= 5 writes `rope_parameters`; older configs write rope_theta + rope_scaling.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{source}: unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        return theta, RopeScaling()
    if "factor" not in params:
        raise ValueError(f"{source}: rope type {rope_type!r} needs a 'factor'")
    scaling = RopeScaling(rope_type=rope_type, factor=float(params["factor"]))
    if rope_type == "llama3":
        scaling.low_freq_factor = float(params.get("low_freq_factor", 1.0))
        scaling.high_freq_factor = float(params.get("high_freq_factor", 4.0))
        original = params.get("original_max_position_embeddings") or raw.get("max_position_embeddings")
        scaling.original_max_position_embeddings = int(original)
    return theta, scaling


def _needs_sliding_window(raw: dict[str, Any], config: ArchConfig) -> bool:
    """True when some layer would attend over a window shorter than the context."""
    window = config.sliding_window
    if window is None or window >= config.max_position_embeddings:
        return False
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        return "sliding_attention" in layer_types
    if "use_sliding_window" in raw:  # Qwen2/Qwen3 style: off unless asked for
        max_window_layers = raw.get("max_window_layers", 0) or 0
        return bool(raw["use_sliding_window"]) and config.num_hidden_layers > max_window_layers
    return True  # Mistral style: a window is in force whenever one is given
