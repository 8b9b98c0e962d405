"""Structured outputs after the thinking (issue 25, item 3): with
starts_after_token_ids (the tokens of "</think>"), the output is free until
the model has written them, and held to the grammar after, through the whole
engine (greedy, tiny random model: the free part equals the unconstrained
output token for token, the rest follows the grammar and ends it with
"stop"); a request resumed past the gate continues the grammar; before the
gate the matcher is not fed."""

from __future__ import annotations

import re

import pytest

from raylm import LLM, SamplingParams
from raylm.core.request import Request
from raylm.core.structured_output import StructuredOutputManager
from raylm.engine.protocol import EngineCoreRequest
from raylm.sampling_params import StructuredOutputsParams

PROMPT = "Think first"
CHOICES = ["yes", "no"]
REGEX = r"\((yes|no)\)"


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(
        tiny_model_dir("llama"), dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256, num_threads=1
    )


@pytest.fixture(scope="module")
def free_output(llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids


def _gate(free_tokens: list[int], at_least: int = 3) -> tuple[list[int], int]:
    """A one-token "end of thinking" the free output writes first at position
    >= at_least (and not before), and that position."""
    for i in range(at_least, len(free_tokens)):
        if free_tokens[i] not in free_tokens[:i]:
            return [free_tokens[i]], i
    pytest.skip("the free output repeats itself")


def test_output_is_free_until_the_gate_then_follows_the_grammar(llm, free_output):
    gate, at = _gate(free_output)
    so = StructuredOutputsParams(regex=REGEX, starts_after_token_ids=gate)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, structured_outputs=so), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.token_ids[: at + 1] == free_output[: at + 1]  # thinking: untouched, the gate included
    tokenizer = llm.get_tokenizer()
    after = tokenizer.decode(out.token_ids[at + 1 :], skip_special_tokens=True)
    assert re.fullmatch(REGEX, after), after
    assert out.finish_reason == "stop"


def test_a_gate_never_written_leaves_the_output_free(llm, free_output):
    unseen = next(t for t in range(llm.get_tokenizer().vocab_size) if t not in free_output)
    so = StructuredOutputsParams(choice=CHOICES, starts_after_token_ids=[unseen])
    out = llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, structured_outputs=so), use_tqdm=False
    )[0].outputs[0]
    assert out.token_ids == free_output and out.finish_reason == "length"


def test_a_multi_token_gate_must_appear_whole(llm, free_output):
    gate, at = _gate(free_output)
    two = [free_output[at - 1], gate[0]]
    so = StructuredOutputsParams(regex=REGEX, starts_after_token_ids=two)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, structured_outputs=so), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.token_ids[: at + 1] == free_output[: at + 1]
    assert re.fullmatch(REGEX, llm.get_tokenizer().decode(out.token_ids[at + 1 :], skip_special_tokens=True))


def test_resumed_past_the_gate_continues_the_grammar(llm, free_output):
    gate, at = _gate(free_output)
    so = StructuredOutputsParams(regex=REGEX, starts_after_token_ids=gate)
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=so)
    full = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    prompt, checked = engine.validate(PROMPT, params)
    core.add_request(
        EngineCoreRequest(
            "resumed",
            prompt.prompt_token_ids,
            checked,
            engine.input_processor.eos_token_id,
            output_token_ids=full[: at + 2],
        )
    )  # the gate and one constrained token
    tokens, reason = [], None
    while core.has_unfinished_requests():
        for out in core.step():
            tokens += out.new_token_ids
            reason = out.finish_reason or reason
    assert full[: at + 2] + tokens == full and reason == "stop"


def test_manager_holds_back_rows_and_accepts_nothing_before_the_gate(tiny_model_dir):
    from transformers import AutoTokenizer

    model = tiny_model_dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(model)
    manager = StructuredOutputManager(model, len(tokenizer))
    try:
        yes = tokenizer.encode("yes", add_special_tokens=False)
        so = StructuredOutputsParams(choice=["yes"], starts_after_token_ids=[7, 8])
        request = Request(
            "r",
            tokenizer.encode("Hi"),
            SamplingParams(max_tokens=32, structured_outputs=so),
            tokenizer.eos_token_id,
            output_token_ids=[5, 7],
        )
        manager.add_request(request)
        manager._grammars["r"].ready.result(timeout=30)
        grammar = manager._grammars["r"]
        assert not grammar.started_output and grammar.num_accepted == 2
        request.output_token_ids.extend([9, 7])  # tokens the grammar would refuse: not its business yet
        assert manager.accept_tokens(request) is False and not grammar.started_output
        request.output_token_ids.append(8)  # ... 7, 8: the gate
        assert manager.accept_tokens(request) is False and grammar.started_output
        request.output_token_ids.extend(yes)
        assert manager.accept_tokens(request) is False
        request.output_token_ids.append(tokenizer.eos_token_id)
        assert manager.accept_tokens(request) is True  # the grammar is done: the request stops
    finally:
        manager.shutdown()
