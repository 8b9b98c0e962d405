"""The server with the Ray executor at TP=2: the engine-core process starts Ray
itself, the client sees the same greedy text as offline generation, and the
whole tree (Ray included) is gone after SIGTERM."""

from __future__ import annotations

import openai
import pytest

from raylm import LLM, SamplingParams
from tests.entrypoints.openai.server_utils import API_KEY, MODEL_NAME, RaylmServer

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_server(llama_dir, tmp_path_factory):
    srv = RaylmServer(
        llama_dir,
        ["--api-key", API_KEY, "-tp", "2", "--distributed-executor-backend", "ray"],
        str(tmp_path_factory.mktemp("serve-ray") / "server.log"),
        startup_timeout=300.0,
    )
    try:
        yield srv
    finally:
        srv.terminate()  # asserts that no process of the tree outlived it


def test_ray_tp2_server_matches_offline_generation(ray_server, llama_dir):
    client = openai.OpenAI(base_url=ray_server.url("/v1"), api_key=API_KEY)
    prompt = "The quick brown fox"
    completion = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)
    stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    with LLM(llama_dir, kv_cache_memory_bytes=4 << 20, max_model_len=512) as llm:
        expected = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    assert completion.choices[0].text == expected == streamed
    assert completion.usage.completion_tokens <= 12
