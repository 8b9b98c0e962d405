"""The reasoning parsers (qwen3, deepseek_r1) on recorded replies: the
thinking and the answer, whole and streamed in random chunkings (equal to
the whole), from where the rendered prompt leaves the model (an open
<think>, a block the template closed, enable_thinking false); linear work."""

from __future__ import annotations

import random
import zlib

import pytest

from raylm.entrypoints.openai.reasoning_parsers import get_reasoning_parser, reasoning_parser_names

# (parser, reply starts inside the thinking, reply, expected reasoning, expected content)
CASES = [
    ("qwen3", False, '<think>\nThe user wants JSON.\n</think>\n\n{"a": 1}', "\nThe user wants JSON.\n", '\n\n{"a": 1}'),
    ("qwen3", False, "  <think>x</think>y", "x", "y"),
    ("qwen3", False, "No thinking here.", None, "No thinking here."),
    ("qwen3", False, "<thin", None, "<thin"),  # a look-alike at the end stays content
    ("qwen3", False, "<think>cut short by max_tokens", "cut short by max_tokens", ""),
    ("qwen3", False, "a</think>b", None, "a</think>b"),  # no <think>: all answer
    ("qwen3", True, "still thinking</think>done", "still thinking", "done"),
    ("qwen3", False, "<think></think>", "", ""),
    ("qwen3", False, "<think>a </thinking> b</think>c <think>d</think>", "a </thinking> b", "c <think>d</think>"),
    ("qwen3", False, " " * 100 + "<think>late</think>", None, " " * 100 + "<think>late</think>"),
    ("deepseek_r1", True, "Let me think.\n</think>\n\nThe answer is 4.", "Let me think.\n", "\n\nThe answer is 4."),
    ("deepseek_r1", True, "<think>Older R1 writes the tag.</think>4", "Older R1 writes the tag.", "4"),
    ("deepseek_r1", True, "never closes", "never closes", ""),
    ("deepseek_r1", False, "Thinking was closed in the prompt.", None, "Thinking was closed in the prompt."),
    ("deepseek_r1", True, "a </think", "a </think", ""),
    ("deepseek_r1", True, "", "", ""),
]


def _split_randomly(text: str, rng: random.Random) -> list[str]:
    if len(text) < 2:
        return [text]
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(len(text) - 1, 10))))
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("name, in_reasoning, text, reasoning, content", CASES)
def test_whole_and_streamed(name, in_reasoning, text, reasoning, content):
    parser = get_reasoning_parser(name)
    split = parser.split(text, in_reasoning)
    assert (split.reasoning, split.content) == (reasoning, content)
    rng = random.Random(zlib.crc32(text.encode()))
    for chunks in [[text], list(text), *(_split_randomly(text, rng) for _ in range(25))]:
        stream = parser.streaming(in_reasoning)
        pieces = [*(stream.feed(chunk) for chunk in chunks), stream.finish()]
        assert "".join(p.reasoning for p in pieces) == (reasoning or ""), chunks
        assert "".join(p.content for p in pieces) == content, chunks


def test_thinking_streams_as_it_is_written():
    stream = get_reasoning_parser("qwen3").streaming(False)
    assert stream.feed("<th").reasoning == ""  # could be the tag: held
    first = stream.feed("ink>Hmm, ")
    assert (first.reasoning, first.content) == ("Hmm, ", "")
    second = stream.feed("ok.</thi")
    assert (second.reasoning, second.content) == ("ok.", "")  # "</thi" held back
    third = stream.feed("nk>Yes")
    assert (third.reasoning, third.content) == ("", "Yes")


@pytest.mark.parametrize(
    "name, prompt, kwargs, state, starts_inside",
    [
        # Qwen3: the template writes nothing; the reply decides.
        ("qwen3", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", None, "none", False),
        # Qwen3 with enable_thinking false: an empty block closed at the prompt's end.
        ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", {"enable_thinking": False}, "closed", False),
        ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", None, "closed", False),
        ("qwen3", "<|im_start|>assistant\n", {"enable_thinking": False}, "closed", False),
        # Qwen3 thinking models and DeepSeek-R1 open the block in the prompt.
        ("qwen3", "<|im_start|>assistant\n<think>\n", None, "open", True),
        ("deepseek_r1", "<｜Assistant｜><think>\n", None, "open", True),
        ("deepseek_r1", "<｜Assistant｜>", None, "none", True),
        # An earlier turn's closed block in the history does not close this reply's.
        ("qwen3", "<think>old</think>answer<|im_end|>\n<|im_start|>assistant\n", None, "none", False),
    ],
)
def test_where_the_prompt_leaves_the_thinking(name, prompt, kwargs, state, starts_inside):
    parser = get_reasoning_parser(name)
    assert parser.prompt_state(prompt, kwargs) == state
    assert parser.reply_starts_in_reasoning(state) is starts_inside


def test_registry():
    assert reasoning_parser_names() == ["deepseek_r1", "qwen3"]
    with pytest.raises(ValueError, match="unknown parser 'nope'"):
        get_reasoning_parser("nope")


@pytest.mark.parametrize("text", ["<think>" + "why " * 20000 + "</think>" + "so " * 20000, " " * 50 + "x" * 80000])
def test_work_is_linear_however_the_text_is_split(text):
    stream = get_reasoning_parser("qwen3").streaming(False)
    for char in text:
        stream.feed(char)
    stream.finish()
    assert stream.chars_examined <= 3 * len(text), stream.chars_examined
