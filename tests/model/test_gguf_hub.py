"""A GGUF model named by Hub id, offline from a Hugging Face cache laid out as
huggingface_hub stores downloads: `--gguf-file NAME`, and vLLM's
`org/name:QUANT` that picks the repository's one file of that type."""

from __future__ import annotations

import pytest

from raylm.config import create_engine_config
from raylm.testing.gguf_writer import write_gguf
from tests.model.test_hub import add_snapshot

REPO_ID = "tiny-org/tiny-llama-GGUF"
COMMIT = "3" * 40


@pytest.fixture
def gguf_hub(tiny_model_dir, tmp_path, monkeypatch):
    files = tmp_path / "repo"
    files.mkdir()
    folder = tiny_model_dir("llama")
    write_gguf(folder, files / "tiny-llama-Q8_0.gguf", "Q8_0")
    write_gguf(folder, files / "tiny-llama-f32.gguf")
    cache = tmp_path / "hub"
    snapshot = add_snapshot(cache, REPO_ID, COMMIT, files, "main")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("RAYLM_GGUF_CACHE", str(tmp_path / "gguf_cache"))
    return snapshot


def test_gguf_file_of_a_hub_repo(gguf_hub):
    config = create_engine_config(REPO_ID, gguf_file="tiny-llama-f32.gguf")
    assert config.model_config.model == str(gguf_hub / "tiny-llama-f32.gguf")
    assert config.model_config.quantization == "gguf"


def test_quant_selector_picks_the_one_file_of_that_type(gguf_hub):
    config = create_engine_config(f"{REPO_ID}:Q8_0")
    assert config.model_config.model == str(gguf_hub / "tiny-llama-Q8_0.gguf")
    assert config.model_config.arch.architecture == "LlamaForCausalLM"


def test_a_type_the_repo_lacks_is_a_clear_error(gguf_hub):
    with pytest.raises(ValueError, match="has no GGUF file of type 'Q4_K_M'"):
        create_engine_config(f"{REPO_ID}:Q4_K_M")
