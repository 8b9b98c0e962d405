"""The work team that runs the decode matmuls' items (csrc/work_team.cpp):
every item once per call whatever the thread count, the caller alone with one
thread, a forked child with a team of its own, and the matmuls' results the
same bits on any number of threads."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from raylm.model.layers.cpu_kernels import get_cpu_kernels
from tests.model.cpu_kernel_utils import needs_compiler

pytestmark = needs_compiler


@pytest.fixture
def threads():
    """Sets torch's thread count for one test and puts it back."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("items", [1, 2, 3, 7, 64, 1000])
@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_every_item_runs_once_per_call(kernels, threads, items, num_threads):
    threads(num_threads)
    counts, _ = kernels.work_team_probe(items, 40)
    assert counts.tolist() == [40] * items


def test_one_thread_runs_every_item_on_the_caller(kernels, threads):
    threads(2)
    kernels.work_team_probe(64, 20)  # the team's worker exists and spins
    threads(1)
    counts, off_caller = kernels.work_team_probe(64, 200)
    assert counts.tolist() == [200] * 64
    assert off_caller == 0


def _probe_in_child(queue) -> None:
    kernels = get_cpu_kernels()
    torch.set_num_threads(2)
    counts, _ = kernels.work_team_probe(100, 30)
    queue.put(counts.tolist())


def test_forked_child_gets_a_team_of_its_own(kernels, threads):
    threads(2)
    kernels.work_team_probe(100, 30)  # the parent's worker runs before the fork
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_probe_in_child, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=120) == [30] * 100
        child.join(timeout=60)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    assert not child.is_alive()


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_matmuls_give_the_same_bits_on_any_thread_count(kernels, threads, rows):
    torch.manual_seed(rows)
    weight = torch.randn(1000, 264).to(torch.bfloat16)  # 63 tiles: a group ends mid-way
    packed = kernels.bf16_pack(weight)
    x = torch.randn(rows, 264).to(torch.bfloat16)
    threads(1)
    alone = kernels.bf16_linear(x, packed, 1000)
    threads(2)
    for _ in range(50):
        assert torch.equal(kernels.bf16_linear(x, packed, 1000), alone)


@pytest.mark.parametrize("n,grain", [(0, 1), (1, 1), (5, 8), (8, 8), (9, 8), (100, 1), (1000, 3), (64, 16)])
@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_ranges_cover_every_index_once(kernels, threads, n, grain, num_threads):
    threads(num_threads)
    counts, ranges = kernels.work_team_range_probe(n, grain)
    assert counts.tolist() == [1] * n
    if n <= grain:  # small work stays whole, on the caller
        assert ranges == min(n, 1)
    else:  # at least `grain` per range (but the last), at most 4 ranges per thread
        assert ranges <= min(-(-n // grain), 4 * num_threads)


def test_attention_and_elementwise_ops_give_the_same_bits_on_any_thread_count(kernels, threads):
    """Paged decode attention and the fused elementwise ops split their requests
    or rows over threads (called from Python, as here, with OpenMP; inside a
    fused decode step on the team, which test_fused_decode holds to the module
    path's bits): however they are split, each result must not change."""
    torch.manual_seed(0)
    block_size, kv_heads, heads, head_dim, num_blocks = 16, 4, 8, 64, 160
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim).to(torch.bfloat16)
    lengths = torch.tensor([1, 17, 300, 5, 64, 129, 2, 250], dtype=torch.int64)  # uneven requests
    table = torch.randperm(num_blocks).view(len(lengths), 20)  # 320 tokens per request at most
    q = torch.randn(len(lengths), heads, head_dim).to(torch.bfloat16)
    rows = torch.randn(40, 1024).to(torch.bfloat16)
    residual = torch.randn(40, 1024).to(torch.bfloat16)
    weight = torch.randn(1024).to(torch.bfloat16)
    gate_up = torch.randn(40, 2 * 1024).to(torch.bfloat16)

    def run():
        return [
            kernels.paged_decode(q, cache, table, lengths, 0.125),
            kernels.rms_norm(rows, weight, 1e-6),
            *kernels.add_rms_norm(rows, residual, weight, 1e-6),
            kernels.silu_and_mul(gate_up),
        ]

    threads(1)
    alone = run()
    threads(2)
    for _ in range(20):
        for got, want in zip(run(), alone):
            assert torch.equal(got, want)
