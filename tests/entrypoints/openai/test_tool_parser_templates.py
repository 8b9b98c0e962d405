"""Each tool-call parser with the chat template it expects: the template
raylm ships for it (tool_parsers/templates/, for --chat-template) renders
through the server's own rendering (render_chat) the tools offered and an
assistant's earlier calls in exactly the format its parser reads back, so a
model prompted with it sees calls it can imitate, and those calls come back
equal."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from raylm.entrypoints.openai.protocol import ChatCompletionRequest
from raylm.entrypoints.openai.serving_chat import render_chat
from raylm.entrypoints.openai.serving_tools import template_reads_tools
from raylm.entrypoints.openai.tool_parsers import get_tool_parser, tool_chat_template_path, tool_parser_names

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "where": {"type": "object"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}},
    },
]
CALLS = [
    ("get_weather", {"city": 'Paris "centre"', "days": 3, "metric": True, "where": {"lat": 48.8}}),
    ("get_time", {"zone": "CET"}),
]
# Where the assistant's turn ends in each template.
TURN_END = {
    "llama3_json": "<|eot_id|>",
    "pythonic": "<|eot_id|>",
    "mistral": "</s>",
    "qwen3_xml": "<|im_end|>\n",
    "qwen3_coder": "<|im_end|>\n",
}
SHIPPED = sorted(name for name in tool_parser_names() if tool_chat_template_path(name) is not None)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))


def _request(template: str, messages: list[dict], **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=messages, tools=TOOLS, chat_template=template, **fields)


def test_every_parser_but_hermes_ships_a_template():
    # hermes: Qwen2.5/Qwen3 and Hermes models write <tool_call> in their own templates.
    assert SHIPPED == ["llama3_json", "mistral", "pythonic", "qwen3_coder", "qwen3_xml"]


@pytest.mark.parametrize("parser_name", SHIPPED)
def test_shipped_template_writes_calls_its_parser_reads(tokenizer, parser_name):
    template = tool_chat_template_path(parser_name).read_text()
    assert template_reads_tools(template)
    user = {"role": "user", "content": "Weather and time in Paris?"}
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
            for i, (name, arguments) in enumerate(CALLS)
        ],
    }
    prompt, _ = render_chat(tokenizer, _request(template, [user]))
    history, _ = render_chat(tokenizer, _request(template, [user, assistant], add_generation_prompt=False))
    # The tools are offered, with their schemas.
    for tool in TOOLS:
        assert json.dumps(tool["function"]["name"]) in prompt
    assert '"description": "The weather in a city."' in prompt
    # The earlier turn is the prompt's generation point followed by the calls, as the model would write them.
    assert history.startswith(prompt)
    written = history[len(prompt) :]
    assert written.endswith(TURN_END[parser_name]), written
    written = written[: -len(TURN_END[parser_name])]
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    extracted = get_tool_parser(parser_name, schemas).extract(written)
    assert extracted.content is None, written
    assert [(c.name, json.loads(c.arguments)) for c in extracted.calls] == CALLS, written


@pytest.mark.parametrize("parser_name", SHIPPED)
def test_shipped_template_renders_a_tool_reply_and_a_system_turn(tokenizer, parser_name):
    template = tool_chat_template_path(parser_name).read_text()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Time?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_9", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_9", "content": "12:00"},
    ]
    text, ids = render_chat(tokenizer, _request(template, messages))
    assert "Be brief." in text and "Time?" in text and "12:00" in text
    assert text.count("Be brief.") == 1
    assert ids
