"""Hugging Face Hub ids ("org/name") as models and tokenizers, offline: the tests
lay out a cache exactly as huggingface_hub does (models--org--name/blobs,
refs/<branch>, snapshots/<commit>/ with files as symlinks to blobs), point
HF_HUB_CACHE (or HF_HOME, or --download-dir) at it and set HF_HUB_OFFLINE=1."""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys

import pytest

from raylm import LLM, SamplingParams
from raylm.config import create_engine_config
from raylm.entrypoints.cli import _SEPARATOR
from raylm.model.hub import resolve_model_path

REPO_ID = "tiny-org/tiny-llama"
MAIN_COMMIT = "1" * 40
V2_COMMIT = "2" * 40
PROMPTS = ["ROMEO:", "Hello there"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
SMALL_ENGINE = {"num_threads": 1, "kv_cache_memory_bytes": 4 << 20}


def add_snapshot(cache_dir: pathlib.Path, repo_id: str, commit: str, source: str, branch: str | None) -> pathlib.Path:
    """Copy the files of folder `source` into the cache as huggingface_hub
    stores a download: content-addressed blobs, a snapshot folder of relative
    symlinks to them, and refs/<branch> holding the commit."""
    repo = cache_dir / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(pathlib.Path(source).iterdir()):
        data = file.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    if branch is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / branch).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def folders(tiny_model_dir) -> dict[str, str]:
    """Two different models: main's and the v2 branch's."""
    return {"main": tiny_model_dir("llama"), "v2": tiny_model_dir("llama", seed=7)}


@pytest.fixture(scope="module")
def hub_cache(folders, tmp_path_factory) -> pathlib.Path:
    cache = tmp_path_factory.mktemp("hf_home") / "hub"
    add_snapshot(cache, REPO_ID, MAIN_COMMIT, folders["main"], "main")
    add_snapshot(cache, REPO_ID, V2_COMMIT, folders["v2"], "v2")
    return cache


@pytest.fixture
def offline_hub(hub_cache, monkeypatch) -> pathlib.Path:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    return hub_cache


def greedy_texts(model: str, **engine_kwargs) -> list[str]:
    with LLM(model=model, **SMALL_ENGINE, **engine_kwargs) as llm:
        return [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_hub_snapshots_are_symlinks_to_blobs(hub_cache):
    # The layout under test is huggingface_hub's, not a plain copy.
    config = hub_cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / MAIN_COMMIT / "config.json"
    assert config.is_symlink() and config.resolve().parent.name == "blobs"


def test_generation_from_hub_id_equals_generation_from_folder(offline_hub, folders):
    with LLM(model=REPO_ID, **SMALL_ENGINE) as llm:
        config = llm.llm_engine.config.model_config
        # Resolved once, to the cached snapshot of main, for every process.
        assert config.model == str(offline_hub / "models--tiny-org--tiny-llama" / "snapshots" / MAIN_COMMIT)
        assert config.tokenizer == config.model and config.model_name == REPO_ID
        from_id = [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert from_id == greedy_texts(folders["main"])
    assert any(from_id)


def test_revision_selects_a_branch_or_a_commit(offline_hub):
    main = resolve_model_path(REPO_ID)
    by_branch = resolve_model_path(REPO_ID, revision="v2")
    by_commit = resolve_model_path(REPO_ID, revision=V2_COMMIT)
    assert pathlib.Path(main).name == MAIN_COMMIT
    assert pathlib.Path(by_branch).name == V2_COMMIT == pathlib.Path(by_commit).name


def test_cli_generate_with_hub_id_and_revision(offline_hub, folders):
    """`raylm generate --model ID --revision v2` prints what the v2 folder generates."""
    expected = _SEPARATOR.join(f"{p}{t}\n" for p, t in zip(PROMPTS, greedy_texts(folders["v2"])))
    assert expected != _SEPARATOR.join(f"{p}{t}\n" for p, t in zip(PROMPTS, greedy_texts(folders["main"])))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "raylm.entrypoints.cli",
            "generate",
            *PROMPTS,
            "--model",
            REPO_ID,
            "--revision",
            "v2",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
            "--num-threads",
            "1",
            "--kv-cache-memory-bytes",
            "4MiB",
        ],
        capture_output=True,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode() == expected


def test_hf_home_and_download_dir_locate_the_cache(hub_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(hub_cache.parent))
    assert pathlib.Path(resolve_model_path(REPO_ID)).name == MAIN_COMMIT
    # --download-dir wins over the environment.
    monkeypatch.setenv("HF_HOME", str(tmp_path / "elsewhere"))
    assert pathlib.Path(resolve_model_path(REPO_ID, download_dir=str(hub_cache))).name == MAIN_COMMIT


def test_tokenizer_as_hub_id_with_its_own_revision(offline_hub, folders):
    config = create_engine_config(model=folders["main"], tokenizer=REPO_ID, tokenizer_revision="v2")
    assert config.model_config.model == folders["main"]
    assert pathlib.Path(config.model_config.tokenizer).name == V2_COMMIT


def test_local_folder_wins_over_the_hub(offline_hub, folders, tmp_path, monkeypatch):
    (tmp_path / "tiny-org").mkdir()
    (tmp_path / "tiny-org" / "tiny-llama").symlink_to(folders["v2"], target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    assert create_engine_config(model=REPO_ID).model_config.model == REPO_ID


def test_uncached_id_offline_is_a_clear_error(offline_hub):
    with pytest.raises(ValueError) as info:
        create_engine_config(model="tiny-org/not-downloaded")
    message = str(info.value)
    assert "'tiny-org/not-downloaded'" in message
    assert "HF_HUB_OFFLINE" in message and str(offline_hub) in message


def test_unknown_revision_offline_is_a_clear_error(offline_hub):
    with pytest.raises(ValueError, match="'v3'.*HF_HUB_OFFLINE"):
        resolve_model_path(REPO_ID, revision="v3")


def test_uncached_id_with_hub_unreachable_is_a_clear_error(offline_hub, monkeypatch):
    """Online mode on a machine that cannot reach the Hub: the error says so.
    The endpoint is a closed local port, so nothing leaves this machine."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", f"http://127.0.0.1:{closed_port}")
    with pytest.raises(ValueError) as info:
        resolve_model_path("tiny-org/not-downloaded")
    message = str(info.value)
    assert "'tiny-org/not-downloaded'" in message and "could not be reached" in message and str(offline_hub) in message


def test_a_path_that_is_neither_folder_nor_id_is_refused(tmp_path):
    with pytest.raises(ValueError, match="model .* is not a folder"):
        create_engine_config(model=str(tmp_path / "missing"))


def test_a_model_folder_given_as_a_path_object_is_read_as_its_string(tiny_model_dir):
    """LLM(model=pathlib.Path(...)) raised a TypeError deep in the config's
    resolution ('PosixPath' is not iterable); a path-like names the same folder."""
    folder = tiny_model_dir("llama")
    from_path = create_engine_config(pathlib.Path(folder), tokenizer=pathlib.Path(folder), device="cpu")
    from_str = create_engine_config(str(folder), tokenizer=str(folder), device="cpu")
    assert from_path.model_config.model == from_str.model_config.model
    assert from_path.model_config.tokenizer == from_str.model_config.tokenizer
