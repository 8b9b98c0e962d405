"""Data parallelism on Ray: replicas of the whole engine core as Ray actors,
routed, scaled and replaced (docs/architecture.md, "Data parallel and the supervisor"). Each test
ends with no replica actor, worker actor or placement group left."""

from __future__ import annotations

import os
import time

import pytest

from raylm import LLM, SamplingParams
from raylm.testing.hf_oracle import hf_greedy
from tests.conftest import STRAGGLER_TOKEN, our_live_ray_state, straggling, wait_until

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Every prompt starts with STRAGGLER_TOKEN: with the straggler on
# (`straggling`), a strike lands while the requests still run.
PROMPTS = [[STRAGGLER_TOKEN] + [(7 * i + j) % 250 + 3 for j in range(1 + 3 * i)] for i in range(16)]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", num_key_value_heads=2)


@pytest.fixture(scope="module")
def reference(model):
    return [r.token_ids for r in hf_greedy(model, PROMPTS, MAX_TOKENS)]


def _dp_llm(model, dp=2, **kwargs) -> LLM:
    # Single decode steps: a strike must land while every request is mid-stream,
    # and a decode burst can take a 16-token request from 2 tokens to done.
    kwargs.setdefault("num_scheduler_steps", 1)
    return LLM(model, dtype="float32", data_parallel_size=dp, num_threads=1, kv_cache_memory_bytes=16 << 20, **kwargs)


def _client(llm: LLM):
    return llm.llm_engine.engine_core


def _assert_nothing_left() -> None:
    live_actors, live_pgs = our_live_ray_state()
    assert not live_actors, f"actors left: {[a['ActorClassName'] for a in live_actors]}"
    assert not live_pgs, "placement groups left"


def _threads_cpu_s(pid: int) -> dict[int, float]:
    """Seconds each thread of process `pid` has run on a CPU."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
        except OSError:  # the thread ended
            pass
    return out


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "dp2xtp2"])
def test_replicas_match_hf_and_share_the_load(ray_session, model, reference, tp):
    extra = {"tensor_parallel_size": 2, "distributed_executor_backend": "ray"} if tp == 2 else {}
    with _dp_llm(model, **extra) as llm:
        pids = [r.pid for r in _client(llm).launcher.manager.replicas.values()]
        before = {pid: _threads_cpu_s(pid) for pid in pids}
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
        if os.path.isdir("/proc/self/task") and os.geteuid() == 0:  # allowed to undo Ray's nice 15
            # Each replica's loop (the thread that stepped the most meanwhile) runs at
            # the driver's niceness, not at the nice 15 Ray starts its workers at.
            for pid in pids:
                after = _threads_cpu_s(pid)
                loop = max(after, key=lambda tid: after[tid] - before[pid].get(tid, 0.0))
                assert os.getpriority(os.PRIO_PROCESS, loop) == os.getpriority(os.PRIO_PROCESS, 0), pid
        routed = [r["num_routed"] for r in _client(llm).replica_states()]
        assert len(routed) == 2 and sum(routed) == len(PROMPTS)
        assert max(routed) <= 1.25 * len(PROMPTS) / 2  # within 25% of even
    _assert_nothing_left()


def test_prefill_decode_roles_on_ray_replicas_hand_off_equal_to_hf(ray_session, model, reference):
    """`--prefill-replicas 1` with the replicas as Ray actors (raylm.engine.
    handoff): every prompt is routed to replica 0, handed to replica 1 after
    its first token; greedy outputs equal HF's; the hand-offs' files and
    every actor and placement group are gone after."""
    with _dp_llm(model, prefill_replicas=1, pd_min_prompt_tokens=0) as llm:
        supervisor = _client(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
        counts = dict(supervisor.handoffs.counts)
        assert counts.get("ok", 0) > 0, counts
        assert not {"failed", "refused", "source_gone", "destination_gone", "prefill_on_decode"} & set(counts), counts
        states = supervisor.replica_states()
        assert [(s["role"], s["state"], s["num_routed"]) for s in states] == [
            ("prefill", "serving", len(PROMPTS)),
            ("decode", "serving", 0),
        ]
        assert supervisor.migration_counts["migrated"] >= counts["ok"]
        folder = supervisor.kv_routes.transfer_dir
    assert folder is None or not os.path.exists(folder)
    _assert_nothing_left()


def test_data_parallel_rank_pins_a_replica(ray_session, model, reference):
    with _dp_llm(model) as llm:
        engine = llm.llm_engine
        for i, prompt in enumerate(PROMPTS[:6]):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY, data_parallel_rank=1)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = out.outputs[0].token_ids
        assert [done[str(i)] for i in range(6)] == reference[:6]
        assert [r["num_routed"] for r in _client(llm).replica_states()] == [0, 6]
        with pytest.raises(ValueError, match="data_parallel_rank 5"):
            engine.add_request("x", {"prompt_token_ids": PROMPTS[0]}, GREEDY, data_parallel_rank=5)
    _assert_nothing_left()


def test_scale_up_and_down_while_requests_run(ray_session, model, reference):
    """2 -> 1 -> 2 -> 1 with requests in flight at each change: none fails."""
    with _dp_llm(model) as llm:
        client = _client(llm)
        llm.scale(1)
        assert [r["state"] for r in client.replica_states()] == ["serving"]
        engine = llm.llm_engine
        done = {}

        def add(indices):
            for i in indices:
                engine.add_request(str(i), {"prompt_token_ids": PROMPTS[i]}, GREEDY)

        def step_until(predicate):
            while not predicate():
                for out in engine.step():
                    done[out.request_id] = out.outputs[0].token_ids

        add(range(0, 6))
        step_until(lambda: len(done) >= 1 or not engine.has_unfinished_requests())
        llm.scale(2)  # placed and warmed, then routed to
        add(range(6, 12))
        routed = [r["num_routed"] for r in client.replica_states()]
        assert len(routed) == 2 and routed[1] > 0
        llm.scale(1)  # replica 1 drains: its requests finish there first
        assert [r["state"] for r in client.replica_states()] == ["serving", "draining"]
        add(range(12, 16))
        step_until(lambda: not engine.has_unfinished_requests())
        for _ in range(3):
            engine.step()  # lets the drained replica leave
        assert [r["state"] for r in client.replica_states()] == ["serving"]
        assert [done[str(i)] for i in range(16)] == reference
    _assert_nothing_left()


def test_killed_replica_is_replaced_and_loses_no_request(ray_session, model, reference, monkeypatch):
    import ray

    straggling(monkeypatch)
    with _dp_llm(model) as llm:
        client = _client(llm)
        victim = client.launcher.manager.replicas[1].actor
        killed_at = []

        def kill():
            killed_at.append(time.monotonic())
            ray.kill(victim)

        outputs = generate_with_strike_dp(llm, kill)
        assert outputs == reference

        # A replacement comes up and serves.
        def step_and_pause() -> None:
            llm.llm_engine.step()
            time.sleep(0.1)

        wait_until(
            lambda: [r["state"] for r in client.replica_states()] == ["serving", "serving"],
            120,
            step=step_and_pause,
            message=lambda: f"both replicas to serve: {client.replica_states()}",
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference[:4]
    _assert_nothing_left()


def generate_with_strike_dp(llm: LLM, strike, victim: int = 1) -> list[list[int]]:
    """Strike once every request routed to replica `victim` has produced
    tokens and none has finished (the replicas' schedulers live in other
    processes: count what came back instead)."""
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
    client = _client(llm)
    on_victim = {rid for rid, s in client.ledger.items() if s.channel == victim}
    assert on_victim
    done, struck = {}, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out.outputs[0].token_ids
        if not struck and all(len(client.ledger[rid].token_ids) >= 3 for rid in on_victim if rid in client.ledger):
            assert on_victim <= set(client.ledger), "a request finished before the strike"
            strike()
            struck = True
    assert struck
    return [done[str(i)] for i in range(len(PROMPTS))]
