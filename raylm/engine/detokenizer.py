"""Incremental detokenization: turns each request's streamed token ids into text.
Also finds stop strings in the growing text and holds back what could still become one."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

# How many prompt tokens give the first generated token its context (a leading
# space, a word piece); a few are enough and keep the first decode cheap.
_PROMPT_CONTEXT_TOKENS = 5

# A character is at most 4 bytes, so bytes still undecodable after this many
# further tokens (with no text coming out) will never complete; they are then
# released as U+FFFD, as the full decode shows them, and the window slides on.
_MAX_PENDING_TOKENS = 8

# A byte-level token may end inside a multi-byte character; decoding then ends in
# the replacement character until the following tokens complete it.
_REPLACEMENT_CHAR = "\ufffd"


def _backend_of(tokenizer: Any) -> Tokenizer:
    """The Rust ``tokenizers.Tokenizer`` behind a transformers fast tokenizer."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(
            f"{type(tokenizer).__name__} has no Rust backend; incremental "
            "detokenization needs a fast tokenizer (PreTrainedTokenizerFast)"
        )
    return backend


def _clean_context(backend: Tokenizer, token_ids: Sequence[int], skip_special_tokens: bool) -> list[int]:
    """The last few ids of ``token_ids``, cut back so their text ends on a whole character.

    A prompt ending inside a character would otherwise let the output's first
    bytes complete it, pulling a prompt character into the output text.
    """
    start = max(0, len(token_ids) - _PROMPT_CONTEXT_TOKENS)
    for end in range(len(token_ids), start, -1):
        window = list(token_ids[start:end])
        text = backend.decode(window, skip_special_tokens=skip_special_tokens)
        if not text.endswith(_REPLACEMENT_CHAR):
            return window
    return []


class IncrementalDetokenizer:
    """Detokenizes one request's output token by token and watches for stop strings.

    Each step decodes only a small window of recent tokens: ``_prefix_offset``
    marks where the window starts (tokens that give spacing context) and
    ``_read_offset`` where the tokens begin whose text ended on a whole
    character last time it was released. ``output_text`` holds the generated
    text up to the last complete character; ``get_next_output_text`` hands it
    out, keeping back a tail that could still turn into a stop string.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] | str | None = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._backend = _backend_of(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        # SamplingParams allows a bare string; iterating it would stop on single letters.
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        self.stop = [s for s in stops if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)

        self.token_ids: list[int] = []
        self.output_text = ""
        # The stop string that ended the text, once one has, and how many of
        # the tokens of that update came after the one that completed it
        # (several tokens arrive at once from a burst or a speculative run).
        self.matched_stop: str | None = None
        self.num_tokens_past_stop = 0

        # Context ids followed by generated ids; only the tail from _prefix_offset is decoded.
        self._window_ids = _clean_context(self._backend, prompt_token_ids, skip_special_tokens)
        self._prefix_offset = 0
        self._read_offset = len(self._window_ids)
        # Characters of the window's decoded text already in output_text (or context).
        self._window_chars_released = len(self._decode(self._window_ids))
        # Tokens added while the window's end stayed undecodable and no text came out.
        self._stuck_tokens = 0
        self._flushed = False
        self._returned_chars = 0

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Append tokens, extend ``output_text`` and return the stop string they completed.

        Several tokens (a decode burst's) are taken one at a time, so the text
        never depends on how the tokens were grouped: where bytes never make a
        whole character, what is released and when depends on the tokens seen
        so far (see _decode_window), and tokens after a stop string are ignored.
        """
        if not new_token_ids:
            return None
        self.token_ids.extend(new_token_ids)
        if self.matched_stop is not None:
            logger.debug("tokens arrived after stop string %r; ignored", self.matched_stop)
            return None
        for i, token_id in enumerate(new_token_ids):
            self._window_ids.append(token_id)
            new_text = self._decode_window(final=False, num_new_tokens=1)
            if new_text:
                stop = self._append_text(new_text)
                if stop is not None:
                    self.num_tokens_past_stop = len(new_token_ids) - i - 1
                    return stop
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The whole text, or only the part not yet returned when ``delta``.

        Until the request finishes, the last ``max_stop_len - 1`` characters are
        kept back so a half-generated stop string never reaches the client.
        """
        if finished and not self._flushed and self.matched_stop is None:
            # Bytes of an unfinished character: the full decode shows them as U+FFFD.
            self._flushed = True
            tail = self._decode_window(final=True)
            if tail:
                self._append_text(tail)
        if finished or self.matched_stop is not None:
            end = len(self.output_text)
        else:
            end = max(0, len(self.output_text) - max(0, self.max_stop_len - 1))
        if not delta:
            return self.output_text[:end]
        if end <= self._returned_chars:
            return ""
        text = self.output_text[self._returned_chars : end]
        self._returned_chars = end
        return text

    def _decode(self, token_ids: list[int]) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_window(self, final: bool, num_new_tokens: int = 0) -> str:
        """Text the window gained since the last release, up to its last whole character."""
        text = self._decode(self._window_ids[self._prefix_offset :])
        complete_len = len(text.rstrip(_REPLACEMENT_CHAR))
        if complete_len < len(text):
            if complete_len > self._window_chars_released:
                self._stuck_tokens = 0
            else:
                self._stuck_tokens += num_new_tokens
            if final or self._stuck_tokens > _MAX_PENDING_TOKENS:
                complete_len = len(text)
        new_text = text[self._window_chars_released : complete_len]
        self._window_chars_released = max(self._window_chars_released, complete_len)
        if complete_len == len(text):
            # Everything decoded cleanly: the released tokens become the next context.
            self._stuck_tokens = 0
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._window_ids)
            self._window_chars_released = len(self._decode(self._window_ids[self._prefix_offset :]))
            # Drop ids no window will read again, so memory stays flat on long outputs.
            if self._prefix_offset > 4 * _MAX_PENDING_TOKENS:
                del self._window_ids[: self._prefix_offset]
                self._read_offset -= self._prefix_offset
                self._prefix_offset = 0
        return new_text

    def _append_text(self, new_text: str) -> str | None:
        old_len = len(self.output_text)
        self.output_text += new_text
        if not self.stop:
            return None
        match = self._find_stop(old_len)
        if match is None:
            return None
        position, stop_str = match
        end = position + len(stop_str) if self.include_stop_str_in_output else position
        self.output_text = self.output_text[:end]
        self.matched_stop = stop_str
        return stop_str

    def _find_stop(self, old_len: int) -> tuple[int, str] | None:
        """Earliest stop string that the text appended after ``old_len`` completed."""
        best: tuple[int, str] | None = None
        for stop_str in self.stop:
            # Only a match that ends in the new text is new; anything earlier was seen before.
            start = max(0, old_len - len(stop_str) + 1)
            position = self.output_text.find(stop_str, start)
            if position != -1 and (best is None or position < best[0]):
                best = (position, stop_str)
        return best


def detokenize_logprobs(tokenizer: Any, token_ids: Sequence[int]) -> list[str]:
    """Each token id decoded on its own (the ``decoded_token`` of a logprob entry).

    A byte-level token holding part of a character decodes to the replacement
    character, as Hugging Face's ``decode([id])`` gives.
    """
    if not token_ids:
        return []
    backend = _backend_of(tokenizer)
    return backend.decode_batch([[int(i)] for i in token_ids], skip_special_tokens=False)
