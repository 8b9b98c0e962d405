"""A request that makes the engine's steps fail gets an error (HTTP 500, or an
error event in its stream); the requests beside it complete, unchanged."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from raylm import LLM, SamplingParams
from raylm.engine.async_llm import AsyncLLM
from raylm.entrypoints.openai.api_server import build_app
from tests.engine.test_recovery import POISON, PoisonedUniProcExecutor

GOOD = [[5, 6, 7, 8, 9], [20, 21, 22, 23], list(range(30, 60))]
BAD = [5, 6, POISON, 7]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", num_key_value_heads=2)


@pytest.mark.slow
def test_poisoned_request_fails_alone(model):
    with LLM(model, dtype="float32", kv_cache_memory_bytes=16 << 20) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        reference = [
            o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in GOOD], params, use_tqdm=False)
        ]

    async def run():
        engine = AsyncLLM.from_engine_args(
            model=model,
            dtype="float32",
            kv_cache_memory_bytes=16 << 20,
            distributed_executor_backend=PoisonedUniProcExecutor,
        )
        try:
            app = build_app(engine, ["tiny"])
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:

                def body(prompt, stream=False):
                    return {
                        "model": "tiny",
                        "prompt": prompt,
                        "max_tokens": MAX_TOKENS,
                        "temperature": 0,
                        "ignore_eos": True,
                        "stream": stream,
                    }

                async def good(prompt):
                    response = await client.post("/v1/completions", json=body(prompt))
                    assert response.status_code == 200, response.text
                    return response.json()

                async def bad_stream():
                    async with client.stream("POST", "/v1/completions", json=body(BAD, stream=True)) as response:
                        assert response.status_code == 200
                        return [line async for line in response.aiter_lines() if line.startswith("data: ")]

                results = await asyncio.gather(
                    *(good(p) for p in GOOD), client.post("/v1/completions", json=body(BAD)), bad_stream()
                )
                health = await client.get("/health")
            return results, health
        finally:
            engine.shutdown()

    results, health = asyncio.run(run())
    *good, bad, bad_events = results
    for response, expected in zip(good, reference):
        assert response["choices"][0]["finish_reason"] == "length"
        assert response["choices"][0]["text"] == expected
    assert bad.status_code == 500
    assert "poisoned" in bad.json()["error"]["message"]
    assert bad_events[-1] == "data: [DONE]"
    error_event = json.loads(bad_events[-2][len("data: ") :])
    assert "poisoned" in error_event["error"]["message"]
    assert health.status_code == 200  # the engine goes on
