"""Llama 3.1 / 3.2 / 3.3 JSON tool calls (`--tool-call-parser llama3_json`):

    {"name": "get_weather", "parameters": {"city": "Paris"}}

the whole reply, optionally after <|python_tag|>, several calls separated by
";" or blanks; "arguments" is read as well as "parameters". A reply that does
not start with a call (after blanks) is plain content. The templates:
Llama 3.1/3.3's own (read from the model) writes tools and calls this way;
templates/llama3_json.jinja for models whose template does not.
"""

from __future__ import annotations

import json

from raylm.entrypoints.openai.tool_parsers.base import JsonObjectScanner, ParsedToolCall, StreamDelta
from raylm.entrypoints.openai.tool_parsers.incremental import (
    CallStream,
    IncrementalToolParser,
    arguments_text,
)

PYTHON_TAG = "<|python_tag|>"
_BLANKS = " \t\r\n"
_SEPARATORS = _BLANKS + ";"


def parse_json_call(body: str, argument_keys: tuple[str, ...]) -> ParsedToolCall | None:
    """{"name": str, <one of argument_keys>: {...}} -> the call, else None."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    key = next((k for k in argument_keys if k in call), None)
    arguments = call[key] if key is not None else {}
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(call["name"], arguments_text(body, key, arguments) if key else "{}")


class Llama3JsonStream(CallStream):
    def __init__(self) -> None:
        super().__init__()
        self._state = "start"  # start, calls, object
        self._scanner: JsonObjectScanner | None = None
        self._object: list[str] = []

    def step(self, out: StreamDelta, final: bool) -> bool:
        if self._state == "start":
            self.take(len(self.buffer) - len(self.buffer.lstrip(_BLANKS)))  # blanks before: looked at once
            body = self.buffer
            if body.startswith(PYTHON_TAG):
                self.take(len(PYTHON_TAG))
            elif not body or (PYTHON_TAG.startswith(body) and not final):
                if final:
                    self.to_content(out)
                return False
            elif body[0] != "{":
                self.to_content(out)  # a reply, not a call
                return True
            self._state = "calls"
            return True
        if self._state == "calls":
            body = self.buffer.lstrip(_SEPARATORS)
            self.take(len(self.buffer) - len(body))
            if not body:
                if final and not self.num_calls:
                    self.to_content(out)  # a tag and nothing after it
                elif final:
                    self.since_call, self.verbatim = [], True  # only blanks after the last call
                return False
            if body[0] != "{":
                self.to_content(out, _SEPARATORS)
                return True
            self._state, self._scanner, self._object = "object", JsonObjectScanner(), []
            return True
        end = self._scanner.feed(self.buffer)
        piece = self.take(len(self.buffer) if end is None else end)
        self._object.append(piece)
        if end is None:
            if final:
                self.to_content(out, _SEPARATORS)  # cut short
            return False
        call = parse_json_call("".join(self._object), ("parameters", "arguments"))
        if call is None:
            self.to_content(out, _SEPARATORS)
            return True
        self.send_call(out, call)
        self._state = "calls"
        return True


class Llama3JsonToolParser(IncrementalToolParser):
    name = "llama3_json"
    chat_template = "llama3_json.jinja"

    def streaming(self) -> Llama3JsonStream:
        return Llama3JsonStream()
