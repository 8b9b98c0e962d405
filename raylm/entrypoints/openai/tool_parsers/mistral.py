"""Mistral tool calls (`--tool-call-parser mistral`): content, then
[TOOL_CALLS] and the calls, in either of the forms Mistral's tokenizers use:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]   (v3 and older)
    [TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]other{}                   (v11)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                                (v13)

Text before the first [TOOL_CALLS] is the content. Mistral's own chat
templates (read from the model) write tools in [AVAILABLE_TOOLS] and calls
this way; templates/mistral.jinja for a model without one.
"""

from __future__ import annotations

import json
import re
import secrets
import string

from raylm.entrypoints.openai.tool_parsers.base import JsonObjectScanner, ParsedToolCall, StreamDelta
from raylm.entrypoints.openai.tool_parsers.incremental import (
    MAX_NAME_CHARS,
    CallStream,
    IncrementalToolParser,
    TagFinder,
    partial_suffix,
)
from raylm.entrypoints.openai.tool_parsers.llama3_json import parse_json_call

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_BLANKS = " \t\r\n"
_NAME_CHAR = re.compile(r"[A-Za-z0-9_\-.:]")
_ID_ALPHABET = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """Mistral's templates accept only ids of 9 letters and digits (they raise on
    others when the conversation comes back with the calls)."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


class MistralStream(CallStream):
    new_call_id = staticmethod(mistral_call_id)

    def __init__(self) -> None:
        super().__init__()
        # content (before the first tag), after_tag, array, object, name, arguments, after_call
        self._state = "content"
        self._tag = TagFinder(TOOL_CALLS)
        self._scanner: JsonObjectScanner | None = None
        self._object: list[str] = []
        self._name = ""
        self._in_array = False

    def step(self, out: StreamDelta, final: bool) -> bool:
        state = self._state
        if state == "content":
            end = self._tag.feed(self.buffer)
            if end is None:
                held = 0 if final else partial_suffix(self.buffer, TOOL_CALLS)
                out.content += self.buffer[: len(self.buffer) - held]
                self.buffer = self.buffer[len(self.buffer) - held :]
                self._tag = TagFinder(TOOL_CALLS)  # the held text is searched again
                return False
            out.content += self.buffer[: end - len(TOOL_CALLS)]
            self.buffer = self.buffer[end - len(TOOL_CALLS) :]
            self.take(len(TOOL_CALLS))
            self._state = "after_tag"
            return True
        if state in ("after_tag", "array", "after_call"):
            return self._between(out, final)
        if state == "name":
            return self._read_name(out, final)
        return self._read_object(out, final)

    def _between(self, out: StreamDelta, final: bool) -> bool:
        separators = _BLANKS + ("," if self._state == "array" else "")
        body = self.buffer.lstrip(separators)
        self.take(len(self.buffer) - len(body))
        if not body:
            if final:
                if self._state == "after_call":
                    self.since_call, self.verbatim = [], True
                else:
                    self.to_content(out)  # the calls never came
            return False
        if self._state == "after_call":
            if body.startswith(TOOL_CALLS):
                self.take(len(TOOL_CALLS))
                self._state = "after_tag"
                return True
            if TOOL_CALLS.startswith(body) and not final:
                return False
            self.to_content(out)  # text after the calls
            return True
        if self._state == "after_tag" and body[0] == "[":
            self.take(1)
            self._state, self._in_array = "array", True
            return True
        if self._state == "array" and body[0] == "]":
            self.take(1)
            self._state, self._in_array = "after_call", False
            return True
        if body[0] == "{" and self._state == "array":
            self._start_object("object")
            return True
        if self._state == "after_tag" and _NAME_CHAR.match(body[0]):
            self._state, self._name = "name", ""
            return True
        self.to_content(out)
        return True

    def _read_name(self, out: StreamDelta, final: bool) -> bool:
        i = 0
        while i < len(self.buffer) and _NAME_CHAR.match(self.buffer[i]):
            i += 1
        self._name += self.take(i)
        if len(self._name) > MAX_NAME_CHARS:
            self.to_content(out)
            return True
        if not self.buffer:
            if final:
                self.to_content(out)
            return False
        if self.buffer.startswith(ARGS):
            self.take(len(ARGS))
            return True
        if ARGS.startswith(self.buffer) and not final:
            return False
        if self.buffer[0] == "{":
            self._start_object("arguments")
            return True
        self.to_content(out)
        return True

    def _start_object(self, state: str) -> None:
        self._state, self._scanner, self._object = state, JsonObjectScanner(), []

    def _read_object(self, out: StreamDelta, final: bool) -> bool:
        end = self._scanner.feed(self.buffer)
        self._object.append(self.take(len(self.buffer) if end is None else end))
        if end is None:
            if final:
                self.to_content(out)
            return False
        body = "".join(self._object)
        if self._state == "object":
            call = parse_json_call(body, ("arguments", "parameters"))
        else:
            call = _named_call(self._name, body)
        if call is None:
            self.to_content(out)
            return True
        self.send_call(out, call)
        self._state = "array" if self._in_array else "after_call"
        return True


def _named_call(name: str, body: str) -> ParsedToolCall | None:
    try:
        arguments = json.loads(body)
    except ValueError:
        return None
    return ParsedToolCall(name, body) if isinstance(arguments, dict) and name else None


class MistralToolParser(IncrementalToolParser):
    name = "mistral"
    chat_template = "mistral.jinja"
    new_call_id = staticmethod(mistral_call_id)

    def streaming(self) -> MistralStream:
        return MistralStream()
