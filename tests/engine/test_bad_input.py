"""Bad input raises ValueError naming the field, and the engine keeps serving."""

from __future__ import annotations

import pytest
from safetensors.torch import save_file
import torch

from raylm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=64, kv_cache_memory_bytes=16 << 20) as engine:
        yield engine


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),  # 0 and -1 both mean "no top-k", as in vLLM
        ({"top_k": 1.5}, "top_k"),
        ({"n": 0}, "n"),
        ({"min_p": 2.0}, "min_p"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "prompt, field",
    [
        ("", "prompt"),
        ({"prompt_token_ids": []}, "prompt"),
        ({"prompt_token_ids": [1, 2, 10**6]}, "prompt_token_ids"),
        ({"prompt_token_ids": [-1]}, "prompt_token_ids"),
        ({"prompt_token_ids": [1] * 65}, "max_model_len"),
        (12, "prompt"),
    ],
)
def test_bad_prompt_then_engine_still_serves(llm, prompt, field):
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match=field):
        llm.generate(["fine prompt", prompt], good, use_tqdm=False)
    # Nothing of the failed batch was left in the engine.
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate("fine prompt", good, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_out_of_vocab_stop_token(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate("x", SamplingParams(stop_token_ids=[10**7]), use_tqdm=False)


def test_unknown_model_path(tmp_path):
    with pytest.raises(ValueError, match="model path"):
        LLM(str(tmp_path / "nope"))


def test_unsupported_architecture(tiny_model_dir, tmp_path):
    import json
    import shutil

    folder = tmp_path / "gpt"
    shutil.copytree(tiny_model_dir("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="LlamaForCausalLM") as err:
        LLM(str(folder))
    assert "Qwen3ForCausalLM" in str(err.value) and "MistralForCausalLM" in str(err.value)


def test_corrupt_safetensors(tiny_model_dir, tmp_path):
    import shutil

    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_model_dir("llama"), folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(folder), kv_cache_memory_bytes=16 << 20)


def test_bad_engine_arguments(tiny_model_dir):
    model = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="dtype"):
        LLM(model, dtype="int3")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model, max_model_len=10**6)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        LLM(model, distributed_executor_backend="carrier-pigeon")
