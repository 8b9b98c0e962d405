"""Load-time weight-only int8 (`--quantization int8`): every linear-layer
weight of a float checkpoint as int8 with one scale per output row. Oracle:
transformers running the float weights those int8 values and scales stand for
(computed here, independently of raylm's quantizer)."""

from __future__ import annotations

import pytest
import torch

from raylm import LLM, SamplingParams
from raylm.model.loader import load_model
from raylm.testing import load_hf_model
from raylm.testing.int8_reference import write_int8_reference

TOKENS = torch.tensor([1, 17, 300, 5, 42, 99, 640, 7, 3, 250, 11, 500])
SMALL_ENGINE = {"num_threads": 1, "kv_cache_memory_bytes": 4 << 20, "dtype": "float32"}


@torch.inference_mode()
def test_int8_logits_match_the_dequantized_float_model(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("qwen2")
    reference = write_int8_reference(folder, tmp_path / "reference")
    model = load_model(folder, torch.float32, "cpu", quantization="int8")
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.quant_matmul is not None and layer.mlp.down_proj.quant_matmul is not None
    assert layer.mlp.gate_up_proj.weight.numel() == 0  # no float copy kept
    got = model.compute_logits(model(TOKENS, torch.arange(len(TOKENS))))
    expected = load_hf_model(reference)(TOKENS[None]).logits[0].float()
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
    assert (load_hf_model(folder)(TOKENS[None]).logits[0] - expected).abs().max() > 1e-2


def test_int8_engine_generates_what_the_dequantized_model_does(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("llama")
    reference = write_int8_reference(folder, tmp_path / "reference")
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    prompts = ["ROMEO:", "Hello there, friend"]
    llm = LLM(model=folder, quantization="int8", **SMALL_ENGINE)
    assert llm.llm_engine.config.model_config.quantization == "int8"
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    del llm
    expected = [o.outputs[0].token_ids for o in LLM(model=str(reference), **SMALL_ENGINE).generate(prompts, greedy)]
    assert got == expected


@pytest.mark.parametrize("method", ["awq", "gguf"])
def test_unsupported_or_misplaced_method_is_refused(method, tiny_model_dir):
    with pytest.raises(ValueError, match=f"quantization '{method}'"):
        LLM(model=tiny_model_dir("llama"), quantization=method, **SMALL_ENGINE)
