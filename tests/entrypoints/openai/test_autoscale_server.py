"""`raylm serve --autoscale 1:2` (local replicas): a burst of streams raises
the replica count to MAX, idleness returns it to MIN (the leaving replica's
requests migrate), every request completes with an unmoved run's text, and
each decision is counted on /metrics."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from raylm import LLM, SamplingParams
from tests.entrypoints.openai.server_utils import MODEL_NAME, RaylmServer, scrape_metric

PROMPTS = [f"JULIET {i}: hark" for i in range(16)]
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def autoscale_server(tmp_path_factory):
    # The embedded model: its steps take long enough that the burst is still
    # running when the replica it asked for comes up.
    srv = RaylmServer(
        None,
        [
            "--autoscale",
            "1:2",
            "--data-parallel-backend",
            "mp",
            "--autoscale-target-ongoing-requests",
            "4",
            "--autoscale-upscale-delay",
            "0.5",
            "--autoscale-downscale-delay",
            "1",
            "--kv-cache-memory-bytes",
            "32MiB",
        ],
        str(tmp_path_factory.mktemp("serve-autoscale") / "server.log"),
        startup_timeout=300.0,
    )
    try:
        yield srv
    finally:
        srv.terminate()


@pytest.fixture(scope="module")
def reference():
    with LLM(kv_cache_memory_bytes=4 << 20, max_model_len=512) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _states(server) -> list[str]:
    return [r["state"] for r in httpx.get(server.url("/health"), timeout=30).json()["replicas"]]


async def _load_until_scaled_out(base_url: str) -> tuple[list[str], list[str]]:
    """Keep len(PROMPTS) requests in flight until /health shows two replicas
    serving, then send one more round (the new replica takes its share) and
    wait for all: (texts, the prompts they answer)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:

        async def one(prompt: str) -> str:
            body = {
                "model": MODEL_NAME,
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            }
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        tasks: list[tuple[str, asyncio.Task]] = []
        deadline = time.monotonic() + 300
        while [r["state"] for r in (await client.get("/health")).json()["replicas"]] != ["serving", "serving"]:
            assert time.monotonic() < deadline, "no scale-out within 300 s"
            while sum(not t.done() for _, t in tasks) < len(PROMPTS):
                prompt = PROMPTS[len(tasks) % len(PROMPTS)]
                tasks.append((prompt, asyncio.create_task(one(prompt))))
            await asyncio.sleep(0.05)
        tasks += [(p, asyncio.create_task(one(p))) for p in PROMPTS]
        return list(await asyncio.gather(*(t for _, t in tasks))), [p for p, _ in tasks]


def test_a_burst_scales_out_and_idleness_scales_back_in(autoscale_server, reference):
    assert _states(autoscale_server) == ["serving"]
    texts, prompts = asyncio.run(_load_until_scaled_out(autoscale_server.base_url))
    assert texts == [reference[PROMPTS.index(p)] for p in prompts]
    assert scrape_metric(autoscale_server.base_url, "raylm:autoscale_decisions_total", 'direction="up"') >= 1
    deadline = time.monotonic() + 120
    while _states(autoscale_server) != ["serving"]:
        assert time.monotonic() < deadline, _states(autoscale_server)
        time.sleep(0.2)
    assert scrape_metric(autoscale_server.base_url, "raylm:autoscale_decisions_total", 'direction="down"') >= 1
    assert scrape_metric(autoscale_server.base_url, "raylm:dp_target_replicas") == 1
