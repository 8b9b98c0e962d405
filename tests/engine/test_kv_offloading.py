"""The tier of evicted K/V blocks end to end (`--kv-offloading-size`,
issue 49 item 4): a prompt whose blocks the prefix cache evicted finds them
in the tier and loads them back, computing only the rest, and its greedy
output equals Hugging Face's (float32); the tier never holds more than its
size, its files go with the engine, and sizes that cannot be are refused
by name. The pieces: tests/core/test_host_tier.py."""

from __future__ import annotations

import glob
import json
import os

import pytest

from raylm import LLM, SamplingParams
from raylm.engine.core_tier import tier_room, tier_share_bytes
from raylm.testing.hf_oracle import hf_greedy
from tests.engine.pinned import run_pinned

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# 25 blocks of 16 each: two of them do not fit in a 41-block cache together.
A = [(13 * j) % 250 + 3 for j in range(400)]
B = [(17 * j) % 240 + 5 for j in range(400)]


TIER_GIB = 0.002


def _cache_bytes(model: str, num_blocks: int = 41) -> int:
    """A float32 KV cache of `num_blocks` blocks of 16 tokens for this model."""
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return num_blocks * 16 * c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * 4


def _engine(model: str, **kwargs) -> LLM:
    return LLM(
        model,
        dtype="float32",
        num_threads=1,
        max_model_len=512,
        kv_cache_memory_bytes=kwargs.pop("kv_cache_memory_bytes", _cache_bytes(model)),
        kv_offloading_size=kwargs.pop("kv_offloading_size", TIER_GIB),
        **kwargs,
    )


def _tier_files(core) -> list[str]:
    return glob.glob(glob.escape(core.host_tier.prefix) + ".rank*")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_evicted_blocks_come_back_from_the_tier(tiny_model_dir, arch):
    model = tiny_model_dir(arch)
    outputs = []
    with _engine(model) as llm:
        core = llm.llm_engine.engine_core.engine_core
        for prompt in (A, B, A):
            out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
            outputs.append(list(out.outputs[0].token_ids))
        kv = core.scheduler.kv_cache_manager
        # B's prefill evicted A's blocks into the tier; A again found them
        # there, after those its cache still held: 24 full blocks in all.
        assert kv.tier.stored_blocks >= 10 and kv.tier_hits > 0
        assert kv.prefix_hits == 24 * 16
        stats = core.stats()
        assert stats["prefix_cache_tier_hits"] == kv.tier_hits
        assert 0 < stats["kv_tier_blocks"] <= stats["kv_tier_capacity_blocks"]
        files = _tier_files(core)
        assert files
    assert outputs == [r.token_ids for r in hf_greedy(model, [A, B, A], 6)]
    assert not any(os.path.exists(f) for f in files)  # gone with the engine


def test_the_tier_never_holds_more_than_its_size(tiny_model_dir):
    model = tiny_model_dir("llama")
    prompts = [[(7 * i + 11 * j) % 250 + 3 for j in range(300)] for i in range(8)]
    with _engine(model, kv_offloading_size=0.0005) as llm:  # ~512 KiB: fewer slots than the traffic evicts
        core = llm.llm_engine.engine_core.engine_core
        share = tier_share_bytes(core.config)
        for prompt in prompts + prompts[:2]:
            llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
        tier = core.scheduler.kv_cache_manager.tier
        assert tier.stored_blocks > tier.num_slots  # it filled and went on evicting its oldest
        assert len(tier) <= tier.num_slots
        assert sum(os.path.getsize(f) for f in _tier_files(core)) <= share


@pytest.mark.slow
def test_tensor_parallel_ranks_each_keep_their_shard(tiny_model_dir):
    model = tiny_model_dir("qwen2")
    outputs = []
    # Each rank holds half the heads: half the bytes for the same 41 blocks.
    tp2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    with _engine(model, kv_cache_memory_bytes=_cache_bytes(model) // 2, **tp2) as llm:
        core = llm.llm_engine.engine_core.engine_core
        for prompt in (A, B, A):
            out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
            outputs.append(list(out.outputs[0].token_ids))
        assert core.scheduler.kv_cache_manager.tier_hits > 0
        assert len(_tier_files(core)) == 2
    assert outputs == [r.token_ids for r in hf_greedy(model, [A, B, A], 6)]


def test_a_core_takes_no_more_than_the_node_tier_has_left(tmp_path):
    (tmp_path / "kvtier-aaa.rank0").write_bytes(b"x" * 600)
    (tmp_path / "kvtier-aaa.rank1").write_bytes(b"x" * 300)
    (tmp_path / "pull3-0.rank0").write_bytes(b"x" * 5000)  # a transfer's stage, not a tier
    assert tier_room(str(tmp_path), 1000) == 100
    assert tier_room(str(tmp_path), 800) == 0


@pytest.mark.parametrize("size", [0, -1.0, float("nan"), "2"])
def test_a_size_that_is_no_size_is_refused_by_name(tiny_model_dir, size):
    with pytest.raises(ValueError, match="kv_offloading_size"):
        _engine(tiny_model_dir("llama"), kv_offloading_size=size)


def test_a_tier_larger_than_the_node_is_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match="kv_offloading_size .* more than this node's"):
        _engine(tiny_model_dir("llama"), kv_offloading_size=100_000)


def _run(llm: LLM, outputs: dict, rid: str, prompt: list[int], rank: int) -> None:
    run_pinned(llm, outputs, rid, prompt, rank, GREEDY)


def _replica_loads_from_another_replicas_tier(model: str, backend: str) -> None:
    c = [(19 * j) % 230 + 7 for j in range(400)]
    outputs: dict[str, list[int]] = {}
    with _engine(model, data_parallel_size=2, data_parallel_backend=backend) as llm:
        sup = llm.llm_engine.engine_core
        for rid, prompt in (("a1", A), ("b", B), ("c", c)):
            _run(llm, outputs, rid, prompt, rank=1)
        hits_before = sup.channels[0].stats.prefix_cache_hits if sup.channels[0].stats else 0
        _run(llm, outputs, "a0", A, rank=0)
        assert sup.tier_loads.counts["loads"] == 1 and sup.tier_loads.counts["blocks"] == 24
        assert sup.pulls.counts["started"] == 0
        stats = sup.channels[0].stats
        assert stats.prefix_cache_hits - hits_before == 24 * 16
        assert stats.prefix_cache_tier_hits == 24 * 16
        folder = sup.kv_routes.transfer_dir
        assert len(glob.glob(os.path.join(folder, "kvtier-*"))) == 2  # one core, one rank each
        # A third replica, above the two the node's tier was shared out for,
        # gets what is left of it (nothing here): the files stay within the size.
        llm.scale(3)
        files = glob.glob(os.path.join(folder, "kvtier-*"))
        assert len(files) == 2 and sum(os.path.getsize(f) for f in files) <= int(TIER_GIB * 2**30)
        _run(llm, outputs, "a2", A, rank=2)  # it serves, and reads the others' tiers
    assert not os.path.exists(folder)
    expected = hf_greedy(model, [A, B, c, A], 6)
    assert [outputs[r] for r in ("a1", "b", "c", "a0", "a2")] == [t.token_ids for t in expected + expected[:1]]


@pytest.mark.slow
def test_a_replica_loads_a_prefix_from_another_replicas_tier(tiny_model_dir):
    """Core 1 computes A, then B and C evict all of A's blocks into its tier;
    A sent to core 0 is loaded from core 1's tier (no pull: nobody's cache
    holds it) and computes only its last token."""
    _replica_loads_from_another_replicas_tier(tiny_model_dir("llama"), "mp")


def test_ray_replicas_load_from_each_others_tier(tiny_model_dir, ray_session):
    """The same with replicas as Ray actors (on this node: the supervisor's folder is theirs)."""
    from tests.conftest import our_live_ray_state

    _replica_loads_from_another_replicas_tier(tiny_model_dir("llama"), "ray")
    assert our_live_ray_state() == ([], [])
