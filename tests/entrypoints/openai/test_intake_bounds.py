"""No client can hurt another through what it asks for (issue 20): request
chat templates (refused unless trusted; bounded when trusted), /tokenize and
/detokenize behind the API key, and the caps on bad_words, stop_token_ids,
prompt logprobs and grammar sizes. Each hostile request gets a 4xx naming its
field while another client's stream runs, and that stream finishes as it
would have alone."""

from __future__ import annotations

import httpx
import psutil
import pytest

from raylm.chat_template_budget import MAX_RENDER_WORK
from raylm.entrypoints.openai.limits import MAX_REQUEST_CHAT_TEMPLATE_CHARS
from raylm.sampling_params import MAX_BAD_WORDS, MAX_GRAMMAR_CHARS, MAX_STOP_TOKEN_IDS
from tests.entrypoints.openai.server_utils import API_KEY, MODEL_NAME
from tests.entrypoints.openai.stream_utils import BackgroundStream, long_body

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "Hello there"}]
# What grew a server to 23.8 GB, and loops that would run for hours.
HOSTILE_TEMPLATES = {
    "repeat": "{{ 'a' * 200000000 }}",
    "nested_loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "doubling": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    "{{ ns.s }}",
    "block_set": "{% set s %}{% for i in range(100000) %}" + "x" * 10000 + "{% endfor %}{% endset %}{{ s }}",
    "join": "{% set s = 'a' * 1000000 %}{{ ([s] * 100000) | join }}",
    "macro_tree": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
}
VICTIM_TOKENS = 160


def _error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


class Victim:
    """Another client's greedy stream, checked against the same request run alone."""

    def __init__(self, server, http):
        body = long_body(max_tokens=VICTIM_TOKENS)
        alone = http.post("/v1/completions", json={**body, "stream": False})
        assert alone.status_code == 200, alone.text
        self.expected = alone.json()["choices"][0]["text"]
        self.stream = BackgroundStream(server, body, headers=AUTH)

    def check_finished(self) -> None:
        self.stream.thread.join(timeout=120)
        stream = self.stream
        assert stream.status == 200 and stream.got_done and not stream.errors, (stream.status, stream.errors)
        assert stream.finish_reasons == ["length"]
        text = "".join(choice.get("text", "") for event in stream.events for choice in event.get("choices", []))
        assert text == self.expected


# ---- request chat templates ------------------------------------------------------


@pytest.mark.parametrize(
    "path, extra",
    [
        ("/v1/chat/completions", {"max_tokens": 2}),
        ("/tokenize", {}),
    ],
)
def test_request_chat_template_refused_without_trust(http, path, extra):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "chat_template": "{{ messages[0]['content'] }}", **extra}
    error = _error(http.post(path, json=body))
    assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]
    # The server's own template still renders.
    del body["chat_template"]
    assert http.post(path, json=body).status_code == 200


@pytest.fixture(scope="module")
def trusting_http(trusting_server):
    with httpx.Client(base_url=trusting_server.base_url, headers=AUTH, timeout=120) as client:
        yield client


def test_trusted_request_chat_template_renders(trusting_http):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "chat_template": "<{{ messages[0]['content'] }}>"}
    tokens = trusting_http.post("/tokenize", json=body).json()["tokens"]
    text = trusting_http.post("/detokenize", json={"model": MODEL_NAME, "tokens": tokens}).json()["prompt"]
    assert text.endswith("<Hello there>")


def test_overlong_request_chat_template_refused(trusting_http):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "chat_template": "x" * (MAX_REQUEST_CHAT_TEMPLATE_CHARS + 1)}
    assert _error(trusting_http.post("/tokenize", json=body))["param"] == "chat_template"


def test_hostile_templates_get_400_while_another_client_streams(trusting_server, trusting_http):
    server_process = psutil.Process(trusting_server.proc.pid)
    rss_before = server_process.memory_info().rss
    victim = Victim(trusting_server, trusting_http)
    for name, template in HOSTILE_TEMPLATES.items():
        for path in ("/tokenize", "/v1/chat/completions"):
            body = {"model": MODEL_NAME, "messages": MESSAGES, "chat_template": template, "max_tokens": 2}
            if path == "/tokenize":
                del body["max_tokens"]
            error = _error(trusting_http.post(path, json=body))
            assert error["param"] == "chat_template", (name, error)
            assert error["message"].startswith("chat template render exceeded"), (name, error)
    victim.check_finished()
    # What a render may build is bounded (MAX_RENDER_WORK characters, at most 4
    # bytes each), so the server never held more than a few such renders' worth.
    grown = server_process.memory_info().rss - rss_before
    assert grown < 8 * MAX_RENDER_WORK, f"the server grew by {grown} bytes"
    assert trusting_http.get("/health").status_code == 200


def test_server_template_renders_are_bounded_too(http):
    """A conversation the server's own template would render past the output
    limit is refused, not rendered (the body limit allows it; ~2M tokens)."""
    messages = [{"role": "user", "content": "word " * 200_000}] * 12
    error = _error(http.post("/tokenize", json={"model": MODEL_NAME, "messages": messages}))
    assert error["param"] == "messages" and error["message"].startswith("chat template render exceeded")


# ---- the API key ------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body",
    [
        ("/tokenize", {"model": MODEL_NAME, "prompt": "Hello"}),
        ("/detokenize", {"model": MODEL_NAME, "tokens": [1, 2, 3]}),
    ],
)
def test_tokenize_and_detokenize_need_the_api_key(server, path, body):
    without = httpx.post(server.url(path), json=body, timeout=60)
    assert without.status_code == 401 and without.json()["error"]["type"] == "authentication_error"
    wrong = httpx.post(server.url(path), json=body, headers={"Authorization": "Bearer nope"}, timeout=60)
    assert wrong.status_code == 401
    assert httpx.post(server.url(path), json=body, headers=AUTH, timeout=60).status_code == 200


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version"])
def test_probes_stay_open(server, path):
    assert httpx.get(server.url(path), timeout=60).status_code == 200


# ---- bad_words, stop_token_ids, prompt logprobs, grammar sizes ------------------


def test_huge_bad_words_list_is_refused_while_another_client_streams(server, http):
    victim = Victim(server, http)
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4, "bad_words": [f"w{i}" for i in range(100_000)]}
    error = _error(http.post("/v1/completions", json=body))
    assert error["param"] == "bad_words" and str(MAX_BAD_WORDS) in error["message"]
    chat = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, "bad_words": ["w" * 100_000]}
    assert _error(http.post("/v1/chat/completions", json=chat))["param"] == "bad_words"
    victim.check_finished()


def test_bad_words_at_the_cap_complete_while_another_client_streams(server, http):
    victim = Victim(server, http)
    words = [f"zq{i}x" for i in range(MAX_BAD_WORDS)]
    prompts = ["ROMEO:", "JULIET:", "Hello"]  # tokenized once for all three
    body = {"model": MODEL_NAME, "prompt": prompts, "max_tokens": 16, "temperature": 0, "bad_words": words}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 3 and all(c["finish_reason"] in ("length", "stop") for c in choices)
    victim.check_finished()


def test_stop_token_ids_capped_after_deduplication(http):
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "stop_token_ids": [7] * 50_000}
    assert http.post("/v1/completions", json=body).status_code == 200
    body["stop_token_ids"] = list(range(MAX_STOP_TOKEN_IDS + 1))
    error = _error(http.post("/v1/completions", json=body))
    assert error["param"] == "stop_token_ids"


def test_echo_logprobs_capped_per_request(server, http):
    victim = Victim(server, http)
    # 32 prompts of 500 tokens x (20 + 1) logprobs: ~336k entries, past the cap.
    prompts = [[5 + i % 50] * 500 for i in range(32)]
    body = {"model": MODEL_NAME, "prompt": prompts, "max_tokens": 1, "echo": True, "logprobs": 20}
    error = _error(http.post("/v1/completions", json=body))
    assert error["param"] == "logprobs" and "echo with logprobs" in error["message"]
    body["prompt"] = prompts[:2]
    assert http.post("/v1/completions", json=body).status_code == 200
    victim.check_finished()


@pytest.mark.parametrize(
    "field, value",
    [
        ("structured_outputs", {"regex": "a" * (MAX_GRAMMAR_CHARS + 1)}),
        ("structured_outputs", {"choice": ["c"] * 2000}),
        ("guided_json", {"type": "object", "description": "d" * MAX_GRAMMAR_CHARS}),
        ("guided_grammar", "root ::= " + '"a" ' * MAX_GRAMMAR_CHARS),
        (
            "response_format",
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "description": "d" * MAX_GRAMMAR_CHARS}},
            },
        ),
    ],
)
def test_oversized_grammars_are_refused(http, field, value):
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, field: value}
    error = _error(http.post("/v1/completions", json=body))
    assert error["param"] == field and "at most" in error["message"]
