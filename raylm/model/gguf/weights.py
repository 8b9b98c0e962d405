"""The tensors of a GGUF file under the Hugging Face names the model loads.

Float tensors (F32, F16, BF16) come as lazy slices that read only the rows or
columns a rank keeps; quantized ones as QuantizedWeight over the file's
memory map. llama.cpp's converter permutes the rows of Llama's q and k
projections so that ggml's rotary (which rotates adjacent pairs) matches the
Hugging Face one (which rotates the two halves of each head); raylm rotates
halves, so those rows are put back in Hugging Face order here. Qwen2/Qwen3
files are written unpermuted.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType

from raylm.model.gguf.reader import GGUFFile
from raylm.model.quantization import QUANT_TYPES, QuantizedWeight

_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_PARTS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight; ValueError if unknown."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _TOP_PARTS:
        return f"{_TOP_PARTS[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_PARTS:
        return f"model.layers.{parts[1]}.{_LAYER_PARTS[parts[2]]}.{suffix}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}")


def rope_unpermute_order(rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation: file_rows[order] = HF rows."""
    forward = np.arange(rows).reshape(n_head, 2, rows // n_head // 2).swapaxes(1, 2).reshape(rows)
    return np.argsort(forward)


class GGUFFloatSlice:
    """A float tensor in the file, read (and widened to a torch dtype) only where indexed."""

    def __init__(self, data: np.ndarray, ggml_type: GGMLQuantizationType, order: np.ndarray | None = None):
        self.data, self.ggml_type, self.order = data, ggml_type, order

    def get_shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def __getitem__(self, index) -> torch.Tensor:
        data = self.data if self.order is None else self.data[self.order]
        part = np.array(data[index], copy=True)  # out of the read-only memory map
        if self.ggml_type == GGMLQuantizationType.BF16:
            return torch.from_numpy(part.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(part)


def iterate_gguf_weights(gguf_file: GGUFFile, num_heads: int, num_kv_heads: int) -> Iterator[tuple[str, object]]:
    permuted = gguf_file.architecture == "llama"
    for t in gguf_file.reader.tensors:
        name = hf_name(t.name)
        data = t.data
        if t.tensor_type == GGMLQuantizationType.BF16:
            data = data.view(np.uint16).reshape(*data.shape[:-1], -1) if data.dtype == np.uint8 else data
        order = None
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            heads = num_heads if ".q_proj." in name else num_kv_heads
            order = rope_unpermute_order(data.shape[0], heads)
        qtype = next((q for q in QUANT_TYPES.values() if q.ggml_type == t.tensor_type), None)
        if qtype is None:
            yield name, GGUFFloatSlice(data, t.tensor_type, order)
            continue
        weight = QuantizedWeight(qtype, data, int(t.shape[0]), name=f"{t.name} ({name})")
        yield name, weight if order is None else weight.permute_rows(order)
