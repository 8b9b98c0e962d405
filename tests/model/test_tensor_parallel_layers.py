"""Tensor- and pipeline-parallel model runs in two gloo processes must give the
same logits as one process holding the whole model."""

from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch

from raylm.distributed import parallel_state
from raylm.model.loader import load_model
from tests.child_processes import preloaded_spawn_context

WORLD_SIZE = 2
JOIN_TIMEOUT_S = 120
TOKENS = torch.tensor([1, 17, 300, 5, 42, 99, 640, 7, 3, 250, 12, 766, 0, 64])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@torch.inference_mode()
def _run_case(folder: str, tp_size: int, pp_size: int) -> torch.Tensor | None:
    """One forward on this rank; the logits on a last-stage rank, else None."""
    parallel_state.initialize_model_parallel(tp_size=tp_size, pp_size=pp_size)
    model = load_model(folder, torch.float32, "cpu")
    # The layers must really be split: each rank holds 1/tp of the attention heads.
    first_layer = model.model.layers[model.model.start_layer]
    assert first_layer.self_attn.num_heads * tp_size == model.arch.num_attention_heads
    positions = torch.arange(len(TOKENS))
    pp = parallel_state.get_pp_group()
    intermediate = None
    if not pp.is_first_rank:
        intermediate = pp.recv(model.make_empty_intermediate(len(TOKENS)), pp.rank_in_group - 1)
    out = model(TOKENS, positions, intermediate)
    if not pp.is_last_rank:
        assert out.shape == (2, len(TOKENS), model.arch.hidden_size)
        pp.send(out, pp.rank_in_group + 1)
        return None
    return model.compute_logits(out)


def _worker(rank: int, port: int, cases: list[tuple[str, int, int]], out_dir: str) -> None:
    torch.set_num_threads(1)
    try:
        parallel_state.init_distributed_environment(WORLD_SIZE, rank, f"tcp://127.0.0.1:{port}", "gloo")
        results = [_run_case(*case) for case in cases]
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        parallel_state.destroy_model_parallel()


def _run_two_ranks(cases: list[tuple[str, int, int]], out_dir: str) -> list[list[torch.Tensor | None]]:
    context = preloaded_spawn_context()
    port = _free_port()
    procs = [
        context.Process(target=_worker, args=(rank, port, cases, out_dir), daemon=True) for rank in range(WORLD_SIZE)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(JOIN_TIMEOUT_S)
    finally:
        # A rank that failed leaves its peer blocked in a collective: end both.
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
    errors = [open(os.path.join(out_dir, f)).read() for f in sorted(os.listdir(out_dir)) if f.endswith(".err")]
    assert not errors, "\n".join(errors)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD_SIZE)]


# (arch, overrides, tp, pp). Every case runs inside one pair of processes to pay the spawn once.
CASES = {
    # 4 q heads, 1 KV head: each rank holds a replica of the KV head; tied embeddings.
    "llama-tp2-kv1-tied": ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True, "vocab_size": 777}, 2, 1),
    # Untied head, q/k/v biases sharded with their heads, vocab padded past a shard edge.
    "qwen2-tp2-bias": ("qwen2", {"vocab_size": 777}, 2, 1),
    # Per-head q/k norm applied to the local heads only.
    "qwen3-tp2-qknorm": ("qwen3", {"tie_word_embeddings": True}, 2, 1),
    # Two stages; the tied head on stage 1 loads its own copy of the embedding.
    "llama-pp2-tied": ("llama", {"num_hidden_layers": 3, "tie_word_embeddings": True}, 1, 2),
    "mistral-pp2": ("mistral", {"num_hidden_layers": 3}, 1, 2),
}


def test_parallel_logits_equal_single_process(tmp_path):
    from raylm.testing import make_tiny_model

    folders, expected = [], []
    for name, (arch, overrides, _, _) in CASES.items():
        # Several files, so each rank reads its slices across a sharded checkpoint.
        folder = make_tiny_model(arch, tmp_path / name, seed=7, num_shards=2, **overrides)
        folders.append(str(folder))
        model = load_model(folder, torch.float32, "cpu")
        with torch.inference_mode():
            expected.append(model.compute_logits(model(TOKENS, torch.arange(len(TOKENS)))))

    out_dir = tmp_path / "results"
    out_dir.mkdir()
    cases = [(folder, tp, pp) for folder, (_, _, tp, pp) in zip(folders, CASES.values())]
    per_rank = _run_two_ranks(cases, str(out_dir))

    for i, (name, (_, _, _tp, pp)) in enumerate(CASES.items()):
        reference = expected[i]
        last_stage_ranks = range(WORLD_SIZE) if pp == 1 else [WORLD_SIZE - 1]
        for rank in range(WORLD_SIZE):
            got = per_rank[rank][i]
            if rank not in last_stage_ranks:
                assert got is None, name
                continue
            assert got.shape == reference.shape, name
            torch.testing.assert_close(
                got, reference, atol=1e-4, rtol=1e-4, msg=lambda m, name=name, rank=rank: f"{name} rank {rank}: {m}"
            )
            assert torch.equal(got.argmax(-1), reference.argmax(-1)), name


@pytest.fixture
def two_rank_tp_group(monkeypatch):
    """Pretend to be rank 1 of a TP group of 2 (no collectives are called)."""
    fake = parallel_state.GroupCoordinator(ranks=[0, 1], rank_in_group=1, group=None)
    monkeypatch.setattr(parallel_state, "_TP", fake)
    return fake


def test_qkv_shards_and_kv_replication(two_rank_tp_group):
    from raylm.model.layers.linear import QKVParallelLinear

    head_dim, hidden = 2, 3
    full = {
        s: torch.arange(n * head_dim * hidden, dtype=torch.float32).view(-1, hidden) + 1000 * i
        for i, (s, n) in enumerate([("q", 4), ("k", 1), ("v", 1)])
    }
    layer = QKVParallelLinear(hidden, head_dim, total_num_heads=4, total_num_kv_heads=1)
    assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
    for shard_id, weight in full.items():
        layer.weight_loader(layer.weight, weight, shard_id)
    # Rank 1 takes q heads 2..3 and the single (replicated) KV head.
    expected = torch.cat([full["q"][4:8], full["k"], full["v"]])
    assert torch.equal(layer.weight, expected)

    layer = QKVParallelLinear(hidden, head_dim, total_num_heads=4, total_num_kv_heads=4)
    kv = torch.arange(4 * head_dim * hidden, dtype=torch.float32).view(-1, hidden)
    layer.weight_loader(layer.weight, kv, "k")
    assert torch.equal(layer.weight[4:8], kv[4:8])  # kv heads 2..3


def test_vocab_shard_padding(two_rank_tp_group):
    from raylm.model.layers.embedding import VocabParallelEmbedding

    embedding = VocabParallelEmbedding(200, 4)
    assert embedding.num_embeddings_padded == 256 and embedding.weight.shape == (128, 4)
    table = torch.randn(200, 4)
    embedding.weight_loader(embedding.weight, table)
    # Rank 1 holds rows 128..199 and zeros for the 56 padding rows.
    assert torch.equal(embedding.weight[:72], table[128:])
    assert not embedding.weight[72:].any()
