"""Poison requests (docs/architecture.md, "The failure model"; raylm.core.quarantine): a
request that kills, hangs or breaks the process running the model is found
and failed, alone, while every other request completes with the output of a
run without it, and the engine stays healthy with its restart budget intact.

Faults come from the RAYLM_FAULT_INJECTION hook (raylm.worker.fault_injection):
the worker of the highest rank does ACTION on any step that holds a request
whose prompt contains POISON. Each poison request is submitted together with
the good ones, so it strikes while they are in flight.
"""

from __future__ import annotations

import asyncio

import pytest

from raylm import LLM, SamplingParams
from raylm.config import create_engine_config
from raylm.core import quarantine
from raylm.core.request import Request
from raylm.engine.async_llm import AsyncLLM
from raylm.engine.errors import RequestFailedError
from raylm.engine.protocol import RecoveryKind
from raylm.testing.hf_oracle import hf_greedy
from raylm.worker.fault_injection import ENV_VAR, FaultInjector, FaultSpec, InjectedFault
from tests.conftest import executor_of
from tests.engine.test_recovery import _executor_traces, assert_gone

NUM_GOOD = 16
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
GOOD = [[(7 * i + j) % 250 + 3 for j in range(1 + 3 * i)] for i in range(NUM_GOOD)]
POISON = 700
POISONED = [5, 6, POISON, 7]

# Each fault the hook injects, and the kind of recovery the core reports for it.
ACTIONS_AND_KINDS = [
    ("kill", RecoveryKind.WORKER_DIED),
    ("hang", RecoveryKind.WORKER_HUNG),
    ("raise", RecoveryKind.STEP_ERROR),
]


def _step_deadline(action: str) -> float:
    """The step deadline: a hang is waited out three times (batched twice,
    then alone), so it is short there, yet far above a step of the tiny model
    on a busy machine; the other faults keep the deadline they were tested
    with (a death is noticed before it, whatever the machine's speed)."""
    return 3 if action == "hang" else 5


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", num_key_value_heads=2)


@pytest.fixture(scope="module")
def reference(model):
    return [r.token_ids for r in hf_greedy(model, GOOD, MAX_TOKENS)]


def _llm(model, backend, tp=1, **kwargs) -> LLM:
    return LLM(
        model,
        dtype="float32",
        tensor_parallel_size=tp,
        distributed_executor_backend=backend,
        num_threads=1,
        kv_cache_memory_bytes=16 << 20,
        **kwargs,
    )


def _core(llm: LLM):
    return llm.llm_engine.engine_core.engine_core


def _prompts(poison_at: int) -> list[dict]:
    prompts = [{"prompt_token_ids": p} for p in GOOD]
    prompts.insert(poison_at, {"prompt_token_ids": POISONED})
    return prompts


def _generate_past_the_poison(llm: LLM, poison_at: int, reference, kind: str):
    """Serve the good requests with the poison at `poison_at`; check that it is
    failed alone after three recoveries of `kind` (batched twice, then alone)
    and that the budget is whole. Returns the engine core."""
    _check_outputs(llm.generate(_prompts(poison_at), GREEDY, use_tqdm=False), poison_at, reference)
    core = _core(llm)
    assert [e.kind for e in core.recoveries] == [kind] * 3
    assert [len(e.culprits) for e in core.recoveries] == [0, 0, 1]
    assert not core.scheduler.quarantined and core.unhealthy_reason is None
    assert core.restart_budget.num_recent == 0  # the culprit's doing, forgiven
    return core


def _check_outputs(outputs, poison_at: int, reference) -> None:
    bad = outputs.pop(poison_at).outputs[0]
    assert bad.finish_reason == "error" and "failed again running alone" in bad.error
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


# ---- the rules, on their own ------------------------------------------------------------


def _requests(n: int) -> list[Request]:
    return [Request(str(i), [1, 2], SamplingParams(), None) for i in range(n)]


def test_two_recoveries_quarantine_and_a_lone_repeat_is_the_culprit():
    first, second, third = _requests(3)
    verdict = quarantine.charge([first, second, third])
    assert verdict.charged == ["0", "1", "2"] and not verdict.found_culprit
    assert not any(r.quarantined for r in (first, second, third))
    quarantine.charge([first, second])
    assert first.quarantined and second.quarantined and not third.quarantined
    verdict = quarantine.charge([second])  # quarantined, alone, failed again
    assert verdict.culprits == ["1"] and verdict.culprit_recoveries == 2 and not verdict.charged
    assert quarantine.release([first, third]) == ["0", "2"]
    assert (first.num_recoveries, first.quarantined, third.num_recoveries) == (0, False, 0)


def test_a_lone_first_failure_is_retried_alone_once():
    (request,) = _requests(1)
    assert not quarantine.charge([request]).found_culprit and request.quarantined
    assert quarantine.charge([request]).culprits == ["0"]


def test_fault_specs_parse_and_typos_are_refused():
    assert FaultSpec.parse("kill:token=7") == FaultSpec("kill", 7, None)
    assert FaultSpec.parse("hang:token=7:rank=0") == FaultSpec("hang", 7, 0)
    assert FaultSpec.parse("slow:token=7:ms=5") == FaultSpec("slow", 7, None, delay_ms=5)
    for bad in (
        "explode:token=1",
        "kill",
        "kill:tok=1",
        "raise:token=x",
        "raise:token=1:rank",
        "slow:token=7",
        "slow:token=7:ms=0",
        "kill:token=7:ms=5",
    ):
        with pytest.raises(ValueError, match=ENV_VAR):
            FaultSpec.parse(bad)
    assert not FaultInjector(FaultSpec("raise", 7), rank=0, world_size=2).armed  # default: the highest rank
    assert FaultInjector(FaultSpec("raise", 7, rank=0), rank=0, world_size=2).armed


# ---- offline: the engine core recovers in place ---------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("action, kind", ACTIONS_AND_KINDS)
def test_mp_tp2_poison_is_failed_alone_and_the_rest_complete(monkeypatch, model, reference, action, kind):
    monkeypatch.setenv(ENV_VAR, f"{action}:token={POISON}")
    poison_at = 5
    llm = _llm(model, "mp", tp=2, execute_model_timeout=_step_deadline(action))
    try:
        _generate_past_the_poison(llm, poison_at, reference, kind)
        traces = _executor_traces(executor_of(llm))
        # Still serving, at full batch.
        again = llm.generate([{"prompt_token_ids": p} for p in GOOD[:4]], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == reference[:4]
    finally:
        llm.shutdown()
    assert_gone(traces)


@pytest.mark.parametrize("action, kind", ACTIONS_AND_KINDS)
def test_ray_tp2_poison_is_failed_alone(monkeypatch, ray_session, model, reference, action, kind):
    monkeypatch.setenv(ENV_VAR, f"{action}:token={POISON}")
    poison_at = NUM_GOOD  # last: every good request runs alone before it
    llm = _llm(model, "ray", tp=2, execute_model_timeout=_step_deadline(action))
    try:
        _generate_past_the_poison(llm, poison_at, reference, kind)
        traces = _executor_traces(executor_of(llm))
    finally:
        llm.shutdown()
    assert_gone(traces)


def test_uni_poison_that_raises_is_failed_alone_among_16(monkeypatch, model, reference):
    monkeypatch.setenv(ENV_VAR, f"raise:token={POISON}")
    poison_at = 7
    llm = _llm(model, "uni")
    try:
        _generate_past_the_poison(llm, poison_at, reference, RecoveryKind.STEP_ERROR)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_ten_poison_requests_in_a_row_leave_the_budget_whole(monkeypatch, model, reference):
    monkeypatch.setenv(ENV_VAR, f"raise:token={POISON}")
    llm = _llm(model, "uni")  # default budget: 3 restarts within 600 s
    try:
        for round_ in range(10):
            poison_at = round_ % 3
            prompts = [{"prompt_token_ids": p} for p in GOOD[:2]]
            prompts.insert(poison_at, {"prompt_token_ids": POISONED})
            outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
            _check_outputs(outputs, poison_at, reference[:2])
        core = _core(llm)
        assert all(e.kind == RecoveryKind.STEP_ERROR for e in core.recoveries)
        assert sum(len(e.culprits) for e in core.recoveries) == 10
        assert core.restart_budget.num_recent == 0 and core.unhealthy_reason is None
    finally:
        llm.shutdown()


def test_blamed_recoveries_past_the_rate_make_the_engine_unhealthy(monkeypatch, model, reference):
    monkeypatch.setenv(ENV_VAR, f"raise:token={POISON}")
    llm = _llm(model, "uni")
    core = _core(llm)
    core.blame._blamed.max_restarts = 1  # the rate, as if the window were nearly full already
    try:
        outputs = llm.generate([{"prompt_token_ids": POISONED}], GREEDY, use_tqdm=False)
        assert outputs[0].outputs[0].finish_reason == "error"
        assert "blamed on requests" in core.unhealthy_reason
        assert core.restart_budget.num_recent > 0  # no longer forgiven
    finally:
        llm.shutdown()


# ---- online: the front end replaces a core process that died or hung -------------------------


async def _serve_all(engine: AsyncLLM, prompts: list[dict]) -> list:
    async def one(i: int, prompt: dict):
        try:
            final = None
            async for out in engine.generate(prompt, GREEDY, f"req-{i}", stream=False):
                final = out
            return final.outputs[0].token_ids
        except RequestFailedError as e:
            return e

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


@pytest.mark.slow
@pytest.mark.parametrize("action", ["kill", "hang"])
def test_uni_core_process_poison_is_failed_alone_online(monkeypatch, model, reference, action):
    """With the uni backend the model runs in the engine-core process: a kill
    ends it and a hang freezes it (the front end kills it past the step
    deadline); the front end blames the request the core ran alone."""
    monkeypatch.setenv(ENV_VAR, f"{action}:token={POISON}")
    poison_at = 3
    config = create_engine_config(
        model=model,
        dtype="float32",
        num_threads=1,
        kv_cache_memory_bytes=16 << 20,
        execute_model_timeout=3 if action == "hang" else 4,
    )
    engine = AsyncLLM(config)

    async def run() -> None:
        results = await _serve_all(engine, _prompts(poison_at))
        bad = results.pop(poison_at)
        assert isinstance(bad, RequestFailedError) and "failed again running alone" in str(bad)
        assert results == reference
        assert engine.restart_budget.num_recent == 0 and engine.blame.unhealthy_reason is None
        await engine.check_health()
        assert await _serve_all(engine, [{"prompt_token_ids": GOOD[0]}]) == reference[:1]

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    assert not engine.engine_core.is_alive()


def test_hook_raises_only_on_steps_with_the_token():
    from raylm.messages import NewRequestData, SchedulerOutput

    injector = FaultInjector(FaultSpec("raise", POISON), rank=0, world_size=1)

    def step(new, scheduled):
        return SchedulerOutput(
            [NewRequestData(r, p, [], SamplingParams(), [], 0) for r, p in new],
            [],
            {r: 1 for r in scheduled},
            len(scheduled),
        )

    injector.before_step(step([("a", [1, 2])], ["a"]))
    with pytest.raises(InjectedFault):
        injector.before_step(step([("b", [POISON])], ["a", "b"]))
    with pytest.raises(InjectedFault):  # known by id on later steps
        injector.before_step(step([], ["b"]))
    injector.before_step(step([], ["a"]))


# ---- data parallel: a replica that dies is healed, its requests resubmitted ------------------


@pytest.mark.parametrize("action", ["kill", "hang", "raise"])
def test_dp2_poison_is_failed_alone(monkeypatch, ray_session, model, reference, action):
    """Each replica runs its model in the replica actor (uni), so the poison
    kills or hangs replicas (the front end kills a replica silent past the
    step deadline), or breaks steps inside one; its record (charges,
    quarantine) travels with it to the other replica, and a replica running
    it alone names it through Ray."""
    from tests.engine.test_data_parallel import _assert_nothing_left

    monkeypatch.setenv(ENV_VAR, f"{action}:token={POISON}")
    poison_at = 2
    # A short step deadline for the hang (a replica is killed once silent for
    # that long); in-replica rebuilds (raise) may take longer than that here.
    llm = LLM(
        model,
        dtype="float32",
        data_parallel_size=2,
        num_threads=1,
        kv_cache_memory_bytes=16 << 20,
        execute_model_timeout=3 if action == "hang" else 300,
    )
    try:
        outputs = llm.generate(_prompts(poison_at), GREEDY, use_tqdm=False)
        _check_outputs(outputs, poison_at, reference)
        client = llm.llm_engine.engine_core
        assert client.restart_budget.num_recent == 0 and client.blame.unhealthy_reason is None
        again = llm.generate([{"prompt_token_ids": p} for p in GOOD[:4]], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == reference[:4]
        # The replicas it killed are replaced (then shut down with the others).
        wait_for(
            lambda: [r["state"] for r in client.replica_states()] == ["serving", "serving"],
            step=llm.llm_engine.step,
            within_s=120,
        )
    finally:
        llm.shutdown()
    _assert_nothing_left()


def wait_for(condition, step, within_s: float) -> None:
    import time

    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        step()
        time.sleep(0.1)
