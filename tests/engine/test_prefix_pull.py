"""Prefix pulls (issue 49, item 3): a request sent to a core that holds
less of its prompt's cached prefix than another core finds that prefix
copied over before it starts, and computes only the rest; whatever dooms a
pull (the holder no longer has the blocks, the holder dies, the blocks
arrive broken), the request computes its whole prompt instead. Outputs
equal Hugging Face's greedy output every time (float32).

Each test pins a first request to core 1 (its prompt's blocks stay cached
there) and a second one, sharing the prefix, to core 0."""

from __future__ import annotations

import os
import signal

import pytest

from raylm import LLM, SamplingParams
from raylm.engine import pull_estimate
from raylm.engine.prefix_index import prompt_block_hashes
from raylm.engine.protocol import KVCacheEvents
from raylm.testing.hf_oracle import hf_greedy
from tests.engine.pinned import run_pinned

BLOCK = 16
PREFIX = [(13 * j) % 250 + 3 for j in range(96)]  # 6 blocks
FIRST, SECOND = PREFIX + [7, 8], PREFIX + [9, 10, 11]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _engine(model: str) -> LLM:
    return LLM(
        model,
        dtype="float32",
        data_parallel_size=2,
        data_parallel_backend="mp",
        num_threads=1,
        kv_cache_memory_bytes=16 << 20,
    )


def _run(llm: LLM, outputs: dict, rid: str, prompt: list[int], rank: int) -> None:
    run_pinned(llm, outputs, rid, prompt, rank, GREEDY)


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,network", [("llama", False), ("qwen3", False), ("qwen2", True)], ids=["llama", "qwen3", "qwen2-network"]
)
def test_a_prefix_is_pulled_to_the_chosen_core(tiny_model_dir, monkeypatch, arch, network):
    if network:  # the sealed network path (each rank's K/V server), as across nodes
        monkeypatch.setenv("RAYLM_MIGRATION_NETWORK", "1")
    model = tiny_model_dir(arch)
    outputs: dict[str, list[int]] = {}
    with _engine(model) as llm:
        sup = llm.llm_engine.engine_core
        _run(llm, outputs, "first", FIRST, rank=1)
        hits_before = sup.channels[0].stats.prefix_cache_hits if sup.channels[0].stats else 0
        _run(llm, outputs, "second", SECOND, rank=0)
        assert sup.pulls.counts["ok"] == 1, dict(sup.pulls.counts)
        assert sup.pulls.bytes_pulled > 0
        assert sup.pulls.cpu_seconds > 0  # the ranks' copies, counted apart
        # Core 0 computed none of the prefix: its blocks were found cached there.
        assert sup.channels[0].stats.prefix_cache_hits - hits_before == len(PREFIX) // BLOCK * BLOCK
        # The index saw core 0 store them (its own hashes): both hold the prefix now.
        hashes = prompt_block_hashes(PREFIX, BLOCK)
        assert sup.prefix_index.matched_blocks(hashes, [0, 1]) == {0: 6, 1: 6}
        assert len(sup.pulls) == 0
    assert [outputs["first"], outputs["second"]] == [r.token_ids for r in hf_greedy(model, [FIRST, SECOND], 6)]


@pytest.mark.slow
def test_blocks_gone_from_the_holder_mean_the_request_computes_its_prompt(tiny_model_dir):
    """The index says core 1 holds a prefix it does not (evicted between the
    lookup and the export, as far as the pull can tell): the holder answers
    `missing`, and the request computes its prompt on core 0."""
    model = tiny_model_dir("llama")
    outputs: dict[str, list[int]] = {}
    other = [(7 * j) % 250 + 3 for j in range(96)] + [5, 6]
    with _engine(model) as llm:
        sup = llm.llm_engine.engine_core
        sup.prefix_index.apply(1, KVCacheEvents(stored=prompt_block_hashes(other[:96], BLOCK)))
        _run(llm, outputs, "other", other, rank=0)
        assert sup.pulls.counts["missing"] == 1 and sup.pulls.counts["ok"] == 0, dict(sup.pulls.counts)
        assert len(sup.pulls) == 0
    assert outputs["other"] == hf_greedy(model, [other], 6)[0].token_ids


@pytest.mark.slow
def test_a_holder_that_dies_before_it_exports_leaves_the_request_to_compute(tiny_model_dir, monkeypatch):
    """The holder is stopped (SIGSTOP) before it can export, then killed:
    the pull falls back when its channel is removed (not at a timeout: that
    is set far off), and the request computes its prompt on core 0."""
    monkeypatch.setattr(pull_estimate, "EXPORT_TIMEOUT_S", 600.0)
    model = tiny_model_dir("llama")
    outputs: dict[str, list[int]] = {}
    with _engine(model) as llm:
        sup = llm.llm_engine.engine_core
        _run(llm, outputs, "first", FIRST, rank=1)
        holder = sup.launcher._processes[1].pid
        os.kill(holder, signal.SIGSTOP)
        llm.llm_engine.add_request("second", {"prompt_token_ids": SECOND}, GREEDY, data_parallel_rank=0)
        assert len(sup.pulls) == 1
        os.kill(holder, signal.SIGKILL)
        while llm.llm_engine.has_unfinished_requests():
            for out in llm.llm_engine.step():
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        assert sup.pulls.counts["holder_gone"] == 1 and sup.pulls.counts["ok"] == 0, dict(sup.pulls.counts)
    assert [outputs["first"], outputs["second"]] == [r.token_ids for r in hf_greedy(model, [FIRST, SECOND], 6)]


@pytest.mark.parametrize("outcome", ["ok", "timeout"])
def test_pull_metrics(outcome):
    """A pull's end, as the supervisor passes it up, in the server's metrics."""
    from raylm.engine.protocol import PullStats
    from raylm.entrypoints.openai.metrics import PrometheusStatLogger

    logger = PrometheusStatLogger("m")
    logger.record_pull(PullStats(outcome, 4096, 0.02 if outcome == "ok" else None, 0.25))
    text = logger.render().decode()
    assert f'raylm:kv_pulls_total{{engine="0",model_name="m",outcome="{outcome}"}} 1.0' in text
    assert 'raylm:kv_pull_bytes_total{engine="0",model_name="m"} 4096.0' in text
    assert 'raylm:kv_pull_cpu_seconds_total{engine="0",model_name="m"} 0.25' in text
    assert f'raylm:kv_pull_seconds_count{{engine="0",model_name="m"}} {1.0 if outcome == "ok" else 0.0}' in text
