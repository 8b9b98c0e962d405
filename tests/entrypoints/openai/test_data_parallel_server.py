"""`raylm serve -dp 2`: replicas as Ray actors behind the server's router.
Greedy text equals offline generation, the load is shared, /health and
/metrics show each replica (and every series the Grafana board queries),
POST /scale changes the replica count while streams run and none fails, and
SIGTERM leaves no process behind."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from raylm import LLM, SamplingParams
from tests.entrypoints.openai.server_utils import API_KEY, RaylmServer, scrape_metric
from tests.entrypoints.openai.stream_utils import stream_completion

pytestmark = pytest.mark.ray  # the replicas are Ray actors

PROMPTS = [f"ROMEO {i}: speak" for i in range(24)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def dp_server(llama_dir, tmp_path_factory):
    srv = RaylmServer(
        llama_dir,
        ["--api-key", API_KEY, "-dp", "2"],
        str(tmp_path_factory.mktemp("serve-dp") / "server.log"),
        startup_timeout=300.0,
    )
    try:
        yield srv
    finally:
        srv.terminate()  # asserts that no process of the tree (Ray included) outlived it


@pytest.fixture(scope="module")
def reference(llama_dir):
    with LLM(llama_dir, kv_cache_memory_bytes=4 << 20, max_model_len=512) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


async def _stream_all(base_url: str, prompts: list[str], during=None) -> list[str]:
    """Stream every prompt at once; `during(client)` runs once all have
    received their first tokens (so it strikes mid-generation)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    started = asyncio.Event()
    counts = [0] * len(prompts)

    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=300) as client:

        async def one(i: int) -> str:
            def counted() -> None:
                counts[i] += 1
                if all(c >= 2 for c in counts):
                    started.set()

            return await stream_completion(client, prompts[i], MAX_TOKENS, on_chunk=counted)

        tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
        if during is not None:
            await asyncio.wait_for(started.wait(), 300)
            await during(client)
        return await asyncio.gather(*tasks)


def test_replicas_serve_greedy_text_and_share_the_load(dp_server, reference):
    texts = asyncio.run(_stream_all(dp_server.base_url, PROMPTS))
    assert texts == reference
    health = httpx.get(dp_server.url("/health"), timeout=30).json()["replicas"]
    assert [r["state"] for r in health] == ["serving", "serving"]
    routed = [r["num_routed"] for r in health]
    assert min(routed) >= 0.75 * sum(routed) / 2  # each within 25% of an even share
    per_replica = [
        scrape_metric(dp_server.base_url, "raylm:dp_replica_requests_routed", f'replica="{i}"') for i in range(2)
    ]
    assert per_replica == routed


def test_scale_down_and_up_while_streams_run(dp_server, reference):
    async def scale_down_then_up(client: httpx.AsyncClient) -> None:
        response = await client.post("/scale", json={"data_parallel_size": 1})
        assert response.status_code == 200, response.text
        response = await client.post("/scale", json={"data_parallel_size": 2})
        assert response.status_code == 200, response.text

    texts = asyncio.run(_stream_all(dp_server.base_url, PROMPTS, during=scale_down_then_up))
    assert texts == reference  # no request failed or changed
    states = [r["state"] for r in httpx.get(dp_server.url("/health"), timeout=30).json()["replicas"]]
    assert states.count("serving") == 2


def test_concurrent_scale_ups_start_each_replica_once(dp_server):
    """Three scale-ups to 2 at once, from 1: run one after the other, the
    first starts the missing replica and the others find the size reached
    (racing, each would have started one)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert (
        httpx.post(dp_server.url("/scale"), json={"data_parallel_size": 1}, headers=headers, timeout=300).status_code
        == 200
    )

    async def scale_up_thrice() -> list[int]:
        async with httpx.AsyncClient(base_url=dp_server.base_url, headers=headers, timeout=300) as client:
            responses = await asyncio.gather(*(client.post("/scale", json={"data_parallel_size": 2}) for _ in range(3)))
            return [r.status_code for r in responses]

    assert asyncio.run(scale_up_thrice()) == [200] * 3
    replicas = httpx.get(dp_server.url("/health"), timeout=30).json()["replicas"]
    assert [r["state"] for r in replicas] == ["serving", "serving"], replicas


def test_scale_needs_the_api_key_and_a_valid_size(dp_server):
    assert httpx.post(dp_server.url("/scale"), json={"data_parallel_size": 1}).status_code == 401
    headers = {"Authorization": f"Bearer {API_KEY}"}
    response = httpx.post(dp_server.url("/scale"), json={"data_parallel_size": 0}, headers=headers)
    assert response.status_code == 400 and response.json()["error"]["param"] == "data_parallel_size"


# Board metrics a `raylm serve -dp 2` without these features never shows:
# LoRA's (only with --enable-lora) and those whose label sets are made at
# their first event (a finished request's reason, an autoscaling decision),
# which tests/docs checks against the registry.
_BOARD_ONLY_WITH = {
    "vllm:lora_requests_info",
    "raylm:autoscale_decisions_total",
}


def test_the_grafana_board_names_metrics_a_live_server_serves(dp_server):
    """Issue 52: the board's metric names against a live /metrics (tests/docs
    checks them against the registry in process; this scrape is what
    Prometheus would see, series suffixes and all)."""
    import json

    from tests.docs.test_operator_docs import _METRIC_NAME, DASHBOARD, _queries

    asyncio.run(_stream_all(dp_server.base_url, PROMPTS[:2]))  # a request's histograms and counters
    text = httpx.get(dp_server.url("/metrics"), timeout=30).text
    live = {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines() if line and line[0] != "#"}
    board = {name for query in _queries(json.loads(DASHBOARD.read_text())) for name in _METRIC_NAME.findall(query)}
    assert len(board) > 40
    missing = board - live - _BOARD_ONLY_WITH
    assert not missing, f"the board queries series the live server does not serve: {sorted(missing)}"
