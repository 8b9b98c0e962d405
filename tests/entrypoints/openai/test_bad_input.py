"""Client mistakes get HTTP 400 with an OpenAI error body naming the field, never
a 5xx, and the server keeps serving; a hypothesis fuzz of request bodies."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.entrypoints.openai.server_utils import API_KEY, MODEL_NAME

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
GOOD = {"model": MODEL_NAME, "prompt": "ROMEO:", "max_tokens": 2}
GOOD_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=60) as client:
        yield client


def _assert_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param


@pytest.mark.parametrize(
    "body, param",
    [
        ({**GOOD, "temperature": -1}, "temperature"),
        ({**GOOD, "top_p": 0}, "top_p"),
        ({**GOOD, "top_k": -2}, "top_k"),
        ({**GOOD, "min_p": 2}, "min_p"),
        ({**GOOD, "presence_penalty": 3}, "presence_penalty"),
        ({**GOOD, "max_tokens": 0}, "max_tokens"),
        ({**GOOD, "max_tokens": 100000}, "max_tokens"),
        ({**GOOD, "n": 0}, "n"),
        ({**GOOD, "temperature": "hot"}, "temperature"),
        ({**GOOD, "stop": [""]}, "stop"),
        ({**GOOD, "prompt": ""}, "prompt"),
        ({**GOOD, "prompt": []}, "prompt"),
        ({**GOOD, "prompt": [1, 2, 10**9]}, "prompt_token_ids"),
        ({**GOOD, "prompt": "word " * 600}, "prompt"),
        ({**GOOD, "seed": 2**70}, "seed"),
        ({"model": MODEL_NAME}, "prompt"),
    ],
)
def test_bad_completion_requests(http, body, param):
    _assert_error(http.post("/v1/completions", json=body), 400, param)


@pytest.mark.parametrize(
    "body, param",
    [
        ({**GOOD_CHAT, "messages": []}, "messages"),
        ({**GOOD_CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        (
            {**GOOD_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages",
        ),
        ({**GOOD_CHAT, "max_completion_tokens": 100000}, "max_completion_tokens"),
        ({**GOOD_CHAT, "top_logprobs": 3}, "top_logprobs"),
        ({**GOOD_CHAT, "frequency_penalty": -5}, "frequency_penalty"),
    ],
)
def test_bad_chat_requests(http, body, param):
    _assert_error(http.post("/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize("path, body", [("/v1/completions", GOOD), ("/v1/chat/completions", GOOD_CHAT)])
def test_unknown_model_is_not_found(http, path, body):
    # OpenAI's and vLLM's answer to a model the server does not serve.
    response = http.post(path, json={**body, "model": "not-a-model"})
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["type"] == "NotFoundError" and error["param"] == "model" and error["code"] == 404


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"", b'{"prompt": NaN, "model": "x"}'])
def test_malformed_bodies(http, content):
    response = http.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_server_still_serves_after_bad_input(http):
    assert http.get("/health").status_code == 200
    response = http.post("/v1/completions", json=GOOD)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


_json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
_json = st.recursive(
    _json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8,
)
# Values near the edges of what is valid, so many bodies get past validation.
_small_int = st.one_of(st.integers(min_value=-2, max_value=4), st.sampled_from([2**63, 2**31, -(2**63)]))
_fields = {
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 1000), max_size=6), _json),
    "max_tokens": _small_int,
    "n": st.one_of(st.integers(min_value=-1, max_value=3), _json),
    "temperature": st.one_of(st.floats(-1, 3, allow_nan=False), _json),
    "top_p": st.one_of(st.floats(-0.5, 1.5, allow_nan=False), _json),
    "top_k": st.one_of(_small_int, _json),
    "min_p": st.floats(-0.5, 1.5, allow_nan=False),
    "seed": st.one_of(_small_int, _json),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), _json),
    "logprobs": st.one_of(_small_int, st.booleans(), _json),
    "top_logprobs": _small_int,
    "echo": st.one_of(st.booleans(), _json),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), _json),
    "presence_penalty": st.floats(-3, 3, allow_nan=False),
    "frequency_penalty": st.floats(-3, 3, allow_nan=False),
    "min_tokens": _small_int,
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.one_of(st.lists(st.integers(-2, 2000), max_size=3), _json),
    "messages": st.one_of(
        st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["system", "user", "assistant", "tool", 3]),
                    "content": st.one_of(st.text(max_size=20), _json),
                }
            ),
            max_size=3,
        ),
        _json,
    ),
    "model": st.one_of(st.just(MODEL_NAME), _json),
}
_bodies = st.fixed_dictionaries({}, optional=_fields)


def _post(http: httpx.Client, path: str, body) -> httpx.Response:
    if isinstance(body, dict) and "max_tokens" not in body:
        # Chat defaults max_tokens to the whole context: too slow for a fuzz.
        body = {**body, "max_tokens": 3}
    response = http.post(path, json=body)
    if response.status_code == 200 and isinstance(body, dict) and body.get("stream") is True:
        assert response.text.rstrip().endswith("data: [DONE]")
    return response


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.one_of(_bodies, _json), path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzzed_bodies_never_5xx(http, body, path):
    response = _post(http, path, body)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_healthy_after_fuzz(http):
    assert http.get("/health").status_code == 200
    assert http.post("/v1/chat/completions", json=GOOD_CHAT).status_code == 200
