"""Structured outputs with speculative decoding (raylm.core.spec_decode): a
constrained request drafts with n-gram lookup or suffix decoding, its draft
grammar-checked and each verified position masked by its grammar after the
draft's tokens before it, and its output equals decoding without
speculation token for token (greedy and seeded sampling), follows its
grammar, and drafts were made and accepted. The prompts quote the text the
grammar allows, and the grammars repeat themselves, so lookup finds drafts
even where the random model picks its own tokenization of that text."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import raylm.core.spec_decode as spec_decode
from raylm import LLM, SamplingParams
from raylm.core.scheduler import Scheduler
from raylm.sampling_params import StructuredOutputsParams
from tests.conftest import wait_until
from tests.engine.test_start_deadlines import _children

FOX = "quick brown fox"
SCHEMA = {
    "type": "object",
    "properties": {"animals": {"type": "array", "items": {"enum": [FOX]}, "minItems": 4, "maxItems": 4}},
    "required": ["animals"],
    "additionalProperties": False,
}
REGEX = rf"({FOX} ){{4}}(yes|no)"
CHOICES = [f"{FOX}, {FOX}, {FOX}", "lazy dog, lazy dog, lazy dog"]
# kind -> (constraint, the text quoted twice in its prompt)
KINDS = {
    "json": (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), json.dumps({"animals": [FOX] * 4})),
    "regex": (StructuredOutputsParams(regex=REGEX), f"{FOX} " * 4 + "yes"),
    "choice": (StructuredOutputsParams(choice=CHOICES), CHOICES[1]),
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SUFFIX = {**NGRAM, "method": "suffix"}


@pytest.fixture(autouse=True)
def _speculate_at_any_batch_size(monkeypatch):
    monkeypatch.setattr(spec_decode, "MAX_SPECULATIVE_BATCH", 64)


@pytest.fixture(autouse=True)
def verified(monkeypatch):
    """request id -> [draft tokens, accepted tokens], and each step's requests with a draft."""
    counts: dict[str, list[int]] = {}
    steps: list[set[str]] = []
    record = spec_decode.Speculator.record_verified
    make_output = Scheduler._make_output

    def record_verified(self, request, num_draft_tokens, num_committed):
        entry = counts.setdefault(request.request_id, [0, 0])
        entry[0] += num_draft_tokens
        entry[1] += min(num_committed - 1, num_draft_tokens)
        return record(self, request, num_draft_tokens, num_committed)

    def _make_output(self, *args, **kwargs):
        so = make_output(self, *args, **kwargs)
        steps.append(set(so.spec_token_ids))
        return so

    monkeypatch.setattr(spec_decode.Speculator, "record_verified", record_verified)
    monkeypatch.setattr(Scheduler, "_make_output", _make_output)
    return counts, steps


def _engine(model: str, speculative_config=None, **kwargs) -> LLM:
    kwargs.setdefault("distributed_executor_backend", "uni")
    return LLM(
        model,
        dtype="float32",
        kv_cache_memory_bytes=32 << 20,
        max_model_len=256,
        speculative_config=speculative_config,
        **kwargs,
    )


def _follows(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text)
    else:
        assert text in CHOICES


def _requests() -> list[tuple[str, str, SamplingParams]]:
    """(kind, prompt, params): each kind greedy and seeded."""
    return [
        (kind, f"{text}\n{text}\n", SamplingParams(temperature=t, seed=7, max_tokens=96, structured_outputs=so))
        for kind, (so, text) in KINDS.items()
        for t in (0.0, 0.8)
    ]


def _generate(llm: LLM, requests) -> list:
    results = llm.generate([prompt for _, prompt, _ in requests], [p for _, _, p in requests], use_tqdm=False)
    return [r.outputs[0] for r in results]


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    with _engine(tiny_model_dir("llama")) as llm:
        return [o.token_ids for o in _generate(llm, _requests())]


@pytest.mark.parametrize("config", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_constrained_requests_speculate_and_equal_plain_decoding(config, tiny_model_dir, plain, verified):
    counts, _ = verified
    requests = _requests()
    with _engine(tiny_model_dir("llama"), config) as llm:
        # Suffix decoding drafts from earlier outputs too: a second pass.
        passes = [_generate(llm, requests) for _ in range(2 if config is SUFFIX else 1)]
        stats = llm.llm_engine.stats()
    for outputs in passes:
        assert [o.token_ids for o in outputs] == plain
        for (kind, _, _), o in zip(requests, outputs):
            assert o.finish_reason == "stop", (kind, o.text)
            _follows(kind, o.text)
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert "structured_output" not in stats["spec_decode_steps_aside_by_reason"]
    # Every request (each kind, greedy and seeded) had drafts, and some of them accepted.
    assert len(counts) == len(requests) * len(passes)
    assert all(drafted > 0 and accepted > 0 for drafted, accepted in counts.values()), counts


def test_constrained_and_free_requests_speculate_together(tiny_model_dir, verified):
    counts, steps = verified
    model = tiny_model_dir("llama")
    so, text = KINDS["json"]
    prompts = [f"{text}\n{text}\n", [(11 * i) % 97 + 3 for i in range(9)] * 4]
    params = [
        SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=so),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    ]
    prompts[1] = {"prompt_token_ids": prompts[1]}
    with _engine(model) as llm:
        alone = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    with _engine(model, NGRAM) as llm:
        outputs = [r.outputs[0] for r in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in outputs] == alone
    _follows("json", outputs[0].text)
    # A step verified a draft of each, side by side.
    assert len(counts) == 2 and any(len(step) == 2 for step in steps)
    assert all(accepted > 0 for _, accepted in counts.values())


def test_two_tensor_parallel_workers_mask_drafts_alike(tiny_model_dir, plain, verified):
    """The drafts' grammar rows travel to both ranks (mp) in the step's
    message; the workers are gone after."""
    counts, _ = verified
    requests = _requests()
    before = _children()
    tp = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp", "num_threads": 1}
    with _engine(tiny_model_dir("llama"), NGRAM, **tp) as llm:
        outputs = _generate(llm, requests)
    wait_until(lambda: not (_children() - before), 30, message=lambda: f"processes left: {_children() - before}")
    assert [o.token_ids for o in outputs] == plain
    assert all(accepted > 0 for _, accepted in counts.values()) and len(counts) == len(requests)
