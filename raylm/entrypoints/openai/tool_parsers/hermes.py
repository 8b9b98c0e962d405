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
from dataclasses import dataclass, field

from raylm.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    JsonObjectScanner,
    ParsedToolCall,
    StreamDelta,
    StreamingToolParser,
    ToolParser,
    tool_call_id,
)

START_TAG = "<tool_call>"
END_TAG = "</tool_call>"

# A closed call, or the last one left open at the end of the output.
_CALL = re.compile(
    re.escape(START_TAG) + r"(.*?)" + re.escape(END_TAG) + "|" + re.escape(START_TAG) + r"(.*)\Z", re.DOTALL
)
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
            return body[key.end() : end]
    return json.dumps(arguments, ensure_ascii=False)


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


# While a call's name and the start of its arguments are looked for, its text
# is matched from its start at each delta; past this many characters without
# them, the call waits for its end instead (OpenAI's function names are at most
# 64 characters, so a real call has both long before).
_MAX_CALL_HEAD = 1024


@dataclass
class _OpenCall:
    index: int
    name_sent: bool = False
    streamable: bool = True  # False: its name or arguments were not found early on
    head: str = ""  # its text so far, while its name and arguments' start are looked for
    after_name: int = 0  # in head
    arguments_start: int = 0  # in head, once found
    scanner: JsonObjectScanner | None = None  # once its arguments object has started
    sent: list[str] = field(default_factory=list)  # the arguments' pieces sent
    body: list[str] = field(default_factory=list)  # its whole text so far, in pieces


class HermesStreamingParser(StreamingToolParser):
    """Content streams until the first <tool_call>; a call's id and name go out
    as soon as its name is complete, then its arguments as they are written.

    Linear in the text: each delta's characters are examined a bounded number
    of times (the tags are searched for in the delta plus the few characters
    held back that could start a tag; a call's arguments are scanned as they
    arrive), and a call's text is joined once, when it ends.
    `chars_examined` counts that work."""

    def __init__(self) -> None:
        self._pending = ""  # received, not handled: a held-back partial tag and the latest delta
        self._call: _OpenCall | None = None
        self._num_calls = 0
        self._seen_call = False
        # The first call was malformed before any of it was sent: from then on
        # everything is content, as the non-streamed result makes it.
        self._verbatim = False
        self.chars_examined = 0

    def feed(self, text: str) -> StreamDelta:
        self._pending += text
        out = StreamDelta()
        self._advance(out, final=False)
        return out

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        self._advance(out, final=True)
        return out

    def _advance(self, out: StreamDelta, final: bool) -> None:
        while True:
            text = self._pending
            self.chars_examined += len(text)
            if self._verbatim:
                out.content += text
                self._pending = ""
                return
            if self._call is None:
                start = text.find(START_TAG)
                if start < 0:
                    held = 0 if final else _partial_tag_length(text, 0, START_TAG)
                    if not self._seen_call:
                        out.content += text[: len(text) - held]
                    self._pending = text[len(text) - held :]
                    return
                if not self._seen_call:
                    out.content += text[:start]
                self._seen_call = True
                self._call = _OpenCall(self._num_calls)
                self._pending = text[start + len(START_TAG) :]
                continue
            end = text.find(END_TAG)
            if end < 0 and not final:
                # Never past what could be the start of its closing tag.
                held = _partial_tag_length(text, 0, END_TAG)
                self._take(out, text[: len(text) - held])
                self._pending = text[len(text) - held :]
                return
            closed = end >= 0
            # The call's end: the whole of it is parsed (what is new of it was never streamed).
            self._call.body.append(text if not closed else text[:end])
            self._pending = text[end + len(END_TAG) :] if closed else ""
            self._close_call(out, closed)
            if not closed and not self._verbatim:
                return

    def _take(self, out: StreamDelta, piece: str) -> None:
        """More of the open call's text: kept whole for its end, and streamed."""
        if not piece:
            return
        call = self._call
        call.body.append(piece)
        if not call.streamable:
            return
        if call.scanner is None:
            call.head += piece
            self._find_arguments(out, call)
            if call.scanner is None:
                return
            piece, call.head = call.head[call.arguments_start :], ""
        if call.scanner.done:
            return
        self.chars_examined += len(piece)
        end = call.scanner.feed(piece)
        piece = piece if end is None else piece[:end]
        if piece:
            call.sent.append(piece)
            out.add_call_piece(call.index, arguments=piece)

    def _find_arguments(self, out: StreamDelta, call: _OpenCall) -> None:
        """Sends the call's id and name once complete, and starts scanning its
        arguments once their object opens (call.scanner, call.arguments_start)."""
        head = call.head
        self.chars_examined += len(head)
        if not call.name_sent:
            match = _NAME_PREFIX.match(head)
            if match is not None:
                try:
                    name = json.loads(match.group(1))
                except ValueError:
                    name = None
                if name is not None:
                    call.name_sent, call.after_name = True, match.end()
                    out.add_call_piece(call.index, id=tool_call_id(), name=name)
        if call.name_sent:
            match = _ARGUMENTS_KEY.match(head, call.after_name)
            if match is not None and match.end() < len(head):
                if head[match.end()] != "{":
                    call.streamable = False  # only an object is streamed; the rest waits for the end
                    return
                call.arguments_start = match.end()
                call.scanner = JsonObjectScanner()
                return
        if len(head) > _MAX_CALL_HEAD:
            call.streamable, call.head = False, ""

    def _close_call(self, out: StreamDelta, closed: bool) -> None:
        call, self._call = self._call, None
        body = "".join(call.body)
        parsed = parse_call(body)
        if parsed is None:
            if not call.name_sent:
                if call.index == 0:
                    # All of it is content after all, from its tag on.
                    self._verbatim = True
                    self._pending = START_TAG + body + (END_TAG if closed else "") + self._pending
                return
            # Part of it is out already (its index is taken); the rest is dropped.
            self._num_calls += 1
            return
        self._num_calls += 1
        if not call.name_sent:
            out.add_call_piece(call.index, id=tool_call_id(), name=parsed.name, arguments=parsed.arguments)
            return
        sent = "".join(call.sent)
        rest = parsed.arguments[len(sent) :]
        if rest and parsed.arguments.startswith(sent):
            out.add_call_piece(call.index, arguments=rest)
