"""The Hermes tool-call parser on hand-written outputs, whole and streamed in
random chunk splits (the streamed result must add up to the whole one), and
the tool plan: tool_choice checks, the schemas that constrain "required" and
named calls (checked with jsonschema), rendering through a chat template."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from transformers import AutoTokenizer

from raylm.entrypoints.openai.protocol import ChatCompletionRequest
from raylm.entrypoints.openai.serving_chat import render_chat
from raylm.entrypoints.openai.serving_common import OpenAIError
from raylm.entrypoints.openai.serving_tools import (
    ToolCallConfig,
    add_tool_fields,
    plan_tools,
    template_reads_tools,
)
from raylm.entrypoints.openai.tool_parsers import get_tool_parser, tool_parser_names
from raylm.sampling_params import SamplingParams, StructuredOutputsParams
from raylm.testing.tiny_models import CHAT_TEMPLATE
from raylm.testing.tool_chat_template import TOOL_CHAT_TEMPLATE, install_tool_chat_template

# (model output, expected content, expected [(name, arguments object)]); None: the output is plain content.
CASES = [
    ("Just text, no calls.", "Just text, no calls.", None),
    ("", "", None),
    (
        'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Let me check.",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        '<tool_call>\n{"name": "a", "arguments": {"s": "}{ \\"quoted\\" ]", "n": [1, {"x": null}]}}\n'
        '</tool_call>\n<tool_call>\n{"name": "b", "arguments": {"city": "東京 🌸"}}\n</tool_call>',
        None,
        [("a", {"s": '}{ "quoted" ]', "n": [1, {"x": None}]}), ("b", {"city": "東京 🌸"})],
    ),
    # The model stopped right after the last call, before its closing tag.
    (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"k": 1}}',
        None,
        [("a", {}), ("b", {"k": 1})],
    ),
    ('<tool_call>{"name": "no_args"}</tool_call>', None, [("no_args", {})]),
    ('<tool_call>{"arguments": {"k": true}, "name": "args_first"}</tool_call>', None, [("args_first", {"k": True})]),
    # Look-alikes of the tag stay content.
    ("a <tool> b <tool_ c <tool_call", "a <tool> b <tool_ c <tool_call", None),
    # A malformed call makes the whole output content.
    ("Hi <tool_call>not json</tool_call> tail", "Hi <tool_call>not json</tool_call> tail", None),
]
BROKEN_AFTER_NAME = 'Hi <tool_call>{"name": "a", "arguments": {"k": </tool_call>'


def _split_randomly(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]


def _streamed(chunks: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) as a client assembles OpenAI deltas."""
    stream = get_tool_parser("hermes").streaming()
    content, calls = "", {}
    for delta in [*(stream.feed(chunk) for chunk in chunks), stream.finish()]:
        content += delta.content
        for piece in delta.tool_calls:
            if piece.index not in calls:
                # A call's first piece brings its id and name.
                assert piece.id.startswith("call_") and piece.name, piece
                calls[piece.index] = [piece.name, ""]
            else:
                assert piece.id is None and piece.name is None, piece
            calls[piece.index][1] += piece.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_hermes_extract(text, content, calls):
    extracted = get_tool_parser("hermes").extract(text)
    assert extracted.content == content
    if calls is None:
        assert extracted.calls == []
    else:
        assert [(c.name, json.loads(c.arguments)) for c in extracted.calls] == calls


@pytest.mark.parametrize("text,content,calls", CASES)
def test_hermes_streaming_equals_whole(text, content, calls):
    whole = get_tool_parser("hermes").extract(text)
    expected = (whole.content or "", [(c.name, c.arguments) for c in whole.calls])
    rng = random.Random(text)
    for _ in range(40):
        assert _streamed(_split_randomly(text, rng)) == expected
    assert _streamed([text]) == expected
    assert _streamed(list(text)) == expected


def test_hermes_call_broken_after_its_name():
    """Whole: plain content. Streamed: once the name went out, the call and
    the arguments already sent stay sent (vLLM's streaming parser behaves
    alike); nothing more follows."""
    assert get_tool_parser("hermes").extract(BROKEN_AFTER_NAME).content == BROKEN_AFTER_NAME
    rng = random.Random(0)
    for _ in range(20):
        content, calls = _streamed(_split_randomly(BROKEN_AFTER_NAME, rng))
        if not calls:  # the call closed before its name went out: as whole
            assert content == BROKEN_AFTER_NAME
            continue
        [(name, arguments)] = calls
        assert (content, name) == ("Hi ", "a") and '{"k": '.startswith(arguments)
    assert _streamed([BROKEN_AFTER_NAME]) == (BROKEN_AFTER_NAME, [])
    assert _streamed(list(BROKEN_AFTER_NAME)) == ("Hi ", [("a", '{"k": ')])


def test_hermes_streams_incrementally():
    """Content before the tag goes out at once (a partial tag is held back);
    the name goes out before the arguments are complete."""
    stream = get_tool_parser("hermes").streaming()
    assert stream.feed("Sure <tool").content == "Sure "
    delta = stream.feed('_call>{"name": "get_weather", "arguments": {"ci')
    assert delta.content == "" and len(delta.tool_calls) == 1
    first = delta.tool_calls[0]
    assert (first.index, first.name, first.arguments) == (0, "get_weather", '{"ci')
    assert stream.feed('ty": "Paris"}}').tool_calls[0].arguments == 'ty": "Paris"}'
    assert not stream.feed("</tool_call>") and not stream.finish()


def test_parser_registry():
    assert "hermes" in tool_parser_names()
    with pytest.raises(ValueError, match="tool_call_parser"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ToolCallConfig(enable_auto_tool_choice=True)


# ---- The plan ------------------------------------------------------------------

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]
AUTO = ToolCallConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


@pytest.mark.parametrize(
    "fields,config,param,message",
    [
        ({"tools": TOOLS}, ToolCallConfig(), "tool_choice", "--enable-auto-tool-choice"),
        ({"tools": TOOLS, "tool_choice": "auto"}, ToolCallConfig(tool_call_parser="hermes"), "tool_choice", "auto"),
        ({"tool_choice": "required"}, AUTO, "tool_choice", "`tools` must be set"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            AUTO,
            "tool_choice",
            "'nope'",
        ),
        ({"tools": TOOLS + TOOLS[:1]}, AUTO, "tools", "unique"),
    ],
)
def test_plan_refuses(fields, config, param, message):
    with pytest.raises(OpenAIError, match=message) as info:
        plan_tools(_request(**fields), config)
    assert (info.value.status_code, info.value.param) == (400, param)


def test_plan_modes():
    assert plan_tools(_request(), ToolCallConfig()).mode == "plain"
    assert plan_tools(_request(tools=TOOLS, tool_choice="none"), ToolCallConfig()).mode == "none"
    assert plan_tools(_request(tools=TOOLS), AUTO).mode == "auto"
    named = plan_tools(
        _request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}), ToolCallConfig()
    )
    assert (named.mode, named.function_name) == ("named", "get_time")


def test_named_choice_constrains_to_the_parameters():
    plan = plan_tools(
        _request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}), ToolCallConfig()
    )
    params = plan.apply(SamplingParams())
    assert params.structured_outputs.json == WEATHER
    message, finish = plan.message('{"city": "Tokyo"}', "stop")
    assert finish == "stop" and message.content is None  # forced by name: "stop", as OpenAI and vLLM
    [call] = message.tool_calls
    assert call.id.startswith("call_") and (call.function.name, call.function.arguments) == (
        "get_weather",
        '{"city": "Tokyo"}',
    )
    # Cut short: the reason stays.
    assert plan.message('{"ci', "length")[1] == "length"


def test_required_schema_accepts_exactly_valid_calls():
    plan = plan_tools(_request(tools=TOOLS, tool_choice="required"), ToolCallConfig())
    schema = plan.apply(SamplingParams()).structured_outputs.json
    valid = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(valid, schema)
    for invalid in (
        [],
        [{"name": "nope", "parameters": {}}],
        [{"name": "get_weather", "parameters": {"city": "Rome"}}],
        [{"name": "get_weather"}],
        [{"name": "get_time", "parameters": {}, "extra": 1}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(invalid, schema)
    message, finish = plan.message(json.dumps(valid), "stop")
    assert finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    # Cut short: the complete calls before the cut; none at all leaves the text as content.
    message, finish = plan.message('[{"name": "get_time", "parameters": {}}, {"name": "get_we', "length")
    assert [c.function.name for c in message.tool_calls] == ["get_time"] and finish == "length"
    message, finish = plan.message('[{"name": "get_we', "length")
    assert (message.content, message.tool_calls, finish) == ('[{"name": "get_we', [], "length")

    single = plan_tools(_request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), ToolCallConfig())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(valid, single.apply(SamplingParams()).structured_outputs.json)


def test_required_stream_sends_each_call_when_complete():
    plan = plan_tools(_request(tools=TOOLS, tool_choice="required"), ToolCallConfig())
    stream = plan.stream()
    assert stream.step('[{"name": "get_weather", "parameters": {"ci', False) is None
    first = stream.step('ty": "Paris"}}, {"name": "get_time", ', False)
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in first.tool_calls] == [
        (0, "get_weather", {"city": "Paris"})
    ]
    second = stream.step('"parameters": {}}]', True)
    assert [(c.index, c.type, c.function.name) for c in second.tool_calls] == [(1, "function", "get_time")]
    assert stream.finish_reason("stop") == "tool_calls"


def test_unusable_parameters_schema_is_a_400_naming_tools():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}]
    plan = plan_tools(_request(tools=tools, tool_choice="required"), ToolCallConfig())
    with pytest.raises(OpenAIError) as info:
        plan.apply(SamplingParams())
    assert info.value.param == "tools"


def test_tool_choice_with_another_structured_output_is_a_400():
    plan = plan_tools(_request(tools=TOOLS, tool_choice="required"), ToolCallConfig())
    with pytest.raises(OpenAIError) as info:
        plan.apply(SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)))
    assert info.value.param == "tool_choice"


# ---- Rendering -------------------------------------------------------------------


def test_template_reads_tools():
    assert template_reads_tools(TOOL_CHAT_TEMPLATE)
    assert not template_reads_tools(CHAT_TEMPLATE)


def test_tool_messages_are_checked():
    bad = [
        [{"role": "tool", "content": "21 C"}],
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "not json"}}
                ],
            }
        ],
        [
            {
                "role": "user",
                "content": "x",
                "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            }
        ],
    ]
    for messages in bad:
        request = ChatCompletionRequest(messages=messages)
        with pytest.raises(ValueError, match="^messages: "):
            add_tool_fields([{} for _ in messages], request.messages)


@pytest.fixture(scope="module")
def tool_tokenizer(tiny_model_dir, tmp_path_factory):
    folder = install_tool_chat_template(tiny_model_dir("llama"), tmp_path_factory.mktemp("tool_tok") / "m")
    return AutoTokenizer.from_pretrained(folder)


def test_render_chat_with_tools_matches_the_template(tool_tokenizer):
    """The server's rendering against apply_chat_template on a hand-built
    conversation (arguments as objects, as tool templates expect them)."""
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    request = ChatCompletionRequest(messages=messages, tools=TOOLS)
    text, ids = render_chat(tool_tokenizer, request)
    expected_conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_call_id": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"},
    ]
    expected = tool_tokenizer.apply_chat_template(
        expected_conversation, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert text == expected
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '"name": "get_time"' in text  # the tools themselves
    assert ids == tool_tokenizer.encode(text, add_special_tokens=False)


def test_render_chat_refuses_tools_the_template_ignores(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    with pytest.raises(OpenAIError) as info:
        render_chat(tokenizer, ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS))
    assert (info.value.status_code, info.value.param) == (400, "tools")
