"""A CPU cache's transfer file is written and read in chunks of vector I/O
(raylm.kv_transfer.files), paced beside the steps (raylm.kv_transfer.background):
whatever the blocks' order and however the copy is cut, the file holds the
same bytes as the in-memory format and reads back bit for bit; a copy beside
the steps pauses between its chunks for the time its share asks."""

from __future__ import annotations

import os

import pytest
import torch

from raylm.kv_transfer import background as kv_background
from raylm.kv_transfer import files as kv_transfer
from tests.conftest import wait_until

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, LAYERS = 16, 4, 2, 8, 3
BLOCK_BYTES = BLOCK_SIZE * KV_HEADS * HEAD_DIM * 2  # bf16, one of K or V


def _caches(seed: int | None) -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]


# Runs up and down, single blocks, a run longer than a chunk (3 blocks below).
SOURCE_BLOCKS = [3, 4, 5, 6, 7, 9, 0, 15, 14, 13, 1, 2]
DESTINATION_BLOCKS = [10, 11, 12, 13, 14, 15, 0, 8, 7, 6, 1, 2]


@pytest.mark.parametrize("chunk_blocks, iov_max", [(3, 1024), (100, 2), (1, 1)])
def test_a_file_cut_in_chunks_holds_the_packed_bytes_and_reads_back(tmp_path, monkeypatch, chunk_blocks, iov_max):
    monkeypatch.setattr(kv_transfer, "_CHUNK_BYTES", chunk_blocks * BLOCK_BYTES)
    monkeypatch.setattr(kv_transfer, "_IOV_MAX", iov_max)
    source, destination = _caches(1), _caches(None)
    path = str(tmp_path / "stage.rank0")
    kv_transfer.create_file(source, len(SOURCE_BLOCKS), path)
    pauses = []
    kv_transfer.fill_file(source, SOURCE_BLOCKS, path, pause=lambda: pauses.append("export"))
    with open(path, "rb") as f:
        assert f.read() == kv_transfer.pack_blocks(source, SOURCE_BLOCKS).numpy().tobytes()
    kv_transfer.import_blocks(destination, DESTINATION_BLOCKS, path, pause=lambda: pauses.append("import"))
    for s, d in zip(source, destination):
        assert torch.equal(d[:, DESTINATION_BLOCKS], s[:, SOURCE_BLOCKS])
    untouched = sorted(set(range(NUM_BLOCKS)) - set(DESTINATION_BLOCKS))
    assert all(not d[:, untouched].any() for d in destination)
    # A pause after every chunk: at least one per layer and K/V, more as chunks shrink
    # (and, with few ranges a call, as the blocks make more runs).
    fewest = 2 * LAYERS * -(-len(SOURCE_BLOCKS) // chunk_blocks)
    assert pauses.count("export") >= fewest and pauses.count("import") >= fewest


def test_a_cache_that_is_not_dense_goes_through_a_mapping(tmp_path):
    """A cache that is not one dense tensor (or not on the CPU) is gathered into a mapping instead."""
    source = [c.transpose(3, 4).contiguous().transpose(3, 4) for c in _caches(2)]
    assert not source[0].is_contiguous()
    destination = _caches(None)
    path = str(tmp_path / "stage.rank0")
    kv_transfer.export_blocks(source, [5, 2, 3], path)
    kv_transfer.import_blocks(destination, [0, 1, 9], path)
    assert all(torch.equal(d[:, [0, 1, 9]], s[:, [5, 2, 3]]) for s, d in zip(source, destination))


def test_a_short_read_or_write_is_continued(tmp_path):
    """A vector read may move fewer bytes than asked: the rest follows."""
    path = str(tmp_path / "f")
    data = os.urandom(100)
    with open(path, "wb") as f:
        f.write(data)
    buffers = [memoryview(bytearray(n)) for n in (7, 1, 30, 2)]
    calls = []

    def stingy_preadv(fd, bufs, offset):
        calls.append(offset)
        first = bufs[0][:3]  # at most 3 bytes a call, out of the first buffer only
        return os.preadv(fd, [first], offset)

    fd = os.open(path, os.O_RDONLY)
    try:
        kv_transfer._vector_io(stingy_preadv, fd, buffers, 10, 40)
        with pytest.raises(kv_transfer.KVTransferError, match="ended 10 bytes early"):
            kv_transfer._vector_io(os.preadv, fd, [memoryview(bytearray(20))], 90, 20)
    finally:
        os.close(fd)
    assert b"".join(bytes(b) for b in buffers) == data[10:50]
    assert len(calls) > len(buffers)


def test_the_copy_budget_holds_all_the_copying_threads_together_to_the_share(monkeypatch):
    """One debt for every counted thread: what any of them spends adds to it,
    the passing time pays `share` a second, a copy goes on while it is at
    most the burst and otherwise waits until it is paid; idle time saves
    no credit, a thread that ended is dropped, a forgotten one no longer
    counts, and a share of 1 never waits."""
    now = [100.0]
    cpu = {11: 5.0, 12: 7.0}
    budget = kv_background.CopyBudget(share=0.25, burst_s=0.005, clock=lambda: now[0], cpu_of=cpu.get)
    budget.count([11, 12, 13])  # 13 does not exist: not counted
    assert budget.wait_s() == 0.0
    cpu[11] += 0.004  # one thread's burst: within the burst allowance
    assert budget.wait_s() == 0.0
    cpu[12] += 0.006  # the other's: 10 ms of debt together
    assert budget.wait_s() == pytest.approx(0.04)
    now[0] += 0.021  # 21 ms pay 5.25 ms
    assert budget.wait_s() == 0.0
    now[0] += 10.0  # idle: the debt is paid, no credit saved
    assert budget.wait_s() == 0.0
    cpu[11] += 0.012
    assert budget.wait_s() == pytest.approx(0.048)
    assert budget.spent_s == pytest.approx(0.022)
    now[0] += 0.048
    del cpu[12]  # ended
    cpu[11] += 0.001
    assert budget.wait_s() == 0.0
    budget.forget([11])
    cpu[11] += 1.0
    assert budget.wait_s() == 0.0 and budget.spent_s == pytest.approx(0.023)
    slept = []
    monkeypatch.setattr(kv_background.time, "sleep", slept.append)
    budget.count([11])
    cpu[11] += 0.01
    budget.pause()
    assert slept == [pytest.approx((0.001 + 0.01) / 0.25)]  # the 1 ms left over, and 10 ms
    unlimited = kv_background.CopyBudget(share=1.0, clock=lambda: now[0], cpu_of=cpu.get)
    unlimited.count([11])
    cpu[11] += 5.0
    assert unlimited.wait_s() == 0.0


def test_the_copy_threads_are_counted_in_one_budget():
    """The export and import threads of a rank's copies count in the same
    budget, and no longer once the jobs close."""
    import threading

    budget = kv_background.CopyBudget(share=0.5)
    jobs = kv_background.KVCopyJobs(budget)
    exporter = jobs.export(threading.get_native_id).result(10)
    if hasattr(os, "SCHED_BATCH"):  # waking, a copy does not preempt a step
        assert jobs.export(lambda: os.sched_getscheduler(0)).result(10) == os.SCHED_BATCH
    paced_pause = jobs.export(lambda pause: pause, paced=True).result(10)
    assert paced_pause == budget.pause
    assert set(budget._cpu_s) == {exporter}
    jobs.import_("m-1", lambda cancelled, pause: sum(range(100_000)), paced=True)
    wait_until(lambda: jobs.finished(["m-1"]), 10, message="the import to end")
    assert len(budget._cpu_s) == 2
    jobs.close()
    assert budget._cpu_s == {}


@pytest.mark.parametrize("value", ["0", "-0.5", "1.5", "fast"])
def test_a_bad_copy_share_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("RAYLM_MIGRATION_COPY_CPU_SHARE", value)
    with pytest.raises(ValueError, match="RAYLM_MIGRATION_COPY_CPU_SHARE"):
        kv_background._copy_cpu_share()
    monkeypatch.setenv("RAYLM_MIGRATION_COPY_CPU_SHARE", "0.2")
    assert kv_background._copy_cpu_share() == 0.2


def test_paced_copies_beside_the_steps_get_a_pause_and_end(tmp_path):
    """The copy jobs hand a paced copy its pause; the outcome is reported as before."""
    source, destination = _caches(3), _caches(None)
    path = str(tmp_path / "m1-0.rank0")
    jobs = kv_background.KVCopyJobs()
    try:
        kv_transfer.create_file(source, 2, path)
        jobs.export(kv_transfer.fill_file, source, [4, 5], path, paced=True).result(30)
        jobs.import_("m1-0", kv_transfer.import_blocks, destination, [7, 8], path, 30.0, paced=True)
        finished = wait_until(lambda: jobs.finished(["m1-0"]), 60, message="the paced import to end")
        assert finished == {"m1-0": [True, kv_transfer.packed_size(source, 2)]}
    finally:
        jobs.close()
    assert all(torch.equal(d[:, [7, 8]], s[:, [4, 5]]) for s, d in zip(source, destination))


def test_an_import_waiting_for_its_source_gives_up_when_cancelled(tmp_path):
    """A source that died never fills its file: cancelling the import (its
    migration abandoned) ends its wait at once, not after its 30 s timeout,
    and the blocks it was to write stay as they were."""
    import time

    source, destination = _caches(3), _caches(None)
    path = str(tmp_path / "m2-0.rank0")
    kv_transfer.create_file(source, 2, path)  # created, never filled
    jobs = kv_background.KVCopyJobs()
    try:
        jobs.import_("m2-0", kv_transfer.import_blocks, destination, [7, 8], path, 30.0, paced=True)
        time.sleep(0.05)
        assert jobs.finished(["m2-0"]) == {}  # still waiting
        started = time.monotonic()
        jobs.cancel(["m2-0", "not-a-copy"])
        ((ok, error),) = wait_until(lambda: jobs.finished(["m2-0"]), 10, message="the cancelled import to end").values()
        assert time.monotonic() - started < 5
        assert not ok and "cancelled" in error, error
    finally:
        jobs.close()
    assert all(not d.any() for d in destination)


def test_closing_the_copy_jobs_does_not_wait_for_a_source_that_never_answers(tmp_path):
    """A rank shutting down while an import waits for a dead source's file,
    or for its network offer, is not held for the import's timeout."""
    import time

    from raylm.distributed.tcp_auth import CurveKeys
    from raylm.kv_transfer import network as kv_network

    source, destination = _caches(3), _caches(None)
    path = str(tmp_path / "m3-0.rank0")
    kv_transfer.create_file(source, 2, path)
    jobs = kv_background.KVCopyJobs()
    jobs.import_("m3-0", kv_transfer.import_blocks, destination, [7, 8], path, 30.0, paced=True)
    time.sleep(0.05)
    started = time.monotonic()
    jobs.close()
    assert time.monotonic() - started < 5
    # A fetch from an address where nobody answers, cancelled mid-wait.
    jobs = kv_background.KVCopyJobs()
    jobs.import_(
        "m3-1",
        kv_network.KVNetworkEndpoint().fetch_into,
        destination,
        "m3-1.rank0",
        [7, 8],
        "tcp://127.0.0.1:9",
        CurveKeys.generate(),
    )
    time.sleep(0.2)
    started = time.monotonic()
    jobs.close()
    assert time.monotonic() - started < 5


def test_a_transfer_between_nodes_packs_and_unpacks_layer_by_layer_with_pauses():
    """The network path's in-memory copies are paced too: a pause after each
    layer, and the blocks arrive bit for bit."""
    source, destination = _caches(5), _caches(None)
    pauses: list[str] = []
    packed = kv_transfer.pack_blocks(source, [4, 9, 2], pause=lambda: pauses.append("pack"))
    size = kv_transfer.unpack_blocks(
        destination, [1, 2, 3], packed.numpy().tobytes(), "a test's blocks", pause=lambda: pauses.append("unpack")
    )
    assert size == kv_transfer.packed_size(source, 3)
    assert pauses == ["pack"] * LAYERS + ["unpack"] * LAYERS
    assert all(torch.equal(d[:, [1, 2, 3]], s[:, [4, 9, 2]]) for s, d in zip(source, destination))
