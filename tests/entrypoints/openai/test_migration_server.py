"""Live migration through `raylm serve -dp 2` (local replicas): POST /scale 1
and POST /replicas/{i}/restart move the running requests of the replicas that
leave to the others; every one of 24 streams completes with the text of an
unmoved run, none errors, and no request is recomputed (the migration counter
counts them, the recovery counters do not move)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from raylm import LLM, SamplingParams
from tests.conftest import bos_straggler_env
from tests.entrypoints.openai.server_utils import API_KEY, RaylmServer, scrape_metric
from tests.entrypoints.openai.stream_utils import stream_completion

PROMPTS = [f"ROMEO {i}: speak" for i in range(24)]
# Room to move: the streams are far from their end when replicas leave.
MAX_TOKENS = 300
# Every step of the replicas at least this long (a straggler on the BOS token
# every prompt starts with): the streams last at least MAX_TOKENS x this
# (6 s) however fast the machine decodes, so their moves, paced to a small
# share of a core beside the steps, land before they end (without it, a
# loaded CI run once saw a scale-in move none of them: they completed while
# their replica drained).
STEP_MS = 20
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def mp_dp_server(tmp_path_factory):
    # The embedded model, not a tiny one: a tiny model's cores generate faster
    # than the front end reads, so the server's view of what runs (and the
    # moment of a scale) would lag behind the streams' real progress.
    srv = RaylmServer(
        None,
        ["--api-key", API_KEY, "-dp", "2", "--data-parallel-backend", "mp", "--kv-cache-memory-bytes", "32MiB"],
        str(tmp_path_factory.mktemp("serve-dp-mp") / "server.log"),
        startup_timeout=300.0,
        env=bos_straggler_env(ms=STEP_MS),
    )
    try:
        yield srv
    finally:
        srv.terminate()  # asserts that no process of the tree outlived it


@pytest.fixture(scope="module")
def reference():
    with LLM(kv_cache_memory_bytes=4 << 20, max_model_len=512) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


async def _all_in_flight(client) -> None:
    """Until the server holds every stream in its replicas (the client may read
    its streams later than the server writes them: the server's view says
    whether they still run)."""
    while True:
        replicas = (await client.get("/health")).json()["replicas"]
        if sum(r.get("in_flight", 0) for r in replicas) == len(PROMPTS):
            return
        await asyncio.sleep(0.01)


async def _stream_all(base_url: str, during) -> list[str]:
    """Stream every prompt at once; `during(client)` runs once the server
    holds them all (each then has hundreds of tokens to go)."""
    async with httpx.AsyncClient(base_url=base_url, headers=HEADERS, timeout=300) as client:

        async def one(i: int) -> str:
            return await stream_completion(client, PROMPTS[i], MAX_TOKENS)

        tasks = [asyncio.create_task(one(i)) for i in range(len(PROMPTS))]
        await asyncio.wait_for(_all_in_flight(client), 300)
        await during(client)
        return await asyncio.gather(*tasks)


def _recovered(server) -> float:
    return scrape_metric(server.base_url, "raylm:recovered_requests_total")


def _states(server) -> list[str]:
    return [r["state"] for r in httpx.get(server.url("/health"), timeout=30).json()["replicas"]]


def test_scale_in_migrates_every_running_stream(mp_dp_server, reference):
    recovered = _recovered(mp_dp_server)

    async def scale_in(client) -> None:
        response = await client.post("/scale", json={"data_parallel_size": 1})
        assert response.status_code == 200, response.text

    assert asyncio.run(_stream_all(mp_dp_server.base_url, scale_in)) == reference
    migrated = scrape_metric(mp_dp_server.base_url, "raylm:request_migrations_total", 'reason="scale_in"')
    assert migrated > 0
    assert scrape_metric(mp_dp_server.base_url, "raylm:migration_downtime_seconds_count") == migrated
    assert scrape_metric(mp_dp_server.base_url, "raylm:migration_bytes_total") > 0
    assert _recovered(mp_dp_server) == recovered
    assert _states(mp_dp_server) == ["serving"]
    assert scrape_metric(mp_dp_server.base_url, "raylm:dp_target_replicas") == 1
    response = httpx.post(mp_dp_server.url("/scale"), json={"data_parallel_size": 2}, headers=HEADERS, timeout=300)
    assert response.status_code == 200, response.text


def test_rolling_restart_under_streams_loses_nothing(mp_dp_server, reference):
    recovered = _recovered(mp_dp_server)
    before = scrape_metric(mp_dp_server.base_url, "raylm:request_migrations_total", 'reason="restart"')

    async def rolling_restart(client) -> None:
        for index in (0, 1):
            response = await client.post(f"/replicas/{index}/restart")
            assert response.status_code == 200, response.text

    assert asyncio.run(_stream_all(mp_dp_server.base_url, rolling_restart)) == reference
    assert scrape_metric(mp_dp_server.base_url, "raylm:request_migrations_total", 'reason="restart"') > before
    assert _recovered(mp_dp_server) == recovered
    assert _states(mp_dp_server) == ["serving", "serving"]


def test_restart_route_refuses_clearly(mp_dp_server):
    response = httpx.post(mp_dp_server.url("/replicas/7/restart"), headers=HEADERS, timeout=30)
    assert response.status_code == 400 and "replica 7 is not serving" in response.json()["error"]["message"]
    response = httpx.post(mp_dp_server.url("/replicas/0/restart"), timeout=30)
    assert response.status_code == 401
