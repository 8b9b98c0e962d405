"""Open and check a GGUF file, and read the model's config from its metadata.

Everything is checked before anything is loaded: the file parses, every
tensor's data lies inside the file (a truncated download fails here, naming
the first tensor cut off), the architecture is one raylm serves, and every
tensor's type is one raylm can run (else the error names the tensor and type).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from raylm.model.quantization import FLOAT_GGUF_TYPES, QUANT_TYPES

logger = logging.getLogger(__name__)

# general.architecture -> the Hugging Face architecture raylm implements it with.
# llama.cpp writes Mistral (and other Llama-shaped models) as "llama".
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Types raylm loads, by ggml type.
QUANT_GGML = {q.ggml_type: name for name, q in QUANT_TYPES.items() if q.ggml_type is not None}
SUPPORTED_TYPES = {**FLOAT_GGUF_TYPES, **QUANT_GGML}


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
        need = self._need
        heads = int(need("attention.head_count"))
        hidden = int(need("embedding_length"))
        tensors = self.tensors
        vocab = self.arch_field("vocab_size") or len(self.field("tokenizer.ggml.tokens") or [])
        if not vocab and "token_embd.weight" in tensors:
            vocab = int(tensors["token_embd.weight"].shape[1])
        head_dim = self.arch_field("attention.key_length") or hidden // heads
        rope_dims = self.arch_field("rope.dimension_count")
        if rope_dims is not None and int(rope_dims) != int(head_dim):
            raise ValueError(f"{self.path}: partial rotary (rope.dimension_count {rope_dims} < head dim "
                             f"{head_dim}) is not supported")
        if "rope_freqs.weight" in tensors:
            raise ValueError(f"{self.path}: per-frequency rope factors (tensor rope_freqs.weight, Llama 3.1 "
                             "style rope scaling) are not supported for GGUF files yet")
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(self.arch_field("rope.freq_base", 10000.0))}
        scaling = self.arch_field("rope.scaling.type")
        if scaling not in (None, "none"):
            if scaling != "linear":
                raise ValueError(f"{self.path}: rope scaling {scaling!r} is not supported (linear is)")
            rope.update(rope_type="linear", factor=float(self.arch_field("rope.scaling.factor")))
        eos = self.field("tokenizer.ggml.eos_token_id")
        return {
            "architectures": [GGUF_ARCHITECTURES[self.architecture]],
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(need("feed_forward_length")),
            "num_hidden_layers": int(need("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.arch_field("attention.head_count_kv", heads)),
            "head_dim": int(head_dim),
            "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
            "rope_parameters": rope,
            "max_position_embeddings": int(need("context_length")),
            "tie_word_embeddings": "output.weight" not in tensors,
            "attention_bias": "blk.0.attn_q.bias" in tensors,
            "mlp_bias": "blk.0.ffn_up.bias" in tensors,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": int(eos) if eos is not None else None,
            # Activations: float32 for an all-float32 file, else bfloat16 (as a
            # bf16 checkpoint would run); the weights keep their own types.
            "dtype": "float32" if set(self.type_counts()) == {"F32"} else "bfloat16",
        }

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


class _TruncationCheckingReader(GGUFReader):
    """GGUFReader that names the first tensor whose data lies past the end of the
    file, instead of failing on a numpy reshape of the short memory map."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        size = len(self.data)
        for field in fields:
            try:
                _, name_data, _, dims, raw_dtype, offset = field.parts
                block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_dtype[0]))]
                end = int(start_offs + offset[0]) + int(np.prod(dims)) * type_size // block_size
                name = bytes(name_data).decode("utf-8", "replace")
            except (ValueError, KeyError, TypeError):
                continue  # an unknown type: refused by name later
            if end > size:
                raise _Truncated(f"tensor {name!r} needs bytes up to {end}, the file has {size}")
        super()._build_tensors(start_offs, fields)


class _Truncated(Exception):
    pass


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
    try:
        reader = _TruncationCheckingReader(path, "r")
    except _Truncated as e:
        raise ValueError(f"truncated GGUF file {path!r}: {e}") from None
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors... on bad bytes
        raise ValueError(f"corrupt or truncated GGUF file {path!r}: {type(e).__name__}: {e}") from e
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ValueError(
                f"truncated GGUF file {path!r}: tensor {t.name!r} needs bytes up to {t.data_offset + t.n_bytes}, "
                f"the file has {size}"
            )
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
    return GGUFFile(path, reader, arch)
