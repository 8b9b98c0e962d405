"""Tool-call parsers by name (`--tool-call-parser NAME`): each turns a model's
own tool-call format back into OpenAI tool calls."""

from __future__ import annotations

import pathlib

from raylm.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    JsonObjectScanner,
    ParsedToolCall,
    StreamDelta,
    StreamingToolParser,
    ToolCallDelta,
    ToolParser,
    tool_call_id,
)
from raylm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from raylm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from raylm.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from raylm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from raylm.entrypoints.openai.tool_parsers.qwen3_xml import Qwen3CoderToolParser, Qwen3XmlToolParser

_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (
        HermesToolParser,
        Llama3JsonToolParser,
        MistralToolParser,
        Qwen3XmlToolParser,
        Qwen3CoderToolParser,
        PythonicToolParser,
    )
}
_TEMPLATES = pathlib.Path(__file__).parent / "templates"


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str, tools: dict[str, dict] | None = None) -> ToolParser:
    """A parser for one request; `tools`: its functions' parameters schemas by name."""
    try:
        parser = _PARSERS[name]
    except KeyError:
        raise ValueError(f"tool_call_parser: unknown parser {name!r}; known: {tool_parser_names()}") from None
    return parser(tools)


def tool_chat_template_path(name: str) -> pathlib.Path | None:
    """The shipped chat template that writes tools and calls the way parser
    `name` reads them (for --chat-template), or None: the model's own."""
    file = _PARSERS[name].chat_template
    return _TEMPLATES / file if file else None


__all__ = [
    "ExtractedToolCalls",
    "HermesToolParser",
    "JsonObjectScanner",
    "ParsedToolCall",
    "StreamDelta",
    "StreamingToolParser",
    "ToolCallDelta",
    "ToolParser",
    "get_tool_parser",
    "tool_call_id",
    "tool_chat_template_path",
    "tool_parser_names",
]
