"""--reasoning-parser in /v1/chat/completions, on the serving layer itself
with recorded replies (a model that thinks is needed for them; the engine
part, the grammar held after "</think>", is tests/core/
test_reasoning_structured_output.py): reasoning_content and content, whole
and streamed as deltas (the same text either way), with and without tools
(the tool parser reads the answer only), include_reasoning false, and where
the prompt leaves the thinking decides whether a grammar waits for it."""

from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from raylm.engine.input_processor import ProcessedPrompt
from raylm.entrypoints.openai.protocol import ChatCompletionRequest
from raylm.entrypoints.openai.reasoning_parsers import END_TAG
from raylm.entrypoints.openai.serving_chat import OpenAIServingChat
from raylm.entrypoints.openai.serving_tools import ToolCallConfig, plan_tools
from raylm.outputs import CompletionOutput, RequestOutput
from raylm.sampling_params import SamplingParams, StructuredOutputsParams

TOOL = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}},
}
USER = [{"role": "user", "content": "What time is it in Paris?"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))


def _chat(tokenizer, parser: str = "deepseek_r1", tool_parser: str | None = None) -> OpenAIServingChat:
    engine = SimpleNamespace(tokenizer=tokenizer)  # what the reasoning and answer steps use
    tools = ToolCallConfig(enable_auto_tool_choice=True, tool_call_parser=tool_parser) if tool_parser else None
    return OpenAIServingChat(engine, ["m"], admission=SimpleNamespace(), tool_config=tools, reasoning_parser=parser)


def _whole(chat, request, text, in_reasoning):
    output = RequestOutput("r", None, [1], [CompletionOutput(0, text, [1] * 3, finish_reason="stop")], True)
    plan = plan_tools(request, chat.tool_config)
    return chat._response(request, "m", "r", output, 0, plan, in_reasoning).choices[0]


def _streamed(chat, request, text, in_reasoning, seed=0):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 12)))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]

    async def outputs():
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            completion = CompletionOutput(0, piece, [1], finish_reason="stop" if last else None)
            yield RequestOutput("r", None, [1], [completion], last)

    async def collect():
        plan = plan_tools(request, chat.tool_config)
        return [event async for event in chat._stream(request, "m", "r", outputs(), 0, plan, in_reasoning)]

    events = asyncio.run(collect())
    reasoning = content = ""
    calls, finish = {}, None
    for event in events:
        if event.startswith("data: {"):
            choice = json.loads(event[len("data: ") :])["choices"][0]
            delta = choice["delta"]
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], ["", ""])
                entry[0] += call["function"].get("name") or ""
                entry[1] += call["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return reasoning, content, [(n, json.loads(a)) for n, a in calls.values()], finish


REPLY = "Paris is on CET.\n</think>\n\nIt is noon."


@pytest.mark.parametrize("seed", range(3))
def test_thinking_and_answer_whole_and_streamed(tokenizer, seed):
    chat = _chat(tokenizer)
    request = ChatCompletionRequest(messages=USER)
    choice = _whole(chat, request, REPLY, in_reasoning=True)
    assert choice.message.reasoning_content == "Paris is on CET.\n"
    assert choice.message.content == "\n\nIt is noon."
    assert choice.finish_reason == "stop"
    assert _streamed(chat, request, REPLY, True, seed) == ("Paris is on CET.\n", "\n\nIt is noon.", [], "stop")


@pytest.mark.parametrize("seed", range(3))
def test_tool_calls_are_read_from_the_answer_only(tokenizer, seed):
    chat = _chat(tokenizer, "qwen3", tool_parser="hermes")
    request = ChatCompletionRequest(messages=USER, tools=[TOOL])
    # A call quoted while thinking is not a call.
    reply = (
        '<think>Maybe <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>? '
        'No: CET.</think>Checking.<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    )
    thinking = 'Maybe <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>? No: CET.'
    choice = _whole(chat, request, reply, in_reasoning=False)
    assert choice.message.reasoning_content == thinking
    assert choice.message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_time", {"zone": "CET"})
    ]
    assert choice.finish_reason == "tool_calls"
    assert _streamed(chat, request, reply, False, seed) == (
        thinking,
        "Checking.",
        [("get_time", {"zone": "CET"})],
        "tool_calls",
    )


def test_include_reasoning_false_leaves_the_thinking_out(tokenizer):
    chat = _chat(tokenizer)
    request = ChatCompletionRequest(messages=USER, include_reasoning=False)
    choice = _whole(chat, request, REPLY, in_reasoning=True)
    assert (choice.message.reasoning_content, choice.message.content) == (None, "\n\nIt is noon.")
    assert _streamed(chat, request, REPLY, True)[:2] == ("", "\n\nIt is noon.")


def test_without_a_parser_the_thinking_stays_in_the_content(tokenizer):
    chat = _chat(tokenizer, parser=None)
    choice = _whole(chat, ChatCompletionRequest(messages=USER), REPLY, in_reasoning=False)
    assert (choice.message.reasoning_content, choice.message.content) == (None, REPLY)


@pytest.mark.parametrize(
    "prompt, kwargs, gated, starts_inside",
    [
        ("<｜Assistant｜><think>\n", None, True, True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", {"enable_thinking": False}, False, False),
        ("<|im_start|>assistant\n", {"enable_thinking": False}, False, False),
        ("<|im_start|>assistant\n", None, True, True),  # deepseek_r1: the reply starts thinking
    ],
)
def test_a_grammar_waits_for_the_thinking_unless_the_prompt_closed_it(tokenizer, prompt, kwargs, gated, starts_inside):
    chat = _chat(tokenizer)
    request = ChatCompletionRequest(messages=USER, chat_template_kwargs=kwargs)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    in_reasoning, params = chat._reasoning_plan(ProcessedPrompt(prompt, [1]), request, params)
    assert in_reasoning is starts_inside
    expected = tokenizer.encode(END_TAG, add_special_tokens=False) if gated else None
    assert params.structured_outputs.starts_after_token_ids == expected
    assert params.structured_outputs.json_object  # the grammar itself is unchanged
    free = SamplingParams()
    assert chat._reasoning_plan(ProcessedPrompt(prompt, [1]), request, free)[1].structured_outputs is None
