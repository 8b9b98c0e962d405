"""Fixtures: a tiny llama model folder and `raylm serve` subprocesses on it,
started once per test session and always torn down (process tree checked).

The plain and the trusting server are shared by every module that uses them
(a start and stop costs ~35 s on a loaded two-core machine): a test on them
leaves the server as it found it (no request left running) and reads counters
as differences. A module that needs other flags, or breaks its server on
purpose, starts its own."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.entrypoints.openai.server_utils import API_KEY, RaylmServer


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def server(llama_dir, tmp_path_factory):
    srv = RaylmServer(llama_dir, ["--api-key", API_KEY], str(tmp_path_factory.mktemp("serve") / "server.log"))
    try:
        yield srv
    finally:
        srv.terminate()


@pytest.fixture(scope="session")
def trusting_server(llama_dir, tmp_path_factory):
    """A server that renders chat templates sent with requests; a module uses
    it as its `server` by defining `server` to return it."""
    srv = RaylmServer(
        llama_dir,
        ["--api-key", API_KEY, "--trust-request-chat-template"],
        str(tmp_path_factory.mktemp("serve") / "server.log"),
    )
    try:
        yield srv
    finally:
        srv.terminate()


@pytest.fixture(scope="module")
def http(server):
    """An httpx client on the module's server, with its API key."""
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    """The Hugging Face tokenizer of the served model: the oracle for token ids."""
    return AutoTokenizer.from_pretrained(llama_dir)
