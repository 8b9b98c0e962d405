"""What the tool-call parsers written as one incremental machine share.

Each such parser (llama3_json, mistral, qwen3_xml, pythonic) is a state
machine fed the output's text delta by delta; the whole output is parsed by
feeding it at once, so streamed and whole results are equal by construction.
Calls go out whole, each as soon as it is complete (its id, name and
arguments in one piece). The machines look at each character a bounded number
of times: tags are searched for in the new text plus the few characters
before it that could start one, JSON objects are scanned as they arrive, and a
call's text is joined and parsed once, when it ends.

Malformed text is content: when the text where a call should be is not a
valid call, everything from there on goes out as content (all of the output,
when no call went out before it); no exception reaches the server.
"""

from __future__ import annotations

import json
import re
from abc import abstractmethod

from raylm.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedToolCall,
    StreamDelta,
    StreamingToolParser,
    ToolParser,
    tool_call_id,
)

_DECODER = json.JSONDecoder()
# A function's name as the formats write it (OpenAI allows [a-zA-Z0-9_-], 64
# characters; dots and colons appear in namespaced tools).
MAX_NAME_CHARS = 256


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could begin `tag` (held back
    until the next delta says whether the tag follows)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class TagFinder:
    """Finds `tag` in text fed piece by piece, each character looked at once
    (plus the len(tag) - 1 carried over from the previous piece)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self._carry = ""

    def feed(self, piece: str) -> int | None:
        """Index in `piece` just past the tag's end, or None if not there yet."""
        carry = self._carry
        window = carry + piece
        found = window.find(self.tag)
        if found >= 0:
            self._carry = ""
            return found + len(self.tag) - len(carry)
        self._carry = window[max(0, len(window) - (len(self.tag) - 1)) :]
        return None


def arguments_text(body: str, key: str, arguments: dict) -> str:
    """The arguments object exactly as the model wrote it under `key` in the
    JSON `body`; re-serialised when that text cannot be found unambiguously."""
    for match in re.finditer(r'"' + re.escape(key) + r'"\s*:\s*', body):
        try:
            value, end = _DECODER.raw_decode(body, match.end())
        except ValueError:
            continue
        if value == arguments:
            return body[match.end() : end]
    return json.dumps(arguments, ensure_ascii=False)


class CallStream(StreamingToolParser):
    """The bookkeeping of an incremental machine: the text not handled yet,
    the text since the last call went out (content, should what follows prove
    malformed), the calls sent, and the switch to content for the rest."""

    # Ids of the calls found; a family whose templates need their own shape sets its own.
    new_call_id = staticmethod(tool_call_id)

    def __init__(self) -> None:
        self.buffer = ""  # received, not handled
        self.since_call: list[str] = []  # handled since the last call went out (or since the first call began)
        self.num_calls = 0
        self.verbatim = False  # malformed: the rest is content
        self.chars_examined = 0

    def feed(self, text: str) -> StreamDelta:
        self.buffer += text
        out = StreamDelta()
        self._drive(out, final=False)
        return out

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        self._drive(out, final=True)
        if not self.verbatim and self.buffer:  # a call cut short: content, from where it began
            self.to_content(out)
        return out

    def _drive(self, out: StreamDelta, final: bool) -> None:
        while True:
            self.chars_examined += len(self.buffer)
            if self.verbatim:
                out.content += self.buffer
                self.buffer = ""
                return
            if not self.step(out, final):
                return

    @abstractmethod
    def step(self, out: StreamDelta, final: bool) -> bool:
        """Handle what it can of self.buffer; False when it needs more text."""

    def take(self, n: int) -> str:
        """The buffer's first n characters, handled (kept for a fallback to content)."""
        taken, self.buffer = self.buffer[:n], self.buffer[n:]
        self.since_call.append(taken)
        return taken

    def send_call(self, out: StreamDelta, call: ParsedToolCall) -> None:
        out.add_call_piece(self.num_calls, id=self.new_call_id(), name=call.name, arguments=call.arguments)
        self.num_calls += 1
        self.since_call = []

    def to_content(self, out: StreamDelta, separators: str = " \t\r\n") -> None:
        """Malformed from where the last call ended: that text and the rest are
        content (without the blanks or separators right after a call)."""
        held = "".join(self.since_call) + self.buffer
        out.content += held.lstrip(separators) if self.num_calls else held
        self.since_call, self.buffer = [], ""
        self.verbatim = True


class IncrementalToolParser(ToolParser):
    """A parser whose whole result is its stream's, fed at once."""

    def extract(self, text: str) -> ExtractedToolCalls:
        stream = self.streaming()
        first, last = stream.feed(text), stream.finish()
        content = first.content + last.content
        calls = [ParsedToolCall(p.name, p.arguments) for p in [*first.tool_calls, *last.tool_calls]]
        return ExtractedToolCalls(content or None if calls else content, calls)
