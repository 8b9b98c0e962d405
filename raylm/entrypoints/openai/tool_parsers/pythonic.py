"""Pythonic tool calls, as Llama 3.2 and Llama 4 write them
(`--tool-call-parser pythonic`): the whole reply is a Python list of calls
with keyword arguments of literal values,

    [get_weather(city="Paris", days=3), get_time(zone='CET')]

optionally inside <|python_start|> ... <|python_end|> (Llama 4). A reply that
does not start with "[" (after blanks) is plain content; a list that is not
calls of literals is content too. The list goes out as calls once it closes.
Llama 4's own chat template (read from the model) asks for this form;
templates/pythonic.jinja is one for Llama 3.2 and others.
"""

from __future__ import annotations

import ast
import json
import math

from raylm.entrypoints.openai.tool_parsers.base import ParsedToolCall, StreamDelta
from raylm.entrypoints.openai.tool_parsers.incremental import CallStream, IncrementalToolParser

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_BLANKS = " \t\r\n"


class PythonListScanner:
    """Finds where a Python list literal ends, fed piece by piece; each
    character looked at once (brackets counted outside '...' and "..." strings)."""

    def __init__(self) -> None:
        self.depth = 0
        self.quote: str | None = None
        self.escaped = False

    def feed(self, piece: str) -> int | None:
        for i, char in enumerate(piece):
            if self.quote is not None:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == self.quote:
                    self.quote = None
            elif char in "'\"":
                self.quote = char
            elif char in "([{":
                self.depth += 1
            elif char in ")]}":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


def _name_of(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        base = _name_of(func.value)
        return f"{base}.{func.attr}" if base else None
    return None


def parse_call_list(text: str) -> list[ParsedToolCall] | None:
    """The calls of a Python list literal, or None when it is not one."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for element in tree.body.elts:
            name = _name_of(element.func) if isinstance(element, ast.Call) else None
            if name is None or element.args or any(k.arg is None for k in element.keywords):
                return None
            arguments = {k.arg: _literal(k.value) for k in element.keywords}
            calls.append(ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False)))
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None  # not Python, or not a literal JSON can hold


# Models trained on JSON often write its literals in these calls too.
_NAMED_LITERALS = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def _literal(node: ast.expr):
    """A JSON value from a Python literal (ValueError for anything else:
    names, calls, sets, bytes, complex numbers)."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (bool, int, float, str))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ValueError("JSON has no infinite numbers")
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMED_LITERALS:
        return _NAMED_LITERALS[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}
    raise ValueError(f"not a literal: {ast.dump(node)[:80]}")


class PythonicStream(CallStream):
    def __init__(self) -> None:
        super().__init__()
        self._state = "start"  # start, list, after
        self._scanner = PythonListScanner()
        self._list: list[str] = []

    def step(self, out: StreamDelta, final: bool) -> bool:
        if self._state in ("start", "opened"):
            self.take(len(self.buffer) - len(self.buffer.lstrip(_BLANKS)))  # blanks before: looked at once
            body = self.buffer
            if self._state == "start" and body.startswith(PYTHON_START):
                self.take(len(PYTHON_START))
                self._state = "opened"
                return True
            if not body or (self._state == "start" and PYTHON_START.startswith(body) and not final):
                if final:
                    self.to_content(out)
                return False
            if body[0] != "[":
                self.to_content(out)
                return True
            self._state = "list"
            return True
        if self._state == "list":
            end = self._scanner.feed(self.buffer)
            self._list.append(self.take(len(self.buffer) if end is None else end))
            if end is None:
                if final:
                    self.to_content(out)
                return False
            calls = parse_call_list("".join(self._list))
            if calls is None:
                self.to_content(out)
                return True
            for call in calls:
                self.send_call(out, call)
            self._state = "after"
            return True
        body = self.buffer.lstrip(_BLANKS)
        if body.startswith(PYTHON_END):
            body = body[len(PYTHON_END) :].lstrip(_BLANKS)
        elif PYTHON_END.startswith(body) and body and not final:
            return False
        self.buffer = body
        if body:
            self.to_content(out)  # text after the list
        return False


class PythonicToolParser(IncrementalToolParser):
    name = "pythonic"
    chat_template = "pythonic.jinja"

    def streaming(self) -> PythonicStream:
        return PythonicStream()
