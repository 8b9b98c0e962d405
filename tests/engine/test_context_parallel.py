"""Context parallelism (issue 26): each sequence's KV cache sharded across the
ranks of a CP group, partial attention merged exactly by log-sum-exp.

Greedy outputs equal Hugging Face's at CP=2 (mp and Ray), TP=2 x CP=2 and
PP=2 x CP=2 (mp) for a prompt longer than one rank's KV cache holds (the same
per-rank budget refuses it at CP=1), through chunked prefill and prefix-cache
hits; the flag's validation; the rank layout and `raylm plan`'s view of it;
nothing left behind."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from raylm import LLM, SamplingParams
from raylm.config import create_engine_config
from raylm.distributed.parallel_state import cp_group_ranks, pp_group_ranks, rank_coordinates, tp_group_ranks
from raylm.model.arch_config import ArchConfig
from raylm.sampling_params import SamplingParams as Params
from raylm.testing.hf_oracle import hf_greedy, hf_prompt_logprobs
from raylm.worker.input_batch import CachedRequestState, prepare_batch
from tests.conftest import executor_of, process_gone

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
BLOCK = 16
# Each rank holds 8 blocks (128 tokens); the long prompt needs 10 blocks.
BLOCKS_PER_RANK = 8
MAX_MODEL_LEN = 200


def _bytes_per_block(model: str) -> int:
    a = ArchConfig.from_model_dir(model)
    return 2 * BLOCK * a.num_key_value_heads * a.head_dim * 4 * a.num_hidden_layers


def _prompts(model: str) -> dict[str, list[int]]:
    rng = random.Random(0)
    vocab = ArchConfig.from_model_dir(model).vocab_size
    long = [rng.randrange(vocab) for _ in range(150)]
    return {
        "long": long,
        "short": [rng.randrange(vocab) for _ in range(7)],
        "one": [rng.randrange(vocab)],
        # Shares the long prompt's first 144 tokens: 9 cached blocks on the second call.
        "shared": long[:144] + [rng.randrange(vocab) for _ in range(20)],
    }


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    # GQA (2 kv heads for 4 query heads): partial attention must map heads as HF does.
    return tiny_model_dir("qwen2", num_key_value_heads=2)


@pytest.fixture(scope="module")
def reference(model):
    prompts = _prompts(model)
    return prompts, dict(zip(prompts, (r.token_ids for r in hf_greedy(model, list(prompts.values()), MAX_TOKENS))))


def _engine_kwargs(model: str, **extra) -> dict:
    return dict(
        dtype="float32",
        num_threads=1,
        kv_cache_memory_bytes=BLOCKS_PER_RANK * _bytes_per_block(model),
        max_model_len=MAX_MODEL_LEN,
        **extra,
    )


def _run_and_compare(llm: LLM, reference) -> None:
    prompts, ref = reference
    first = ["long", "short", "one"]
    outs = llm.generate([{"prompt_token_ids": prompts[k]} for k in first], GREEDY, use_tqdm=False)
    assert {k: o.outputs[0].token_ids for k, o in zip(first, outs)} == {k: ref[k] for k in first}
    # The long prompt's blocks are cached (spread over both ranks): a hit reads them from both.
    [hit] = llm.generate([{"prompt_token_ids": prompts["shared"]}], GREEDY, use_tqdm=False)
    assert hit.metrics["num_cached_tokens"] == 144
    assert hit.outputs[0].token_ids == ref["shared"]


# ---- one process, no engine ---------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, "2", 1.5, True])
def test_context_parallel_size_must_be_a_positive_integer(value, tiny_model_dir):
    with pytest.raises(ValueError, match="context_parallel_size"):
        create_engine_config(tiny_model_dir("llama"), context_parallel_size=value)


@pytest.mark.parametrize(
    "settings, named",
    [
        ({"data_parallel_size": 2, "data_parallel_rebalance": True}, "data_parallel_rebalance"),
        ({"distributed_executor_backend": "ray", "ray_step_transport": "cgraph"}, "cgraph"),
    ],
)
def test_what_context_parallelism_cannot_combine_with_yet_is_refused(settings, named, tiny_model_dir):
    with pytest.raises(ValueError, match=f"context_parallel_size 2 cannot be combined yet with: .*{named}"):
        create_engine_config(tiny_model_dir("llama"), context_parallel_size=2, **settings)


def test_cuda_is_accepted(tiny_model_dir):
    """CP on CUDA runs torch's partial attention and the merge (the C++ kernel is
    CPU's); tests/model/test_context_parallel_decode_paths proves that path on CPU,
    tests/gpu/test_context_parallel_cuda on a GPU."""
    config = create_engine_config(tiny_model_dir("llama"), context_parallel_size=2, device="cuda")
    assert config.device == "cuda" and config.cache_config.num_kv_shards == 2


def test_uni_backend_refuses_several_ranks(tiny_model_dir):
    with pytest.raises(ValueError, match="context_parallel_size = 1"):
        LLM(tiny_model_dir("llama"), context_parallel_size=2, distributed_executor_backend="uni")


def test_world_size_and_rank_layout(tiny_model_dir):
    config = create_engine_config(tiny_model_dir("llama"), tensor_parallel_size=2, context_parallel_size=2)
    assert config.parallel_config.world_size == 4
    # global rank = (pp_rank * cp + cp_rank) * tp + tp_rank
    assert tp_group_ranks(2, 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert cp_group_ranks(2, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert pp_group_ranks(2, 2, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert rank_coordinates(6, tp_size=2, cp_size=2) == (0, 1, 1)  # (tp, pp, cp)
    # Without CP the layout is the one TP x PP always had.
    assert tp_group_ranks(2, 2) == [[0, 1], [2, 3]] and pp_group_ranks(2, 2) == [[0, 2], [1, 3]]


def test_each_token_is_stored_on_exactly_one_cp_rank():
    """The ranks' shares of a step partition its tokens, and each rank's keys
    of a sequence are those of its blocks (block id g on rank g % cp)."""
    block_ids = [5, 2, 7, 4, 9]  # rank of each block at cp=2: 1, 0, 1, 0, 1
    state = CachedRequestState("r", list(range(70)), list(range(70)), Params(), block_ids, num_computed_tokens=40)
    stored = []
    for rank in range(2):
        meta = prepare_batch({"r": state}, {"r": 30}, BLOCK, "cpu", cp_rank=rank, cp_size=2).attn_metadata
        cp = meta.context_parallel
        rows = cp.store_rows.numpy()
        positions = 40 + rows
        assert all(block_ids[p // BLOCK] % 2 == rank for p in positions)
        # Local slot = (g // cp) * block_size + offset.
        expected = [block_ids[p // BLOCK] // 2 * BLOCK + p % BLOCK for p in positions]
        assert cp.store_slots.tolist() == expected
        stored.append(set(positions.tolist()))
        [seq] = cp.sharded  # a later chunk: its context is spread over the group
        assert seq.key_slots.numel() == sum(
            min(BLOCK, 70 - j * BLOCK) for j, g in enumerate(block_ids) if g % 2 == rank
        )
        assert seq.mask.shape == (30, seq.key_slots.numel())
    assert stored[0] | stored[1] == set(range(40, 70)) and not stored[0] & stored[1]
    assert np.all(np.asarray(sorted(stored[0] | stored[1])) == np.arange(40, 70))


def test_a_sequences_blocks_alternate_between_cp_ranks_whatever_was_freed():
    from raylm.core.kv_cache_manager import KVCacheManager
    from raylm.core.request import Request

    def request(rid: str, num_tokens: int) -> Request:
        return Request(rid, list(range(num_tokens)), Params(max_tokens=1), eos_token_id=None)

    manager = KVCacheManager(num_blocks=12, block_size=4, enable_prefix_caching=False, num_shards=2)
    first, second = request("a", 16), request("b", 8)
    manager.allocate_slots(first, 16)
    manager.allocate_slots(second, 8)
    manager.free(first)  # frees 4 blocks tail first: the free queues' order is no longer by id
    third = request("c", 40)
    ids = manager.allocate_slots(third, 32)
    assert [g % 2 for g in ids] == [0, 1] * 4
    # A shard with no free block left: the other gives (capacity is the group's).
    manager = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False, num_shards=2)
    assert manager.allocate_slots(request("p", 4), 4) == [0] and manager.allocate_slots(request("q", 4), 4) == [2]
    assert manager.allocate_slots(request("r", 8), 8) == [1, 3]


def test_batched_decode_partials_equal_one_by_one():
    """partial_decode_attention over padded shards equals partial_attention
    per sequence; a row with no key here gives out 0 and lse -inf even when
    its padding holds NaN."""
    import torch

    from raylm.model.layers.attention_merge import partial_attention, partial_decode_attention

    gen = torch.Generator().manual_seed(0)
    lengths, width, heads, kv_heads, dim = [5, 1, 0, 3], 5, 4, 2, 8
    q = torch.randn(len(lengths), heads, dim, generator=gen)
    k = torch.randn(len(lengths), width, kv_heads, dim, generator=gen)
    v = torch.randn(len(lengths), width, kv_heads, dim, generator=gen)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    k[2], v[2] = float("nan"), float("nan")
    for row, n in enumerate(lengths):  # padding repeats a real key of the row, as the worker pads
        if n:
            k[row, n:], v[row, n:] = k[row, 0], v[row, 0]
    out, lse = partial_decode_attention(q, k, v, 0.3, mask)
    for row, n in enumerate(lengths):
        ref_out, ref_lse = partial_attention(q[row : row + 1], k[row, :n], v[row, :n], 0.3)
        torch.testing.assert_close(out[row : row + 1], ref_out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse[row : row + 1], ref_lse, rtol=1e-5, atol=1e-6)
    assert torch.all(out[2] == 0) and torch.all(torch.isinf(lse[2]))


def test_one_rank_refuses_what_a_cp_group_holds(model):
    """The per-rank budget the CP=2 runs below use cannot hold max_model_len alone."""
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model, **_engine_kwargs(model))


# ---- worker processes -----------------------------------------------------------------


@pytest.mark.slow
def test_cp2_on_mp_equals_hf_past_one_ranks_cache(model, reference):
    """CP=2, chunked prefill (24-token steps), then a prefix-cache hit; both
    ranks' processes and segments gone afterwards."""
    llm = LLM(
        model,
        context_parallel_size=2,
        distributed_executor_backend="mp",
        **_engine_kwargs(model, max_num_batched_tokens=24),
    )
    executor = executor_of(llm)
    try:
        # The scheduler counts both ranks' blocks.
        assert llm.llm_engine.engine_core.engine_core.config.cache_config.num_blocks == 2 * BLOCKS_PER_RANK
        _run_and_compare(llm, reference)
    finally:
        pids, segments = executor.worker_pids, executor.shm_segment_names
        llm.shutdown()
    assert len(pids) == 2 and all(process_gone(p) for p in pids)
    assert not set(segments) & set(os.listdir("/dev/shm"))


def test_plan_shows_the_cp_groups(tiny_model_dir):
    """`raylm plan`'s table: a cp column and the CP groups, each (pp, tp) slot's."""
    from raylm.entrypoints.plan_report import Plan, format_plan, rank_placement, replica_placement
    from raylm.executor.ray_cluster import NodeState

    pc = create_engine_config(tiny_model_dir("llama"), tensor_parallel_size=2, context_parallel_size=2).parallel_config
    nodes = [
        NodeState("a" * 16, "10.0.0.1", {"CPU": 2}, {"CPU": 2}, True),
        NodeState("b" * 16, "10.0.0.2", {"CPU": 2}, {"CPU": 2}),
    ]
    ranks = [rank_placement(r, pc, nodes[r // 2].node_id, nodes[r // 2].ip, "cpu", r % 2) for r in range(4)]
    replica = replica_placement(0, None, None, ranks, pc)
    assert [r.cp_rank for r in ranks] == [0, 0, 1, 1] and [r.tp_rank for r in ranks] == [0, 1, 0, 1]
    request = {
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 1,
        "context_parallel_size": 2,
        "data_parallel_size": 1,
        "bundles": 4,
        "bundle": {"CPU": 1},
        "placement_strategy": "PACK",
        "device": "cpu",
    }
    text = format_plan(Plan(True, None, nodes[0].node_id, nodes, request, [replica]))
    assert "TP=2 x PP=1 x CP=2 = 4 Ray workers" in text
    assert "rank  tp  pp  cp  node" in text
    assert "CP groups: ranks 0,2 across 2 nodes; ranks 1,3 across 2 nodes" in text
    assert "TP groups: ranks 0,1 on aaaaaaaaaaaa; ranks 2,3 on bbbbbbbbbbbb" in text


def test_a_ray_serve_replica_reserves_a_bundle_per_cp_rank():
    from raylm.ray_serve import plan_replica, split_settings

    engine, options = plan_replica(
        split_settings({"context_parallel_size": 2, "tensor_parallel_size": 2, "device": "cpu"})[0]
    )
    assert engine["distributed_executor_backend"] == "ray"
    assert options["placement_group_bundles"] == [{"CPU": 0.01}] + [{"CPU": 1.0}] * 4


@pytest.mark.slow
def test_tp2_x_cp2_on_mp_equals_hf(model, reference):
    """Four ranks: TP groups {0,1}, {2,3}; CP groups {0,2}, {1,3} (each TP
    rank's heads sharded over its CP group). With async scheduling: every CP
    rank fills in the token it sampled itself, the same on all of them."""
    llm = LLM(
        model,
        context_parallel_size=2,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        **_engine_kwargs(model, async_scheduling=True),
    )
    executor = executor_of(llm)
    try:
        _run_and_compare(llm, reference)
    finally:
        pids = executor.worker_pids
        llm.shutdown()
    assert len(pids) == 4 and all(process_gone(p) for p in pids)


@pytest.mark.slow
def test_pp2_x_cp2_on_mp_equals_hf(model, reference):
    """Two stages of one CP group each: stage-to-stage tensors go between the
    ranks of the same cp slot, and the last stage's cp rank 0 replies."""
    llm = LLM(
        model,
        context_parallel_size=2,
        pipeline_parallel_size=2,
        distributed_executor_backend="mp",
        **_engine_kwargs(model, max_num_batched_tokens=24),
    )
    executor = executor_of(llm)
    try:
        assert executor._output_rank == 2  # (pp - 1) * cp * tp
        _run_and_compare(llm, reference)
    finally:
        pids = executor.worker_pids
        llm.shutdown()
    assert len(pids) == 4 and all(process_gone(p) for p in pids)


def test_cp2_on_ray_equals_hf(model, reference, ray_session):
    from tests.conftest import our_live_ray_state

    with LLM(model, context_parallel_size=2, distributed_executor_backend="ray", **_engine_kwargs(model)) as llm:
        assert len(executor_of(llm).workers) == 2
        _run_and_compare(llm, reference)
    assert our_live_ray_state() == ([], [])


@pytest.mark.slow
def test_killed_cp_rank_mid_decode_is_recovered(model, reference):
    """CP rank 1 (holding half of every sequence's KV) dies mid-decode: the
    engine rebuilds the executor, the requests recompute their KV across the
    new group, and the outputs are unchanged."""
    import signal

    from raylm.engine.protocol import RecoveryKind
    from tests.engine.test_recovery import _executor_traces, assert_gone, generate_with_strike

    prompts, ref = reference
    keys = ["long", "short", "one"]
    llm = LLM(model, context_parallel_size=2, distributed_executor_backend="mp", **_engine_kwargs(model))
    try:
        old = executor_of(llm)
        old_traces = _executor_traces(old)
        outputs = generate_with_strike(
            llm, [prompts[k] for k in keys], GREEDY, lambda: os.kill(old.worker_pids[1], signal.SIGKILL), min_tokens=2
        )
        assert [o.token_ids for o in outputs] == [ref[k] for k in keys]
        core = llm.llm_engine.engine_core.engine_core
        assert [e.kind for e in core.recoveries] == [RecoveryKind.WORKER_DIED]
        assert core.scheduler.kv_cache_manager.num_blocks == 2 * BLOCKS_PER_RANK
        assert_gone(old_traces)
        new_traces = _executor_traces(executor_of(llm))
    finally:
        llm.shutdown()
    assert_gone(new_traces)


# ---- the prefill split across the CP ranks (issue 26, item 2) ------------------------------


def test_a_mixed_steps_split_chunk_is_shared_out_and_every_position_stored_once():
    """A step with a decode, a short prompt and a long later chunk (earlier
    context on both ranks): decode and short prompt on every rank, the chunk's
    tokens split between the ranks (a piece from each end), each fresh
    position stored by the rank owning its block, every rank's keys of the
    chunk its positions 0..end in order, and the last token on rank 0."""
    from raylm.model.layers.cp_prefill import prefill_share

    long_blocks = [5, 2, 7, 4, 9, 6]  # rank of each block at cp=2: 1, 0, 1, 0, 1, 0
    states = {
        "decode": CachedRequestState("decode", list(range(9)), list(range(10)), Params(), [8], num_computed_tokens=9),
        "short": CachedRequestState("short", list(range(5)), list(range(5)), Params(), [3], num_computed_tokens=0),
        "long": CachedRequestState(
            "long", list(range(90)), list(range(90)), Params(), long_blocks, num_computed_tokens=40
        ),
    }
    scheduled = {"decode": 1, "short": 5, "long": 50}
    inputs, stored = [], []
    for rank in range(2):
        batch = prepare_batch(states, scheduled, BLOCK, "cpu", cp_rank=rank, cp_size=2)
        cp, rows = batch.attn_metadata.context_parallel, batch.cp_rows
        assert batch.req_ids == ["decode", "short", "long"]
        share = [40 + p for lo, hi in prefill_share(50, rank, 2) for p in range(lo, hi)]
        assert batch.positions.tolist() == [9] + list(range(5)) + share
        assert rows.owner[:6].tolist() == [-1] * 6  # decode and short prompt: every rank
        assert cp.num_decodes == 1 and cp.local_prefills == [(1, 6)]
        inputs.append(batch.input_ids.tolist())
        split = cp.split
        [seq] = split.sequences
        # The gathered buffer is [2 ranks x send_len]: rank q's fresh rows, then its old context.
        assert split.send_rows.tolist() == list(range(6, 6 + len(share)))
        old_here = [p for p in range(40) if long_blocks[p // BLOCK] % 2 == rank]
        assert split.send_slots.tolist() == [long_blocks[p // BLOCK] // 2 * BLOCK + p % BLOCK for p in old_here]
        assert sorted(seq.key_index.tolist()) == seq.key_index.unique().tolist() and len(seq.key_index) == 90
        assert [(p.q_end - p.q_start, p.num_keys) for p in seq.pieces] == [
            (hi - lo, 40 + hi) for lo, hi in prefill_share(50, rank, 2)
        ]
        stored.append({p for p in range(40, 90) if long_blocks[p // BLOCK] % 2 == rank})
        assert len(split.store_slots) == len(stored[-1])
        assert batch.sample_indices == [0, 5, 55]  # rows of the whole step's layout
        assert rows.owner[55] == 0  # the chunk's last token: on rank 0, where the sampler reads it
    assert stored[0] | stored[1] == set(range(40, 90)) and not stored[0] & stored[1]
    assert len(inputs[0]) + len(inputs[1]) == 2 * 6 + 50


def _row_counts(worker) -> dict:
    return dict(vars(worker.model_runner.row_counts))


@pytest.mark.slow
def test_cp2_splits_the_prefill_between_its_ranks(model, reference):
    """CP=2, 64-token steps: a short prompt beside a long one's first chunk,
    then the short one's decode beside the long one's later chunk (a mixed
    step), then a prefix-cache hit whose 40 new tokens are split too. Outputs
    equal HF; each rank's forwards ran about half of every split chunk's rows,
    counted by the workers; prompt logprobs of a split prompt equal HF's."""
    prompts, ref = reference
    rng = random.Random(1)
    vocab = ArchConfig.from_model_dir(model).vocab_size
    hit_prompt = prompts["long"][:112] + [rng.randrange(vocab) for _ in range(40)]
    [hit_ref] = hf_greedy(model, [hit_prompt], MAX_TOKENS)
    llm = LLM(
        model,
        context_parallel_size=2,
        distributed_executor_backend="mp",
        **_engine_kwargs(model, max_num_batched_tokens=64),
    )
    try:
        outs = llm.generate([{"prompt_token_ids": prompts[k]} for k in ("short", "long")], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [ref["short"], ref["long"]]
        [hit] = llm.generate([{"prompt_token_ids": hit_prompt}], GREEDY, use_tqdm=False)
        assert hit.metrics["num_cached_tokens"] == 112
        assert hit.outputs[0].token_ids == hit_ref.token_ids
        # Prompt logprobs (no prefix cache for them): every position's row, from whichever rank computed it.
        [scored] = llm.generate(
            [{"prompt_token_ids": hit_prompt}],
            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
            use_tqdm=False,
        )
        hf_lps = hf_prompt_logprobs(model, hit_prompt)
        assert len(scored.prompt_logprobs) == len(hit_prompt)
        for token, position, hf_lp in zip(hit_prompt[1:], scored.prompt_logprobs[1:], hf_lps):
            assert abs(position[token].logprob - hf_lp) < 1e-3
        counts = executor_of(llm).collective_rpc(_row_counts)
        # What /metrics shows as each rank's KV capacity (raylm:kv_cache_capacity_tokens_per_rank).
        stats = llm.llm_engine.engine_core.engine_core.stats()
        assert stats["kv_capacity_tokens_per_rank"] == BLOCKS_PER_RANK * BLOCK
        assert stats["kv_capacity_tokens"] == 2 * BLOCKS_PER_RANK * BLOCK
    finally:
        llm.shutdown()
    assert len(counts) == 2
    # Split chunks: 57 and 63 tokens of the long prompt, 40 of the hit, 64 and 64 of the scored prompt.
    assert [c["split_scheduled"] for c in counts] == [288, 288]
    assert sum(c["split_computed"] for c in counts) == 288
    assert all(0.45 < c["split_computed"] / c["split_scheduled"] < 0.55 for c in counts)
    assert all(c["computed"] < 0.75 * c["scheduled"] for c in counts)
    assert all(c["mixed_split_steps"] >= 1 for c in counts)


def test_metrics_show_the_kv_capacity_per_rank():
    from raylm.engine.protocol import SchedulerStats
    from raylm.entrypoints.openai.metrics import PrometheusStatLogger

    logger = PrometheusStatLogger("m")
    logger.record_scheduler_stats(SchedulerStats(kv_capacity_tokens=256, kv_capacity_tokens_per_rank=128))
    text = logger.render().decode()
    assert 'raylm:kv_cache_capacity_tokens{engine="0",model_name="m"} 256.0' in text
    assert 'raylm:kv_cache_capacity_tokens_per_rank{engine="0",model_name="m"} 128.0' in text
