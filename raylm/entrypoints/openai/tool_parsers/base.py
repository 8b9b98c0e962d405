"""What every tool-call parser gives back, whole or streamed, independent of
the model's format: the calls (name + arguments as JSON text) and the text
around them that is meant for the user."""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


def tool_call_id() -> str:
    # OpenAI's shape: "call_" and 24 characters.
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass
class ExtractedToolCalls:
    content: str | None
    calls: list[ParsedToolCall] = field(default_factory=list)


@dataclass
class ToolCallDelta:
    """One call's piece in a streamed chunk: its first piece has the id and
    the name; later pieces carry more of the arguments text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def add_call_piece(
        self, index: int, *, id: str | None = None, name: str | None = None, arguments: str = ""
    ) -> None:
        """Pieces of one call within one chunk are merged: clients key them by index."""
        for piece in self.tool_calls:
            if piece.index == index:
                piece.arguments += arguments
                return
        self.tool_calls.append(ToolCallDelta(index, id, name, arguments))

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


class JsonObjectScanner:
    """Finds where a JSON object (or array) ends, fed its text piece by piece:
    each character is looked at once, however many pieces it comes in, so a
    streamed call costs time linear in its length."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def feed(self, piece: str) -> int | None:
        """Index in `piece` just past the object's end, or None if it has not ended."""
        for i, char in enumerate(piece):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return None


class StreamingToolParser(ABC):
    """Per choice state: fed the text deltas as they are generated."""

    @abstractmethod
    def feed(self, text: str) -> StreamDelta: ...

    @abstractmethod
    def finish(self) -> StreamDelta:
        """The output ended: whatever was held back goes out."""


class ToolParser(ABC):
    name: str
    # The file in tool_parsers/templates/ with a chat template that writes
    # tools and calls the way this parser reads them, for a model whose own
    # template does not; None: the model's own (the format's reference models ship it).
    chat_template: str | None = None

    def __init__(self, tools: dict[str, dict] | None = None) -> None:
        """`tools`: the request's functions' parameters schemas, by name
        (formats that write arguments as text convert them by these)."""
        self.tools = tools or {}

    @staticmethod
    def new_call_id() -> str:
        """An id for a call found (a family's templates may require their own shape)."""
        return tool_call_id()

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls: ...

    @abstractmethod
    def streaming(self) -> StreamingToolParser: ...
