"""Open and check a GGUF file, and read the model's config from its metadata.

Everything is checked before anything is loaded: the header walks cleanly
within the file's bytes and limits (header.py: a crafted count or length fails
there, before gguf's reader would believe it), every tensor's data lies inside
the file (a truncated download fails here, naming the first tensor cut off),
the architecture is one raylm serves, every tensor's type is one raylm can run
(else the error names the tensor and type), and the metadata that sizes the
model is within sane limits and matches the tensors the file holds.
"""

from __future__ import annotations

import functools
import logging
import os
import reprlib
from dataclasses import dataclass
from typing import Any

from gguf import GGUFReader

from raylm.model.gguf.header import check_header
from raylm.model.quantization import FLOAT_GGUF_TYPES, QUANT_TYPES

logger = logging.getLogger(__name__)

# general.architecture -> the Hugging Face architecture raylm implements it with.
# llama.cpp writes Mistral (and other Llama-shaped models) as "llama".
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Types raylm loads, by ggml type.
QUANT_GGML = {q.ggml_type: name for name, q in QUANT_TYPES.items() if q.ggml_type is not None}
SUPPORTED_TYPES = {**FLOAT_GGUF_TYPES, **QUANT_GGML}

# Bounds on the metadata that sizes what raylm allocates from the config alone
# (the model's parameters before any weight is read, the rotary caches, the KV
# cache): each well above every released Llama/Qwen model (in brackets), low
# enough that a crafted value fails here instead of exhausting memory. The
# weights' sizes are also held to the tensors in the file (_check_tensor_shapes).
METADATA_LIMITS = {
    "context_length": 1 << 22,  # 4,194,304 [Llama-3 finetunes of 4,194,304; Qwen2.5-1M 1,010,000]
    "embedding_length": 1 << 16,  # 65,536 [Llama 3.1 405B 16,384]
    "feed_forward_length": 1 << 18,  # 262,144 [405B 53,248]
    "block_count": 512,  # llama.cpp's LLAMA_MAX_LAYERS [405B 126]
    "attention.head_count": 1024,  # [405B 128]
    "attention.head_count_kv": 1024,
    "attention.key_length": 1024,  # the head dim [256]
    "vocab_size": 1 << 20,  # 1,048,576 [262,144]
    "expert_count": 1024,  # not used by raylm (no MoE), bounded all the same [384]
    "expert_used_count": 1024,
}
# The weights of every block, by their shape in the file (ggml order: the
# input dimension first); hidden, q and kv widths, feed-forward width.
_BLOCK_WEIGHTS = {
    "attn_q.weight": ("hidden", "q"),
    "attn_k.weight": ("hidden", "kv"),
    "attn_v.weight": ("hidden", "kv"),
    "attn_output.weight": ("q", "hidden"),
    "ffn_gate.weight": ("hidden", "ff"),
    "ffn_up.weight": ("hidden", "ff"),
    "ffn_down.weight": ("ff", "hidden"),
}


def is_gguf_path(path: str | os.PathLike) -> bool:
    return os.fspath(path).lower().endswith(".gguf")


@dataclass
class GGUFFile:
    path: str
    reader: GGUFReader
    architecture: str  # general.architecture, e.g. "llama"

    def field(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.architecture}.{key}", default)

    @property
    def tensors(self) -> dict[str, Any]:
        return {t.name: t for t in self.reader.tensors}

    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.reader.tensors:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        return counts

    def config_dict(self) -> dict[str, Any]:
        """A Hugging Face config.json's fields, from the metadata (llama.cpp's keys)."""
        size = self._size
        heads = size("attention.head_count")
        hidden = size("embedding_length")
        tensors = self.tensors
        vocab = self.arch_field("vocab_size") or len(self.field("tokenizer.ggml.tokens") or [])
        if not vocab and "token_embd.weight" in tensors:
            vocab = int(tensors["token_embd.weight"].shape[-1])
        self._bounded("vocab_size", vocab)
        head_dim, derived = self.arch_field("attention.key_length"), ""
        if head_dim is None:  # not written when it is the embedding width over the heads
            head_dim, derived = hidden // heads, f"(absent: embedding_length {hidden} / head_count {heads}) "
        head_dim = self._bounded("attention.key_length", head_dim, derived)
        for key in ("expert_count", "expert_used_count"):
            if self.arch_field(key) is not None:
                self._bounded(key, self.arch_field(key), lowest=0)  # 0: a dense model
        rope_dims = self.arch_field("rope.dimension_count")
        if rope_dims is not None and int(rope_dims) != int(head_dim):
            raise ValueError(
                f"{self.path}: partial rotary (rope.dimension_count {rope_dims} < head dim {head_dim}) is not supported"
            )
        if "rope_freqs.weight" in tensors:
            raise ValueError(
                f"{self.path}: per-frequency rope factors (tensor rope_freqs.weight, Llama 3.1 "
                "style rope scaling) are not supported for GGUF files yet"
            )
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(self.arch_field("rope.freq_base", 10000.0))}
        scaling = self.arch_field("rope.scaling.type")
        if scaling not in (None, "none"):
            if scaling != "linear":
                raise ValueError(f"{self.path}: rope scaling {scaling!r} is not supported (linear is)")
            rope.update(rope_type="linear", factor=float(self.arch_field("rope.scaling.factor")))
        eos = self.field("tokenizer.ggml.eos_token_id")
        config = {
            "architectures": [GGUF_ARCHITECTURES[self.architecture]],
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": size("feed_forward_length"),
            "num_hidden_layers": size("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": size("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "rms_norm_eps": float(self._need("attention.layer_norm_rms_epsilon")),
            "rope_parameters": rope,
            "max_position_embeddings": size("context_length"),
            "tie_word_embeddings": "output.weight" not in tensors,
            "attention_bias": "blk.0.attn_q.bias" in tensors,
            "mlp_bias": "blk.0.ffn_up.bias" in tensors,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": int(eos) if eos is not None else None,
            # Activations: float32 for an all-float32 file, else bfloat16 (as a
            # bf16 checkpoint would run); the weights keep their own types.
            "dtype": "float32" if set(self.type_counts()) == {"F32"} else "bfloat16",
        }
        self._check_tensor_shapes(config)
        return config

    def _check_tensor_shapes(self, config: dict[str, Any]) -> None:
        """Every weight the config implies is in the file, in the config's shape.
        The model is allocated from the config before any weight is read: a
        config larger than the file's tensors would allocate memory they never
        fill (a tiny file claiming a 65,536-wide, million-token embedding)."""
        widths = {
            "hidden": config["hidden_size"],
            "ff": config["intermediate_size"],
            "q": config["num_attention_heads"] * config["head_dim"],
            "kv": config["num_key_value_heads"] * config["head_dim"],
        }
        expected = {"token_embd.weight": (config["hidden_size"], config["vocab_size"])}
        if not config["tie_word_embeddings"]:
            expected["output.weight"] = expected["token_embd.weight"]
        blocks = config["num_hidden_layers"]
        for i in range(blocks):
            for part, dims in _BLOCK_WEIGHTS.items():
                expected[f"blk.{i}.{part}"] = tuple(widths[d] for d in dims)
        tensors = self.tensors
        for name, shape in expected.items():
            if name not in tensors:
                raise ValueError(
                    f"{self.path}: GGUF file lacks tensor {name!r}, which its metadata implies "
                    f"({self.architecture}.block_count {blocks})"
                )
            found = tuple(int(d) for d in tensors[name].shape)
            if found != shape:
                raise ValueError(
                    f"{self.path}: tensor {name!r} has shape {list(found)}, the metadata "
                    f"({self.architecture}.*) implies {list(shape)}"
                )
        for name in tensors:
            parts = name.split(".")
            if len(parts) > 1 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) >= blocks:
                raise ValueError(f"{self.path}: tensor {name!r} lies past {self.architecture}.block_count {blocks}")

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Refuse a tensor-parallel size that would split a row-parallel weight
        (attn_output, ffn_down: split by input columns) inside a quantized block."""
        if tp_size == 1:
            return
        for t in self.reader.tensors:
            if not t.name.endswith(("attn_output.weight", "ffn_down.weight")):
                continue
            block = QUANT_TYPES[SUPPORTED_TYPES[t.tensor_type]].block_size if t.tensor_type in QUANT_GGML else 1
            cols = int(t.shape[0])
            if cols % tp_size or (cols // tp_size) % block:
                raise ValueError(
                    f"{self.path}: tensor_parallel_size {tp_size} would split tensor {t.name!r} "
                    f"({t.tensor_type.name}, {cols} columns) into shards of {cols / tp_size:g} columns, not whole "
                    f"{t.tensor_type.name} blocks of {block}; use a tensor_parallel_size that keeps whole blocks"
                )

    def _need(self, key: str) -> Any:
        value = self.arch_field(key)
        if value is None:
            raise ValueError(f"{self.path}: GGUF metadata lacks {self.architecture}.{key}")
        return value

    def _size(self, key: str, default: Any = None) -> int:
        """A required (or defaulted) metadata size, within METADATA_LIMITS."""
        return self._bounded(key, self._need(key) if default is None else self.arch_field(key, default))

    def _bounded(self, key: str, value: Any, derived: str = "", lowest: int = 1) -> int:
        """`value` of `key` (or, `derived` says how, in its place), within METADATA_LIMITS."""
        highest = METADATA_LIMITS[key]
        if isinstance(value, bool) or not isinstance(value, int) or not lowest <= value <= highest:
            raise ValueError(
                f"{self.path}: GGUF metadata {self.architecture}.{key} {derived}is "
                f"{reprlib.repr(value)}, not a whole number from {lowest} to {highest}"
            )
        return value


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """The checked GGUF file at `path`; ValueError naming the cause otherwise.

    gguf's reader parses every metadata value, the tokenizer's token list and
    merges too (most of the time of opening a file): a file opened again in the
    same process (config, then model) is parsed once while it is unchanged."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path!r} does not exist")
    stat = os.stat(path)
    return _open_checked(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_checked(path: str, size: int, mtime_ns: int) -> GGUFFile:
    try:  # first our bounded walk: gguf's reader believes every count in the header
        check_header(path)
    except ValueError as e:
        raise ValueError(f"corrupt or truncated GGUF file {path!r}: {e}") from None
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors... on bad bytes
        raise ValueError(f"corrupt or truncated GGUF file {path!r}: {type(e).__name__}: {e}") from e
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {path!r}: architecture {arch!r} is not served by raylm; supported: "
            f"{', '.join(GGUF_ARCHITECTURES)}"
        )
    for t in reader.tensors:
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ValueError(
                f"GGUF file {path!r}: tensor {t.name!r} has type {t.tensor_type.name}, which raylm cannot run; "
                f"supported types: {', '.join(SUPPORTED_TYPES.values())}"
            )
    gguf_file = GGUFFile(path, reader, arch)
    gguf_file.config_dict()  # the metadata's sizes, checked before anyone allocates by them
    return gguf_file
