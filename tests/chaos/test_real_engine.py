"""The chaos harness's real-engine tier: seeded schedules (raylm.testing.chaos.
schedule) of kills, freezes, scales, migrations, restarts, aborts and junk
on every socket the engine listens on, against two engine-core processes
serving greedy float32 streams of the embedded model (every other replay
short of KV blocks, with a tier of evicted blocks). Each seed is replayed
several times (the cores run beside the schedule: each replay meets them in
another state; in the colocated variant every other replay speculates, with
n-gram drafts, or with a draft model on even seeds), every other replay with its migrations on the sealed network
path (RAYLM_MIGRATION_NETWORK=1: the K/V servers listen, and meet the
stranger) instead of shared-memory files; every replay must end with each
stream equal to an undisturbed run of the same requests, and leave no
process, transfer file or descriptor behind. The failure rate over the
replays is printed.

The P/D variant replays its own seeds (RAYLM_CHAOS_REAL_PD_SEEDS) on
`--prefill-replicas 1` (raylm.engine.handoff): every request is handed from
core 0 to core 1 after its first token while the schedule strikes, but
the two shortest prompts, which core 1 serves alone (`--pd-min-prompt-tokens 12`).

RAYLM_CHAOS_REAL_SEEDS (comma-separated) and RAYLM_CHAOS_REAL_REPLAYS set the
size (the soak: more of both)."""

from __future__ import annotations

import collections
import os

import pytest

from raylm import LLM, SamplingParams
from raylm.config import DEFAULT_MODEL_DIR
from raylm.testing.chaos.schedule import ScheduleRunner, descendants, make_schedule
from tests.conftest import bos_straggler_env, wait_until

pytestmark = pytest.mark.slow

SEEDS = [int(s) for s in os.environ.get("RAYLM_CHAOS_REAL_SEEDS", "1,2,3").split(",")]
PD_SEEDS = [int(s) for s in os.environ.get("RAYLM_CHAOS_REAL_PD_SEEDS", "4").split(",")]
REPLAYS = int(os.environ.get("RAYLM_CHAOS_REAL_REPLAYS", "2"))
MAX_TOKENS = 40
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def bos_token_id():
    from transformers import AutoTokenizer

    import raylm

    folder = os.path.join(os.path.dirname(raylm.__file__), "data", "default_model")
    return AutoTokenizer.from_pretrained(folder).bos_token_id


@pytest.fixture(scope="module")
def requests(bos_token_id):
    """Eight prompts behind the BOS token (its straggler makes each step last
    at least 20 ms: the streams outlast the schedule however fast the machine)."""
    prompts = [[bos_token_id] + [(11 * i + 7 * j) % 90 + 5 for j in range(3 + 4 * i)] for i in range(8)]
    return {f"s{i}": (p, GREEDY) for i, p in enumerate(prompts)}


@pytest.fixture(scope="module")
def late_requests(requests):
    """Sent by the schedule's `late` operations: each extends the prompt of
    one of the longest early requests (a full block or two of it cached on
    the core that served it), so that one routed to the other core has its
    prefix pulled there, whatever the schedule does meanwhile."""
    longest = [requests[f"s{i}"][0] for i in (5, 6, 7)]
    return {f"late{k}": (prompt + [7 + k, 9 + k, 11], GREEDY) for k, prompt in enumerate(longest)}


def _llm(**kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 16 << 20)
    return LLM(None, dtype="float32", num_threads=1, num_scheduler_steps=1, **kwargs)


# Every other replay runs its cores short of KV blocks (40 of 64 KiB: one
# 512-token sequence fits, the streams together do not) with a tier of
# evicted blocks: preemptions, evictions into the tier and loads back from
# it (the late requests' prefixes, from any core's tier) meet the schedule.
TIERED = {"kv_cache_memory_bytes": 40 << 16, "kv_offloading_size": 0.01}
# The other replays of the colocated variant speculate (n-gram drafts,
# raylm.core.spec_decode): drafts verified and rolled back meet the schedule's
# kills, migrations and pulls, and the streams must still equal the plain run.
SPECULATIVE = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}}
# Even seeds speculate with a draft model instead (the embedded model drafting
# for itself: every draft accepted), so that the draft's own K/V cache, kept
# beside the target's blocks, meets the same faults.
DRAFT_MODEL = {"speculative_config": {"method": "draft_model", "model": DEFAULT_MODEL_DIR, "num_speculative_tokens": 3}}


@pytest.fixture(scope="module")
def reference(requests, late_requests):
    """An undisturbed run of the same requests."""
    every = {**requests, **late_requests}
    with _llm() as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p, _ in every.values()], GREEDY)
    return {rid: list(out.outputs[0].token_ids) for rid, out in zip(every, outputs)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("prefill_replicas", [0, 1], ids=["colocated", "pd"])
def test_seeded_schedules_against_real_cores(
    requests, late_requests, reference, monkeypatch, bos_token_id, prefill_replicas
):
    for name, value in bos_straggler_env(ms=20).items():
        monkeypatch.setenv(name, value)
    failed, pulls, tier, handoffs = [], collections.Counter(), collections.Counter(), collections.Counter()
    drafts = 0
    seeds = PD_SEEDS if prefill_replicas else SEEDS
    for seed in seeds:
        schedule = make_schedule(seed)
        for replay in range(REPLAYS):
            transport = "network" if replay % 2 else "files"
            monkeypatch.setenv("RAYLM_MIGRATION_NETWORK", "1" if transport == "network" else "0")
            before, fds = descendants(), len(os.listdir("/proc/self/fd"))
            tiered = TIERED if replay % 2 else {}
            engine = dict(data_parallel_size=2, data_parallel_backend="mp", prefill_replicas=prefill_replicas)
            speculative = not prefill_replicas and not replay % 2
            if speculative:
                engine.update(DRAFT_MODEL if seed % 2 == 0 else SPECULATIVE)
            # Every step speculates, however many streams run (the cores read it at their start).
            monkeypatch.setenv("RAYLM_SPECULATIVE_MAX_BATCH", "64" if speculative else "2")
            if prefill_replicas:  # the two shortest prompts stay on a decode replica, the others are handed off
                engine["pd_min_prompt_tokens"] = 12
            with _llm(**engine, **tiered) as llm:
                result = ScheduleRunner(llm, schedule).run(requests, late=late_requests)
                broken = result.failures(reference)
                pulls.update(llm.llm_engine.engine_core.pulls.counts)
                tier.update(llm.llm_engine.engine_core.tier_loads.counts)
                handoffs.update(llm.llm_engine.engine_core.handoffs.counts)
                drafts += llm.llm_engine.engine_core.aggregate_stats().spec_decode_num_drafts
                # This engine's own (others' tests on the machine make theirs meanwhile).
                folder = llm.llm_engine.engine_core.kv_routes.transfer_dir
                if llm.llm_engine.engine_core.dead_error is not None:
                    broken.append(f"the engine died: {llm.llm_engine.engine_core.dead_error}")
            # This replay's `before`, bound as a default argument.
            wait_until(
                lambda before=before: not (descendants() - before),
                30,
                message=lambda before=before: f"processes left: {descendants() - before}",
            )
            if folder is not None and os.path.exists(folder):
                broken.append(f"transfer folder left: {folder}: {os.listdir(folder)}")
            if len(os.listdir("/proc/self/fd")) > fds + 4:
                broken.append(f"descriptors: {fds} before, {len(os.listdir('/proc/self/fd'))} after")
            print(
                f"seed {seed}, replay {replay} ({transport}{', tier' if tiered else ''}): "
                f"{'ok' if not broken else 'FAILED'}; " + "; ".join(result.done)
            )
            if broken:
                failed.append((seed, replay, broken))
    runs = len(seeds) * REPLAYS
    print(
        f"chaos real-engine tier: {len(failed)} of {runs} replays failed; prefix pulls {dict(pulls)}; "
        f"tier loads {dict(tier)}; P/D hand-offs {dict(handoffs)}; speculative drafts {drafts}"
    )
    assert not failed, failed
    if prefill_replicas:
        assert handoffs["ok"] and handoffs["short_prompt"], dict(handoffs)
    else:
        assert drafts, "no replay speculated"
