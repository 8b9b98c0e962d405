"""Prefill/decode disaggregation on local data parallelism (issue 50's first
step, raylm.engine.handoff): `-dp 2 --prefill-replicas 1` with the mp
backend, one engine for the module. New requests are prefilled on replica
0 and handed, after their first token, to replica 1 in one final migration
stage over the shared-memory files; greedy outputs equal Hugging Face's.
What ends with its first token, or asks for prompt logprobs, stays on the
prefill replica; a decode replica killed mid-stream costs no request. The
hand-offs are asserted by their counts, never by a time; nothing (process,
transfer folder) is left after the engine. Short prompts stay on the
decode replica (`--pd-min-prompt-tokens`); each role runs with its own
threads per worker (`--prefill-num-threads`); an abort mid-hand-off frees both
replicas' blocks; and an async engine of its own scales the two pools apart
(`AsyncLLM.scale_roles`, as the per-role autoscaler does)."""

from __future__ import annotations

import os
import signal

import pytest

from raylm import LLM, SamplingParams
from raylm.testing.hf_oracle import hf_greedy
from tests.conftest import straggling, wait_until
from tests.engine.test_data_parallel import (  # noqa: F401 (module fixtures)
    GREEDY,
    MAX_TOKENS,
    PROMPTS,
    model,
    reference,
)
from tests.engine.test_start_deadlines import _children

pytestmark = pytest.mark.slow


# One prefill and one decode replica, as local processes, each role with
# its own torch threads per worker (--prefill-num-threads; the decode
# replica takes --num-threads).
PD_ENGINE = dict(
    dtype="float32",
    data_parallel_size=2,
    data_parallel_backend="mp",
    prefill_replicas=1,
    pd_min_prompt_tokens=0,  # every prompt handed off (one test sets a threshold)
    num_threads=1,
    prefill_num_threads=2,
    kv_cache_memory_bytes=16 << 20,
)


@pytest.fixture(scope="module")
def pd_llm(model):  # noqa: F811 (the fixture imported above)
    before = _children()
    with pytest.MonkeyPatch.context() as monkeypatch:
        # Each step holding a prompt's first token (every prompt here) takes
        # 20 ms: the kill below lands while the decode replica still runs them.
        straggling(monkeypatch)
        llm = LLM(model, **PD_ENGINE, num_scheduler_steps=1)
    with llm:
        yield llm
        folder = llm.llm_engine.engine_core.kv_routes.transfer_dir
    wait_until(lambda: not (_children() - before), 30, message=lambda: f"processes left: {_children() - before}")
    # The hand-offs' stage files went with the engine's folder (this engine's:
    # others' tests on the machine make theirs meanwhile).
    assert folder is not None and not os.path.exists(folder)


def _counts(llm: LLM) -> dict[str, int]:
    return dict(llm.llm_engine.engine_core.handoffs.counts)


def _run(llm: LLM, prompts, params, strike=None) -> list[list[int]]:
    """Generate `prompts` step by step; `strike(supervisor)` is called once,
    when it returns True (it is asked after every step)."""
    engine, supervisor = llm.llm_engine, llm.llm_engine.engine_core
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    done, struck = {}, strike is None
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out.outputs[0].token_ids
        if not struck:
            struck = strike(supervisor)
    assert struck, f"the strike never came: hand-offs {_counts(llm)}"
    return [done[str(i)] for i in range(len(prompts))]


def test_requests_prefill_on_one_replica_and_decode_on_the_other_equal_to_hf(pd_llm, reference):  # noqa: F811
    supervisor = pd_llm.llm_engine.engine_core
    before = _counts(pd_llm)
    assert _run(pd_llm, PROMPTS, GREEDY) == reference
    counts = _counts(pd_llm)
    moved = counts.get("ok", 0) - before.get("ok", 0)
    assert moved > 0, counts
    # Whatever did not move fell back and finished where it was (no failure counted as one).
    assert not {"failed", "source_gone", "destination_gone", "prefill_on_decode"} & set(counts), counts
    states = supervisor.replica_states()
    assert [(s["role"], s["state"]) for s in states] == [("prefill", "serving"), ("decode", "serving")]
    # Each role's workers run with its own thread count (torch.get_num_threads, read by the ranks).
    assert [s["threads"] for s in states] == [2, 1]
    # Routing sent every request to the prefill replica; the moves went through migration.
    assert states[1]["num_routed"] == 0 and states[0]["num_routed"] >= len(PROMPTS)
    assert supervisor.migration_counts["migrated"] >= moved


def test_what_ends_with_its_first_token_or_wants_prompt_logprobs_stays_on_the_prefill_replica(
    pd_llm,
    reference,  # noqa: F811
):
    before = _counts(pd_llm)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    assert _run(pd_llm, PROMPTS[:3], one) == [r[:1] for r in reference[:3]]
    logprobs = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=1)
    assert _run(pd_llm, PROMPTS[3:5], logprobs) == reference[3:5]
    counts = _counts(pd_llm)
    assert counts.get("finished_on_prefill", 0) - before.get("finished_on_prefill", 0) == 3, counts
    assert counts.get("kept_on_prefill", 0) - before.get("kept_on_prefill", 0) == 2, counts
    assert counts.get("ok", 0) == before.get("ok", 0), counts


def test_seeded_sampling_and_logprobs_go_on_exactly_across_the_hand_off(pd_llm):
    """The same requests pinned to the prefill replica (never handed off)
    and handed off: the same tokens and logprobs (the seeded generator's
    draws continue at the decode replica)."""
    engine = pd_llm.llm_engine
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    before = _counts(pd_llm).get("ok", 0)
    prompts = PROMPTS[:4]
    for pinned in (0, None):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{pinned}-{i}", {"prompt_token_ids": prompt}, params, data_parallel_rank=pinned)
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: out.outputs[0] for out in engine.step()})
    assert _counts(pd_llm).get("ok", 0) - before == len(prompts)  # the unpinned ones moved
    for i in range(len(prompts)):
        stayed, moved = done[f"0-{i}"], done[f"None-{i}"]
        assert moved.token_ids == stayed.token_ids
        for a, b in zip(stayed.logprobs, moved.logprobs):
            assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


def test_short_prompts_stay_on_a_decode_replica_the_others_are_handed_off(pd_llm, reference):  # noqa: F811
    """Conditional disaggregation (`--pd-min-prompt-tokens`, set here while
    serving): the six prompts under 20 tokens are prefilled and decoded on
    the decode replica alone, the others handed off; all equal to HF."""
    supervisor = pd_llm.llm_engine.engine_core
    short = sum(1 for p in PROMPTS if len(p) < 20)
    assert 0 < short < len(PROMPTS)
    before, routed = _counts(pd_llm), supervisor.replica_states()[1]["num_routed"]
    supervisor.handoffs.min_prompt_tokens = 20
    try:
        assert _run(pd_llm, PROMPTS, GREEDY) == reference
    finally:
        supervisor.handoffs.min_prompt_tokens = 0
    counts = _counts(pd_llm)
    assert counts.get("short_prompt", 0) - before.get("short_prompt", 0) == short, counts
    assert counts.get("ok", 0) > before.get("ok", 0), counts
    assert supervisor.replica_states()[1]["num_routed"] - routed == short


def test_a_client_abort_mid_hand_off_frees_both_replicas_blocks(pd_llm, reference):  # noqa: F811
    """Requests aborted while their hand-off is under way: the others equal
    HF's, and both replicas' caches are all free again (their stats, fresh
    with a ping's answer, say so)."""
    engine, supervisor = pd_llm.llm_engine, pd_llm.llm_engine.engine_core
    before = _counts(pd_llm)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
    done, aborted = {}, set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out.outputs[0].token_ids
        moving = {m.request_id for m in supervisor.migrations.values() if m.reason == "pd_handoff"} - aborted
        if moving and len(aborted) < 3:
            engine.abort_request(sorted(moving)[0])
            aborted.add(sorted(moving)[0])
    assert aborted, _counts(pd_llm)
    kept = [i for i in range(len(PROMPTS)) if str(i) not in aborted]
    assert [done[str(i)] for i in kept] == [reference[i] for i in kept]
    counts = _counts(pd_llm)
    assert counts.get("ended", 0) + counts.get("ok", 0) > before.get("ended", 0) + before.get("ok", 0), counts
    supervisor.ping()
    wait_until(
        lambda: all(c.stats is not None and c.stats.kv_cache_usage == 0.0 for c in supervisor.channels.values()),
        30,
        step=engine.step,
        message=lambda: f"blocks still held: {[c.stats for c in supervisor.channels.values()]}",
    )


def test_a_decode_replica_killed_mid_stream_costs_no_request(pd_llm, reference):  # noqa: F811
    supervisor = pd_llm.llm_engine.engine_core
    victim = supervisor.launcher._processes[1]
    killed = []

    def strike(sup) -> bool:
        # Once requests decode on replica 1, a few tokens in (mid-stream: still in the ledger).
        decoding = [rid for rid, e in sup.ledger.items() if e.channel == 1 and len(e.token_ids) >= 3]
        if len(decoding) < 2:
            return False
        os.kill(victim.pid, signal.SIGKILL)
        killed.extend(decoding)
        return True

    restarts = supervisor.restart_budget.num_restarts
    assert _run(pd_llm, PROMPTS, GREEDY, strike) == reference
    assert killed and supervisor.restart_budget.num_restarts == restarts + 1
    # The replacement serves as a decode replica again.
    _wait_until_both_serve(pd_llm)
    assert supervisor.launcher._processes[1].pid != victim.pid


def _wait_until_both_serve(llm) -> None:
    """The killed replica's replacement serves, in its role, beside the other."""
    supervisor = llm.llm_engine.engine_core
    wait_until(
        lambda: (
            [(s["role"], s["state"]) for s in supervisor.replica_states()]
            == [("prefill", "serving"), ("decode", "serving")]
        ),
        120,
        step=llm.llm_engine.step,
        message=lambda: f"both replicas to serve: {supervisor.replica_states()}",
    )


def test_a_prefill_replica_killed_mid_hand_off_costs_no_request(pd_llm, reference):  # noqa: F811
    """Killed as its first hand-offs start: those handed over go on at the
    decode replica, the others are recovered there (it prefills while no
    prefill replica serves) or on the replacement."""
    supervisor = pd_llm.llm_engine.engine_core
    victim = supervisor.launcher._processes[0]
    before = _counts(pd_llm)

    def strike(sup) -> bool:
        if not any(m.reason == "pd_handoff" for m in sup.migrations.values()):
            return False
        os.kill(victim.pid, signal.SIGKILL)
        return True

    assert _run(pd_llm, PROMPTS, GREEDY, strike) == reference
    counts = _counts(pd_llm)
    gone = counts.get("source_gone", 0) - before.get("source_gone", 0)
    moved = counts.get("ok", 0) - before.get("ok", 0)
    assert gone + moved > 0, counts
    _wait_until_both_serve(pd_llm)


def test_hand_offs_over_the_sealed_network_path(tiny_model_dir, monkeypatch):
    """The way K/V crosses nodes (each prefill rank's K/V server, sealed
    frames; RAYLM_MIGRATION_NETWORK=1 takes it on one node), on another
    architecture: outputs equal Hugging Face's, every request moved."""
    monkeypatch.setenv("RAYLM_MIGRATION_NETWORK", "1")
    qwen2 = tiny_model_dir("qwen2")
    prompts = PROMPTS[:4]
    before = _children()
    with LLM(qwen2, **PD_ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert _counts(llm) == {"ok": len(prompts)}
    assert [o.outputs[0].token_ids for o in outs] == [r.token_ids for r in hf_greedy(qwen2, prompts, MAX_TOKENS)]
    wait_until(lambda: not (_children() - before), 30, message=lambda: f"processes left: {_children() - before}")


def test_the_pools_scaled_apart_through_the_async_engine(model, reference):  # noqa: F811
    """AsyncLLM.scale_roles, as the per-role autoscaler calls it
    (raylm.engine.role_autoscaler): 1+1 -> 2+1 (a replica started, then
    replica 1 turned prefill) -> 1+1 (replica 1 turned decode, then replica
    2 drained away); requests between equal HF's, and no process is left."""
    import asyncio

    from raylm.config import create_engine_config
    from raylm.engine.async_llm import AsyncLLM

    async def generate(engine, prompts) -> list[list[int]]:
        async def one(i, prompt):
            tokens = []  # (the async engine streams each output's new tokens)
            async for out in engine.generate({"prompt_token_ids": prompt}, GREEDY, f"{id(prompts)}-{i}"):
                tokens.extend(out.outputs[0].token_ids)
            return tokens

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    async def run(engine) -> list[tuple]:
        seen = []
        await engine.scale_roles(3, 2)
        await engine.check_health()  # (each core's answer brings its threads: 0 until then)
        states = engine.replica_states()
        seen.append([(s["role"], s["state"], s["threads"]) for s in states])
        assert await generate(engine, PROMPTS[:6]) == reference[:6]
        await engine.scale_roles(2, 1)
        await engine.check_health()
        seen.append([(s["role"], s["threads"]) for s in engine.replica_states()])
        assert await generate(engine, PROMPTS[6:10]) == reference[6:10]
        return seen

    before = _children()
    engine = AsyncLLM(create_engine_config(model, **PD_ENGINE))
    try:
        seen = asyncio.run(run(engine))
        counts = dict(engine.engine_core.handoffs.counts)
    finally:
        engine.shutdown()
    # A replica keeps the threads it started with when its role changes
    # (replica 1, started as a decode one); a replica starts with its role's.
    assert seen == [
        [("prefill", "serving", 2), ("prefill", "serving", 1), ("decode", "serving", 1)],
        [("prefill", 2), ("decode", 1)],
    ]
    assert counts.get("ok", 0) > 0, counts
    wait_until(lambda: not (_children() - before), 30, message=lambda: f"processes left: {_children() - before}")
