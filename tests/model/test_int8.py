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


def test_an_int8_model_keeps_one_copy_of_its_weights(tiny_model_dir):
    """Layers keep the packed int8 weight only (not the row-major matrix beside it):
    the int8 bytes reachable from the loaded model are the checkpoint's linear
    weights once, up to the packing's padding, and no QuantizedWeight is left."""
    from raylm.model.layers.cpu_kernels import get_cpu_kernels
    from tests.model.test_quant_kernels import bytes_held_once

    if get_cpu_kernels() is None:
        pytest.skip("no CPU kernels here: layers keep the int8 rows for aten's kernel")
    folder = tiny_model_dir(
        "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2
    )
    model = load_model(folder, torch.bfloat16, "cpu", quantization="int8")
    linears = [m for m in model.modules() if getattr(m, "quant_matmul", None) is not None]
    int8_bytes = sum(segment.shape[0] * segment.shape[1] for m in linears for segment in m.quant_matmul.segments)
    held = bytes_held_once(model, torch.int8)
    assert int8_bytes <= held <= 1.05 * int8_bytes, (held, int8_bytes)
    # Decode and prefill rows (the packed kernel, for any count) equal the dequantized matmul.
    segment = linears[0].quant_matmul.segments[0]
    state = segment.state
    packed, scales = state[3], state[4]  # tiles [N / 16, K / 4, 4, 16 columns]
    rows_of_packed = packed.permute(0, 3, 1, 2).reshape(packed.shape[0] * 16, -1)[: segment.shape[0]]
    dequantized = rows_of_packed[:, : segment.shape[1]].double() * scales.double()[:, None]
    for rows in (1, 4, 5, 300):
        x = torch.randn(rows, segment.shape[1]).bfloat16()
        torch.testing.assert_close(segment(x).double(), x.double() @ dequantized.t(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("method", ["awq", "gguf"])
def test_unsupported_or_misplaced_method_is_refused(method, tiny_model_dir):
    with pytest.raises(ValueError, match=f"quantization '{method}'"):
        LLM(model=tiny_model_dir("llama"), quantization=method, **SMALL_ENGINE)
