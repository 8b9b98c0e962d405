"""Quantized models on CUDA (issue 24, item 5): a GGUF file and --quantization
int8 load there with their weights dequantized to the model dtype at load (no
GPU kernel yet), and greedy-decode what Hugging Face does on the same float
weights on the same GPU (fp32: token for token). Untested until a GPU run."""

from __future__ import annotations

import pytest
import torch

from raylm import LLM, SamplingParams
from raylm.testing.gguf_writer import write_dequantized_reference, write_gguf
from raylm.testing.int8_reference import write_int8_reference
from tests.conftest import executor_of
from tests.gpu.conftest import hf_greedy_cuda

PROMPTS = [[1, 17, 300, 5, 42], [1, 99, 640, 7, 3, 250, 11, 500, 23]]
MAX_TOKENS = 12
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def q4_k_m(name: str, shape) -> str:
    return "Q6_K" if name.endswith(("attn_v.weight", "ffn_down.weight", "output.weight")) else "Q4_K"


def _greedy(model: str, **engine) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model, dtype="float32", distributed_executor_backend="uni", gpu_memory_utilization=0.3, **engine) as llm:
        assert executor_of(llm).driver_worker.worker.device.type == "cuda"
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("variant", ["Q8_0", "Q4_K_M", "int8"])
def test_quantized_model_on_cuda_matches_hf_on_its_float_weights(variant, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLM_GGUF_CACHE", str(tmp_path / "cache"))
    folder = tiny_model_dir("llama", **SHAPE)
    if variant == "int8":
        reference = write_int8_reference(folder, tmp_path / "reference")
        ours = _greedy(folder, quantization="int8")
    else:
        chooser = q4_k_m if variant == "Q4_K_M" else None
        path = write_gguf(folder, tmp_path / "m.gguf", variant, tensor_type=chooser)
        reference = write_dequantized_reference(folder, tmp_path / "reference", variant, tensor_type=chooser)
        ours = _greedy(str(path))
    expected = [
        [step.token_id for step in steps] for steps in hf_greedy_cuda(reference, PROMPTS, MAX_TOKENS, torch.float32)
    ]
    assert ours == expected
