"""Under sustained overload the server stays bounded: 256 clients stream
completions as fast as they are let, far past a small waiting limit, for half a
minute. No 5xx; every stream either completes (finish_reason "length", [DONE])
or is refused up front with a 429 and Retry-After; none hangs; afterwards the
server holds nothing, serves the next request, and its memory is where it was."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter

import httpx
import psutil
import pytest

from tests.entrypoints.openai.server_utils import MODEL_NAME, RaylmServer
from tests.entrypoints.openai.stream_utils import metric, wait_idle

NUM_CLIENTS = 256
MAX_NUM_SEQS = 8
MAX_WAITING = 8
WARMUP_S = 10.0
DURATION_S = 30.0
# Long enough that a request holds its place a while: the server stays full.
MAX_TOKENS = 48
# No request may take longer than this, queued or not: past it, it is stuck.
REQUEST_DEADLINE_S = 120.0
# Generous: allocator noise and lazily grown caches, not a leak per request
# (a leak of even 1 KiB per request would be ~20 MiB here).
RSS_GROWTH_BOUND = 64 * 2**20


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    srv = RaylmServer(
        llama_dir,
        ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING)],
        str(tmp_path_factory.mktemp("load") / "server.log"),
    )
    try:
        yield srv
    finally:
        srv.terminate()


async def _one_request(client: httpx.AsyncClient, index: int, progress: dict) -> tuple[str, str]:
    """('ok' | '429' | a failure kind, detail); `progress` says how far it got."""
    body = {
        "model": MODEL_NAME,
        "prompt": f"Client {index} says",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0.8,
        "stream": True,
    }
    async with client.stream("POST", "/v1/completions", json=body) as response:
        progress["status"] = response.status_code
        if response.status_code == 429:
            await response.aread()
            error = json.loads(response.content)["error"]
            if "Retry-After" not in response.headers or error["code"] != 429:
                return "bad-429", response.text
            return "429", ""
        if response.status_code != 200:
            await response.aread()
            return f"status-{response.status_code}", response.text
        finish_reasons, tokens, done, errors = [], 0, False, []
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            progress["events"] = progress.get("events", 0) + 1
            if "error" in event:
                errors.append(event["error"])
                continue
            choice = event["choices"][0]
            tokens += 1
            if choice["finish_reason"]:
                finish_reasons.append(choice["finish_reason"])
        if errors or not done or finish_reasons != ["length"]:
            return "broken-stream", f"{errors} done={done} finish={finish_reasons} chunks={tokens}"
        return "ok", ""


async def _client_loop(
    client: httpx.AsyncClient, index: int, stop_at: float, outcomes: Counter, failures: list
) -> None:
    rng = random.Random(index)
    await asyncio.sleep(rng.uniform(0, 0.2))
    while time.monotonic() < stop_at:
        progress: dict = {}
        try:
            kind, detail = await asyncio.wait_for(_one_request(client, index, progress), REQUEST_DEADLINE_S)
        except asyncio.TimeoutError:
            kind, detail = "stuck", f"no answer within {REQUEST_DEADLINE_S}s ({progress})"
        except httpx.HTTPError as e:
            kind, detail = "http-error", f"{e!r} ({progress or 'no response'})"
        outcomes[kind] += 1
        if kind not in ("ok", "429"):
            failures.append((kind, detail))
            return
        if kind == "429":
            # Retry-After says 1 s; jitter, so the clients do not come back in step.
            await asyncio.sleep(rng.uniform(0.5, 1.5))


async def _load(server: RaylmServer, duration: float) -> tuple[Counter, list]:
    outcomes: Counter = Counter()
    failures: list = []
    # A pooled connection is dropped after 2 s idle, before the server's 5 s
    # keep-alive timeout can close it just as a request is sent on it (a race
    # of every HTTP client and server, which no server change removes).
    limits = httpx.Limits(
        max_connections=NUM_CLIENTS + 8, max_keepalive_connections=NUM_CLIENTS + 8, keepalive_expiry=2.0
    )
    timeout = httpx.Timeout(REQUEST_DEADLINE_S, connect=30)
    async with httpx.AsyncClient(base_url=server.base_url, limits=limits, timeout=timeout) as client:
        stop_at = time.monotonic() + duration
        await asyncio.gather(*(_client_loop(client, i, stop_at, outcomes, failures) for i in range(NUM_CLIENTS)))
    return outcomes, failures


def _rss(server: RaylmServer) -> tuple[int, int]:
    """Resident memory of the front end, and of its whole process tree."""
    front = psutil.Process(server.proc.pid)
    tree = [front, *front.children(recursive=True)]
    return front.memory_info().rss, sum(p.memory_info().rss for p in tree)


def test_256_streams_against_a_small_waiting_limit(server):
    refused_before = metric(server, "raylm:requests_refused_total", 'reason="queue_full"')
    # A first round brings the server's memory to its working size.
    warmup, failures = asyncio.run(_load(server, WARMUP_S))
    assert not failures, failures[:5]
    wait_idle(server)
    front_before, tree_before = _rss(server)

    outcomes, failures = asyncio.run(_load(server, DURATION_S))
    assert not failures, (outcomes, failures[:5])
    assert set(outcomes) <= {"ok", "429"}, outcomes
    # Overloaded for real, and serving all the while.
    total_429 = warmup["429"] + outcomes["429"]
    assert total_429 > 0 and outcomes["ok"] > MAX_NUM_SEQS + MAX_WAITING, (warmup, outcomes)
    assert metric(server, "raylm:requests_refused_total", 'reason="queue_full"') == refused_before + total_429

    # Nothing left behind: no request held, the server healthy and serving.
    wait_idle(server)
    assert httpx.get(server.url("/health"), timeout=30).status_code == 200
    response = httpx.post(
        server.url("/v1/completions"), json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4}, timeout=60
    )
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    front_after, tree_after = _rss(server)
    assert front_after - front_before < RSS_GROWTH_BOUND, (front_before, front_after, outcomes)
    assert tree_after - tree_before < 2 * RSS_GROWTH_BOUND, (tree_before, tree_after, outcomes)
