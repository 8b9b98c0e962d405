"""/tokenize and /detokenize (vLLM's shapes), checked against the Hugging Face
tokenizer and chat template; and the chat template fields they share with
/v1/chat/completions (chat_template, chat_template_kwargs, documents,
reasoning_effort, continue_final_message, add_special_tokens): the ids
/tokenize reports are the ones a chat completion is generated from."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.server_utils import MODEL_NAME


@pytest.fixture(scope="module")
def server(trusting_server):
    """Requests here send chat templates of their own."""
    return trusting_server


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
# Renders the variables only a per-request template and its kwargs can bring.
TEMPLATE = (
    "{{ greeting }}|{{ reasoning_effort }}|{{ documents[0]['title'] }}|"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
)


def _tokenize(http, **body) -> dict:
    response = http.post("/tokenize", json={"model": MODEL_NAME, **body})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_tokenize_prompt(http, tokenizer, add_special_tokens):
    prompt = "ROMEO: But soft, what light through yonder window breaks? ✨"
    result = _tokenize(http, prompt=prompt, add_special_tokens=add_special_tokens, return_token_strs=True)
    expected = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    assert result["tokens"] == expected and result["count"] == len(expected)
    assert result["max_model_len"] == 512
    assert result["token_strs"] == tokenizer.convert_ids_to_tokens(expected)


def test_tokenize_matches_completion_usage(http):
    prompt = "JULIET: O Romeo, Romeo"
    counted = _tokenize(http, prompt=prompt)["count"]
    usage = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == counted


def test_tokenize_chat_matches_hf_template(http, tokenizer):
    result = _tokenize(http, messages=MESSAGES)
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    # The template writes BOS itself.
    assert result["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert result["token_strs"] is None
    without_prompt = _tokenize(http, messages=MESSAGES, add_generation_prompt=False)
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert without_prompt["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    # add_special_tokens adds BOS on top of the template's.
    doubled = _tokenize(http, messages=MESSAGES, add_special_tokens=True)
    assert doubled["tokens"] == [tokenizer.bos_token_id] + result["tokens"]


def test_continue_final_message_renders_open(http, tokenizer):
    messages = [*MESSAGES, {"role": "assistant", "content": "General Kenobi"}]
    result = _tokenize(http, messages=messages, continue_final_message=True, add_generation_prompt=False)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert rendered.endswith("General Kenobi")  # no end-of-turn after it
    assert result["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    both = http.post("/tokenize", json={"messages": messages, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_template_fields_reach_the_template(http, tokenizer):
    fields = {
        "chat_template": TEMPLATE,
        "chat_template_kwargs": {"greeting": "Howdy"},
        "reasoning_effort": "high",
        "documents": [{"title": "Scroll", "text": "..."}],
    }
    result = _tokenize(http, messages=MESSAGES, **fields)
    text = "Howdy|high|Scroll|system: Be brief.\nuser: Hello there\n"
    # This template writes no BOS: raylm adds it, as for the model's own template.
    assert result["tokens"] == tokenizer.encode(text, add_special_tokens=True)
    # A chat completion is generated from exactly these ids.
    chat = http.post(
        "/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1, **fields}
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == result["count"]


@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
def test_reserved_template_kwargs_are_400(http, path):
    body = {
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "max_tokens": 1,
        "chat_template_kwargs": {"tokenize": True, "add_generation_prompt": False},
    }
    if path == "/tokenize":
        del body["max_tokens"]
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "chat_template_kwargs" and "add_generation_prompt, tokenize" in error["message"]


def test_detokenize_round_trip(http, tokenizer):
    text = "Parting is such sweet sorrow. ünïcödé 日本"
    ids = tokenizer.encode(text, add_special_tokens=False)
    response = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": ids})
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": tokenizer.decode(ids)} and response.json()["prompt"] == text


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/detokenize", {"tokens": [1, 10**7]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "nope"}, 404, "model"),
        ("/tokenize", {"prompt": "x", "model": "nope"}, 404, "model"),
        ("/tokenize", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
        ("/tokenize", {"messages": [], "add_generation_prompt": True}, 400, "messages"),
        ("/tokenize", {}, 400, "prompt"),
    ],
)
def test_bad_requests(http, path, body, status, param):
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_malformed_body(http):
    response = http.post("/tokenize", content=b"{nope", headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_truncate_prompt_tokens_keeps_the_last_tokens(http, path):
    """The request's prompt (a chat: its rendered conversation) is cut to its
    last k tokens: usage says k, and the greedy reply is the completion of
    exactly those k tokens."""
    if path == "/v1/completions":
        ids = _tokenize(http, prompt="ROMEO: But soft, what light through yonder window breaks?")["tokens"]
        body = {"prompt": "ROMEO: But soft, what light through yonder window breaks?"}
    else:
        ids = _tokenize(http, messages=MESSAGES)["tokens"]
        body = {"messages": MESSAGES}
    keep = 5
    assert len(ids) > keep
    common = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    cut = http.post(path, json={**body, **common, "truncate_prompt_tokens": keep}).json()
    assert cut["usage"]["prompt_tokens"] == keep
    reference = http.post("/v1/completions", json={"prompt": ids[-keep:], **common}).json()
    text = cut["choices"][0]["message"]["content"] if "message" in cut["choices"][0] else cut["choices"][0]["text"]
    assert text == reference["choices"][0]["text"]
