"""The tool-call parsers of the families raylm serves (llama3_json, mistral,
qwen3_xml / qwen3_coder, pythonic) on recorded model texts hand-written in
each family's format, malformed ones included: whole, and streamed in random
chunkings, which must add up to the whole (and to the expected calls); a
malformed text is content, never an exception; the work per character is
bounded however the text is split."""

from __future__ import annotations

import json
import random
import re
import zlib

import pytest

from raylm.entrypoints.openai.protocol import ChatTool
from raylm.entrypoints.openai.serving_tools import ToolPlan
from raylm.entrypoints.openai.tool_parsers import get_tool_parser

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
        "where": {"type": "object"},
    },
}
TOOLS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {"zone": {"type": "string"}}}}

# (parser, model text, expected content, expected [(name, arguments object)]); [] : no calls.
CASES = [
    # ---- llama3_json
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
        None,
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "東京 🌸"}}; '
        '{"name": "get_time", "arguments": {"zone": "}{ \\"q\\" ]"}}',
        None,
        [("get_weather", {"city": "東京 🌸"}), ("get_time", {"zone": '}{ "q" ]'})],
    ),
    (
        "llama3_json",
        '\n {"name": "get_time"}\n{"name": "get_weather", "parameters": {}}  ',
        None,
        [("get_time", {}), ("get_weather", {})],
    ),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("llama3_json", "", "", []),
    ("llama3_json", "<|python", "<|python", []),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": "Paris"}',
        '{"name": "get_weather", "parameters": "Paris"}',
        [],
    ),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),  # no name
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": ',  # cut short
        '{"name": "get_weather", "parameters": {"city": ',
        [],
    ),
    (
        "llama3_json",
        '{"name": "get_time", "parameters": {}}; and then some text',
        "and then some text",
        [("get_time", {})],
    ),
    ("llama3_json", '{"name": "get_time", "parameters": {}}; {"name": 3}', '{"name": 3}', [("get_time", {})]),
    # ---- mistral
    (
        "mistral",
        'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]',
        "Checking.",
        [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather{"city": "Paris", "where": {"lat": 1.5}}[TOOL_CALLS]get_time{}',
        None,
        [("get_weather", {"city": "Paris", "where": {"lat": 1.5}}), ("get_time", {})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "[TOOL_CALLS]"}',
        None,
        [("get_weather", {"city": "[TOOL_CALLS]"})],
    ),
    ("mistral", "No tools needed [TOOL_CALL", "No tools needed [TOOL_CALL", []),
    ("mistral", "Hi [TOOL_CALLS] not a call", "Hi [TOOL_CALLS] not a call", []),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": [1]}]',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": [1]}]',
        [],
    ),
    ("mistral", '[TOOL_CALLS]get weather{"city": "Paris"}', '[TOOL_CALLS]get weather{"city": "Paris"}', []),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Par', '[TOOL_CALLS]get_weather{"city": "Par', []),
    ("mistral", '[TOOL_CALLS]get_time{"zone": "UTC"} Done.', "Done.", [("get_time", {"zone": "UTC"})]),
    # ---- qwen3_xml (and qwen3_coder, the same format)
    (
        "qwen3_xml",
        "Let me look.<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
        '<parameter=where>\n{"lat": 40.7}\n</parameter>\n</function>\n</tool_call>',
        "Let me look.",
        [("get_weather", {"city": "New York", "days": 3, "metric": True, "where": {"lat": 40.7}})],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n123\n</parameter>\n</function>\n"
        "</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\nline one\nline two\n"
        "</parameter>\n</function>\n</tool_call>",
        None,
        [("get_weather", {"city": "123"}), ("get_time", {"zone": "line one\nline two"})],
    ),
    # The model stopped before the closing tag; a parameter no tool declares is read as JSON when it is.
    (
        "qwen3_xml",
        "<tool_call>\n<function=lookup>\n<parameter=n>\n[1, 2]\n</parameter>\n<parameter=s>\nplain\n"
        "</parameter>\n</function>",
        None,
        [("lookup", {"n": [1, 2], "s": "plain"})],
    ),
    (
        "qwen3_xml",
        "Hi <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
        "Hi <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
        [],
    ),
    ("qwen3_xml", '<tool_call>{"name": "get_time"}</tool_call>', '<tool_call>{"name": "get_time"}</tool_call>', []),
    ("qwen3_xml", "a <tool_cal b", "a <tool_cal b", []),
    (
        "qwen3_xml",
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call>\nAnything else?",
        "Anything else?",
        [("get_time", {})],
    ),
    # ---- pythonic
    (
        "pythonic",
        "[get_weather(city=\"Paris\", days=3), get_time(zone='CET')]",
        None,
        [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})],
    ),
    (
        "pythonic",
        '<|python_start|>[get_weather(city="a)]\\"(", metric=True, where={"k": [None, -1.5]})]<|python_end|>',
        None,
        [("get_weather", {"city": 'a)]"(', "metric": True, "where": {"k": [None, -1.5]}})],
    ),
    ("pythonic", " [tools.get_time(zone=null)]", None, [("tools.get_time", {"zone": None})]),
    ("pythonic", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("pythonic", "Sure! [get_time()]", "Sure! [get_time()]", []),
    ("pythonic", '[get_weather("Paris")]', '[get_weather("Paris")]', []),  # positional
    ("pythonic", "[get_weather(city=x)]", "[get_weather(city=x)]", []),  # not a literal
    ("pythonic", '[get_weather(city="Par', '[get_weather(city="Par', []),
    ("pythonic", "[get_time(zone=1e999)]", "[get_time(zone=1e999)]", []),
]


def _expected_arguments(calls):
    return [(name, arguments) for name, arguments in calls]


def _split_randomly(text: str, rng: random.Random) -> list[str]:
    if len(text) < 2:
        return [text]
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(len(text) - 1, 12))))
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]


def _streamed(parser_name: str, chunks: list[str]):
    stream = get_tool_parser(parser_name, TOOLS).streaming()
    content, calls = "", {}
    for delta in [*(stream.feed(chunk) for chunk in chunks), stream.finish()]:
        content += delta.content
        for piece in delta.tool_calls:
            if piece.index not in calls:
                assert piece.name, piece
                assert re.fullmatch("[A-Za-z0-9]{9}" if parser_name == "mistral" else "call_[0-9a-f]{24}", piece.id), (
                    piece
                )
                calls[piece.index] = [piece.name, ""]
            else:
                assert piece.id is None and piece.name is None, piece
            calls[piece.index][1] += piece.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, [(name, json.loads(arguments)) for name, arguments in (calls[i] for i in sorted(calls))]


@pytest.mark.parametrize("parser_name, text, content, calls", CASES)
def test_whole(parser_name, text, content, calls):
    extracted = get_tool_parser(parser_name, TOOLS).extract(text)
    assert extracted.content == content
    assert [(c.name, json.loads(c.arguments)) for c in extracted.calls] == calls


@pytest.mark.parametrize("parser_name, text, content, calls", CASES)
def test_streamed_in_random_chunks_equals_whole(parser_name, text, content, calls):
    rng = random.Random(zlib.crc32(text.encode()))
    whole = get_tool_parser(parser_name, TOOLS).extract(text)
    whole_arguments = [(c.name, json.loads(c.arguments)) for c in whole.calls]
    for chunks in [[text], list(text), *(_split_randomly(text, rng) for _ in range(30))]:
        streamed_content, streamed_calls = _streamed(parser_name, chunks)
        assert streamed_content == (whole.content or ""), chunks
        assert streamed_calls == whole_arguments == calls, chunks


def test_a_call_goes_out_as_soon_as_it_is_complete():
    stream = get_tool_parser("llama3_json").streaming()
    first = stream.feed('{"name": "get_time", "parameters": {}}; {"name": "get_wea')
    assert [p.name for p in first.tool_calls] == ["get_time"]
    stream = get_tool_parser("mistral").streaming()
    assert stream.feed("Sure [TOOL").content == "Sure "  # the tag's start is held back
    assert [p.name for p in stream.feed('_CALLS]get_time{"zone": 1}[TOOL_CALLS]x').tool_calls] == ["get_time"]
    stream = get_tool_parser("qwen3_xml").streaming()
    out = stream.feed("Look<tool_call>\n<function=get_time>\n</function>\n</tool_call><tool_call>")
    assert out.content == "Look" and [p.name for p in out.tool_calls] == ["get_time"]


LONG_VALUE = "x" * 20000


@pytest.mark.parametrize(
    "parser_name, text",
    [
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "' + LONG_VALUE + '"}}'),
        ("mistral", "pre" * 3000 + '[TOOL_CALLS]get_weather{"city": "' + LONG_VALUE + '"}'),
        (
            "qwen3_xml",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\n"
            + LONG_VALUE
            + "\n</parameter>\n</function>\n</tool_call>",
        ),
        ("pythonic", '[get_weather(city="' + LONG_VALUE + '")]'),
        ("llama3_json", " " * 20000 + '{"name": "get_weather", "parameters": {"city": "' + LONG_VALUE + '"}}'),
        ("pythonic", "\n" * 20000 + '[get_weather(city="' + LONG_VALUE + '")]'),
    ],
)
def test_work_is_linear_in_the_text_however_it_is_split(parser_name, text):
    """One character a delta (the worst split): the characters examined stay
    a small multiple of the text's length, and the result is the whole one."""
    stream = get_tool_parser(parser_name, TOOLS).streaming()
    calls = [p for char in text for p in stream.feed(char).tool_calls] + stream.finish().tool_calls
    assert [json.loads(p.arguments)["city"] for p in calls] == [LONG_VALUE]
    assert stream.chars_examined <= 4 * len(text), stream.chars_examined


@pytest.mark.parametrize("parser_name", ["llama3_json", "mistral", "qwen3_xml", "pythonic"])
def test_the_chat_plan_answers_with_the_parsed_calls(parser_name):
    """Through the tool plan the server uses: the message and finish reason,
    whole and streamed (the deltas a client receives)."""
    text = {
        "llama3_json": '{"name": "get_time", "parameters": {"zone": "CET"}}',
        "mistral": 'On it.[TOOL_CALLS]get_time{"zone": "CET"}',
        "qwen3_xml": "On it.<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n"
        "</function>\n</tool_call>",
        "pythonic": '[get_time(zone="CET")]',
    }[parser_name]
    tools = [ChatTool(function={"name": "get_time", "parameters": TOOLS["get_time"]})]
    plan = ToolPlan("auto", tools, parser=get_tool_parser(parser_name, TOOLS))
    message, finish_reason = plan.message(text, "stop")
    assert finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_time", {"zone": "CET"})
    ]
    stream = plan.stream()
    deltas = [stream.step(piece, i == len(text) - 1) for i, piece in enumerate(text)]
    calls = [call for delta in deltas if delta and delta.tool_calls for call in delta.tool_calls]
    content = "".join(delta.content for delta in deltas if delta and delta.content)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_time", {"zone": "CET"})]
    assert content == (message.content or "")
    assert stream.finish_reason("stop") == "tool_calls"
    id_shape = "[A-Za-z0-9]{9}" if parser_name == "mistral" else "call_[0-9a-f]{24}"
    assert re.fullmatch(id_shape, message.tool_calls[0].id) and re.fullmatch(id_shape, calls[0].id)
