"""Tool-call parsers by name (`--tool-call-parser NAME`): each turns a model's
own tool-call format back into OpenAI tool calls."""

from __future__ import annotations

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

_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
}


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> ToolParser:
    try:
        return _PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool_call_parser: unknown parser {name!r}; known: {tool_parser_names()}") from None


__all__ = [
    "ExtractedToolCalls", "HermesToolParser", "JsonObjectScanner", "ParsedToolCall", "StreamDelta", "StreamingToolParser",
    "ToolCallDelta", "ToolParser", "get_tool_parser", "tool_call_id", "tool_parser_names",
]
