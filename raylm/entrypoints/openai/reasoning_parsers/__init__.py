"""Reasoning parsers by name (`--reasoning-parser NAME`, vLLM's names): each
separates a reasoning model's thinking from its answer."""

from __future__ import annotations

from raylm.entrypoints.openai.reasoning_parsers.base import (
    END_TAG,
    START_TAG,
    ReasoningDelta,
    ReasoningParser,
    ReasoningSplit,
    ReasoningStream,
)


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: a reply that begins with <think> thinks until </think>; one
    that does not (thinking off, or the template's empty block) is all
    answer; Qwen3 thinking models whose template opens <think> in the prompt
    start inside it."""

    name = "qwen3"
    starts_in_reasoning = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and its distills, QwQ): the template opens <think> in the
    prompt, so the reply starts thinking (a <think> it writes anyway is
    dropped) until </think>; a reply that never closes it is all thinking."""

    name = "deepseek_r1"
    starts_in_reasoning = True


_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)}


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return _PARSERS[name]()
    except KeyError:
        raise ValueError(f"reasoning_parser: unknown parser {name!r}; known: {reasoning_parser_names()}") from None


__all__ = [
    "END_TAG",
    "START_TAG",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningSplit",
    "ReasoningStream",
    "get_reasoning_parser",
    "reasoning_parser_names",
]
