"""`raylm serve --reasoning-parser deepseek_r1` end to end (tiny random
model; its chat template opens <think> in the prompt, or closes an empty
block when chat_template_kwargs says enable_thinking false, as Qwen3's
does): with thinking off, a guided choice holds from the first token and the
answer is the content; with thinking on, the grammar waits for "</think>"
(which this model never writes), so the whole reply is reasoning_content,
streamed as deltas that add up to the whole one. One server."""

from __future__ import annotations

import openai
import pytest

from tests.entrypoints.openai.server_utils import API_KEY, MODEL_NAME, RaylmServer

pytestmark = pytest.mark.server

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\\n\\n</think>\\n\\n"
    "{% else %}<think>\\n{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Yes or no?"}]
CHOICES = ["yes", "no"]


@pytest.fixture(scope="module")
def client(llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("reasoning")
    (folder / "template.jinja").write_text(TEMPLATE)
    server = RaylmServer(
        llama_dir,
        ["--api-key", API_KEY, "--reasoning-parser", "deepseek_r1", "--chat-template", str(folder / "template.jinja")],
        str(folder / "server.log"),
    )
    try:
        with openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=120) as c:
            yield c
    finally:
        server.terminate()


def _ask(client, thinking: bool, **kwargs):
    return client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        extra_body={"guided_choice": CHOICES, "chat_template_kwargs": {"enable_thinking": thinking}},
        **kwargs,
    )


def test_thinking_off_the_grammar_holds_from_the_start(client):
    choice = _ask(client, thinking=False).choices[0]
    assert choice.message.content in CHOICES
    assert getattr(choice.message, "reasoning_content", None) is None
    assert choice.finish_reason == "stop"


def test_thinking_on_the_grammar_waits_and_the_reply_is_reasoning(client):
    whole = _ask(client, thinking=True).choices[0]
    reasoning = whole.message.reasoning_content
    assert reasoning and whole.message.content == ""
    assert whole.finish_reason == "length"
    assert reasoning not in CHOICES  # free text: the grammar did not hold it
    streamed = ""
    chunks = 0
    for chunk in _ask(client, thinking=True, stream=True):
        for choice in chunk.choices:
            piece = getattr(choice.delta, "reasoning_content", None)
            if piece:
                streamed += piece
                chunks += 1
            assert not choice.delta.content
    assert streamed == reasoning and chunks > 1
