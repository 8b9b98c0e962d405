"""`raylm serve --enable-lora --lora-modules name=path`: a request's `model`
naming an adapter runs with it (completions and chat, whole and streamed),
its greedy tokens equal to Hugging Face + PEFT's; /v1/models lists the
adapters under their base; an unknown model is a 404. With
--allow-runtime-lora-updating, adapters are loaded and unloaded at run time
while other streams run, a bad adapter is refused with a 400 naming the
problem and changes nothing, paths stay inside --lora-directory, and an
unload waits for the adapter's requests. One server for the module."""

from __future__ import annotations

import json
import os
import shutil
import threading

import httpx
import pytest
from safetensors.torch import load_file, save_file

from raylm.testing.lora_oracle import make_tiny_adapter, peft_greedy
from tests.conftest import wait_until
from tests.entrypoints.openai.server_utils import API_KEY, MODEL_NAME, RaylmServer, scrape_metric
from tests.entrypoints.openai.stream_utils import BackgroundStream

MAX_TOKENS = 8
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def lora_dir(llama_dir, tmp_path_factory) -> str:
    """The server's --lora-directory: two adapters ("all" served from the
    start, "mlp" loaded at run time) and a spoiled copy of one."""
    root = tmp_path_factory.mktemp("lora-dir")
    make_tiny_adapter(llama_dir, root / "all", seed=1, rank=8, alpha=16.0)
    make_tiny_adapter(llama_dir, root / "mlp", seed=3, rank=8, alpha=32.0, target_modules=("gate_proj", "up_proj"))
    shutil.copytree(root / "mlp", root / "nan")
    weights = root / "nan" / "adapter_model.safetensors"
    tensors = load_file(weights)
    name = next(n for n in sorted(tensors) if "lora_B" in n)
    tensors[name][0, 0] = float("nan")
    save_file(tensors, weights)
    return str(root)


@pytest.fixture(scope="module")
def lora_server(llama_dir, lora_dir, tmp_path_factory):
    srv = RaylmServer(
        llama_dir,
        [
            "--api-key",
            API_KEY,
            "--enable-lora",
            "--max-loras",
            "2",
            "--max-lora-rank",
            "8",
            "--lora-modules",
            f"all={lora_dir}/all",
            "--allow-runtime-lora-updating",
            "--lora-directory",
            lora_dir,
            "--max-served-loras",
            "2",
        ],
        str(tmp_path_factory.mktemp("serve-lora") / "server.log"),
    )
    try:
        yield srv
    finally:
        srv.terminate()


@pytest.fixture(scope="module")
def http(lora_server):
    with httpx.Client(base_url=lora_server.base_url, headers=HEADERS, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def expected(llama_dir, lora_dir) -> dict:
    """PEFT's greedy tokens of PROMPT per adapter (None: the base model)."""
    return {
        name: peft_greedy(llama_dir, None if name is None else f"{lora_dir}/{name}", [PROMPT], MAX_TOKENS)[0].token_ids
        for name in (None, "all", "mlp")
    }


def _text(http: httpx.Client, model: str) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model
    return response.json()["choices"][0]["text"]


def _streamed_text(http: httpx.Client, path: str, body: dict) -> str:
    text = []
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                for choice in event["choices"]:
                    text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(text)


def test_models_lists_the_adapters_under_their_base(http, lora_dir):
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert cards[MODEL_NAME]["parent"] is None
    assert cards["all"]["parent"] == MODEL_NAME and cards["all"]["root"] == f"{lora_dir}/all"
    assert set(cards) == {MODEL_NAME, "all"}


def test_an_unknown_model_is_a_404_as_in_vllm(http):
    response = http.post("/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["message"] == "The model `nope` does not exist." and error["param"] == "model"


def test_a_request_naming_the_adapter_equals_peft_whole_and_streamed(http, expected, tokenizer):
    want = {name: tokenizer.decode(ids, skip_special_tokens=True) for name, ids in expected.items()}
    assert want["all"] != want[None], "an adapter that changes nothing"
    assert _text(http, "all") == want["all"]
    assert _text(http, MODEL_NAME) == want[None]
    body = {"model": "all", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    assert _streamed_text(http, "/v1/completions", body) == want["all"]


def test_chat_with_the_adapter_equals_peft(http, llama_dir, lora_dir, tokenizer):
    messages = [{"role": "user", "content": "Say something"}]
    prompt = http.post("/tokenize", json={"model": MODEL_NAME, "messages": messages}).json()["tokens"]
    # An adapter's name tokenizes as its base does (vLLM's /tokenize takes it too).
    assert http.post("/tokenize", json={"model": "all", "messages": messages}).json()["tokens"] == prompt
    want = tokenizer.decode(
        peft_greedy(llama_dir, f"{lora_dir}/all", [prompt], MAX_TOKENS)[0].token_ids, skip_special_tokens=True
    )
    body = {"model": "all", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == want
    assert _streamed_text(http, "/v1/chat/completions", body) == want


def test_load_use_unload_reload_while_another_adapter_streams(lora_server, http, expected, tokenizer):
    """Run-time updates under load: a long stream on "all" runs throughout
    and ends as PEFT's; "mlp" is loaded, used, unloaded (then a 404),
    loaded again and used."""
    long = {"model": "all", "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    background = BackgroundStream(lora_server, {**long, "stream": True}, headers=HEADERS)
    try:
        load = {"lora_name": "mlp", "lora_path": "mlp"}
        for _ in range(2):
            response = http.post("/v1/load_lora_adapter", json=load)
            assert response.status_code == 200, response.text
            assert _text(http, "mlp") == tokenizer.decode(expected["mlp"], skip_special_tokens=True)
            assert "mlp" in {card["id"] for card in http.get("/v1/models").json()["data"]}
            response = http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})
            assert response.status_code == 200, response.text
            gone = http.post("/v1/completions", json={"model": "mlp", "prompt": PROMPT, "max_tokens": 2})
            assert gone.status_code == 404
        background.thread.join(300)
        assert background.done and not background.errors and background.finish_reasons == ["length"]
        text = "".join(c["text"] for e in background.events for c in e["choices"])
        assert text.startswith(tokenizer.decode(expected["all"], skip_special_tokens=True))
    finally:
        background.hang_up()
    assert scrape_metric(lora_server.base_url, "raylm:lora_adapter_load_seconds_count") >= 2


def test_a_bad_adapter_is_refused_naming_the_problem_and_nothing_changes(
    lora_server, http, lora_dir, expected, tokenizer
):
    body = {"model": "all", "prompt": PROMPT, "max_tokens": 100, "temperature": 0, "ignore_eos": True, "stream": True}
    background = BackgroundStream(lora_server, body, headers=HEADERS)
    # The cards but their `created`, the time of each /v1/models (as in vLLM).
    cards = lambda: [{k: v for k, v in c.items() if k != "created"} for c in http.get("/v1/models").json()["data"]]  # noqa: E731
    before = cards()
    outside = shutil.copytree(f"{lora_dir}/mlp", f"{lora_dir}-outside")
    os.symlink(outside, f"{lora_dir}/escape")
    try:
        refusals = {
            "nan": ("NaN or infinite", "lora_path"),
            "escape": ("outside the server's --lora-directory", "lora_path"),
            "../" + os.path.basename(outside): ("outside the server's --lora-directory", "lora_path"),
            "missing": ("is not a folder", "lora_path"),
        }
        for path, (words, param) in refusals.items():
            response = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path})
            assert response.status_code == 400, (path, response.text)
            error = response.json()["error"]
            assert words in error["message"] and error["param"] == param, (path, error)
        for name, words in ((MODEL_NAME, "base model"), ("all", "already been loaded")):
            response = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": "mlp"})
            assert response.status_code == 400 and words in response.json()["error"]["message"], response.text
        # --max-served-loras 2: "all" and one more.
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "m1", "lora_path": "mlp"}).status_code == 200
        response = http.post("/v1/load_lora_adapter", json={"lora_name": "m2", "lora_path": "mlp"})
        assert response.status_code == 400 and "its most" in response.json()["error"]["message"]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "m1"}).status_code == 200
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "m1"}).status_code == 404
        assert cards() == before
        background.thread.join(300)
        assert background.done and not background.errors and background.finish_reasons == ["length"]
        assert _text(http, "all") == tokenizer.decode(expected["all"], skip_special_tokens=True)
    finally:
        background.hang_up()
        os.unlink(f"{lora_dir}/escape")
        shutil.rmtree(outside)


def test_unload_waits_for_the_adapters_requests(lora_server, http):
    """The name leaves at once (a new request for it is a 404), but the
    answer waits while a request runs with the adapter: here until its
    client hangs up, 400 tokens in (it has produced a few more meanwhile)."""
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": "mlp"}).status_code == 200
    body = {"model": "mlp", "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    stream = BackgroundStream(lora_server, body, headers=HEADERS)
    unload: dict = {}

    def send_unload() -> None:
        unload["response"] = http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})

    try:
        wait_until(lambda: stream.num_chunks or stream.done, 120, message="the stream's first chunk")
        assert not stream.done
        sender = threading.Thread(target=send_unload, daemon=True)
        sender.start()
        gone = lambda: http.post("/v1/completions", json={"model": "mlp", "prompt": PROMPT, "max_tokens": 2})  # noqa: E731
        wait_until(lambda: gone().status_code == 404, 60, message="the name gone")
        chunks = stream.num_chunks
        wait_until(lambda: stream.num_chunks >= chunks + 3 or stream.done, 120, message="more chunks")
        assert not stream.done and "response" not in unload, "the unload did not wait for the adapter's request"
    finally:
        stream.hang_up()
    sender.join(120)
    assert unload["response"].status_code == 200, unload["response"].text
    stream.thread.join(60)


def test_lora_requests_info_names_the_running_adapters(lora_server, http):
    # Long enough to be seen running by a scrape (150 tokens could end between two; 512 positions).
    body = {"model": "all", "prompt": PROMPT, "max_tokens": 480, "temperature": 0, "ignore_eos": True, "stream": True}
    stream = BackgroundStream(lora_server, body, headers=HEADERS)
    try:
        seen = False
        for _ in range(200):
            text = httpx.get(lora_server.url("/metrics"), timeout=10).text
            if 'running_lora_adapters="all"' in text and 'max_lora="2"' in text:
                seen = True
                break
            if stream.done:
                break
            threading.Event().wait(0.05)
        assert seen, [line for line in text.splitlines() if "lora_requests_info{" in line]
        stream.thread.join(120)
        assert stream.finish_reasons == ["length"]
    finally:
        stream.hang_up()
