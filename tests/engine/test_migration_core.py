"""Live migration between two engine cores, at the core level (the
supervisor drives the same messages: test_migration.py): a request's K/V
moves in stages, it resumes on the other core without recomputing, and its
output is the one it would have had without moving (greedy equals Hugging
Face; seeded sampling equals an unmoved run). No block is left behind on
either core, whatever way the migration ends."""

from __future__ import annotations

import os
import tempfile
import time

import pytest

from raylm import LLM, SamplingParams
from raylm.engine.protocol import EngineCoreRequest, KVNetwork, MigrateEnd, MigrateExport, MigrateImport
from raylm.kv_transfer import files as kv_transfer
from raylm.kv_transfer import sealed_frames
from raylm.kv_transfer.transport import NetworkTransport
from raylm.testing.hf_oracle import hf_greedy
from tests.conftest import wait_until

PROMPT = [(5 * j) % 200 + 3 for j in range(37)]  # spans several 16-token blocks
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", num_key_value_heads=2)


def _llm(model, **kwargs) -> LLM:
    return LLM(model, dtype="float32", num_threads=1, kv_cache_memory_bytes=8 << 20, **kwargs)


@pytest.fixture(scope="module")
def cores(model):
    a, b = _llm(model), _llm(model)
    yield a.llm_engine.engine_core.engine_core, b.llm_engine.engine_core.engine_core
    a.llm_engine.engine_core.shutdown()
    b.llm_engine.engine_core.shutdown()


def _run(core, request_id: str, until, tokens: list[int]) -> None:
    """Step `core` until `until()`; the request's new tokens go to `tokens`."""
    while not until():
        for out in core.step():
            if out.request_id == request_id:
                tokens.extend(out.new_token_ids)


def _migrate(
    src,
    dst,
    request_id: str,
    first: EngineCoreRequest,
    tokens: list[int],
    shm_dir: str,
    network: KVNetwork | None = None,
) -> dict:
    """The supervisor's side of one migration, by hand: a first stage while
    the request runs, then the final stage; returns what was moved.
    `network`: the K/V goes over sockets (as between nodes), not files."""
    stage1 = src.take_migration_reports(MigrateExport("m1", request_id, f"{shm_dir}/m1-0", False, network))[0]
    assert stage1.ok and stage1.num_blocks >= 2, stage1
    assert (stage1.sources is None) == (network is None)
    # A stage before the last is read in beside the steps: reported once the ranks are done.
    early = dst.take_migration_reports(
        MigrateImport(
            "m1", request_id, f"{shm_dir}/m1-0", stage1.num_blocks, final=False, network=network, sources=stage1.sources
        )
    )
    # Until the request arrives the destination runs single steps (no decode burst to hold it back).
    assert dst.scheduler.expecting_imports
    # The source decodes on while both sides copy.
    _run(src, request_id, lambda: len(tokens) >= stage1.num_output_tokens + 3, tokens)
    imported = early[0] if early else _report(dst)
    assert imported.ok and imported.num_blocks == stage1.num_blocks, imported
    final = src.take_migration_reports(MigrateExport("m1", request_id, f"{shm_dir}/m1-1", True, network))
    final = final[0] if final else _poll(src)
    assert final.ok and final.final and final.num_output_tokens == len(tokens), (final, len(tokens))
    continuation = EngineCoreRequest(
        request_id, first.prompt_token_ids, first.sampling_params, first.eos_token_id, output_token_ids=list(tokens)
    )
    done = dst.take_migration_reports(
        MigrateImport(
            "m1",
            request_id,
            f"{shm_dir}/m1-1",
            final.num_blocks,
            final=True,
            request=continuation,
            num_computed_tokens=final.num_computed_tokens,
            network=network,
            sources=final.sources,
        )
    )[0]
    assert done.ok, done
    assert not dst.scheduler.expecting_imports
    src.take_migration_reports(MigrateEnd("m1", request_id, commit=True))
    if network is not None:  # every offer was fetched, none is left behind
        assert src.executor.collective_rpc(lambda worker: worker.kv_network.withdraw("")) == [0]
    return {"stage1": stage1, "final": final}


def _record_scheduled(core, request_id: str) -> list[int]:
    """The tokens each step schedules for `request_id` on `core`, from now on."""
    scheduled: list[int] = []
    schedule = core.scheduler.schedule

    def recording():
        output = schedule()
        if request_id in output.num_scheduled_tokens:
            scheduled.append(output.num_scheduled_tokens[request_id])
        return output

    core.scheduler.schedule = recording
    return scheduled


def _report(core, message=None, timeout_s: float = 30.0):
    """`core`'s report on `message` (or on what it is doing), waiting for
    one that runs beside the steps."""
    reports = core.take_migration_reports(message)
    deadline = time.monotonic() + timeout_s
    while not reports and time.monotonic() < deadline:
        time.sleep(0.002)
        reports = core.take_migration_reports()
    assert len(reports) == 1, reports
    return reports[0]


def _poll(core):
    reports = []
    _run(core, "", lambda: bool(reports.extend(core.take_migration_reports()) or reports), [])
    return reports[0]


def _generate(src, dst, params: SamplingParams, migrate: bool, network: KVNetwork | None = None) -> list[int]:
    request_id = f"r-{migrate}-{params.seed}"
    first = EngineCoreRequest(request_id, PROMPT, params, eos_token_id=None)
    src.add_request(EngineCoreRequest(request_id, PROMPT, params, eos_token_id=None))
    tokens: list[int] = []
    if migrate:
        _run(src, request_id, lambda: len(tokens) >= 12, tokens)
        with tempfile.TemporaryDirectory(dir="/dev/shm") as shm_dir:
            moved = _migrate(src, dst, request_id, first, tokens, shm_dir, network)
            assert not src.has_unfinished_requests()
            scheduled = _record_scheduled(dst, request_id)
            _run(dst, request_id, lambda: not dst.has_unfinished_requests(), tokens)
            # Nothing recomputed: each step computed one token, the first one included.
            assert set(scheduled) == {1}, scheduled
            del dst.scheduler.schedule
            assert moved["final"].num_computed_tokens == len(PROMPT) + moved["final"].num_output_tokens - 1
    else:
        _run(src, request_id, lambda: not src.has_unfinished_requests(), tokens)
    for core in (src, dst):
        assert core.scheduler.kv_cache_manager.usage == 0.0 or not core.scheduler.kv_cache_manager.req_blocks
        kv = core.scheduler.kv_cache_manager
        assert not kv.req_blocks and not kv.imports, "a block was left behind"
    return tokens


def test_greedy_migrated_request_equals_hugging_face(cores, model):
    src, dst = cores
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = hf_greedy(model, [PROMPT], MAX_TOKENS)[0].token_ids
    assert _generate(src, dst, params, migrate=True) == expected
    # And back the other way.
    assert _generate(dst, src, params, migrate=True) == expected


def test_greedy_request_migrated_over_the_network_equals_hugging_face(cores, model):
    """The cross-node path (sealed frames over TCP, raylm.kv_transfer.network), on loopback."""
    src, dst = cores
    network = KVNetwork("127.0.0.1", sealed_frames.new_key())
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = hf_greedy(model, [PROMPT], MAX_TOKENS)[0].token_ids
    assert _generate(src, dst, params, migrate=True, network=network) == expected


def _recording_tokens(core, request_id: str) -> list[int]:
    """The tokens `core` makes for `request_id` from now on, whoever steps it."""
    tokens: list[int] = []
    step = core.step

    def recording():
        outputs = step()
        for out in outputs:
            if out.request_id == request_id:
                tokens.extend(out.new_token_ids)
        return outputs

    core.step = recording
    return tokens


def test_a_stranger_hammering_the_kv_socket_hurts_no_stream(cores, model):
    """While a stranger floods the source rank's K/V socket (junk, and
    requests by name in the clear, sealed with a foreign key, or oversized),
    another client's request decodes beside a request migrated over that
    socket: both equal Hugging Face, the stranger gets nothing, and the
    socket's thread answered only the two rightful fetches."""
    from tests.worker.test_kv_network import KVSocketStranger

    src, dst = cores
    network = KVNetwork("127.0.0.1", sealed_frames.new_key())
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    other_prompt = PROMPT[7:]
    expected = [r.token_ids for r in hf_greedy(model, [PROMPT, other_prompt], MAX_TOKENS)]
    # The socket the migration's stages will be offered on, made now by an offer withdrawn at once.
    route = NetworkTransport(network.host, network.key).route("warm-up")
    [[_, address]] = src.executor.collective_rpc("kv_export", args=(route, [0]))
    assert src.executor.collective_rpc("kv_withdraw", args=(route, "warm-up")) == [1]
    server = src.executor.driver_worker.worker.kv_network._server
    assert server.address == address
    already_received = server.requests_received
    stranger = KVSocketStranger(address, ["m5-0.rank0", "m5-1.rank0", "m1-0.rank0"])
    first = EngineCoreRequest("hammered", PROMPT, params, eos_token_id=None)
    other_tokens = _recording_tokens(src, "other-client")
    tokens: list[int] = []
    stranger.start()
    try:
        wait_until(lambda: stranger.rounds >= 2, 60, message="the stranger's first rounds")
        src.add_request(EngineCoreRequest("hammered", PROMPT, params, eos_token_id=None))
        src.add_request(EngineCoreRequest("other-client", other_prompt, params, eos_token_id=None))
        _run(src, "hammered", lambda: len(tokens) >= 12, tokens)
        with tempfile.TemporaryDirectory(dir="/dev/shm") as shm_dir:
            _migrate(src, dst, "hammered", first, tokens, shm_dir, network)
        during = len(other_tokens)
        _run(dst, "hammered", lambda: not dst.has_unfinished_requests(), tokens)
    finally:
        stranger.stop.set()
        stranger.join(30)
        del src.step
    _run(src, "other-client", lambda: not src.has_unfinished_requests(), other_tokens)
    assert 0 < during < MAX_TOKENS  # the other stream was decoding through the migration
    assert [tokens, other_tokens] == expected
    assert not stranger.is_alive() and stranger.answers == []
    assert server.requests_received - already_received == 2  # the destination's two fetches
    for core in (src, dst):
        kv = core.scheduler.kv_cache_manager
        assert not kv.req_blocks and not kv.imports, "a block was left behind"


def test_seeded_sampling_continues_its_stream(cores):
    src, dst = cores
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert _generate(src, dst, params, migrate=True) == _generate(src, dst, params, migrate=False)


def _decoding_at(core, request_id: str) -> tuple[SamplingParams, list[int]]:
    """A greedy request of PROMPT on `core`, 12 tokens into its decode: its params and tokens so far."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    core.add_request(EngineCoreRequest(request_id, PROMPT, params, eos_token_id=None))
    tokens: list[int] = []
    _run(core, request_id, lambda: len(tokens) >= 12, tokens)
    return params, tokens


def test_abandoned_migration_leaves_the_request_running_at_the_source(cores, model):
    src, dst = cores
    request_id = "abandoned"
    params, tokens = _decoding_at(src, request_id)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm_dir:
        stage1 = src.take_migration_reports(MigrateExport("m2", request_id, f"{shm_dir}/a", final=False))[0]
        assert _report(dst, MigrateImport("m2", request_id, f"{shm_dir}/a", stage1.num_blocks, final=False)).ok
        final = src.take_migration_reports(MigrateExport("m2", request_id, f"{shm_dir}/b", final=True))[0]
        assert final.ok and request_id in src.scheduler.paused
        # The destination cannot take it (the file is gone): it refuses and frees its reservation.
        os.remove(f"{shm_dir}/b.rank0")
        refused = dst.take_migration_reports(
            MigrateImport(
                "m2",
                request_id,
                f"{shm_dir}/b",
                final.num_blocks,
                final=True,
                request=EngineCoreRequest(request_id, PROMPT, params, None, 0.0, list(tokens)),
                num_computed_tokens=final.num_computed_tokens,
            )
        )[0]
        assert not refused.ok and "cannot be read" in refused.error
        assert not dst.scheduler.kv_cache_manager.req_blocks and not dst.has_unfinished_requests()
        assert not dst.scheduler.expecting_imports
        src.take_migration_reports(MigrateEnd("m2", request_id, commit=False))
    _run(src, request_id, lambda: not src.has_unfinished_requests(), tokens)
    assert tokens == hf_greedy(model, [PROMPT], MAX_TOKENS)[0].token_ids
    assert not src.scheduler.kv_cache_manager.req_blocks


def test_engines_of_different_layouts_refuse(model, cores):
    src, _ = cores
    other = _llm(model, block_size=32)
    try:
        dst = other.llm_engine.engine_core.engine_core
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        src.add_request(EngineCoreRequest("layout", PROMPT, params, eos_token_id=None))
        tokens: list[int] = []
        _run(src, "layout", lambda: len(tokens) >= 2, tokens)
        with tempfile.TemporaryDirectory(dir="/dev/shm") as shm_dir:
            stage1 = src.take_migration_reports(MigrateExport("m3", "layout", f"{shm_dir}/a", final=False))[0]
            refused = _report(dst, MigrateImport("m3", "layout", f"{shm_dir}/a", stage1.num_blocks, final=False))
            assert not refused.ok and "KV layouts differ" in refused.error
            assert not dst.scheduler.kv_cache_manager.req_blocks
            src.take_migration_reports(MigrateEnd("m3", "layout", commit=False))
        src.abort_requests(["layout"])
        assert not src.scheduler.kv_cache_manager.req_blocks
    finally:
        other.llm_engine.engine_core.shutdown()


@pytest.mark.slow
def test_tensor_parallel_engines_move_each_rank_s_shard(model):
    """TP=2 on the mp executor: rank i's K/V goes to rank i (two files per stage)."""
    a = _llm(model, tensor_parallel_size=2, distributed_executor_backend="mp")
    b = _llm(model, tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        src, dst = a.llm_engine.engine_core.engine_core, b.llm_engine.engine_core.engine_core
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert _generate(src, dst, params, migrate=True) == hf_greedy(model, [PROMPT], MAX_TOKENS)[0].token_ids
    finally:
        a.llm_engine.engine_core.shutdown()
        b.llm_engine.engine_core.shutdown()


def test_blocks_of_an_abandoned_background_import_are_freed_once_it_ends(cores, monkeypatch):
    """A stage read in beside the steps may be abandoned while its ranks still
    write the reserved blocks: they are freed only once the ranks are done."""
    src, dst = cores
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    src.add_request(EngineCoreRequest("slow-import", PROMPT, params, eos_token_id=None))
    tokens: list[int] = []
    _run(src, "slow-import", lambda: len(tokens) >= 12, tokens)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm_dir:
        block_ids = src.scheduler.kv_cache_manager.get_block_ids("slow-import")[:2]
        path = f"{shm_dir}/m4-0.rank0"
        kv_transfer.create_file(src.executor.driver_worker.worker.model_runner.kv_caches, 2, path)
        # The source has not filled the file yet: the destination's thread waits.
        assert not dst.take_migration_reports(MigrateImport("m4", "slow-import", f"{shm_dir}/m4-0", 2, final=False))
        assert dst.migrations.copying and "m4" in dst.scheduler.kv_cache_manager.imports
        dst.take_migration_reports(MigrateEnd("m4", "slow-import", commit=False))
        assert "m4" in dst.scheduler.kv_cache_manager.imports  # still being written
        kv_transfer.fill_file(src.executor.driver_worker.worker.model_runner.kv_caches, block_ids, path)
        deadline = time.monotonic() + 30
        while dst.migrations.copying and time.monotonic() < deadline:
            assert not dst.take_migration_reports()  # an abandoned stage is not reported
            time.sleep(0.002)
        assert not dst.migrations.copying
        assert not dst.scheduler.kv_cache_manager.imports
    src.abort_requests(["slow-import"])
    assert not src.scheduler.kv_cache_manager.req_blocks


def test_an_abandoned_import_waiting_for_a_dead_source_frees_its_blocks_at_once(cores):
    """The source died before it filled its file: abandoning the migration
    cancels the destination's wait, so its reserved blocks are free within
    a poll or two, not after the import's 30 s timeout."""
    src, dst = cores
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm_dir:
        kv_transfer.create_file(src.executor.driver_worker.worker.model_runner.kv_caches, 2, f"{shm_dir}/m5-0.rank0")
        assert not dst.take_migration_reports(MigrateImport("m5", "dead-source", f"{shm_dir}/m5-0", 2, final=False))
        assert dst.migrations.copying and "m5" in dst.scheduler.kv_cache_manager.imports
        time.sleep(0.05)  # the rank's thread is in its wait
        abandoned = time.monotonic()
        dst.take_migration_reports(MigrateEnd("m5", "dead-source", commit=False))
        while dst.migrations.copying and time.monotonic() - abandoned < 30:
            assert not dst.take_migration_reports()  # an abandoned stage is not reported
            time.sleep(0.002)
        assert time.monotonic() - abandoned < 5
        assert not dst.scheduler.kv_cache_manager.imports and not dst.scheduler.expecting_imports


def test_a_background_import_whose_ranks_finish_at_different_polls_is_reported_once_all_are_done():
    """Rank 0 finishes its copy a poll before rank 1: asked again, rank 0 no
    longer knows the copy, and that must not count as its failure (a TP=2
    migration was refused this way in a loaded CI run)."""
    import threading
    from types import SimpleNamespace

    from raylm.engine.core_migration import MigrationEndpoint, _BackgroundImport
    from raylm.kv_transfer.background import KVCopyJobs

    ranks = [KVCopyJobs(), KVCopyJobs()]
    release = threading.Event()
    try:
        ranks[0].import_("m9-0", lambda cancelled: 100)
        ranks[1].import_("m9-0", lambda cancelled: release.wait(30) and 200)
        executor = SimpleNamespace(collective_rpc=lambda method, args: [r.finished(*args) for r in ranks])
        endpoint = MigrationEndpoint(SimpleNamespace(executor=executor))
        message = MigrateImport("m9", "r9", "/dev/shm/raylm-test/m9-0", 2, final=False)
        endpoint._importing["m9"] = _BackgroundImport(message, [3, 4])
        wait_for = time.monotonic() + 30
        while "m9-0" in ranks[0]._jobs and time.monotonic() < wait_for:
            assert endpoint._imports_done() == []  # rank 1 still copies
            time.sleep(0.01)
        assert endpoint._imports_done() == []  # rank 0 is asked again: it has forgotten the copy
        release.set()
        reports = []
        while not reports and time.monotonic() < wait_for:
            reports = endpoint._imports_done()
        (report,) = reports
        assert report.ok and report.num_blocks == 2 and report.num_bytes == 300, report
        assert not endpoint.copying
    finally:
        release.set()
        for r in ranks:
            r.close()


def test_a_destination_that_rebuilt_its_executor_refuses_the_migration_s_later_stages(cores, model):
    """Issue 48, finding 2: the destination's executor is rebuilt between a
    completed stage and the final one. The blocks of that stage are gone with
    it: the core reports the migration refused, and refuses its later stages
    (accepting the final one would resume the request over blocks nobody
    wrote, and register them in the prefix cache under the real prefix)."""
    from raylm.executor.errors import WorkerDiedError

    src, dst = cores
    request_id = "rebuilt-destination"
    params, tokens = _decoding_at(src, request_id)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm_dir:
        stage1 = src.take_migration_reports(MigrateExport("m6", request_id, f"{shm_dir}/m6-0", final=False))[0]
        assert _report(dst, MigrateImport("m6", request_id, f"{shm_dir}/m6-0", stage1.num_blocks, final=False)).ok
        dst._recover(WorkerDiedError("a worker was killed"), None)
        lost = dst.take_migration_reports()
        assert [(r.migration_id, r.ok) for r in lost] == [("m6", False)], lost
        final = _report(src, MigrateExport("m6", request_id, f"{shm_dir}/m6-1", final=True))
        assert final.ok
        refused = dst.take_migration_reports(
            MigrateImport(
                "m6",
                request_id,
                f"{shm_dir}/m6-1",
                final.num_blocks,
                final=True,
                request=EngineCoreRequest(request_id, PROMPT, params, None, 0.0, list(tokens)),
                num_computed_tokens=final.num_computed_tokens,
                stage=1,
            )
        )[0]
        assert not refused.ok and "holds no stage" in refused.error
        assert not dst.has_unfinished_requests() and not dst.scheduler.kv_cache_manager.imports
        src.take_migration_reports(MigrateEnd("m6", request_id, commit=False))
    _run(src, request_id, lambda: not src.has_unfinished_requests(), tokens)
    assert tokens == hf_greedy(model, [PROMPT], MAX_TOKENS)[0].token_ids


def test_a_request_resubmitted_while_its_abandoned_import_is_open_computes_its_own_kv(cores, model):
    """The cause of the changed streams in issue 48: a migration to this core
    is abandoned (its source died) while its background import is still
    open, and the request, resubmitted after the death, arrives here under
    the same id. Import reservations were kept under the request's id, so
    its block table began with the import's blocks, its prefix-cache hits
    after them: it read K/V nobody wrote for it (and wrote its own into a
    shared cached block). They are kept apart now, by migration."""
    src, dst = cores
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    dst.add_request(EngineCoreRequest("earlier", PROMPT, params, eos_token_id=None))  # the prompt's blocks, cached here
    _run(dst, "earlier", lambda: not dst.has_unfinished_requests(), [])
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm_dir:
        caches = src.executor.driver_worker.worker.model_runner.kv_caches
        kv_transfer.create_file(caches, 2, f"{shm_dir}/m7-0.rank0")  # its source died before filling it
        assert not dst.take_migration_reports(MigrateImport("m7", "resubmitted", f"{shm_dir}/m7-0", 2, final=False))
        dst.take_migration_reports(MigrateEnd("m7", "resubmitted", commit=False))
        dst.add_request(EngineCoreRequest("resubmitted", PROMPT, params, eos_token_id=None))  # recovered here
        tokens: list[int] = []
        # (The core's loop polls its copies; here the test does, between steps.)
        _run(
            dst,
            "resubmitted",
            lambda: not (dst.has_unfinished_requests() or dst.take_migration_reports() or dst.migrations.copying),
            tokens,
        )
    assert tokens == hf_greedy(model, [PROMPT], MAX_TOKENS)[0].token_ids
    kv = dst.scheduler.kv_cache_manager
    assert not kv.req_blocks and not kv.imports
