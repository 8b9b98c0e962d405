"""The safetensors loader and ArchConfig: sharded checkpoints, bad folders and
files, config variants, and the model's weight-name checks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from raylm.model.arch_config import ArchConfig
from raylm.model.llama import PP_PARTITION_ENV, pp_layer_range
from raylm.model.loader import load_model
from raylm.model.registry import MODEL_REGISTRY, SUPPORTED_ARCHITECTURES, get_model_class
from raylm.testing import load_hf_model, make_tiny_model

TOKENS = torch.tensor([1, 17, 300, 5, 42, 99, 640, 7, 3, 250])


@torch.inference_mode()
def _logits(model) -> torch.Tensor:
    return model.compute_logits(model(TOKENS, torch.arange(len(TOKENS))))


def _edit_config(folder, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    single = make_tiny_model("qwen2", tmp_path / "single", seed=2)
    sharded = make_tiny_model("qwen2", tmp_path / "sharded", seed=2, num_shards=3)
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) == 3
    a = load_model(single, torch.float32, "cpu")
    b = load_model(sharded, torch.float32, "cpu")
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    for name in state_a:
        assert torch.equal(state_a[name], state_b[name]), name
    assert torch.equal(_logits(a), _logits(b))


def test_merged_parameters_hold_the_checkpoint_tensors(tmp_path):
    folder = make_tiny_model("qwen2", tmp_path / "m", seed=4)
    checkpoint = load_file(folder / "model.safetensors")
    model = load_model(folder, torch.float32, "cpu")
    attn = model.model.layers[1].self_attn
    prefix = "model.layers.1.self_attn."
    expected_qkv = torch.cat([checkpoint[prefix + f"{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(attn.qkv_proj.bias, expected_qkv)
    mlp_prefix = "model.layers.1.mlp."
    expected_gate_up = torch.cat(
        [checkpoint[mlp_prefix + "gate_proj.weight"], checkpoint[mlp_prefix + "up_proj.weight"]]
    )
    assert torch.equal(model.model.layers[1].mlp.gate_up_proj.weight, expected_gate_up)


def test_corrupt_file_names_it(tmp_path):
    folder = make_tiny_model("llama", tmp_path / "m", num_shards=2)
    victim = sorted(folder.glob("*.safetensors"))[1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=victim.name):
        load_model(folder, torch.float32, "cpu")


def test_garbage_single_file_names_it(tmp_path):
    folder = make_tiny_model("llama", tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"not a safetensors file" * 4)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(folder, torch.float32, "cpu")


def test_no_safetensors_says_so(tmp_path):
    folder = make_tiny_model("llama", tmp_path / "m")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="no safetensors.*pytorch_model.bin"):
        load_model(folder, torch.float32, "cpu")


def test_unknown_architecture_lists_supported(tmp_path):
    folder = make_tiny_model("llama", tmp_path / "m")
    _edit_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        load_model(folder, torch.float32, "cpu")
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(info.value)


def test_every_registered_architecture_resolves_to_its_class():
    for name in SUPPORTED_ARCHITECTURES:
        cls = get_model_class(name)
        assert issubclass(cls, torch.nn.Module) and cls.__name__ == name
        assert f"{cls.__module__}:{cls.__qualname__}" == MODEL_REGISTRY[name]
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM"):
        get_model_class("GPT2LMHeadModel")


def test_reading_a_config_does_not_import_the_model_code():
    # The registry is names only: the model module loads when its class is asked for.
    code = (
        "import sys\n"
        "from raylm.model.arch_config import ArchConfig\n"
        "raw = dict(architectures=['Qwen2ForCausalLM'], vocab_size=64, hidden_size=32,\n"
        "           intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)\n"
        "arch = ArchConfig.from_dict(raw)\n"
        "assert 'raylm.model.llama' not in sys.modules, 'model code imported early'\n"
        "assert arch.model_class.__name__ == 'Qwen2ForCausalLM'\n"
        "assert 'raylm.model.llama' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_missing_path_and_missing_config(tmp_path):
    with pytest.raises(ValueError, match="does-not-exist"):
        load_model(tmp_path / "does-not-exist", torch.float32, "cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path / "empty", torch.float32, "cpu")


@torch.inference_mode()
def test_bf16_load(tmp_path):
    folder = make_tiny_model("qwen3", tmp_path / "m", seed=1)
    model = load_model(folder, torch.bfloat16, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    # The rotary table stays float32 whatever the model dtype.
    assert model.model.rotary_emb.cos_cache.dtype == torch.float32
    hidden = model(TOKENS, torch.arange(len(TOKENS)))
    assert hidden.dtype == torch.bfloat16
    logits = _logits(model)
    assert logits.dtype == torch.float32
    # bf16 rounding differs op by op from HF's, so judge both against the fp32 answer:
    # ours must be about as close to it as transformers' own bf16 run is.
    reference = load_hf_model(folder, torch.float32)(input_ids=TOKENS[None]).logits[0]
    hf_bf16 = load_hf_model(folder, torch.bfloat16)(input_ids=TOKENS[None]).logits[0].float()
    hf_error = (hf_bf16 - reference).abs().max()
    our_error = (logits - reference).abs().max()
    assert our_error <= 1.5 * hf_error + 0.05, (our_error, hf_error)
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))


def test_unknown_and_missing_weights_are_errors(tmp_path):
    folder = make_tiny_model("llama", tmp_path / "m")
    weights = load_file(folder / "model.safetensors")
    model_class = ArchConfig.from_model_dir(folder).model_class
    arch = ArchConfig.from_model_dir(folder)

    with pytest.raises(ValueError, match="model.layers.0.self_attn.rogue_proj.weight"):
        rogue = ("model.layers.0.self_attn.rogue_proj.weight", torch.zeros(1))
        model_class(arch).load_weights([*weights.items(), rogue])
    with pytest.raises(ValueError, match="vision_tower.weight"):
        model_class(arch).load_weights([*weights.items(), ("vision_tower.weight", torch.zeros(1))])
    partial = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"unloaded.*model.layers.1.self_attn.qkv_proj.weight\[k\]"):
        model_class(arch).load_weights(partial.items())
    # HF's old rotary buffer is ignored, not an error.
    model_class(arch).load_weights([*weights.items(), ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8))])


def test_wrong_shape_is_an_error(tmp_path):
    folder = make_tiny_model("llama", tmp_path / "m")
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] = torch.ones(3)
    arch = ArchConfig.from_model_dir(folder)
    with pytest.raises(ValueError, match="model.norm.weight"):
        arch.model_class(arch).load_weights(weights.items())


def _base_config(**changes) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 4096,
    }
    config.update(changes)
    return config


def test_arch_config_defaults_and_legacy_rope_fields():
    config = ArchConfig.from_dict(
        _base_config(
            rope_theta=500000.0,
            rope_scaling={"type": "linear", "factor": 2.0},
            eos_token_id=[2, 7],
            torch_dtype="bfloat16",
        )
    )
    assert config.num_key_value_heads == 4 and config.head_dim == 16
    assert config.rope_theta == 500000.0
    assert config.rope_scaling.rope_type == "linear" and config.rope_scaling.factor == 2.0
    assert config.eos_token_id == [2, 7] and config.dtype == "bfloat16"


def test_arch_config_rope_parameters_llama3():
    config = ArchConfig.from_dict(
        _base_config(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 1e6,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            }
        )
    )
    assert config.rope_theta == 1e6
    assert config.rope_scaling.rope_type == "llama3"
    assert config.rope_scaling.original_max_position_embeddings == 1024
    with pytest.raises(ValueError, match="yarn"):
        ArchConfig.from_dict(_base_config(rope_parameters={"rope_type": "yarn", "factor": 4.0}))


def test_arch_config_flags_per_architecture():
    qwen2 = ArchConfig.from_dict(
        _base_config(architectures=["Qwen2ForCausalLM"], use_sliding_window=False, sliding_window=32)
    )
    assert qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    qwen3 = ArchConfig.from_dict(_base_config(architectures=["Qwen3ForCausalLM"], head_dim=32))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.attention_bias
    llama = ArchConfig.from_dict(_base_config(attention_bias=True))
    assert llama.attention_bias and llama.o_proj_bias


def test_sliding_window_is_rejected_only_when_it_bites():
    with pytest.raises(ValueError, match="sliding-window"):
        ArchConfig.from_dict(_base_config(architectures=["MistralForCausalLM"], sliding_window=1024))
    with pytest.raises(ValueError, match="sliding-window"):
        ArchConfig.from_dict(
            _base_config(
                architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=1024, max_window_layers=1
            )
        )
    # A window as long as the context, or none, is plain causal attention.
    for window in (4096, None):
        config = ArchConfig.from_dict(_base_config(architectures=["MistralForCausalLM"], sliding_window=window))
        assert config.sliding_window == window


def test_pp_layer_partition(monkeypatch):
    monkeypatch.delenv(PP_PARTITION_ENV, raising=False)
    assert [pp_layer_range(7, r, 3) for r in range(3)] == [(0, 2), (2, 4), (4, 7)]
    monkeypatch.setenv(PP_PARTITION_ENV, "3,5")
    assert [pp_layer_range(8, r, 2) for r in range(2)] == [(0, 3), (3, 8)]
    for bad in ("3,4", "8,0", "a,b", "2,3,3"):
        monkeypatch.setenv(PP_PARTITION_ENV, bad)
        with pytest.raises(ValueError, match=PP_PARTITION_ENV):
            pp_layer_range(8, 0, 2)
