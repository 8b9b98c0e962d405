"""Tool calling on /v1/chat/completions with the official `openai` client,
against `raylm serve` of a tiny random-weight llama whose chat template
renders tools the Hermes/Qwen way. A random model never calls a tool on its
own, so calls are forced (a named tool_choice, "required"): their arguments
must validate against the functions' schemas (jsonschema), whole and
streamed. Auto parsing is covered by test_tool_parsers.py; here, the shape
of an auto answer without calls."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from raylm.testing.tool_chat_template import install_tool_chat_template
from tests.entrypoints.openai.server_utils import API_KEY, MODEL_NAME, RaylmServer

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ALARM = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"], "additionalProperties": False}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}},
]
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# Greedy, so that each answer is the same on every run.
GREEDY = {"temperature": 0.0, "max_tokens": 120}


@pytest.fixture(scope="module")
def tool_model_dir(llama_dir, tmp_path_factory) -> str:
    return str(install_tool_chat_template(llama_dir, tmp_path_factory.mktemp("tool_model") / "llama"))


@pytest.fixture(scope="module")
def tool_server(tool_model_dir, tmp_path_factory):
    flags = [
        "--api-key",
        API_KEY,
        "--max-model-len",
        "1024",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ]
    srv = RaylmServer(tool_model_dir, flags, str(tmp_path_factory.mktemp("serve") / "server.log"))
    try:
        yield srv
    finally:
        srv.terminate()


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_server.url("/v1"), api_key=API_KEY, max_retries=0)


def _check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _streamed(client: openai.OpenAI, **kwargs) -> tuple[str, dict[int, dict], str]:
    """(content, {index: call}, finish_reason), assembled from the deltas."""
    content, calls, finish_reason = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL_NAME, stream=True, **kwargs):
        [choice] = chunk.choices
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.index not in calls:
                # OpenAI's shape: a call's first delta has its id, type and name.
                assert piece.id.startswith("call_") and piece.type == "function" and piece.function.name
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            else:
                assert piece.id is None and piece.function.name is None
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        finish_reason = choice.finish_reason or finish_reason
    return content, calls, finish_reason


def test_named_tool_choice(client):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, tools=TOOLS, tool_choice=NAMED, **GREEDY
    )
    [choice] = response.choices
    # Forced by name: "stop", as OpenAI and vLLM answer (a call the model chose says "tool_calls").
    assert choice.finish_reason == "stop" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    _check_call(call.function.name, call.function.arguments)


def test_named_tool_choice_streamed(client):
    content, calls, finish_reason = _streamed(client, messages=QUESTION, tools=TOOLS, tool_choice=NAMED, **GREEDY)
    assert finish_reason == "stop" and content == ""
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    _check_call("get_weather", calls[0]["arguments"])
    # The same greedy arguments as the whole answer.
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, tools=TOOLS, tool_choice=NAMED, **GREEDY
    )
    assert json.loads(calls[0]["arguments"]) == json.loads(whole.choices[0].message.tool_calls[0].function.arguments)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice(client, parallel):
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        temperature=0.0,
        max_tokens=300,
    )
    [choice] = response.choices
    assert len(choice.message.tool_calls) >= 1 and not choice.message.content, choice
    if parallel:
        # A random model may go on adding calls until max_tokens; the complete ones count.
        assert choice.finish_reason in ("tool_calls", "length")
    else:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_")
        _check_call(call.function.name, call.function.arguments)
    assert len({call.id for call in choice.message.tool_calls}) == len(choice.message.tool_calls)

    content, calls, finish_reason = _streamed(
        client,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        temperature=0.0,
        max_tokens=300,
    )
    assert (finish_reason, content) == (choice.finish_reason, "")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
    ]


def _rendered_token_count(tokenizer, conversation: list[dict], tools: list[dict]) -> int:
    text = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_two_turn_conversation_with_a_tool_result(client, tool_model_dir):
    first = client.chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, tools=TOOLS, tool_choice=NAMED, **GREEDY
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"},
    ]
    second = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=TOOLS, tool_choice="none", temperature=0.0, max_tokens=8
    )
    [choice] = second.choices
    assert choice.message.tool_calls in (None, []) and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")

    # The prompt the server rendered is the template's rendering of the whole
    # conversation, tool result included (hand-built here as the oracle).
    tokenizer = AutoTokenizer.from_pretrained(tool_model_dir)
    arguments = json.loads(call.function.arguments)
    conversation = [
        *QUESTION,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"},
    ]
    expected = _rendered_token_count(tokenizer, conversation, TOOLS)
    without_result = _rendered_token_count(tokenizer, conversation[:2], TOOLS)
    assert second.usage.prompt_tokens == expected != without_result


def test_auto_without_a_call_is_plain_content(client):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, tools=TOOLS, temperature=0.0, max_tokens=8
    )
    [choice] = response.choices
    assert choice.message.tool_calls in (None, []) and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    content, calls, finish_reason = _streamed(client, messages=QUESTION, tools=TOOLS, temperature=0.0, max_tokens=8)
    assert (content, calls, finish_reason) == (choice.message.content, {}, choice.finish_reason)


def _error(response: httpx.Response, param: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, 400), error
    return error


def _post(server: RaylmServer, body: dict) -> httpx.Response:
    return httpx.post(
        server.url("/v1/chat/completions"),
        json={"model": MODEL_NAME, "max_tokens": 4, **body},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )


def test_bad_tool_requests(tool_server):
    _error(
        _post(
            tool_server,
            {"messages": QUESTION, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        ),
        "tool_choice",
    )
    _error(_post(tool_server, {"messages": QUESTION, "tool_choice": "required"}), "tool_choice")
    _error(_post(tool_server, {"messages": [*QUESTION, {"role": "tool", "content": "21"}], "tools": TOOLS}), "messages")
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}]
    _error(_post(tool_server, {"messages": QUESTION, "tools": bad_schema, "tool_choice": "required"}), "tools")
    # The server still answers.
    assert _post(tool_server, {"messages": QUESTION}).status_code == 200


def test_without_the_flags_or_a_tool_template(server):
    """The default test server: no --enable-auto-tool-choice, and a template that ignores tools."""
    error = _error(_post(server, {"messages": QUESTION, "tools": TOOLS}), "tool_choice")
    assert "--enable-auto-tool-choice" in error["message"]
    _error(_post(server, {"messages": QUESTION, "tools": TOOLS, "tool_choice": "none"}), "tools")
    assert _post(server, {"messages": QUESTION}).status_code == 200
