"""A request with a LoRA adapter keeps it when it moves (issue 53, item 4):
migrated live to another data-parallel replica mid-stream, or sent again
after its replica was killed, it goes on with its adapter on a core that
never read it, and its greedy tokens equal Hugging Face + PEFT's."""

from __future__ import annotations

import os
import signal

import pytest

from raylm import LLM, SamplingParams
from raylm.testing.lora_oracle import peft_greedy
from tests.conftest import STRAGGLER_TOKEN, straggling, wait_until
from tests.engine.test_migration import _read_one
from tests.engine.test_start_deadlines import _children
from tests.lora.conftest import lora_requests

pytestmark = pytest.mark.slow  # two engine-core processes, a kill and a restart

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Behind the straggler's token (each step holding one takes 20 ms): the moves
# land while the requests still run, however fast the machine decodes.
PROMPTS = [[STRAGGLER_TOKEN] + [(11 * i + j) % 250 + 3 for j in range(6 + 5 * i)] for i in range(3)]
ADAPTERS = ("all", "mlp", None)  # the request of PROMPTS[i] runs with ADAPTERS[i]


@pytest.fixture(scope="module")
def expected(tiny_model_dir, tiny_adapters) -> list[list[int]]:
    model, adapters = tiny_model_dir("llama"), tiny_adapters("llama")
    return [
        peft_greedy(model, None if name is None else adapters[name], [p], MAX_TOKENS)[0].token_ids
        for name, p in zip(ADAPTERS, PROMPTS)
    ]


@pytest.fixture
def llm(tiny_model_dir, monkeypatch):
    straggling(monkeypatch)
    before = _children()
    with LLM(
        tiny_model_dir("llama"),
        dtype="float32",
        data_parallel_size=2,
        data_parallel_backend="mp",
        num_threads=1,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        kv_cache_memory_bytes=16 << 20,
        num_scheduler_steps=1,
    ) as llm:
        yield llm
    wait_until(lambda: not (_children() - before), 30, message=lambda: f"processes left: {_children() - before}")


def _run(llm: LLM, tiny_adapters, action) -> dict[str, list[int]]:
    """The three requests, pinned to core 1, each with its adapter, stepped
    to the end; `action(supervisor)` once each has a few tokens."""
    engine, supervisor = llm.llm_engine, llm.llm_engine.engine_core
    loras = lora_requests(tiny_adapters("llama"))
    for i, (name, prompt) in enumerate(zip(ADAPTERS, PROMPTS)):
        lora = None if name is None else loras[name]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY, data_parallel_rank=1, lora_request=lora)
    done, acted = {}, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = list(out.outputs[0].token_ids)
        ledger = supervisor.ledger
        if not acted and all(str(i) in ledger and len(ledger[str(i)].token_ids) >= 3 for i in range(3)):
            action(supervisor)
            acted = True
    assert acted, "a request ended before the action"
    return done


def test_migrated_requests_keep_their_adapters(llm, tiny_adapters, expected):
    supervisor = llm.llm_engine.engine_core

    def move_all(sup) -> None:
        for rid in ("0", "1", "2"):
            assert sup.ledger[rid].channel == 1
            assert sup.migrate(rid, 0)

    done = _run(llm, tiny_adapters, move_all)
    assert [done[str(i)] for i in range(3)] == expected
    assert supervisor.migration_counts["migrated"] == 3


def test_requests_of_a_killed_replica_go_on_with_their_adapters(llm, tiny_adapters, expected):
    supervisor = llm.llm_engine.engine_core

    def kill_core_1(sup) -> None:
        os.kill(sup.launcher._processes[1].pid, signal.SIGKILL)

    done = _run(llm, tiny_adapters, kill_core_1)
    assert [done[str(i)] for i in range(3)] == expected
    wait_until(
        lambda: len(supervisor.channels) == 2,
        120,
        step=lambda: _read_one(supervisor),
        message="the killed core's replacement",
    )
