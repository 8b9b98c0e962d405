"""What the LoRA loader and settings refuse, each with a ValueError naming
the file and field (or the setting)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from raylm import LLM, SamplingParams
from raylm.config import LoRAConfig, create_engine_config
from raylm.lora.peft_loader import CONFIG_FILE, WEIGHTS_FILE, load_adapter, max_weights_bytes
from raylm.lora.request import LoRARequest
from raylm.model.arch_config import ArchConfig

RANK8 = LoRAConfig(max_lora_rank=8)


@pytest.fixture
def adapter(tiny_adapters, tmp_path):
    """A copy of the tiny llama's rank-8 adapter of every projection, to spoil."""
    folder = tmp_path / "adapter"
    shutil.copytree(tiny_adapters("llama")["all"], folder)
    return folder


@pytest.fixture
def arch(tiny_model_dir):
    return ArchConfig.from_model_dir(tiny_model_dir("llama"))


def _edit_config(folder, **changes) -> None:
    path = folder / CONFIG_FILE
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _edit_weights(folder, edit) -> None:
    path = folder / WEIGHTS_FILE
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_the_unspoiled_adapter_loads(adapter, arch):
    loaded = load_adapter(str(adapter), arch, RANK8)
    assert loaded.rank == 8 and loaded.scaling == 2.0 and len(loaded.weights) == 7 * arch.num_hidden_layers


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"use_dora": True}, "use_dora"),
        ({"bias": "all"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"peft_type": "PREFIX_TUNING"}, "peft_type"),
        ({"target_modules": ".*proj"}, "target_modules"),
        ({"target_modules": ["q_proj", "lm_head"]}, "target_modules"),
        ({"target_modules": ["q_proj"]}, "not in target_modules"),
        ({"r": 16}, "max_lora_rank"),
        ({"r": 4}, "shape"),
        ({"lora_alpha": "sixteen"}, "lora_alpha"),
    ],
)
def test_a_config_raylm_does_not_run_is_refused_by_name(adapter, arch, changes, field):
    _edit_config(adapter, **changes)
    with pytest.raises(ValueError, match=field) as info:
        load_adapter(str(adapter), arch, RANK8)
    assert CONFIG_FILE in str(info.value) or WEIGHTS_FILE in str(info.value)


def _poison(tensors):
    name = next(n for n in tensors if n.endswith("lora_B.weight"))
    tensors[name][0, 0] = float("nan")


def _widen(tensors):
    name = next(n for n in tensors if n.endswith("q_proj.lora_A.weight"))
    tensors[name] = torch.zeros(tensors[name].shape[0], tensors[name].shape[1] + 1)


def _integers(tensors):
    name = next(n for n in tensors if n.endswith("lora_A.weight"))
    tensors[name] = tensors[name].to(torch.int32)


def _stranger(tensors):
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 4)


def _half_missing(tensors):
    del tensors[next(n for n in tensors if n.endswith("lora_B.weight"))]


@pytest.mark.parametrize(
    "edit, message",
    [(_poison, "NaN"), (_widen, "shape"), (_integers, "dtype"), (_stranger, "lm_head"), (_half_missing, "lora_B")],
)
def test_bad_weights_are_refused_naming_the_tensor(adapter, arch, edit, message):
    _edit_weights(adapter, edit)
    with pytest.raises(ValueError, match=message) as info:
        load_adapter(str(adapter), arch, RANK8)
    assert WEIGHTS_FILE in str(info.value)


def test_a_file_over_the_size_bound_is_refused_unread(adapter, arch):
    (adapter / WEIGHTS_FILE).write_bytes(b"\0" * (max_weights_bytes(arch, 8) + 1))
    with pytest.raises(ValueError, match=f"{WEIGHTS_FILE}.*over the bound"):
        load_adapter(str(adapter), arch, RANK8)


def test_a_symlink_out_of_the_adapter_folder_is_refused(adapter, arch, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(adapter / WEIGHTS_FILE, outside)
    os.symlink(outside, adapter / WEIGHTS_FILE)
    with pytest.raises(ValueError, match=f"{WEIGHTS_FILE}.*symlink"):
        load_adapter(str(adapter), arch, RANK8)


def test_a_folder_without_the_files_is_refused(tmp_path, arch):
    with pytest.raises(ValueError, match=CONFIG_FILE):
        load_adapter(str(tmp_path), arch, RANK8)
    with pytest.raises(ValueError, match="lora_path"):
        load_adapter(str(tmp_path / "missing"), arch, RANK8)


def test_lora_requests_need_enable_lora_and_a_loadable_adapter(tiny_model_dir, adapter):
    params = SamplingParams(max_tokens=2)
    with LLM(tiny_model_dir("llama"), dtype="float32", kv_cache_memory_bytes=16 << 20) as llm:
        with pytest.raises(ValueError, match="enable_lora"):
            llm.generate("Hi", params, use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapter)))
    with LLM(tiny_model_dir("llama"), dtype="float32", enable_lora=True, max_lora_rank=8) as llm:
        _edit_config(adapter, use_dora=True)
        with pytest.raises(ValueError, match="use_dora"):
            llm.generate(["Hi", "Ho"], params, use_tqdm=False, lora_request=[None, LoRARequest("a", 1, str(adapter))])
        with pytest.raises(ValueError, match="lora_request has 1 entries for 2 prompts"):
            llm.generate(["Hi", "Ho"], params, use_tqdm=False, lora_request=[None])
        assert not llm.llm_engine.has_unfinished_requests()  # nothing was added


@pytest.mark.parametrize(
    "settings, field",
    [
        ({"max_loras": 2}, "enable_lora"),
        ({"enable_lora": True, "max_loras": 0}, "max_loras"),
        ({"enable_lora": True, "max_lora_rank": 1024}, "max_lora_rank"),
        ({"enable_lora": True, "max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras"),
        ({"enable_lora": True, "tensor_parallel_size": 2, "context_parallel_size": 2}, "context_parallel_size"),
    ],
)
def test_bad_lora_settings_are_refused_by_name(tiny_model_dir, settings, field):
    with pytest.raises(ValueError, match=field):
        create_engine_config(tiny_model_dir("llama"), **settings)


@pytest.mark.parametrize(
    "args, field", [(("", 1, "/a"), "lora_name"), (("a", 0, "/a"), "lora_int_id"), (("a", 1, ""), "lora_path")]
)
def test_a_bad_lora_request_is_refused_by_field(args, field):
    with pytest.raises(ValueError, match=field):
        LoRARequest(*args)
