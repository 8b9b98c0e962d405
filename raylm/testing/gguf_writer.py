"""Write a Hugging Face Llama-family folder as a GGUF file the way llama.cpp's
converter (convert_hf_to_gguf.py) does, with the `gguf` package: its metadata
keys, its tensor names, a byte-level BPE tokenizer as "gpt2", and the rows of
Llama's q/k projections permuted for ggml's rotary. Tests use it to make GGUF
files of tiny models whose logits they know.

`tensor_type` picks each tensor's type (e.g. Q8_0 for 2-D weights); like
llama-quantize, a weight whose rows are not whole blocks of that type falls
back to F16, and 1-D tensors (norms, biases) stay F32.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants
from safetensors.torch import load_file

from raylm.testing.kquants import quantize_q4_k, quantize_q6_k

_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_tensor_name(hf_name: str) -> str:
    stem, _, suffix = hf_name.rpartition(".")
    if stem in _TOP:
        return f"{_TOP[stem]}.{suffix}"
    parts = stem.split(".")
    return f"blk.{parts[2]}.{_LAYER['.'.join(parts[3:])]}.{suffix}"


def permute_for_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation of a q/k weight: each head's halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(w: np.ndarray, qtype: str) -> tuple[np.ndarray, T]:
    """(raw data, type) of a float tensor in `qtype` (with llama-quantize's F16 fallback)."""
    ggml_type = T[qtype]
    block = gguf.GGML_QUANT_SIZES[ggml_type][0]
    if w.ndim == 1 or qtype == "F32":
        return w.astype(np.float32), T.F32
    if w.shape[-1] % block:
        qtype, ggml_type = "F16", T.F16
    if qtype == "F16":
        return w.astype(np.float16), T.F16
    if qtype == "Q4_K":
        return quantize_q4_k(w), T.Q4_K
    if qtype == "Q6_K":
        return quantize_q6_k(w), T.Q6_K
    return quants.quantize(w.astype(np.float32), ggml_type), ggml_type


def write_gguf(
    model_dir: str | pathlib.Path,
    path: str | pathlib.Path,
    qtype: str = "F32",
    tensor_type: Callable[[str, tuple[int, ...]], str] | None = None,
    architecture: str | None = None,
) -> pathlib.Path:
    """Write `model_dir` (config.json, model.safetensors, tokenizer.json) to `path`.

    Every 2-D tensor gets `qtype` unless `tensor_type(gguf_name, shape)` says
    otherwise; `architecture` overrides general.architecture (for tests of refusal)."""
    model_dir, path = pathlib.Path(model_dir), pathlib.Path(path)
    config = json.loads((model_dir / "config.json").read_text())
    arch = architecture or _ARCH[config["architectures"][0]]
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(model_dir.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != hidden // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_vocab_size(config["vocab_size"])
    _add_tokenizer(writer, model_dir, config)

    weights = load_file(str(model_dir / "model.safetensors"))
    for hf_name, tensor in weights.items():
        tied_head = hf_name == "lm_head.weight" and config.get("tie_word_embeddings")
        if hf_name.endswith("rotary_emb.inv_freq") or tied_head:
            continue
        w = tensor.float().numpy()
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            w = permute_for_rope(w, heads)
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            w = permute_for_rope(w, kv_heads)
        name = gguf_tensor_name(hf_name)
        chosen = tensor_type(name, w.shape) if tensor_type else qtype
        data, ggml_type = encode(w, chosen)
        writer.add_tensor(
            name,
            data,
            raw_shape=data.shape if ggml_type not in (T.F32, T.F16) else None,
            raw_dtype=ggml_type if ggml_type not in (T.F32, T.F16) else None,
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: gguf.GGUFWriter, model_dir: pathlib.Path, config: dict) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp writes it ("gpt2")."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    added = {t["content"]: t for t in tokenizer.get("added_tokens", [])}
    tokens = [None] * config["vocab_size"]
    for text, index in vocab.items():
        tokens[index] = text
    for text, entry in added.items():
        tokens[entry["id"]] = text
    types = []
    for i, text in enumerate(tokens):
        if text is None:
            tokens[i], kind = f"[PAD{i}]", gguf.TokenType.UNUSED
        elif text in added:
            kind = gguf.TokenType.CONTROL if added[text].get("special") else gguf.TokenType.USER_DEFINED
        else:
            kind = gguf.TokenType.NORMAL
        types.append(kind)
    merges = [" ".join(m) if isinstance(m, list) else m for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    ids = {text: entry["id"] for text, entry in added.items()}
    for key, add in (
        ("bos_token", writer.add_bos_token_id),
        ("eos_token", writer.add_eos_token_id),
        ("unk_token", writer.add_unk_token_id),
        ("pad_token", writer.add_pad_token_id),
    ):
        text = tokenizer_config.get(key)
        if isinstance(text, str) and text in ids:
            add(ids[text])
    add_bos = tokenizer_config.get("add_bos_token")
    if add_bos is None:  # as llama.cpp's SpecialVocab: a post-processor that starts with BOS adds it
        single = (tokenizer.get("post_processor") or {}).get("single") or [{}]
        add_bos = single[0].get("SpecialToken", {}).get("id") == tokenizer_config.get("bos_token")
    writer.add_add_bos_token(bool(add_bos))
    writer.add_add_eos_token(bool(tokenizer_config.get("add_eos_token", False)))
    if tokenizer_config.get("chat_template"):
        writer.add_chat_template(tokenizer_config["chat_template"])


def write_dequantized_reference(
    model_dir: str | pathlib.Path,
    out_dir: str | pathlib.Path,
    qtype: str = "Q8_0",
    tensor_type: Callable[[str, tuple[int, ...]], str] | None = None,
) -> pathlib.Path:
    """A copy of `model_dir` whose weights are what write_gguf's blocks decode to
    (by `gguf.quants.dequantize`, the format's own decoder): the float model a
    quantized GGUF file stands for, for transformers (or raylm) to run."""
    import shutil

    import torch
    from safetensors.torch import save_file

    model_dir, out_dir = pathlib.Path(model_dir), pathlib.Path(out_dir)
    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    arch = _ARCH[config["architectures"][0]]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    weights = load_file(str(model_dir / "model.safetensors"))
    out = {}
    for hf_name, tensor in weights.items():
        w = tensor.float().numpy()
        if w.ndim == 2 and not hf_name.endswith("rotary_emb.inv_freq"):
            n_head = heads if ".q_proj." in hf_name else kv_heads if ".k_proj." in hf_name else None
            permute = arch == "llama" and n_head is not None
            chosen_in = permute_for_rope(w, n_head) if permute else w
            chosen = tensor_type(gguf_tensor_name(hf_name), w.shape) if tensor_type else qtype
            data, ggml_type = encode(chosen_in, chosen)
            decoded = quants.dequantize(data, ggml_type).astype(np.float32).reshape(w.shape)
            if permute:  # back to Hugging Face row order
                from raylm.model.gguf.weights import rope_unpermute_order

                decoded = decoded[rope_unpermute_order(w.shape[0], n_head)]
            w = decoded
        out[hf_name] = torch.from_numpy(np.ascontiguousarray(w)).to(tensor.dtype)
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
