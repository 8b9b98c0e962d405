"""Nothing a client sends is silently ignored: every field of vLLM's
ChatCompletionRequest and CompletionRequest is honoured, refused with a 400
naming it, or on raylm's documented list of fields without effect on
generation; any other field is a 400.

The walked lists below are vLLM's request fields, written down from vLLM's
source: vllm/entrypoints/openai/chat_completion/protocol.py and
completion/protocol.py (recent main), plus the guided_* fields of v0.10's
vllm/entrypoints/openai/protocol.py, which raylm keeps as aliases. Each entry
holds the body fields that exercise it with a value other than its default.
"""

from __future__ import annotations

import json

import httpx
import pytest

from raylm.entrypoints.openai.protocol import (
    NO_EFFECT_FIELDS,
    UNSUPPORTED_CHAT_FIELDS,
    UNSUPPORTED_COMPLETION_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
)
from tests.entrypoints.openai.server_utils import MODEL_NAME


@pytest.fixture(scope="module")
def server(trusting_server):
    """Requests here send chat templates of their own."""
    return trusting_server


USER = [{"role": "user", "content": "hi"}]
CHAT_BASE = {"model": MODEL_NAME, "messages": USER, "max_tokens": 2}
COMPLETION_BASE = {"model": MODEL_NAME, "prompt": "ROMEO:", "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
# The tiny model's template ignores tools (a 400): this one renders them.
TOOLS_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}"

# Fields both requests have in vLLM.
_SHARED = {
    "model": {"model": MODEL_NAME},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "logit_bias": {"logit_bias": {"5": 2.0}},
    "max_tokens": {"max_tokens": 3},
    "n": {"n": 2},
    "presence_penalty": {"presence_penalty": 0.5},
    "response_format": {"response_format": {"type": "json_object"}},
    "seed": {"seed": 3},
    "stop": {"stop": ["xyz"]},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "temperature": {"temperature": 0.5},
    "top_p": {"top_p": 0.9},
    "user": {"user": "someone"},
    "use_beam_search": {"use_beam_search": True},
    "top_k": {"top_k": 5},
    "min_p": {"min_p": 0.1},
    "repetition_penalty": {"repetition_penalty": 1.2},
    "length_penalty": {"length_penalty": 0.5},
    "stop_token_ids": {"stop_token_ids": [7]},
    "include_stop_str_in_output": {"include_stop_str_in_output": True},
    "ignore_eos": {"ignore_eos": True},
    "min_tokens": {"min_tokens": 1},
    "skip_special_tokens": {"skip_special_tokens": False},
    "spaces_between_special_tokens": {"spaces_between_special_tokens": False},
    "truncate_prompt_tokens": {"truncate_prompt_tokens": 4},
    "prompt_logprobs": {"prompt_logprobs": 1},
    "allowed_token_ids": {"allowed_token_ids": [5, 6, 7]},
    "bad_words": {"bad_words": ["the"]},
    "echo": {"echo": True},
    "add_special_tokens": {"add_special_tokens": True},
    "structured_outputs": {"structured_outputs": {"choice": ["yes", "no"]}},
    "priority": {"priority": 1},
    "request_id": {"request_id": "my-request"},
    "logits_processors": {"logits_processors": ["my.module.Processor"]},
    "return_tokens_as_token_ids": {"return_tokens_as_token_ids": True},
    "return_token_ids": {"return_token_ids": True},
    "cache_salt": {"cache_salt": "pepper"},
    "kv_transfer_params": {"kv_transfer_params": {"do_remote_prefill": True}},
    "vllm_xargs": {"vllm_xargs": {"x": 1}},
    "best_of": {"best_of": 3},
    "guided_json": {"guided_json": {"type": "object"}},
    "guided_regex": {"guided_regex": "[a-z]+"},
    "guided_choice": {"guided_choice": ["yes", "no"]},
    "guided_grammar": {"guided_grammar": 'root ::= "a" | "b"'},
    "guided_decoding_backend": {"guided_decoding_backend": "outlines"},
    "guided_whitespace_pattern": {"guided_whitespace_pattern": " "},
    "mm_processor_kwargs": {"mm_processor_kwargs": {"size": 3}},
    "return_token_offsets": {"return_token_offsets": True},
}

VLLM_CHAT_FIELDS = {
    **_SHARED,
    "messages": {"messages": [{"role": "system", "content": "Be brief."}, *USER]},
    "logprobs": {"logprobs": True},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "max_completion_tokens": {"max_completion_tokens": 3},
    # Tool calling (helper C's): tools offered, the model told not to call them.
    "tools": {"tools": [TOOL], "tool_choice": "none", "chat_template": TOOLS_TEMPLATE},
    "tool_choice": {"tools": [TOOL], "tool_choice": "none", "chat_template": TOOLS_TEMPLATE},
    "parallel_tool_calls": {
        "tools": [TOOL],
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "chat_template": TOOLS_TEMPLATE,
    },
    "reasoning_effort": {"reasoning_effort": "low"},
    "include_reasoning": {"include_reasoning": False},
    "add_generation_prompt": {"add_generation_prompt": False},
    "continue_final_message": {
        "continue_final_message": True,
        "add_generation_prompt": False,
        "messages": [*USER, {"role": "assistant", "content": "Hello"}],
    },
    "documents": {"documents": [{"title": "T", "text": "body"}]},
    "chat_template": {"chat_template": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"},
    "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
    "structural_tag": {"structural_tag": "{}"},
    "max_repetition_pattern_size": {"max_repetition_pattern_size": 4},
    "min_repetition_pattern_size": {"min_repetition_pattern_size": 2},
    "repetition_min_count": {"repetition_min_count": 3},
}

VLLM_COMPLETION_FIELDS = {
    **_SHARED,
    "prompt": {"prompt": ["ROMEO:", "JULIET:"]},
    "logprobs": {"logprobs": 2},
    "suffix": {"suffix": " the end"},
    "prompt_embeds": {"prompt_embeds": "AAAA"},
    "add_special_tokens": {"add_special_tokens": False},
    "truncation_side": {"truncate_prompt_tokens": 2, "truncation_side": "right"},
    "logprob_token_ids": {"logprobs": 1, "logprob_token_ids": [5]},
    "ec_transfer_params": {"ec_transfer_params": {"x": 1}},
    "repetition_detection": {"repetition_detection": {"max_pattern_size": 4}},
    "thinking_token_budget": {"thinking_token_budget": 16},
}

# OpenAI fields outside vLLM's models that carry no meaning for generation.
OPENAI_NO_EFFECT = {
    name: {name: value}
    for name, value in {
        "metadata": {"k": "v"},
        "store": True,
        "service_tier": "auto",
        "safety_identifier": "s",
        "prompt_cache_key": "k",
    }.items()
}

ENDPOINTS = {
    "chat": (
        "/v1/chat/completions",
        CHAT_BASE,
        ChatCompletionRequest,
        UNSUPPORTED_CHAT_FIELDS,
        {**VLLM_CHAT_FIELDS, **OPENAI_NO_EFFECT},
    ),
    "completion": (
        "/v1/completions",
        COMPLETION_BASE,
        CompletionRequest,
        UNSUPPORTED_COMPLETION_FIELDS,
        {**VLLM_COMPLETION_FIELDS, **OPENAI_NO_EFFECT},
    ),
}
WALK = [(endpoint, field) for endpoint, spec in ENDPOINTS.items() for field in spec[4]]


def _kind(endpoint: str, field: str) -> str:
    _, _, model, unsupported, _ = ENDPOINTS[endpoint]
    kinds = [
        kind
        for kind, member in (
            ("no effect", field in NO_EFFECT_FIELDS),
            ("refused", field in unsupported),
            ("honoured", field in model.model_fields),
        )
        if member
    ]
    assert len(kinds) == 1, f"{endpoint}.{field}: {kinds or 'neither honoured, refused nor without effect'}"
    return kinds[0]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_lists_cover_the_models(endpoint):
    """Each field raylm declares, refuses or lets pass is one of the walked
    ones: the lists and the walk cannot drift apart."""
    _, _, model, unsupported, walked = ENDPOINTS[endpoint]
    assert set(model.model_fields) <= set(walked)
    assert set(unsupported) <= set(walked)
    assert set(NO_EFFECT_FIELDS) <= set(walked)


def _post(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    response = http.post(path, json=body)
    if response.status_code == 200 and body.get("stream"):
        assert response.text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in response.text, response.text
    return response


@pytest.mark.parametrize("endpoint, field", WALK, ids=[f"{e}-{f}" for e, f in WALK])
def test_each_field_is_honoured_refused_or_without_effect(http, endpoint, field):
    path, base, _, unsupported, walked = ENDPOINTS[endpoint]
    kind = _kind(endpoint, field)
    response = _post(http, path, {**base, **walked[field]})
    if kind == "refused":
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == field and f"{field} is not supported" in error["message"]
        # Clients send vLLM's defaults explicitly: those change nothing and pass.
        neutral = {**base, field: unsupported[field][0]}
        assert _post(http, path, neutral).status_code == 200
    else:
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("path, base", [("/v1/chat/completions", CHAT_BASE), ("/v1/completions", COMPLETION_BASE)])
@pytest.mark.parametrize("field", ["frobnicate", "modalities", "prediction", "functions"])
def test_unknown_fields_are_400(http, path, base, field):
    response = http.post(path, json={**base, field: [1]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["message"] == f"Unrecognized request argument supplied: {field}"
    assert error["type"] == "invalid_request_error"


def test_field_of_the_other_endpoint_is_400(http):
    response = http.post("/v1/chat/completions", json={**CHAT_BASE, "suffix": "x"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "suffix"


def test_continuous_usage_stats_refused(http):
    body = {**COMPLETION_BASE, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options"


def _completion_text(http, **fields) -> dict:
    response = http.post("/v1/completions", json={**COMPLETION_BASE, "max_tokens": 8, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_top_k_zero_means_no_top_k(http):
    # Same seed: top_k=0 samples exactly as no top_k; top_k=1 is greedy.
    unset = _completion_text(http, temperature=1.0, seed=1234)["choices"][0]["text"]
    assert _completion_text(http, temperature=1.0, seed=1234, top_k=0)["choices"][0]["text"] == unset
    greedy = _completion_text(http, temperature=0.0)["choices"][0]["text"]
    assert _completion_text(http, temperature=1.0, seed=1234, top_k=1)["choices"][0]["text"] == greedy


def test_completion_add_special_tokens(http, tokenizer):
    prompt = "ROMEO: hello there"
    with_bos = _completion_text(http, prompt=prompt, temperature=0.0, echo=True)
    without = _completion_text(http, prompt=prompt, temperature=0.0, echo=True, add_special_tokens=False)
    assert with_bos["usage"]["prompt_tokens"] == len(tokenizer.encode(prompt))
    assert without["usage"]["prompt_tokens"] == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert without["usage"]["prompt_tokens"] == with_bos["usage"]["prompt_tokens"] - 1
    assert without["choices"][0]["text"].startswith(prompt)
    # Without BOS the model sees other tokens: greedy continues as from those ids.
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    from_ids = _completion_text(http, prompt=ids, temperature=0.0)["choices"][0]["text"]
    assert without["choices"][0]["text"] == prompt + from_ids


def test_chat_continue_final_message_with_echo(http, tokenizer):
    """The reply continues the open assistant message: greedy, it is what a
    completion of HF's rendering (continue_final_message=True) gives; with
    echo it starts with the message itself."""
    messages = [*USER, {"role": "assistant", "content": "The answer is"}]
    body = {
        **CHAT_BASE,
        "messages": messages,
        "max_tokens": 6,
        "temperature": 0.0,
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    reply = http.post("/v1/chat/completions", json=body).json()
    echoed = http.post("/v1/chat/completions", json={**body, "echo": True}).json()
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert rendered.endswith("The answer is")
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert reply["usage"]["prompt_tokens"] == len(ids)
    expected = _completion_text(http, prompt=ids, temperature=0.0, max_tokens=6)["choices"][0]["text"]
    assert reply["choices"][0]["message"]["content"] == expected
    assert echoed["choices"][0]["message"]["content"] == "The answer is" + expected


def test_chat_echo_streamed(http):
    messages = [*USER, {"role": "assistant", "content": "Well"}]
    body = {
        **CHAT_BASE,
        "messages": messages,
        "max_tokens": 4,
        "temperature": 0.0,
        "echo": True,
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    events = http.post("/v1/chat/completions", json={**body, "stream": True}).text.split("\n\n")
    chunks = [json.loads(e[len("data: ") :]) for e in events if e.startswith("data: {")]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == whole and whole.startswith("Well")


def test_continue_final_message_with_generation_prompt_is_400(http):
    body = {**CHAT_BASE, "continue_final_message": True}  # add_generation_prompt defaults to true
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize(
    "fields",
    [
        lambda t: {"logit_bias": {str(t): 100}},
        lambda t: {"allowed_token_ids": [t]},
    ],
    ids=["logit_bias", "allowed_token_ids"],
)
def test_token_constraints_reach_the_sampler(http, tokenizer, fields):
    # Sampled at temperature 1, yet every token is the one favoured / allowed
    # (logit_bias keys arrive as strings and must become token ids).
    token = tokenizer.encode(" moon", add_special_tokens=False)[0]
    result = _completion_text(http, temperature=1.0, seed=9, max_tokens=4, ignore_eos=True, logprobs=0, **fields(token))
    assert result["usage"]["completion_tokens"] == 4
    assert result["choices"][0]["text"] == tokenizer.decode([token] * 4)


def test_bad_logit_bias_key_is_400(http):
    response = http.post("/v1/completions", json={**COMPLETION_BASE, "logit_bias": {"moon": 5}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "logit_bias"
