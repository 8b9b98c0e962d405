"""The Hermes / Qwen tool-call format:

    Let me look that up.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text before the first <tool_call> is the message content; each tagged JSON
object is one call (the last one may lack its closing tag when the model
stopped right after it). Text between or after calls is dropped, as vLLM does.
A call that is not such an object makes the whole output plain content;
streamed, that holds only when the broken call is the first and broke before
its name was complete (what was sent of a call cannot be taken back).

`arguments` is returned as the model wrote it (OpenAI returns the model's
text too), which is also what lets streaming send it character by character
and still add up to exactly the non-streamed result.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from raylm.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedToolCall,
    StreamDelta,
    StreamingToolParser,
    ToolParser,
    tool_call_id,
)

START_TAG = "<tool_call>"
END_TAG = "</tool_call>"

# A closed call, or the last one left open at the end of the output.
_CALL = re.compile(re.escape(START_TAG) + r"(.*?)" + re.escape(END_TAG) + "|" + re.escape(START_TAG) + r"(.*)\Z",
                   re.DOTALL)
_JSON_STRING = r'"(?:[^"\\]|\\.)*"'
# While streaming: the call's name, once its string is complete ...
_NAME_PREFIX = re.compile(r'\s*\{\s*"name"\s*:\s*(' + _JSON_STRING + r")")
# ... then the start of its arguments.
_ARGUMENTS_KEY = re.compile(r'\s*,\s*"arguments"\s*:\s*')
_ANY_ARGUMENTS_KEY = re.compile(r'"arguments"\s*:\s*')
_DECODER = json.JSONDecoder()


def parse_call(body: str) -> ParsedToolCall | None:
    """One call's JSON, or None when it is not a {"name", "arguments"} object."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(call["name"], _arguments_text(body, arguments))


def _arguments_text(body: str, arguments: dict) -> str:
    """The arguments object exactly as written in `body`; re-serialised only
    when the text cannot be found unambiguously (e.g. a repeated key)."""
    key = _ANY_ARGUMENTS_KEY.search(body)
    if key is not None:
        try:
            value, end = _DECODER.raw_decode(body, key.end())
        except ValueError:
            value = None
        if value == arguments:
            return body[key.end():end]
    return json.dumps(arguments, ensure_ascii=False)


def _object_end(text: str, start: int) -> int | None:
    """Index just past the JSON object opening at text[start], or None while
    it is still incomplete."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        char = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _partial_tag_length(text: str, start: int, tag: str) -> int:
    """Length of the longest end of text[start:] that could begin `tag`: held
    back until the next delta says whether the tag follows."""
    for length in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class HermesToolParser(ToolParser):
    name = "hermes"

    def extract(self, text: str) -> ExtractedToolCalls:
        start = text.find(START_TAG)
        if start < 0:
            return ExtractedToolCalls(text)
        calls = []
        for match in _CALL.finditer(text, start):
            body = match.group(1) if match.group(1) is not None else match.group(2)
            call = parse_call(body)
            if call is None:
                return ExtractedToolCalls(text)
            calls.append(call)
        return ExtractedToolCalls(text[:start] or None, calls)

    def streaming(self) -> HermesStreamingParser:
        return HermesStreamingParser()


@dataclass
class _OpenCall:
    index: int
    tag_start: int  # where its <tool_call> begins in the whole text
    body_start: int
    name_sent: bool = False
    after_name: int = 0  # in the body
    arguments_start: int | None = None  # in the body
    arguments_sent: str = ""


class HermesStreamingParser(StreamingToolParser):
    """Content streams until the first <tool_call>; a call's id and name go out
    as soon as its name is complete, then its arguments as they are written."""

    def __init__(self) -> None:
        self._text = ""
        self._pos = 0  # text before this has been handled
        self._call: _OpenCall | None = None
        self._num_calls = 0
        self._seen_call = False
        # The first call was malformed before any of it was sent: from then on
        # everything is content, as the non-streamed result makes it.
        self._verbatim = False

    def feed(self, text: str) -> StreamDelta:
        self._text += text
        out = StreamDelta()
        self._advance(out, final=False)
        return out

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        self._advance(out, final=True)
        return out

    def _advance(self, out: StreamDelta, final: bool) -> None:
        text = self._text
        while True:
            if self._verbatim:
                out.content += text[self._pos:]
                self._pos = len(text)
                return
            if self._call is None:
                start = text.find(START_TAG, self._pos)
                if start < 0:
                    held = 0 if final else _partial_tag_length(text, self._pos, START_TAG)
                    if not self._seen_call:
                        out.content += text[self._pos:len(text) - held]
                    self._pos = len(text) - held
                    return
                if not self._seen_call:
                    out.content += text[self._pos:start]
                self._seen_call = True
                self._call = _OpenCall(self._num_calls, start, start + len(START_TAG))
                self._pos = self._call.body_start
                continue
            call = self._call
            end = text.find(END_TAG, call.body_start)
            if end < 0 and not final:
                # Never past what could be the start of its closing tag.
                held = _partial_tag_length(text, call.body_start, END_TAG)
                self._stream_call(out, text[call.body_start:len(text) - held])
                return
            body = text[call.body_start:] if end < 0 else text[call.body_start:end]
            self._pos = len(text) if end < 0 else end + len(END_TAG)
            self._close_call(out, body)
            if end < 0:
                if self._verbatim:
                    continue
                return

    def _stream_call(self, out: StreamDelta, body: str) -> None:
        call = self._call
        if not call.name_sent:
            match = _NAME_PREFIX.match(body)
            if match is None:
                return
            try:
                name = json.loads(match.group(1))
            except ValueError:
                return
            call.name_sent, call.after_name = True, match.end()
            out.add_call_piece(call.index, id=tool_call_id(), name=name)
        if call.arguments_start is None:
            match = _ARGUMENTS_KEY.match(body, call.after_name)
            # Only an object is streamed; anything else waits for the call to close.
            if match is None or match.end() >= len(body) or body[match.end()] != "{":
                return
            call.arguments_start = match.end()
        end = _object_end(body, call.arguments_start)
        piece = body[call.arguments_start + len(call.arguments_sent):end if end is not None else len(body)]
        if piece:
            call.arguments_sent += piece
            out.add_call_piece(call.index, arguments=piece)

    def _close_call(self, out: StreamDelta, body: str) -> None:
        call, self._call = self._call, None
        parsed = parse_call(body)
        if parsed is None:
            if not call.name_sent:
                if call.index == 0:
                    self._verbatim = True
                    self._pos = call.tag_start
                return
            # Part of it is out already (its index is taken); the rest is dropped.
            self._num_calls += 1
            return
        self._num_calls += 1
        if not call.name_sent:
            out.add_call_piece(call.index, id=tool_call_id(), name=parsed.name, arguments=parsed.arguments)
            return
        rest = parsed.arguments[len(call.arguments_sent):]
        if rest and parsed.arguments.startswith(call.arguments_sent):
            out.add_call_piece(call.index, arguments=rest)
