"""Tests for the tiny model factory and the Hugging Face oracle helpers.

Everything else's correctness tests stand on these, so they check the folders against transformers.
"""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from raylm.testing import (
    SUPPORTED_ARCHS,
    hf_greedy,
    hf_logit_margins,
    hf_prompt_logprobs,
    load_hf_model,
    make_tiny_model,
)


def _safetensors_tensors(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    return tensors


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(arch, root / arch) for arch in SUPPORTED_ARCHS}


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_every_arch_builds_and_loads(tiny_folders, arch):
    folder = tiny_folders[arch]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = load_hf_model(folder)
    config = json.loads((folder / "config.json").read_text())
    generation_config = json.loads((folder / "generation_config.json").read_text())

    assert type(model).__name__ == config["architectures"][0]
    assert config["architectures"][0].lower().startswith(arch)
    assert config["vocab_size"] == len(tokenizer)
    assert config["hidden_size"] == 64 and config["num_hidden_layers"] == 2
    assert config["num_attention_heads"] == 4 and config["num_key_value_heads"] == 2
    for source in (config, generation_config):
        assert source["bos_token_id"] == tokenizer.bos_token_id
        assert source["eos_token_id"] == tokenizer.eos_token_id
    logits = model(torch.tensor([tokenizer.encode("hello world")])).logits
    assert logits.shape[-1] == len(tokenizer) and torch.isfinite(logits).all()


def test_unknown_arch_lists_supported(tmp_path):
    with pytest.raises(ValueError, match="llama.*qwen2.*qwen3.*mistral"):
        make_tiny_model("gpt2", tmp_path)


def test_same_seed_same_bytes_different_seed_different(tmp_path):
    first = make_tiny_model("qwen2", tmp_path / "a", seed=3)
    again = make_tiny_model("qwen2", tmp_path / "b", seed=3)
    other = make_tiny_model("qwen2", tmp_path / "c", seed=4)
    weights = (first / "model.safetensors").read_bytes()
    assert weights == (again / "model.safetensors").read_bytes()
    assert weights != (other / "model.safetensors").read_bytes()


def test_weights_are_rescaled_not_hf_default_init(tiny_folders):
    tensors = _safetensors_tensors(tiny_folders["mistral"])
    assert tensors["model.embed_tokens.weight"].std() > 0.2
    norm = tensors["model.layers.0.input_layernorm.weight"]
    assert 0.5 < norm.mean() < 1.5 and norm.std() > 0.01


def test_sharding_writes_index_and_same_weights(tmp_path):
    single = make_tiny_model("llama", tmp_path / "single", seed=1)
    sharded = make_tiny_model("llama", tmp_path / "sharded", seed=1, num_shards=3)
    shard_files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shard_files) == 3
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shard_files
    single_tensors = _safetensors_tensors(single)
    sharded_tensors = _safetensors_tensors(sharded)
    assert set(index["weight_map"]) == set(sharded_tensors) == set(single_tensors)
    for name, tensor in single_tensors.items():
        assert torch.equal(tensor, sharded_tensors[name]), name
    loaded = AutoModelForCausalLM.from_pretrained(sharded)
    assert torch.equal(loaded.model.norm.weight, single_tensors["model.norm.weight"])


def test_llama_ties_embeddings(tiny_folders):
    folder = tiny_folders["llama"]
    assert AutoConfig.from_pretrained(folder).tie_word_embeddings is True
    assert "lm_head.weight" not in _safetensors_tensors(folder)
    model = load_hf_model(folder)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_other_archs_are_untied(tiny_folders, arch):
    tensors = _safetensors_tensors(tiny_folders[arch])
    assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])


def test_qwen2_has_qkv_bias(tiny_folders):
    tensors = _safetensors_tensors(tiny_folders["qwen2"])
    for proj in ("q_proj", "k_proj", "v_proj"):
        bias = tensors[f"model.layers.1.self_attn.{proj}.bias"]
        assert bias.abs().max() > 0
    assert tensors["model.layers.1.self_attn.k_proj.bias"].shape == (2 * 16,)
    assert "model.layers.1.self_attn.o_proj.bias" not in tensors


def test_qwen3_head_dim_and_qk_norm(tiny_folders):
    folder = tiny_folders["qwen3"]
    config = AutoConfig.from_pretrained(folder)
    assert config.head_dim == 32 != config.hidden_size // config.num_attention_heads
    tensors = _safetensors_tensors(folder)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 32, 64)
    assert tensors["model.layers.0.self_attn.o_proj.weight"].shape == (64, 4 * 32)
    for norm in ("q_norm", "k_norm"):
        weight = tensors[f"model.layers.0.self_attn.{norm}.weight"]
        assert weight.shape == (32,) and not torch.allclose(weight, torch.ones(32))


def test_mistral_defaults_and_overrides(tiny_folders, tmp_path):
    config = AutoConfig.from_pretrained(tiny_folders["mistral"])
    assert config.rope_parameters["rope_theta"] == 1e6
    assert config.sliding_window is None
    folder = make_tiny_model("mistral", tmp_path, num_attention_heads=8, num_key_value_heads=1)
    config = AutoConfig.from_pretrained(folder)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 1, 8)
    assert _safetensors_tensors(folder)["model.layers.0.self_attn.k_proj.weight"].shape == (8, 64)


def _default_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def test_linear_rope_scaling_reaches_hf(tmp_path):
    # Given only rope_scaling, mistral must keep its own theta (1e6), not fall back to 1e4.
    folder = make_tiny_model("mistral", tmp_path, rope_scaling={"type": "linear", "factor": 4.0})
    saved = json.loads((folder / "config.json").read_text())["rope_parameters"]
    assert saved == {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}
    rotary = load_hf_model(folder).model.rotary_emb
    expected = _default_inv_freq(1e6, 16) / 4.0
    torch.testing.assert_close(rotary.inv_freq.double(), expected, rtol=1e-6, atol=0)


def test_llama3_rope_scaling_reaches_hf(tmp_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    folder = make_tiny_model("llama", tmp_path, rope_theta=500000.0, rope_scaling=scaling)
    saved = json.loads((folder / "config.json").read_text())["rope_parameters"]
    assert saved == {**scaling, "rope_theta": 500000.0}
    inv_freq = load_hf_model(folder).model.rotary_emb.inv_freq.double()
    default = _default_inv_freq(500000.0, 16)
    # Wavelengths under 256/4 stay as they are; those over 256/1 are slowed by the factor.
    assert math.isclose(inv_freq[0], default[0], rel_tol=1e-6)
    assert math.isclose(inv_freq[-1], default[-1] / 8.0, rel_tol=1e-6)


def test_bfloat16_weights(tmp_path):
    folder = make_tiny_model("qwen3", tmp_path, dtype=torch.bfloat16)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in _safetensors_tensors(folder).values())


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_tokenizer_round_trips_unicode_and_chat(tiny_folders, arch):
    # transformers picks a different tokenizer class per model type (Qwen2Tokenizer for qwen2);
    # all of them must give the ids the raw tokenizer.json gives.
    tokenizer = AutoTokenizer.from_pretrained(tiny_folders[arch])
    raw_tokenizer = Tokenizer.from_file(str(tiny_folders[arch] / "tokenizer.json"))
    text = "Crème brûlée in Zürich 東京 你好 😀🚀, plus unseen: Ωμέγα 🦀 ñandú ∮ 𝔘"
    ids = tokenizer.encode(text)
    assert ids == raw_tokenizer.encode(text).ids
    assert len(tokenizer) == raw_tokenizer.get_vocab_size()
    assert ids[0] == tokenizer.bos_token_id
    assert max(ids) < len(tokenizer)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    chat = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert chat == "<s><|system|>\nBe brief.<|end|>\n<|user|>\nHi 👋<|end|>\n<|assistant|>\n"
    config = json.loads((tiny_folders[arch] / "tokenizer_config.json").read_text())
    assert config["chat_template"] == tokenizer.chat_template


@torch.inference_mode()
def _argmax_loop_without_cache(folder, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokens, logprobs = list(prompt), []
    for _ in range(steps):
        step = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1], dim=-1)
        tokens.append(int(step.argmax()))
        logprobs.append(float(step[tokens[-1]]))
    return tokens[len(prompt) :], logprobs


def test_hf_greedy_matches_manual_argmax_loop(tiny_folders):
    folder = tiny_folders["qwen3"]
    prompt = AutoTokenizer.from_pretrained(folder).encode("ROMEO: But, soft! what light")
    [generation] = hf_greedy(folder, [prompt], max_new_tokens=12)
    expected_tokens, expected_logprobs = _argmax_loop_without_cache(folder, prompt, 12)
    assert generation.token_ids == expected_tokens
    assert len(set(generation.token_ids)) > 3  # a healthy model, not one token on repeat
    torch.testing.assert_close(generation.logprobs, expected_logprobs, rtol=0, atol=1e-5)
    # The prompt-logprob path (one full forward) agrees with the cached greedy path.
    rescored = hf_prompt_logprobs(folder, prompt + generation.token_ids)
    assert len(rescored) == len(prompt) + 12 - 1
    torch.testing.assert_close(rescored[len(prompt) - 1 :], generation.logprobs, rtol=0, atol=1e-5)


def test_hf_greedy_ignores_eos_and_runs_each_prompt(tiny_folders):
    folder = tiny_folders["llama"]
    eos = AutoConfig.from_pretrained(folder).eos_token_id
    prompts = [[0, 5, 9, 200], [0, eos, eos], [0, 300]]
    generations = hf_greedy(folder, prompts, max_new_tokens=5)
    assert [len(g.token_ids) for g in generations] == [5, 5, 5]
    assert all(lp <= 0 for g in generations for lp in g.logprobs)
    assert hf_greedy(folder, [prompts[1]], max_new_tokens=5)[0] == generations[1]


def test_greedy_logit_margins_are_not_flat(tiny_folders):
    # HF's default init gives near-flat logits whose argmax flips on rounding noise.
    folder = tiny_folders["mistral"]
    prompt = AutoTokenizer.from_pretrained(folder).encode("The quick brown fox jumps over the lazy dog.")
    [generation] = hf_greedy(folder, [prompt], max_new_tokens=16)
    margins = hf_logit_margins(folder, prompt + generation.token_ids)
    assert statistics.median(margins) > 0.1
