"""Tool calling for /v1/chat/completions, as vLLM serves it.

A request's `tools` are rendered by the model's chat template; `tool_choice`
decides how calls come back:

- "none": tools are rendered, the output is plain content.
- "auto" (the default when tools are given; needs --enable-auto-tool-choice
  and --tool-call-parser): the model decides, and the parser finds its calls.
- a named function: the output is constrained (structured outputs) to the
  function's `parameters` schema, and IS that call's arguments.
- "required": the output is constrained to a JSON array of
  {"name", "parameters"} objects, one per call.

ToolPlan holds that decision for one request; its ChoiceStream turns each
choice's streamed text into OpenAI's tool_calls deltas.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from raylm.core.structured_output import validate_structured_outputs
from raylm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatDelta,
    ChatMessage,
    ChatResponseMessage,
    ChatTool,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from raylm.entrypoints.openai.serving_common import OpenAIError
from raylm.entrypoints.openai.tool_parsers import (
    JsonObjectScanner,
    ParsedToolCall,
    StreamDelta,
    StreamingToolParser,
    ToolParser,
    get_tool_parser,
    tool_call_id,
)
from raylm.sampling_params import SamplingParams, StructuredOutputsParams

_AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
# A function declared without parameters takes none.
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCallConfig:
    """The server's tool-calling flags (vLLM's names)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # an unknown name fails at start-up

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ToolCallConfig:
        return cls(getattr(args, "enable_auto_tool_choice", False), getattr(args, "tool_call_parser", None))


# ---- Rendering -------------------------------------------------------------


def add_tool_fields(conversation: list[dict[str, Any]], messages: list[ChatMessage]) -> None:
    """Adds the tool parts of each message to the template's conversation:
    an assistant's tool_calls (arguments as objects, which templates such as
    Qwen's and Llama 3.1's serialise themselves) and a tool reply's call id."""
    for entry, message in zip(conversation, messages):
        if message.role == "tool":
            if not message.tool_call_id:
                raise ValueError('messages: a role "tool" message needs the tool_call_id it answers')
            entry["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            if message.role != "assistant":
                raise ValueError(f"messages: only assistant messages carry tool_calls, not {message.role!r}")
            entry["tool_calls"] = [_call_for_template(call) for call in message.tool_calls]


def _call_for_template(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise ValueError(
            f"messages: the arguments of tool call {call.id!r} must be a JSON object, got {call.function.arguments!r}"
        )
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def tools_for_template(tools: list[ChatTool] | None, template: str | None) -> list[dict[str, Any]] | None:
    """The `tools` variable for the chat template; a template that never reads
    it would silently drop them, so that is the client's 400."""
    if not tools:
        return None
    if template is not None and not template_reads_tools(template):
        raise OpenAIError("tools were given, but the model's chat template does not render tools", 400, "tools")
    return [tool.model_dump(exclude_none=True) for tool in tools]


def template_reads_tools(template: str) -> bool:
    import jinja2
    from jinja2 import meta

    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        # Tags of transformers' own (e.g. {% generation %}): judge by the name alone.
        return re.search(r"\btools\b", template) is not None
    return "tools" in meta.find_undeclared_variables(parsed)


# ---- The plan ----------------------------------------------------------------


@dataclass
class ToolPlan:
    mode: str  # "plain" (no tools), "none", "auto", "named" or "required"
    tools: list[ChatTool] = field(default_factory=list)
    parser: ToolParser | None = None  # "auto"
    function_name: str | None = None  # "named"
    parallel: bool = True

    def apply(self, params: SamplingParams) -> SamplingParams:
        """Constrains the output for "named" and "required" (compiling the
        schema: run it off the event loop)."""
        schema = self._output_schema()
        if schema is None:
            return params
        if params.structured_outputs is not None:
            raise OpenAIError(
                'tool_choice "required" or a named function cannot be combined with another '
                "structured output (response_format, structured_outputs)",
                400,
                "tool_choice",
            )
        try:
            # Whitespace kept to the separators: a weak model may otherwise emit runs of it.
            constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
            validate_structured_outputs(constraint)
        except ValueError as e:
            raise OpenAIError(f"tools: a function's parameters are not a usable JSON schema: {e}", 400, "tools") from e
        params.structured_outputs = constraint
        return params

    def _output_schema(self) -> dict[str, Any] | None:
        if self.mode == "named":
            return _parameters_schema(self._tool(self.function_name))
        if self.mode == "required":
            # One alternative per tool, so that each name comes with its own parameters.
            calls = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [tool.function.name]},
                        "parameters": _parameters_schema(tool),
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for tool in self.tools
            ]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return schema
        return None

    def _tool(self, name: str) -> ChatTool:
        return next(tool for tool in self.tools if tool.function.name == name)

    def message(self, text: str, finish_reason: str | None) -> tuple[ChatResponseMessage, str | None]:
        """A whole choice's message and finish_reason."""
        if self.mode == "auto":
            extracted = self.parser.extract(text)
            content, calls = extracted.content, extracted.calls
        elif self.mode == "named":
            content, calls = None, [ParsedToolCall(self.function_name, text)]
        elif self.mode == "required":
            calls = _required_calls(text)
            content = None if calls else text
        else:
            return ChatResponseMessage(content=text), finish_reason
        if not self.parallel:
            calls = calls[:1]
        if not calls:
            return ChatResponseMessage(content=content), finish_reason
        new_id = self.parser.new_call_id if self.parser is not None else tool_call_id
        tool_calls = [ToolCall(id=new_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
        return ChatResponseMessage(content=content, tool_calls=tool_calls), self._finish_with_calls(finish_reason)

    def _finish_with_calls(self, finish_reason: str | None) -> str | None:
        # A call the client forced by name ends "stop", as OpenAI's and vLLM's
        # do; a call the model chose ends "tool_calls". One cut short (length,
        # abort) keeps the reason it ended for.
        if self.mode == "named":
            return finish_reason
        return "tool_calls" if finish_reason == "stop" else finish_reason

    def stream(self) -> ChoiceStream:
        if self.mode == "auto":
            return ChoiceStream(self.parser.streaming(), self.parallel, self._finish_with_calls)
        if self.mode == "named":
            return ChoiceStream(_NamedCallStream(self.function_name), self.parallel, self._finish_with_calls)
        if self.mode == "required":
            return ChoiceStream(_RequiredCallsStream(), self.parallel, self._finish_with_calls)
        return ChoiceStream(None, self.parallel, self._finish_with_calls)


def plan_tools(request: ChatCompletionRequest, config: ToolCallConfig) -> ToolPlan:
    """Checks the request's tool fields against each other and the server's flags."""
    tools = request.tools or []
    choice = request.tool_choice if request.tool_choice is not None else ("auto" if tools else "none")
    if not tools:
        if choice != "none":
            raise OpenAIError("When using `tool_choice`, `tools` must be set.", 400, "tool_choice")
        return ToolPlan("plain")
    names = [tool.function.name for tool in tools]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise OpenAIError(f"tools: function names must be unique, repeated: {duplicates}", 400, "tools")
    parallel = request.parallel_tool_calls
    if choice == "none":
        return ToolPlan("none", tools, parallel=parallel)
    if choice == "auto":
        if not (config.enable_auto_tool_choice and config.tool_call_parser):
            raise OpenAIError(_AUTO_NEEDS_FLAGS, 400, "tool_choice")
        schemas = {tool.function.name: _parameters_schema(tool) for tool in tools}
        return ToolPlan("auto", tools, parser=get_tool_parser(config.tool_call_parser, schemas), parallel=parallel)
    if choice == "required":
        return ToolPlan("required", tools, parallel=parallel)
    name = choice.function.name
    if name not in names:
        raise OpenAIError(
            f"tool_choice: function {name!r} is not among the request's tools {names}", 400, "tool_choice"
        )
    return ToolPlan("named", tools, function_name=name, parallel=parallel)


def _parameters_schema(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else _NO_PARAMETERS


def _required_calls(text: str) -> list[ParsedToolCall]:
    """The complete calls of a "required" output: when it was cut short, those
    before the cut (the ones streaming sent)."""
    delta = _RequiredCallsStream().feed(text)
    return [ParsedToolCall(piece.name, piece.arguments) for piece in delta.tool_calls]


def _required_item(item: Any) -> ParsedToolCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    return ParsedToolCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))


# ---- Streaming -------------------------------------------------------------


class ChoiceStream:
    """One choice's deltas: plain content, or what its tool stream makes of it."""

    def __init__(
        self,
        tool_stream: StreamingToolParser | None,
        parallel: bool,
        finish_with_calls: Callable[[str | None], str | None],
    ):
        self._tool_stream = tool_stream
        self._parallel = parallel
        self._finish_with_calls = finish_with_calls
        self._made_calls = False

    def step(self, text: str, finished: bool) -> ChatDelta | None:
        """The delta for `text`, or None when there is nothing to send yet."""
        if self._tool_stream is None:
            return ChatDelta(content=text)
        delta = self._tool_stream.feed(text)
        if finished:
            tail = self._tool_stream.finish()
            delta.content += tail.content
            for piece in tail.tool_calls:
                delta.add_call_piece(piece.index, id=piece.id, name=piece.name, arguments=piece.arguments)
        pieces = [p for p in delta.tool_calls if self._parallel or p.index == 0]
        if not delta.content and not pieces:
            return None
        self._made_calls = self._made_calls or bool(pieces)
        tool_calls = [
            DeltaToolCall(
                index=p.index,
                id=p.id,
                type="function" if p.id else None,
                function=DeltaFunctionCall(name=p.name, arguments=p.arguments),
            )
            for p in pieces
        ]
        return ChatDelta(content=delta.content or None, tool_calls=tool_calls or None)

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return self._finish_with_calls(finish_reason) if self._made_calls else finish_reason


class _NamedCallStream(StreamingToolParser):
    """The output is the arguments: the call's id and name go out first."""

    def __init__(self, name: str):
        self._name = name
        self._started = False

    def feed(self, text: str) -> StreamDelta:
        delta = StreamDelta()
        if not self._started:
            self._started = True
            delta.add_call_piece(0, id=tool_call_id(), name=self._name, arguments=text)
        elif text:
            delta.add_call_piece(0, arguments=text)
        return delta

    def finish(self) -> StreamDelta:
        return StreamDelta()


class _RequiredCallsStream(StreamingToolParser):
    """The output is a JSON array of calls: each goes out once its object is
    complete. Linear in the text: a call's characters are scanned once as
    they arrive (JsonObjectScanner), and it is decoded once, when it closes."""

    def __init__(self) -> None:
        self._started = False  # the array's "[" was seen
        self._ended = False  # something other than a call object came: nothing more is sent
        self._item: list[str] = []  # the open call's text so far
        self._scanner: JsonObjectScanner | None = None
        self._num_calls = 0
        self.chars_examined = 0

    def feed(self, text: str) -> StreamDelta:
        delta = StreamDelta()
        pos = 0
        if not self._started:
            start = text.find("[")
            if start < 0:
                return delta
            self._started, pos = True, start + 1
        while pos < len(text) and not self._ended:
            if self._scanner is None:
                pos = self._skip_separators(text, pos)
                if pos == len(text):
                    break
                if text[pos] != "{":
                    self._ended = True  # "]" (the array's end); a call is always an object
                    break
                self._scanner = JsonObjectScanner()
            end = self._scanner.feed(text[pos:])
            self.chars_examined += len(text) - pos
            if end is None:
                self._item.append(text[pos:])
                break
            self._item.append(text[pos : pos + end])
            pos += end
            self._send("".join(self._item), delta)
            self._item, self._scanner = [], None
        return delta

    def _send(self, item_text: str, delta: StreamDelta) -> None:
        try:
            item = json.loads(item_text)
        except ValueError:
            return
        call = _required_item(item)
        if call is not None:
            delta.add_call_piece(self._num_calls, id=tool_call_id(), name=call.name, arguments=call.arguments)
            self._num_calls += 1

    @staticmethod
    def _skip_separators(text: str, pos: int) -> int:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        return pos

    def finish(self) -> StreamDelta:
        return StreamDelta()
