"""cache_salt on the completion and chat endpoints: a request hits prefix-cache
blocks only of requests with the same salt (read from the server's prefix
cache counters), and its greedy output does not depend on the salt."""

from __future__ import annotations

from tests.conftest import wait_until
from tests.entrypoints.openai.server_utils import MODEL_NAME
from tests.entrypoints.openai.stream_utils import metric

BLOCK_SIZE = 16  # the engine's default
PROMPT_IDS = list(range(3, 73))  # 70 tokens: four full blocks can be shared
SHAREABLE = (len(PROMPT_IDS) - 1) // BLOCK_SIZE * BLOCK_SIZE


def _counters(server) -> tuple[float, float]:
    return metric(server, "vllm:prefix_cache_queries_total"), metric(server, "vllm:prefix_cache_hits_total")


def _hits_of(server, http, path: str, bodies: list[dict]) -> tuple[list[str], float]:
    """Send the requests in turn: their texts, and the prefix-cache hits they
    added, read once the counters include every one of their prompts."""
    queries, hits = _counters(server)
    texts, num_prompt = [], 0
    for body in bodies:
        response = http.post(path, json=body)
        assert response.status_code == 200, response.text
        data = response.json()
        choice = data["choices"][0]
        texts.append(choice["text"] if "text" in choice else choice["message"]["content"])
        num_prompt += data["usage"]["prompt_tokens"]
    wait_until(lambda: _counters(server)[0] >= queries + num_prompt, 30, message="the prefix cache counters")
    return texts, _counters(server)[1] - hits


def _completion(salt: str | None) -> dict:
    body = {"model": MODEL_NAME, "prompt": PROMPT_IDS, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    return body if salt is None else {**body, "cache_salt": salt}


def test_completions_share_the_cache_only_within_a_salt(server, http):
    texts, hits = _hits_of(server, http, "/v1/completions", [_completion("alpha"), _completion("beta")])
    assert hits == 0 and texts[0] == texts[1]
    texts, hits = _hits_of(server, http, "/v1/completions", [_completion(None)])
    assert hits == 0  # unsalted requests do not see salted blocks
    repeat, hits = _hits_of(server, http, "/v1/completions", [_completion("alpha")])
    assert hits == SHAREABLE and repeat == texts


def test_chat_shares_the_cache_only_within_a_salt(server, http):
    def chat(salt: str) -> dict:
        return {
            "model": MODEL_NAME,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "cache_salt": salt,
            "messages": [{"role": "user", "content": "Tell me a long story about a salted cache " * 4}],
        }

    texts, hits = _hits_of(server, http, "/v1/chat/completions", [chat("gamma"), chat("delta")])
    assert hits == 0 and texts[0] == texts[1]
    repeat, hits = _hits_of(server, http, "/v1/chat/completions", [chat("gamma")])
    assert hits > 0 and repeat == texts[:1]


def test_an_empty_salt_is_400(http):
    response = http.post("/v1/completions", json=_completion(""))
    assert response.status_code == 400 and "cache_salt" in response.text
