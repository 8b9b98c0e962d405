"""Streamed tool calls cost work linear in their text (issue 20): the Hermes
parser and the "required" calls stream examine each delta's characters a
bounded number of times, however long the call already is, and still give
exactly what parsing the whole output gives. Work is counted in characters
examined (`chars_examined`), not timed."""

from __future__ import annotations

import json
import random

from raylm.entrypoints.openai.protocol import ChatCompletionRequest
from raylm.entrypoints.openai.serving_tools import ToolCallConfig, plan_tools
from raylm.entrypoints.openai.tool_parsers import get_tool_parser
from raylm.entrypoints.openai.tool_parsers.hermes import END_TAG

# Arguments with everything the scanner must get right: nesting, brackets and
# quotes inside strings, escapes, non-ASCII.
_ARGUMENT_PARTS = ['{"k": [1, {"x": null}]}', '"}{ \\"quoted\\" ]"', '"東京 🌸"', "[[], {}]", '"\\\\"', "true"]


def _long_arguments(num_values: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    return {f"v{i}": json.loads(rng.choice(_ARGUMENT_PARTS)) for i in range(num_values)}


def _hermes_output(arguments: dict) -> str:
    call = json.dumps({"name": "write_file", "arguments": arguments}, ensure_ascii=False)
    return f"Writing it.<tool_call>\n{call}\n</tool_call>"


def _small_deltas(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    deltas, pos = [], 0
    while pos < len(text):
        size = rng.randint(1, 6)
        deltas.append(text[pos : pos + size])
        pos += size
    return deltas


def _stream_hermes(deltas: list[str]) -> tuple[str, list[tuple[str, str]], list[int]]:
    """(content, [(name, arguments)], characters examined per delta)."""
    stream = get_tool_parser("hermes").streaming()
    content, calls, work = "", {}, []
    for delta in deltas:
        before = stream.chars_examined
        out = stream.feed(delta)
        work.append(stream.chars_examined - before)
        content += out.content
        for piece in out.tool_calls:
            calls.setdefault(piece.index, [piece.name, ""])[1] += piece.arguments
    tail = stream.finish()
    content += tail.content
    for piece in tail.tool_calls:
        calls.setdefault(piece.index, [piece.name, ""])[1] += piece.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)], work


def test_long_hermes_call_in_small_deltas_equals_the_whole():
    text = _hermes_output(_long_arguments(3000))
    whole = get_tool_parser("hermes").extract(text)
    expected = (whole.content, [(c.name, c.arguments) for c in whole.calls])
    assert json.loads(expected[1][0][1]) == _long_arguments(3000)
    for seed in range(3):
        content, calls, _ = _stream_hermes(_small_deltas(text, seed))
        assert (content, calls) == expected
    content, calls, _ = _stream_hermes([text])
    assert (content, calls) == expected


def test_hermes_work_per_delta_does_not_grow_with_the_call():
    """The last deltas of a call ten times as long cost what the last deltas
    of a short one cost: bounded by the delta and the held-back tag."""
    per_delta_bound = 2 * (6 + len(END_TAG))
    late_work = {}
    for num_values in (300, 3000):
        text = _hermes_output(_long_arguments(num_values))
        _, calls, work = _stream_hermes(_small_deltas(text, seed=1))
        assert calls and calls[0][0] == "write_file"
        late_work[num_values] = max(work[len(work) // 2 :])
        assert late_work[num_values] <= per_delta_bound
        # All of it: a few passes over the text (and the call's start, matched
        # while its name is incomplete).
        assert sum(work) <= 4 * len(text) + 20 * 1024
    assert late_work[3000] <= late_work[300] + 6


def test_required_calls_stream_is_linear_and_exact():
    request = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        tool_choice="required",
        tools=[{"type": "function", "function": {"name": "write_file"}}],
    )
    plan = plan_tools(request, ToolCallConfig())
    arguments = _long_arguments(2000)
    text = json.dumps(
        [{"name": "write_file", "parameters": arguments}, {"name": "write_file", "parameters": {}}], ensure_ascii=False
    )
    stream = plan.stream()
    parser = stream._tool_stream
    calls, work = [], []
    for delta in _small_deltas(text, seed=2):
        before = parser.chars_examined
        chat_delta = stream.step(delta, False)
        work.append(parser.chars_examined - before)
        if chat_delta is not None:
            calls.extend((c.function.name, json.loads(c.function.arguments)) for c in chat_delta.tool_calls)
    assert calls == [("write_file", arguments), ("write_file", {})]
    assert max(work) <= 6 and sum(work) <= len(text)
