"""Qwen3-Coder's XML-style tool calls (`--tool-call-parser qwen3_xml`, or
`qwen3_coder`, vLLM's two names for the format):

    Let me look.<tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Text before the first <tool_call> is the content. A parameter's value is
text: it is converted by the type the request's tool declares for it (a
string stays as written; integer, number, boolean, null, object and array are
read as JSON), and read as JSON when that parses and the tool says nothing,
else kept as a string. Qwen3-Coder's own chat template (read from the model)
writes tools and calls this way; templates/qwen3_xml.jinja for a model
without it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from raylm.entrypoints.openai.tool_parsers.base import ParsedToolCall, StreamDelta
from raylm.entrypoints.openai.tool_parsers.incremental import (
    MAX_NAME_CHARS,
    CallStream,
    IncrementalToolParser,
    TagFinder,
    partial_suffix,
)

START, END = "<tool_call>", "</tool_call>"
_BLANKS = " \t\r\n"
# %-formatting, since an f-string would need the patterns' own braces doubled.
_FUNCTION = re.compile(r"\s*<function=([^<>\n]{1,%d})>(.*)</function>\s*\Z" % MAX_NAME_CHARS, re.DOTALL)  # noqa: UP031
_PARAMETER = re.compile(r"<parameter=([^<>\n]{1,%d})>(.*?)</parameter>" % MAX_NAME_CHARS, re.DOTALL)  # noqa: UP031
_NOT_A_STRING = ("integer", "number", "boolean", "null", "object", "array")


def _strip_one_newline(value: str) -> str:
    # The format puts each value on lines of its own.
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _convert(value: str, schema: dict | None) -> Any:
    declared = schema.get("type") if isinstance(schema, dict) else None
    types = declared if isinstance(declared, list) else [declared] if declared else []
    if "string" in types and not any(t in _NOT_A_STRING for t in types):
        return value
    try:
        converted = json.loads(value)
    except ValueError:
        return value
    if types and "string" not in types:
        return converted
    # Not declared (or a string among others): JSON that is not a bare string is taken as such.
    return converted if not types or not isinstance(converted, str) else value


def parse_function_block(block: str, tools: dict[str, dict]) -> ParsedToolCall | None:
    """One <tool_call> block's text -> the call, else None (malformed)."""
    match = _FUNCTION.match(block)
    if match is None:
        return None
    name, inner = match.group(1).strip(), match.group(2)
    properties = (tools.get(name) or {}).get("properties") or {}
    arguments: dict[str, Any] = {}
    position = 0
    for parameter in _PARAMETER.finditer(inner):
        if inner[position : parameter.start()].strip(_BLANKS):
            return None  # text between parameters
        key = parameter.group(1).strip()
        arguments[key] = _convert(_strip_one_newline(parameter.group(2)), properties.get(key))
        position = parameter.end()
    if inner[position:].strip(_BLANKS) or not name:
        return None
    return ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False))


class Qwen3XmlStream(CallStream):
    def __init__(self, tools: dict[str, dict]) -> None:
        super().__init__()
        self._tools = tools
        self._state = "content"  # content, call, between
        self._end = TagFinder(END)
        self._block: list[str] = []

    def step(self, out: StreamDelta, final: bool) -> bool:
        if self._state == "content":
            start = self.buffer.find(START)
            if start < 0:
                held = 0 if final else partial_suffix(self.buffer, START)
                out.content += self.buffer[: len(self.buffer) - held]
                self.buffer = self.buffer[len(self.buffer) - held :]
                return False
            out.content += self.buffer[:start]
            self.buffer = self.buffer[start:]
            self._open_call()
            return True
        if self._state == "between":
            body = self.buffer.lstrip(_BLANKS)
            self.take(len(self.buffer) - len(body))
            if body.startswith(START):
                self._open_call()
                return True
            if not body or (START.startswith(body) and not final):
                if final:
                    self.since_call, self.verbatim = [], True
                return False
            self.to_content(out)  # text after the calls
            return True
        end = self._end.feed(self.buffer)
        self._block.append(self.take(len(self.buffer) if end is None else end))
        if end is None and not final:
            return False
        block = "".join(self._block)
        call = parse_function_block(block[: -len(END)] if end is not None else block, self._tools)
        if call is None:
            self.to_content(out)
            return True
        self.send_call(out, call)
        self._state = "between"
        return end is not None

    def _open_call(self) -> None:
        self.take(len(START))
        self._state, self._end, self._block = "call", TagFinder(END), []


class Qwen3XmlToolParser(IncrementalToolParser):
    name = "qwen3_xml"
    chat_template = "qwen3_xml.jinja"

    def streaming(self) -> Qwen3XmlStream:
        return Qwen3XmlStream(self.tools)


class Qwen3CoderToolParser(Qwen3XmlToolParser):
    name = "qwen3_coder"
