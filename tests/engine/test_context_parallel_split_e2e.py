"""Context parallelism (issue 26) end to end with a split prefill chunk: a
chunk of >= 16 tokens per CP rank is computed half by each rank
(raylm.model.layers.cp_prefill) and still composes with structured outputs,
pipeline stages and the failure model's recovery.

Every engine here runs 64-token steps, so the 150-token prompt is prefilled
over three steps, its chunks of >= 32 tokens split over CP=2. The workers'
row counts prove the split happened and that each rank ran its share only."""

from __future__ import annotations

import json
import os
import random
import signal

import pytest

from raylm import LLM, SamplingParams
from raylm.model.arch_config import ArchConfig
from raylm.sampling_params import StructuredOutputsParams
from raylm.testing.hf_oracle import hf_greedy
from tests.conftest import executor_of, process_gone
from tests.engine.test_context_parallel import GREEDY, MAX_TOKENS, _bytes_per_block

BLOCKS_PER_RANK = 16  # the per-rank KV budget in blocks of 16 tokens (float32)
STEP_TOKENS = 64


def _engine(model: str, blocks: int = BLOCKS_PER_RANK, **extra) -> LLM:
    return LLM(
        model,
        dtype="float32",
        num_threads=1,
        kv_cache_memory_bytes=blocks * _bytes_per_block(model),
        max_model_len=200,
        max_num_batched_tokens=STEP_TOKENS,
        **extra,
    )


def _rank_split_rows(worker) -> tuple[int, int]:
    counts = worker.model_runner.row_counts
    return counts.split_computed, counts.split_scheduled


def _split_rows(llm: LLM) -> list[tuple[int, int]]:
    """(split rows the rank computed, split rows scheduled) of every rank, in rank order."""
    return [tuple(c) for c in executor_of(llm).collective_rpc(_rank_split_rows)]


def _assert_shared_out(split: list[tuple[int, int]]) -> None:
    """A CP group's ranks saw the same split rows (at least one 64-token
    step's worth) and computed each exactly once, about half each."""
    scheduled = {s for _, s in split}
    assert len(scheduled) == 1 and scheduled.pop() >= STEP_TOKENS - 16
    assert sum(c for c, _ in split) == split[0][1]
    assert all(0.4 < c / s < 0.6 for c, s in split)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    # GQA (2 kv heads for 4 query heads), as in test_context_parallel.
    return tiny_model_dir("qwen2", num_key_value_heads=2)


@pytest.fixture(scope="module")
def prompts(model) -> dict[str, list[int]]:
    rng = random.Random(2)
    vocab = ArchConfig.from_model_dir(model).vocab_size
    return {"long": [rng.randrange(vocab) for _ in range(150)], "short": [rng.randrange(vocab) for _ in range(9)]}


@pytest.fixture(scope="module")
def reference(model, prompts) -> dict[str, list[int]]:
    return dict(zip(prompts, (r.token_ids for r in hf_greedy(model, list(prompts.values()), MAX_TOKENS))))


@pytest.mark.slow
def test_json_schema_request_under_cp2_equals_cp1(model, prompts):
    """A greedy json_schema request whose prompt is split over CP=2: the
    grammar's mask is applied to the row rank 0 gathered, so the tokens equal
    one rank's (which holds the same KV in one cache) and form the schema's JSON."""
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["colour", "ok"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        temperature=0,
        max_tokens=40,
        structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
    )
    requests = [{"prompt_token_ids": prompts["long"]}, {"prompt_token_ids": prompts["short"]}]
    with _engine(model, blocks=2 * BLOCKS_PER_RANK) as one:
        expected = [o.outputs[0] for o in one.generate(requests, params, use_tqdm=False)]
    llm = _engine(model, context_parallel_size=2, distributed_executor_backend="mp")
    try:
        got = [o.outputs[0] for o in llm.generate(requests, params, use_tqdm=False)]
        split = _split_rows(llm)
        pids = executor_of(llm).worker_pids
    finally:
        llm.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for out in got:
        assert out.finish_reason == "stop"
        value = json.loads(out.text)
        assert value["colour"] in schema["properties"]["colour"]["enum"] and isinstance(value["ok"], bool)
    _assert_shared_out(split)
    assert all(process_gone(p) for p in pids)


@pytest.mark.slow
def test_split_chunk_under_pp2_x_cp2_equals_hf(model, prompts, reference):
    """Two stages of a CP=2 group: each stage's CP rank computes and passes on
    only its half of a split chunk (the next stage's same CP rank receives it),
    and the last stage's rank 0 samples. A short prompt runs beside the long
    one's first chunk."""
    keys = ["long", "short"]
    llm = _engine(model, context_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="mp")
    try:
        outs = llm.generate([{"prompt_token_ids": prompts[k]} for k in keys], GREEDY, use_tqdm=False)
        split = _split_rows(llm)
        pids = executor_of(llm).worker_pids
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [reference[k] for k in keys]
    # Ranks 0, 1 (stage 0, cp 0 and 1) and 2, 3 (stage 1): each stage's pair shares out every split row.
    _assert_shared_out(split[:2])
    _assert_shared_out(split[2:])
    assert len(pids) == 4 and all(process_gone(p) for p in pids)


@pytest.mark.slow
def test_cp_rank_killed_between_split_chunks_is_recovered(model, prompts, reference):
    """CP rank 1 dies after the long prompt's first split chunk (half of its
    rows and KV were on that rank) while the short request decodes: the
    executor is rebuilt, both requests recompute, and each completes with the
    tokens of an uninterrupted greedy run."""
    from raylm.engine.protocol import RecoveryKind
    from tests.engine.test_recovery import _executor_traces, assert_gone

    llm = _engine(model, context_parallel_size=2, distributed_executor_backend="mp")
    try:
        engine, core = llm.llm_engine, llm.llm_engine.engine_core.engine_core
        old = executor_of(llm)
        old_traces = _executor_traces(old)
        for rid in ("short", "long"):  # step 1: the short prompt beside the long one's first (split) chunk
            engine.add_request(rid, {"prompt_token_ids": prompts[rid]}, GREEDY)
        results, struck = {}, False
        while engine.has_unfinished_requests():
            for output in engine.step():
                results[output.request_id] = output
            long = core.scheduler.requests.get("long")
            if not struck and long is not None and 0 < long.num_computed_tokens < len(prompts["long"]):
                split_before = _split_rows(llm)
                os.kill(old.worker_pids[1], signal.SIGKILL)
                struck = True
        assert struck
        assert {rid: results[rid].outputs[0].token_ids for rid in ("long", "short")} == reference
        assert [e.kind for e in core.recoveries] == [RecoveryKind.WORKER_DIED]
        assert split_before[0][1] >= STEP_TOKENS - len(prompts["short"])  # a split chunk ran before the kill
        assert_gone(old_traces)
        new_traces = _executor_traces(executor_of(llm))
    finally:
        llm.shutdown()
    assert_gone(new_traces)
