"""Fixtures: a tiny llama model folder and a `raylm serve` subprocess on it,
started once per module and always torn down (process tree checked)."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.server_utils import API_KEY, RaylmServer


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    srv = RaylmServer(llama_dir, ["--api-key", API_KEY], str(tmp_path_factory.mktemp("serve") / "server.log"))
    try:
        yield srv
    finally:
        srv.terminate()
