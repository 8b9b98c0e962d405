"""`raylm serve` end to end with the official openai client: completions and
chat (whole and streamed), n, stop, logprobs and seeds checked against
in-process `LLM.generate`; 64 concurrent streams; disconnects free the request."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from raylm import LLM, SamplingParams
from tests.conftest import wait_until
from tests.entrypoints.openai.server_utils import API_KEY, MODEL_NAME, scrape_metric

PROMPTS = ["ROMEO: But, soft! what light", "The quick brown fox jumps over"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(llama_dir):
    """Greedy outputs (with top-3 logprobs) of in-process LLM, the oracle."""
    with LLM(model=llama_dir, num_threads=1, kv_cache_memory_bytes=4 << 20, max_model_len=512) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3)
        completions = llm.generate(PROMPTS, params, use_tqdm=False)
        chat = llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    return {"completions": completions, "chat": chat[0]}


def test_models_version_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(server.url("/health")).status_code == 200
    assert "version" in httpx.get(server.url("/version")).json()


def test_api_key_required(server):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(server.url("/v1/completions"), json=body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"


def test_greedy_completion_matches_llm_generate(client, reference):
    for prompt, expected in zip(PROMPTS, reference["completions"]):
        response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)
        choice = response.choices[0]
        assert choice.text == expected.outputs[0].text
        assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
        assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
        assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_streamed_completion_equals_whole(client, reference):
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[0],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference["completions"][0].outputs[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completion_logprobs_match_llm(client, reference):
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0, logprobs=3)
    logprobs = response.choices[0].logprobs
    expected = reference["completions"][1].outputs[0]
    assert len(logprobs.token_logprobs) == len(expected.token_ids)
    for token_id, got, position, top in zip(
        expected.token_ids, logprobs.token_logprobs, expected.logprobs, logprobs.top_logprobs
    ):
        assert got == pytest.approx(position[token_id].logprob, abs=1e-3)
        # Top-3 plus the chosen token; tokens that decode alike ("\ufffd") share a key.
        assert 1 <= len(top) <= 4 and got in top.values()


def test_echo(client):
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True)
    assert response.choices[0].text.startswith(PROMPTS[0])


def test_chat_matches_llm_chat(client, reference):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_completion_tokens=12, temperature=0, logprobs=True, top_logprobs=2
    )
    expected = reference["chat"].outputs[0]
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert response.usage.prompt_tokens == len(reference["chat"].prompt_token_ids)
    assert len(choice.logprobs.content) == len(expected.token_ids)
    assert all(len(t.top_logprobs) <= 2 for t in choice.logprobs.content)

    stream = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text


def test_n_and_seed(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=10, temperature=1.0, n=2, seed=1234)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == 20
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=5, n=2, seed=7)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_stop_string(client, reference):
    text = reference["completions"][0].outputs[0].text
    # A stop string from inside the greedy text: the output must end right before it.
    start = next(i for i in range(1, len(text) - 1) if text[i : i + 2].strip())
    stop = text[start : start + 2]
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop])
    assert response.choices[0].text == text[: text.index(stop)]
    assert response.choices[0].finish_reason == "stop"


def _sse_events(body: str) -> list[str]:
    return [line[len("data: ") :] for line in body.split("\n") if line.startswith("data: ")]


def test_64_concurrent_streams(server):
    async def one(http: httpx.AsyncClient, i: int) -> list[str]:
        body = {
            "model": MODEL_NAME,
            "prompt": f"{PROMPTS[i % 2]} {i}",
            "max_tokens": 16,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        async with http.stream(
            "POST", server.url("/v1/completions"), json=body, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as response:
            assert response.status_code == 200
            return _sse_events((await response.aread()).decode())

    async def run_all():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as http:
            return await asyncio.gather(*(one(http, i) for i in range(64)))

    results = asyncio.run(run_all())
    assert len(results) == 64
    for events in results:
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 16


def test_disconnect_mid_stream_frees_request(server):
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
    aborted_before = _abort_count(server)
    with httpx.Client(timeout=60) as http:
        with http.stream(
            "POST", server.url("/v1/completions"), json=body, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as response:
            lines = response.iter_lines()
            for _ in range(6):
                next(lines)
            assert scrape_metric(server.base_url, "vllm:num_requests_running") >= 1
    # The connection is closed: the request must leave the engine well before 400 tokens.
    wait_until(
        lambda: scrape_metric(server.base_url, "vllm:num_requests_running") == 0,
        30,
        step=0.1,
        message="the request to leave the engine",
    )
    assert scrape_metric(server.base_url, "vllm:kv_cache_usage_perc") == 0
    assert _abort_count(server) == aborted_before + 1
    assert httpx.get(server.url("/health")).status_code == 200


def test_disconnect_while_waiting_for_whole_response_aborts(server):
    body = {"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": 480, "ignore_eos": True, "n": 8}
    aborted_before = _abort_count(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url("/v1/completions"),
            json=body,
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=httpx.Timeout(60, read=0.1),
        )
    wait_until(lambda: _abort_count(server) >= aborted_before + 8, 30, step=0.1, message="8 aborts")
    assert _abort_count(server) == aborted_before + 8
    assert scrape_metric(server.base_url, "vllm:num_requests_running") == 0


def _abort_count(server) -> float:
    try:
        return scrape_metric(server.base_url, "vllm:request_success_total", 'finished_reason="abort"')
    except AssertionError:  # no abort yet: the labelled series does not exist
        return 0.0


# vLLM's metrics, with their types, that dashboards and autoscalers read.
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
}


def _scrape(server) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url("/metrics"), timeout=10).text
    return {family.name: family for family in text_string_to_metric_families(text)}


def _sample(family, suffix: str = "") -> float:
    return sum(s.value for s in family.samples if s.name == family.name + suffix)


def test_vllm_metrics_exposed_with_their_types(server, client):
    before = _scrape(server)
    # A prompt of several full blocks, twice: the second finds them in the prefix cache.
    prompt = " ".join(["ROMEO: But, soft! what light through yonder window breaks?"] * 8)
    usages = [
        client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
        ).usage
        for _ in range(2)
    ]
    after = _scrape(server)
    for name, kind in VLLM_METRICS.items():
        assert name in after, f"{name} not in /metrics"
        assert after[name].type == kind, f"{name} is a {after[name].type}, vLLM's is a {kind}"
        for sample in after[name].samples:
            assert sample.labels.get("model_name") == MODEL_NAME and sample.labels.get("engine") == "0", sample

    def grew(name: str, suffix: str = "") -> float:
        return _sample(after[name], suffix) - _sample(before[name], suffix)

    assert grew("vllm:generation_tokens", "_total") == 8
    assert grew("vllm:prompt_tokens", "_total") == sum(u.prompt_tokens for u in usages) > 2 * 16
    assert grew("vllm:prefix_cache_queries", "_total") >= grew("vllm:prefix_cache_hits", "_total") > 0
    for histogram in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_generation_tokens",
    ):
        assert grew(histogram, "_count") == 2, histogram
    # One gap per output after the first (a server runs single decode steps by default).
    assert grew("vllm:inter_token_latency_seconds", "_count") == 2 * 3
    assert grew("vllm:request_generation_tokens", "_sum") == 8
    assert grew("vllm:request_success", "_total") == 2
    assert _sample(after["vllm:num_requests_waiting"]) == 0


def test_bench_serve_short_run(server, tmp_path):
    from raylm.entrypoints.cli import main

    out_json = tmp_path / "bench.json"
    code = main(
        [
            "bench",
            "serve",
            "--base-url",
            server.base_url,
            "--api-key",
            API_KEY,
            "--num-prompts",
            "8",
            "--random-input-len",
            "16",
            "--random-output-len",
            "8",
            "--output-json",
            str(out_json),
        ]
    )
    assert code == 0
    result = json.loads(out_json.read_text())
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_output_tokens"] == 64
    assert result["mean_ttft_ms"] > 0 and result["output_throughput"] > 0
