"""GGUF model files: tiny models written by the suite with the `gguf` package
the way llama.cpp's converter writes them (its names, metadata, q/k row
permutation, tokenizer), then loaded by raylm.

Oracles: on an F32 file, the logits of the same model's safetensors folder;
on a quantized file, transformers running the float weights that the file's
blocks decode to (decoded by `gguf.quants.dequantize`, the format's own
reference), within float tolerance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raylm import LLM, SamplingParams
from raylm.model.gguf import open_gguf
from raylm.model.loader import load_model
from raylm.model.quantization import QuantizedWeight, quant_type
from raylm.testing import load_hf_model
from raylm.testing.gguf_writer import write_dequantized_reference, write_gguf

TOKENS = torch.tensor([1, 17, 300, 5, 42, 99, 640, 7, 3, 250, 11, 500])
# Rows of 256 (and 512) weights: whole Q4_K/Q6_K super-blocks, so every type is exercised.
QUANT_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
SMALL_ENGINE = {"num_threads": 1, "kv_cache_memory_bytes": 4 << 20}


def q4_k_m(name: str, shape) -> str:
    """A Q4_K_M-like mix: v and down projections in Q6_K, the rest in Q4_K."""
    return "Q6_K" if name.endswith(("attn_v.weight", "ffn_down.weight", "output.weight")) else "Q4_K"


@torch.inference_mode()
def raylm_logits(model) -> torch.Tensor:
    return model.compute_logits(model(TOKENS, torch.arange(len(TOKENS))))


@torch.inference_mode()
def hf_logits(folder) -> torch.Tensor:
    return load_hf_model(folder)(TOKENS[None]).logits[0].float()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_file_gives_the_safetensors_logits(arch, tiny_model_dir, tmp_path):
    folder = tiny_model_dir(arch)
    path = write_gguf(folder, tmp_path / "model.gguf")
    expected = raylm_logits(load_model(folder, torch.float32, "cpu"))
    assert torch.equal(raylm_logits(load_model(str(path), torch.float32, "cpu")), expected)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q4_K_M"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_file_matches_its_dequantized_float_model(arch, qtype, tiny_model_dir, tmp_path):
    folder = tiny_model_dir(arch, **QUANT_SHAPE)
    chooser = q4_k_m if qtype == "Q4_K_M" else None
    path = write_gguf(folder, tmp_path / "model.gguf", qtype, tensor_type=chooser)
    types = open_gguf(path).type_counts()
    assert types.get("Q6_K" if qtype == "Q4_K_M" else qtype, 0) >= 4, types  # the weights really are quantized
    reference = write_dequantized_reference(folder, tmp_path / "reference", qtype, tensor_type=chooser)
    expected = hf_logits(reference)
    got = raylm_logits(load_model(str(path), torch.float32, "cpu"))
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
    # ...and that model is not the unquantized one (the check above can tell them apart).
    assert (hf_logits(folder) - expected).abs().max() > 1e-2


def test_generation_and_tokenizer_come_from_the_file(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLM_GGUF_CACHE", str(tmp_path / "cache"))
    folder = tiny_model_dir("llama")
    path = write_gguf(folder, tmp_path / "model.gguf")
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    prompts = ["ROMEO:", "Hello there, friend"]
    from_folder = LLM(model=folder, **SMALL_ENGINE)
    expected = [(o.prompt_token_ids, o.outputs[0].token_ids) for o in from_folder.generate(prompts, greedy)]
    chat = [{"role": "user", "content": "hi"}]
    expected_chat = from_folder.chat(chat, greedy)[0].prompt_token_ids
    del from_folder
    llm = LLM(model=str(path), **SMALL_ENGINE)
    assert llm.llm_engine.config.model_config.quantization == "gguf"
    assert [(o.prompt_token_ids, o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)] == expected
    assert llm.chat(chat, greedy)[0].prompt_token_ids == expected_chat


def test_unsupported_tensor_type_is_refused_naming_tensor_and_type(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("llama")
    path = write_gguf(
        folder,
        tmp_path / "m.gguf",
        "Q8_0",
        tensor_type=lambda name, shape: "Q4_1" if name == "blk.1.ffn_up.weight" else "Q8_0",
    )
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_up\.weight' has type Q4_1"):
        load_model(str(path), torch.float32, "cpu")


def test_truncated_file_is_refused(tiny_model_dir, tmp_path):
    path = write_gguf(tiny_model_dir("llama"), tmp_path / "m.gguf", "Q8_0")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match="truncated GGUF file .*m.gguf.*tensor"):
        load_model(str(path), torch.float32, "cpu")
    path.write_bytes(data[:100])  # cut inside the metadata
    with pytest.raises(ValueError, match="corrupt or truncated GGUF file"):
        load_model(str(path), torch.float32, "cpu")


def test_unknown_architecture_is_refused(tiny_model_dir, tmp_path):
    path = write_gguf(tiny_model_dir("llama"), tmp_path / "m.gguf", architecture="phi3")
    with pytest.raises(ValueError, match="architecture 'phi3' is not served by raylm"):
        load_model(str(path), torch.float32, "cpu")
    with pytest.raises(ValueError, match="architecture 'phi3'"):
        LLM(model=str(path), **SMALL_ENGINE)


def test_int8_quantization_of_a_gguf_file_is_refused(tiny_model_dir, tmp_path):
    path = write_gguf(tiny_model_dir("llama"), tmp_path / "m.gguf", "Q8_0")
    with pytest.raises(ValueError, match="quantization 'int8'"):
        LLM(model=str(path), quantization="int8", **SMALL_ENGINE)


def test_blocks_split_only_on_block_boundaries():
    rng = np.random.default_rng(0)
    from raylm.testing.kquants import quantize_q4_k

    weight = QuantizedWeight(quant_type("Q4_K"), quantize_q4_k(rng.standard_normal((4, 512))), 512, name="w")
    left, right = weight[:, 0:256], weight[:, 256:512]
    torch.testing.assert_close(torch.cat([left.dequantize(), right.dequantize()], dim=1), weight.dequantize())
    with pytest.raises(ValueError, match="cannot split a Q4_K weight of 512 columns at column 128"):
        weight[:, 128:256]


def test_a_quantized_lm_head_stays_quantized(tiny_model_dir, tmp_path):
    """GGUF's output.weight runs on the quantized kernels (decode reads it every
    token); the embedding is dequantized (its lookup reads one row per token)."""
    folder = tiny_model_dir("llama", tie_word_embeddings=False, **QUANT_SHAPE)
    path = write_gguf(folder, tmp_path / "model.gguf", "Q4_K", tensor_type=q4_k_m)
    names = {t.name: t.tensor_type.name for t in open_gguf(path).reader.tensors}
    assert names["output.weight"] == "Q6_K" and names["token_embd.weight"] == "Q4_K"
    model = load_model(str(path), torch.float32, "cpu")
    head = model.lm_head
    assert head.quant_matmul is not None and head.weight.numel() == 0
    assert [s.qtype.name for s in head.quant_matmul.segments] == ["Q6_K"]
    assert model.model.embed_tokens.weight.shape[0] >= 512
    reference = write_dequantized_reference(folder, tmp_path / "reference", "Q4_K", tensor_type=q4_k_m)
    torch.testing.assert_close(raylm_logits(model), hf_logits(reference), atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_decode_of_quantized_layers_equals_the_module_path(arch, tiny_model_dir, tmp_path, monkeypatch):
    """Decode steps of a Q4_K_M-like bf16 model through quant_decode_layers (one
    call for the layers; q and k in Q4_K, v in Q6_K, a bias-free and a q/k-norm
    architecture) against the same model module by module: the same kernels in
    the same order, so tokens and logprobs agree to the bit. Seven requests:
    steps of 5-7 rows take the fused loop too (the packed kernels serve up to
    PACKED_MAX_ROWS), then fewer as requests finish."""
    from raylm.model import llama_decode
    from raylm.model.layers import quant_kernels
    from raylm.model.layers.cpu_kernels import get_cpu_kernels

    kernels = get_cpu_kernels()
    if kernels is None or not quant_kernels.packed_kernel_available(kernels):
        pytest.skip("no AVX-512 VNNI decode kernel in this build")

    class Counting:
        calls = 0
        rows: set[int] = set()

        def __getattr__(self, name):
            return getattr(kernels, name)

        def quant_decode_layers(self, *args):
            Counting.calls += 1
            Counting.rows.add(args[0].shape[0])
            return kernels.quant_decode_layers(*args)

    monkeypatch.setattr(llama_decode, "get_cpu_kernels", lambda: Counting())
    path = write_gguf(tiny_model_dir(arch, **QUANT_SHAPE), tmp_path / "model.gguf", "Q4_K", tensor_type=q4_k_m)
    prompts = [[1, 17, 300, 5], [1, 99, 640, 7, 3, 250, 11], [2, 3], [8, 400], [9] * 6, [700, 1, 2], [33, 44, 55]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (12, 5, 9, 7, 3, 10, 6)
    ]

    def generate():
        with LLM(
            str(path), dtype="bfloat16", distributed_executor_backend="uni", enable_prefix_caching=False, **SMALL_ENGINE
        ) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    fused = generate()
    assert Counting.calls > 0, "no decode step went through quant_decode_layers"
    assert max(Counting.rows) == len(prompts) and min(Counting.rows) <= 2, Counting.rows
    monkeypatch.setattr(llama_decode, "ENABLED", False)
    Counting.calls = 0
    modules = generate()
    assert Counting.calls == 0
    assert fused == modules
