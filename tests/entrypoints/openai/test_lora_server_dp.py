"""An adapter loaded at run time reaches every replica that runs it (issue
53, item 6): `raylm serve -dp 2 --enable-lora --allow-runtime-lora-updating`
(local replicas, routed by load so that concurrent requests spread over
both). An adapter loaded through POST /v1/load_lora_adapter serves
concurrent requests on both replicas, each equal to Hugging Face + PEFT's
greedy tokens; unloaded, its folder rewritten with other weights and loaded
again under the same name, both replicas run the new weights (their digest
is new: no block of the old weights' K/V is shared with them)."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from raylm.testing.lora_oracle import make_tiny_adapter, peft_greedy
from tests.entrypoints.openai.server_utils import API_KEY, RaylmServer, scrape_metric

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
MAX_TOKENS = 6
# Distinct prompts sharing a 16-token prefix (one block): a reloaded adapter
# must not reuse the old weights' K/V of that block.
PREFIX = [(13 * j) % 200 + 5 for j in range(16)]
PROMPTS = [PREFIX + [7 + i, 40 + 3 * i, 9] for i in range(8)]


@pytest.fixture(scope="module")
def lora_dir(llama_dir, tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("lora-dp")
    make_tiny_adapter(llama_dir, root / "first", seed=5, rank=8, alpha=16.0)
    make_tiny_adapter(llama_dir, root / "second", seed=9, rank=8, alpha=16.0)
    return str(root)


@pytest.fixture(scope="module")
def dp_lora_server(llama_dir, lora_dir, tmp_path_factory):
    srv = RaylmServer(
        llama_dir,
        [
            "--api-key",
            API_KEY,
            "-dp",
            "2",
            "--data-parallel-backend",
            "mp",
            "--routing-policy",
            "load",
            "--enable-lora",
            "--max-loras",
            "1",
            "--max-lora-rank",
            "8",
            "--allow-runtime-lora-updating",
            "--lora-directory",
            lora_dir,
        ],
        str(tmp_path_factory.mktemp("serve-lora-dp") / "server.log"),
    )
    try:
        yield srv
    finally:
        srv.terminate()


def _routed(server: RaylmServer) -> list[float]:
    return [scrape_metric(server.base_url, "raylm:dp_replica_requests_routed", f'replica="{i}"') for i in range(2)]


def _completions(server: RaylmServer, model: str) -> list[str]:
    """PROMPTS sent at once, naming `model`: each one's text."""

    def one(prompt: list[int]) -> str:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        response = httpx.post(server.base_url + "/v1/completions", json=body, headers=HEADERS, timeout=300)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def _load(server: RaylmServer, name: str, path: str) -> None:
    response = httpx.post(
        server.base_url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, headers=HEADERS
    )
    assert response.status_code == 200, response.text


def test_a_runtime_adapter_runs_on_both_replicas_and_a_reload_runs_its_new_weights(
    dp_lora_server, llama_dir, lora_dir, tokenizer
):
    want = {
        name: [
            tokenizer.decode(g.token_ids, skip_special_tokens=True)
            for g in peft_greedy(llama_dir, f"{lora_dir}/{name}", PROMPTS, MAX_TOKENS)
        ]
        for name in ("first", "second")
    }
    assert want["first"] != want["second"], "two adapters that change nothing"
    served = f"{lora_dir}/served"
    shutil.copytree(f"{lora_dir}/first", served)

    before = _routed(dp_lora_server)
    _load(dp_lora_server, "tuned", "served")
    assert _completions(dp_lora_server, "tuned") == want["first"]
    after = _routed(dp_lora_server)
    assert all(a > b for a, b in zip(after, before)), (before, after)  # both replicas ran it

    # The same name, other weights: unloaded, the folder rewritten, loaded again.
    response = httpx.post(
        dp_lora_server.base_url + "/v1/unload_lora_adapter", json={"lora_name": "tuned"}, headers=HEADERS
    )
    assert response.status_code == 200, response.text
    shutil.rmtree(served)
    shutil.copytree(f"{lora_dir}/second", served)
    _load(dp_lora_server, "tuned", "served")
    assert _completions(dp_lora_server, "tuned") == want["second"]
    assert all(a > b for a, b in zip(_routed(dp_lora_server), after))
