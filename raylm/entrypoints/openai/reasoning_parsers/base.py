"""What a reasoning parser does: split a reasoning model's reply into its
thinking (OpenAI's `reasoning_content`) and the answer (`content`), whole or
streamed as deltas, from where the prompt left the model.

The models write their thinking between <think> and </think>. Whether the
reply starts inside the thinking depends on the chat template: many open the
block in the prompt themselves (DeepSeek-R1, Qwen3 thinking models), and
with thinking switched off (chat_template_kwargs {"enable_thinking": false})
Qwen3's closes an empty one there. So each request's split starts from the
rendered prompt: inside the thinking when the prompt's last <think> is still
open; otherwise as the parser's family decides.

One incremental machine serves both ways: the whole reply is the stream fed
at once, so they are equal by construction. It looks at each character a
bounded number of times (the tags are searched for in the new text and the
few characters held back that could begin one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

START_TAG, END_TAG = "<think>", "</think>"
_BLANKS = " \t\r\n"
# Blanks a reply may write before its <think>; past them it has begun otherwise.
_MAX_LEAD_IN = 64


def _partial_suffix(text: str, tag: str) -> int:
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


@dataclass
class ReasoningSplit:
    reasoning: str | None
    content: str


class ReasoningStream:
    """One choice's split: fed the text deltas as they come."""

    def __init__(self, in_reasoning: bool) -> None:
        # opening: the reply may begin with <think> (dropped); reasoning; content.
        self._state = "opening"
        self._opening_leads_to = "reasoning" if in_reasoning else "content"
        self._pending = ""
        self.saw_reasoning = in_reasoning
        self.chars_examined = 0

    def feed(self, text: str) -> ReasoningDelta:
        self._pending += text
        out = ReasoningDelta()
        self._advance(out, final=False)
        return out

    def finish(self) -> ReasoningDelta:
        out = ReasoningDelta()
        self._advance(out, final=True)
        return out

    def _advance(self, out: ReasoningDelta, final: bool) -> None:
        while self._pending:
            text = self._pending
            self.chars_examined += len(text)
            if self._state == "opening":
                body = text.lstrip(_BLANKS)
                # (Everything received so far is here: the lead-in is measured the same however it came.)
                if len(text) - len(body) <= _MAX_LEAD_IN:
                    if body.startswith(START_TAG):
                        self._pending = body[len(START_TAG) :]
                        self._state, self.saw_reasoning = "reasoning", True
                        continue
                    if not final and (not body or START_TAG.startswith(body)):
                        return  # could still be the tag
                self._state = self._opening_leads_to
                continue
            if self._state == "content":
                out.content += text
                self._pending = ""
                return
            end = text.find(END_TAG)
            if end >= 0:
                out.reasoning += text[:end]
                self._pending = text[end + len(END_TAG) :]
                self._state = "content"
                continue
            held = 0 if final else _partial_suffix(text, END_TAG)
            out.reasoning += text[: len(text) - held]
            self._pending = text[len(text) - held :]
            return


class ReasoningParser:
    """A family's parser (`--reasoning-parser NAME`)."""

    name: str
    # Where the reply starts when the prompt leaves no <think> open.
    starts_in_reasoning: bool = False

    def prompt_state(self, prompt: str | None, chat_template_kwargs: dict[str, Any] | None) -> str:
        """Where the rendered prompt leaves the thinking: "open" (its last
        <think> is unclosed), "closed" (thinking switched off, or the template
        closed a block at its very end), or "none" (the reply decides)."""
        kwargs = chat_template_kwargs or {}
        if kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False:
            return "closed"
        if prompt:
            opened, closed = prompt.rfind(START_TAG), prompt.rfind(END_TAG)
            if opened > closed:
                return "open"
            if closed >= 0 and prompt[closed + len(END_TAG) :].strip(_BLANKS) == "":
                return "closed"
        return "none"

    def reply_starts_in_reasoning(self, prompt_state: str) -> bool:
        if prompt_state == "none":
            return self.starts_in_reasoning
        return prompt_state == "open"

    def streaming(self, in_reasoning: bool) -> ReasoningStream:
        return ReasoningStream(in_reasoning)

    def split(self, text: str, in_reasoning: bool) -> ReasoningSplit:
        stream = self.streaming(in_reasoning)
        first, last = stream.feed(text), stream.finish()
        reasoning = first.reasoning + last.reasoning
        return ReasoningSplit(reasoning if stream.saw_reasoning else None, first.content + last.content)
