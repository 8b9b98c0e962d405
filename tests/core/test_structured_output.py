"""The grammar manager and the scheduler's share of structured outputs,
without an executor: compilation off the step loop (and its failures), the
matcher fed each accepted token once, the bitmask rows of a step, and the
sampler's unpacking of xgrammar's packed bitmask."""

from __future__ import annotations

import threading

import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from raylm.config import CacheConfig, SchedulerConfig
from raylm.core.request import Request
from raylm.core.scheduler import Scheduler
from raylm.core.structured_output import (
    _COMPILE_WORKERS,
    StructuredOutputManager,
    grammar_spec,
    validate_structured_outputs,
)
from raylm.messages import GrammarOutput, ModelRunnerOutput
from raylm.sampling_params import SamplingParams, StructuredOutputsParams
from raylm.worker.sampler import apply_grammar_bitmask

CHOICE = StructuredOutputsParams(choice=["red", "green"])


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def tokenizer(model):
    return AutoTokenizer.from_pretrained(model)


def _request(rid: str, tokenizer, structured=None, output_token_ids=None, **params) -> Request:
    params = SamplingParams(max_tokens=32, structured_outputs=structured, **params)
    return Request(rid, tokenizer.encode("Hi"), params, tokenizer.eos_token_id, output_token_ids=output_token_ids)


def _scheduler(manager: StructuredOutputManager) -> Scheduler:
    return Scheduler(
        SchedulerConfig(), CacheConfig(num_blocks=64), max_model_len=256, structured_output_manager=manager
    )


def _wait_compiled(manager: StructuredOutputManager, *rids: str) -> None:
    for rid in rids:
        manager._grammars[rid].ready.exception(timeout=30)


def _reference_mask(matcher, vocab_size: int) -> torch.Tensor:
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return bitmask


def test_choice_literals_keep_quotes_backslashes_and_newlines(tokenizer):
    choices = ['say "hi"', "a\\b", "two\nlines", "日本"]
    spec = grammar_spec(StructuredOutputsParams(choice=choices))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_grammar(spec.text)
    for choice in choices:
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(choice) and matcher.accept_token(tokenizer.eos_token_id)
        assert matcher.is_terminated()
    assert not xgr.GrammarMatcher(compiled).accept_string("say hi")


def test_intake_validation_reports_xgrammar_message():
    validate_structured_outputs(StructuredOutputsParams(regex="[a-z]+"))
    validate_structured_outputs(None)
    with pytest.raises(ValueError, match=r"structured_outputs.regex is invalid: Regex parsing error .*parenthesis"):
        validate_structured_outputs(StructuredOutputsParams(regex="(ab"))
    with pytest.raises(ValueError, match='structured_outputs.json is invalid: Unsupported type "frog"'):
        validate_structured_outputs(StructuredOutputsParams(json={"type": "frog"}))
    # An integer the engine's messages cannot carry (issue 21), wherever it sits in the schema.
    with pytest.raises(ValueError, match=r"structured_outputs.json is invalid: .*integer -?\d+, past the 64-bit range"):
        validate_structured_outputs(StructuredOutputsParams(json={"enum": [1, -(2**63) - 1]}))
    validate_structured_outputs(StructuredOutputsParams(json={"enum": [-(2**63), 2**63 - 1]}))


def test_packed_bitmask_matches_xgrammar_on_the_rows_it_names():
    vocab_size, rows = 70, ["a", "b", "c", "d"]  # 70: the last word is partly padding
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 3), dtype=torch.int32, generator=generator)
    logits = torch.randn(len(rows), vocab_size, generator=generator)
    expected = logits.clone()
    # Rows "d" and "b" are constrained, in that order; "x" samples nowhere here.
    xgr.apply_token_bitmask_inplace(expected[3:4], bitmask[0:1], vocab_size=vocab_size)
    xgr.apply_token_bitmask_inplace(expected[1:2], bitmask[2:3], vocab_size=vocab_size)
    assert not torch.equal(expected, logits)
    grammar_output = GrammarOutput(req_ids=["d", "x", "b"], bitmask=bitmask.numpy().tobytes(), num_words=3)
    apply_grammar_bitmask(logits, rows, grammar_output)
    assert torch.equal(logits, expected)
    apply_grammar_bitmask(logits, rows, None)  # unconstrained steps are untouched
    assert torch.equal(logits, expected)


def test_same_spec_compiles_once(model, tokenizer):
    manager = StructuredOutputManager(model, len(tokenizer))
    try:
        for rid in ("a", "b"):
            manager.add_request(_request(rid, tokenizer, CHOICE))
        _wait_compiled(manager, "a", "b")
        size = manager._compiler.get_cache_size_bytes()
        manager.add_request(_request("c", tokenizer, StructuredOutputsParams(choice=["red", "green"])))
        _wait_compiled(manager, "c")
        assert manager._compiler.get_cache_size_bytes() == size
        manager.add_request(_request("d", tokenizer, StructuredOutputsParams(choice=["blue"])))
        _wait_compiled(manager, "d")
        assert manager._compiler.get_cache_size_bytes() > size
    finally:
        manager.shutdown()


def test_resumed_request_fast_forwards_and_each_token_is_accepted_once(model, tokenizer):
    manager = StructuredOutputManager(model, len(tokenizer))
    regex = StructuredOutputsParams(regex="[a-z]{2,8}")
    prior = tokenizer.encode("abc", add_special_tokens=False)
    try:
        request = _request("r", tokenizer, regex, output_token_ids=prior)
        manager.add_request(request)
        _wait_compiled(manager, "r")
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        reference = xgr.GrammarMatcher(xgr.GrammarCompiler(info, max_threads=1).compile_regex("[a-z]{2,8}"))
        assert all(reference.accept_token(t) for t in prior)
        assert torch.equal(
            _reference_mask(manager._grammars["r"].ready.result(), len(tokenizer)),
            _reference_mask(reference, len(tokenizer)),
        )
        # Calling again with no new token accepts nothing (no double advance).
        assert manager.accept_tokens(request) is False and manager._grammars["r"].num_accepted == len(prior)
        request.append_output_token(tokenizer.eos_token_id)
        assert manager.accept_tokens(request) is True
    finally:
        manager.shutdown()


def test_constrained_request_waits_for_its_grammar_then_stops_on_it(model, tokenizer):
    """While compiling, the request behind it is scheduled first; once the
    grammar terminates the request ends with "stop", even with ignore_eos."""
    manager = StructuredOutputManager(model, len(tokenizer))
    gate = threading.Event()
    compile_now = manager._make_matcher
    manager._make_matcher = lambda *args: gate.wait(30) and compile_now(*args)
    scheduler = _scheduler(manager)
    try:
        constrained = _request("c", tokenizer, CHOICE, ignore_eos=True)
        scheduler.add_request(constrained)
        scheduler.add_request(_request("free", tokenizer))
        first = scheduler.schedule()
        assert list(first.num_scheduled_tokens) == ["free"] and scheduler.waiting[0] is constrained
        assert scheduler.get_grammar_output(first) is None
        gate.set()
        _wait_compiled(manager, "c")
        second = scheduler.schedule()
        assert "c" in second.num_scheduled_tokens
        grammar_output = scheduler.get_grammar_output(second)
        assert grammar_output.req_ids == ["c"] and grammar_output.num_words == -(-len(tokenizer) // 32)
        tokens = tokenizer.encode("red", add_special_tokens=False) + [tokenizer.eos_token_id]
        runner_output = ModelRunnerOutput(req_ids=["c"], sampled_token_ids=[tokens])
        outputs = {o.request_id: o for o in scheduler.update_from_output(second, runner_output)}
        assert outputs["c"].finish_reason == "stop" and outputs["c"].new_token_ids == tokens
        assert not manager.is_constrained("c")  # its matcher went with it
    finally:
        manager.shutdown()


def test_grammar_that_fails_to_compile_fails_only_its_request(tokenizer, tmp_path):
    # No tokenizer there: compiling raises on the compiler thread, never in the step.
    manager = StructuredOutputManager(str(tmp_path), len(tokenizer))
    scheduler = _scheduler(manager)
    try:
        scheduler.add_request(_request("c", tokenizer, CHOICE))
        _wait_compiled(manager, "c")
        scheduler.add_request(_request("free", tokenizer))
        so = scheduler.schedule()
        assert list(so.num_scheduled_tokens) == ["free"]
        (failed,) = scheduler.take_outputs_outside_step()
        assert failed.request_id == "c" and failed.finish_reason == "error"
        assert failed.error.startswith("structured_outputs.choice:")
        assert "c" not in scheduler.requests and scheduler.has_unfinished_requests()
    finally:
        manager.shutdown()


def test_step_rows_prefill_chunks_and_tokens_in_flight(model, tokenizer):
    manager = StructuredOutputManager(model, len(tokenizer))
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=2, async_scheduling=True),
        CacheConfig(num_blocks=64),
        max_model_len=256,
        structured_output_manager=manager,
    )
    try:
        request = Request(
            "c",
            tokenizer.encode("Hello there, friend"),
            SamplingParams(structured_outputs=CHOICE),
            tokenizer.eos_token_id,
        )
        assert request.num_tokens > 2
        scheduler.add_request(request)
        _wait_compiled(manager, "c")
        chunk = scheduler.schedule()  # a prefill chunk: nothing sampled, no row
        assert scheduler.get_grammar_output(chunk) is None and not scheduler.needs_tokens_in_flight(chunk)
        while request.num_computed_tokens < request.num_tokens:
            last = scheduler.schedule()
        assert scheduler.get_grammar_output(last).req_ids == ["c"]
        # Async scheduling: the next step computes the token `last` samples.
        ahead = scheduler.schedule()
        assert scheduler.needs_tokens_in_flight(ahead)
        scheduler.update_from_output(last, ModelRunnerOutput(["c"], [[tokenizer.convert_tokens_to_ids("r")]]))
        assert not scheduler.needs_tokens_in_flight(ahead)
        assert scheduler.get_grammar_output(ahead).req_ids == ["c"]
    finally:
        manager.shutdown()


class _StoppedClock:
    """A clock that moves only when the test says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_grammar_past_its_deadline_fails_its_request_while_another_compiles(model, tokenizer):
    clock = _StoppedClock()
    manager = StructuredOutputManager(model, len(tokenizer), compile_timeout_s=30, clock=clock)
    stuck, release = threading.Event(), threading.Event()
    compile_now = manager._make_matcher

    def compile_or_block(spec, prior):
        if "slow" in spec.text:  # a grammar that never finishes compiling (until the test ends)
            stuck.set()
            release.wait(60)
        return compile_now(spec, prior)

    manager._make_matcher = compile_or_block
    scheduler = _scheduler(manager)
    try:
        scheduler.add_request(_request("slow", tokenizer, StructuredOutputsParams(choice=["slow"]), ignore_eos=True))
        assert stuck.wait(30)
        scheduler.add_request(_request("fast", tokenizer, CHOICE, ignore_eos=True))
        _wait_compiled(manager, "fast")  # another worker compiles it meanwhile
        first = scheduler.schedule()
        assert list(first.num_scheduled_tokens) == ["fast"] and not scheduler.take_outputs_outside_step()
        clock.now = 31.0  # past the slow one's deadline
        tokens = tokenizer.encode("red", add_special_tokens=False) + [tokenizer.eos_token_id]
        outputs = scheduler.update_from_output(first, ModelRunnerOutput(req_ids=["fast"], sampled_token_ids=[tokens]))
        assert [(o.request_id, o.finish_reason) for o in outputs] == [("fast", "stop")]
        scheduler.schedule()
        (failed,) = scheduler.take_outputs_outside_step()
        assert failed.request_id == "slow" and failed.finish_reason == "error"
        assert failed.error == "structured_outputs.choice: grammar too complex: not compiled within 30 s"
        assert not scheduler.has_unfinished_requests() and not manager.is_constrained("slow")
        # The abandoned compilation's worker was replaced: grammars still compile.
        manager.add_request(_request("later", tokenizer, StructuredOutputsParams(choice=["blue"])))
        _wait_compiled(manager, "later")
        assert manager._grammars["later"].ready.exception() is None
    finally:
        release.set()
        manager.shutdown()


def test_a_queued_grammar_has_no_deadline_yet(model, tokenizer):
    """The deadline counts from when a worker starts on a grammar: waiting
    behind others is not the grammar's fault."""
    clock = _StoppedClock()
    manager = StructuredOutputManager(model, len(tokenizer), compile_timeout_s=30, clock=clock)
    release, started = threading.Event(), threading.Semaphore(0)

    def block(spec, prior):
        started.release()
        release.wait(60)

    manager._make_matcher = block
    try:
        rids = [f"r{i}" for i in range(_COMPILE_WORKERS + 2)]
        for rid in rids:
            manager.add_request(_request(rid, tokenizer, CHOICE))
        for _ in range(_COMPILE_WORKERS):  # every worker busy, two requests queued behind them
            assert started.acquire(timeout=30)
        running = {rid for rid in rids if manager._grammars[rid].started is not None}
        assert len(running) == _COMPILE_WORKERS
        clock.now = 31.0
        assert {rid for rid, _ in manager.failed_requests()} == running
    finally:
        release.set()
        manager.shutdown()


class _FixedDraft:
    """A proposer whose draft the test sets."""

    def __init__(self):
        self.draft: list[int] = []

    def propose(self, request, max_tokens: int) -> list[int]:
        return self.draft[:max_tokens]

    def request_finished(self, request) -> None:
        pass


def test_a_constrained_draft_is_cut_at_its_first_forbidden_token_and_masked_per_position(model, tokenizer):
    """Speculative decoding: a draft is cut before the first token its grammar
    forbids (and before the grammar's end); its bitmask has a row per
    verified position, row j the mask after the draft's first j tokens; the
    matcher, advanced over the draft and rolled back, then takes the
    committed tokens."""
    from raylm.config import SpeculativeConfig
    from raylm.core.spec_decode import Speculator
    from raylm.worker.sampler import apply_draft_grammar_bitmask

    manager = StructuredOutputManager(model, len(tokenizer))
    proposer = _FixedDraft()
    speculator = Speculator(SpeculativeConfig.from_setting({"num_speculative_tokens": 4}), None, proposer)
    scheduler = Scheduler(
        SchedulerConfig(num_scheduler_steps=1),
        CacheConfig(num_blocks=64),
        max_model_len=256,
        structured_output_manager=manager,
        speculator=speculator,
    )
    a, b, c, d, e, upper = tokenizer.convert_tokens_to_ids(["a", "b", "c", "d", "e", "Z"])
    eos = tokenizer.eos_token_id
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_regex("[a-z]{1,6}")
    try:
        request = _request("c", tokenizer, StructuredOutputsParams(regex="[a-z]{1,6}"), temperature=0.0)
        scheduler.add_request(request)
        _wait_compiled(manager, "c")
        so = scheduler.schedule()  # the prompt: no draft
        scheduler.update_from_output(so, ModelRunnerOutput(["c"], [[a]]))

        proposer.draft = [b, c, upper, d]
        so = scheduler.schedule()
        assert so.spec_token_ids == {"c": [b, c]} and so.num_scheduled_tokens == {"c": 3}
        grammar_output = scheduler.get_grammar_output(so)
        assert grammar_output.req_ids == ["c"] and grammar_output.num_rows == [3]
        rows = torch.frombuffer(bytearray(grammar_output.bitmask), dtype=torch.int32).view(3, -1)
        reference = xgr.GrammarMatcher(compiled)
        for j, token_id in enumerate([a, b, c]):
            assert reference.accept_token(token_id)
            assert torch.equal(rows[j : j + 1], _reference_mask(reference, len(tokenizer))), j
        # The workers mask verification row j with grammar row j.
        logits = torch.randn(3, len(tokenizer), generator=torch.Generator().manual_seed(0))
        expected = logits.clone()
        xgr.apply_token_bitmask_inplace(expected, rows.clone(), vocab_size=len(tokenizer))
        apply_draft_grammar_bitmask(logits, [("c", 0, 3)], grammar_output)
        assert torch.equal(logits, expected)

        # Row 1 rejects the draft's c: d committed instead; the matcher takes a, b, d.
        scheduler.update_from_output(so, ModelRunnerOutput(["c"], [[b, d]]))
        assert request.output_token_ids == [a, b, d] and not request.is_finished
        reference = xgr.GrammarMatcher(compiled)
        assert all(reference.accept_token(t) for t in [a, b, d])
        matcher = manager._grammars["c"].ready.result()
        assert torch.equal(_reference_mask(matcher, len(tokenizer)), _reference_mask(reference, len(tokenizer)))

        # A draft through the grammar's end stops before it.
        proposer.draft = [e, eos, a]
        so = scheduler.schedule()
        assert so.spec_token_ids == {"c": [e]}
        assert scheduler.get_grammar_output(so).num_rows == [2]
        stats = scheduler.stats()
        assert stats["spec_decode_num_drafts"] == 1 and stats["spec_decode_num_accepted_tokens"] == 1
        assert "structured_output" not in stats["spec_decode_steps_aside_by_reason"]
    finally:
        manager.shutdown()


def test_a_draft_model_steps_aside_for_constrained_requests():
    """Its tokens are written in the workers, after the grammar rows are built."""
    from raylm.config import SpeculativeConfig
    from raylm.core.spec_decode import Speculator

    config = SpeculativeConfig.from_setting({"method": "draft_model", "model": "x", "num_speculative_tokens": 2})
    speculator = Speculator(config, None)
    speculator.begin_step(1)
    request = Request("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8), None)
    assert speculator.draft(request, True, 256, 64) == []
    assert len(speculator.draft(request, False, 256, 64)) == 2
    speculator.end_step()
    assert speculator.stats.steps_aside_by_reason == {"structured_output": 1}


def test_a_draft_before_the_grammars_start_stops_before_the_token_that_starts_it(model, tokenizer):
    """A reasoning model's thinking is free: its draft is kept up to the
    token that ends the thinking (the rows after it would need the grammar)."""
    q, x, y, a = tokenizer.convert_tokens_to_ids(["q", "x", "y", "a"])
    manager = StructuredOutputManager(model, len(tokenizer))
    try:
        so = StructuredOutputsParams(regex="[a-z]{1,6}", starts_after_token_ids=[x, y])
        request = _request("r", tokenizer, so, output_token_ids=[q, x])
        manager.add_request(request)
        _wait_compiled(manager, "r")
        assert manager.fit_draft(request, [y, a]) == []
        assert manager.fit_draft(request, [q, x, y, a]) == [q, x]
        assert manager.fit_draft(request, [q, q, a]) == [q, q, a]
        assert not manager._grammars["r"].started_output and manager._grammars["r"].num_accepted == 2
    finally:
        manager.shutdown()
