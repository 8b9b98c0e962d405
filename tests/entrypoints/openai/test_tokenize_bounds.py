"""/tokenize and /detokenize are bounded as generation requests are (issue 48,
finding 7): a prompt (or chat, or list of ids) past max_model_len is a 400
naming its field, as /v1/completions answers it, so no answer is larger than
max_model_len tokens; the work (parsing, rendering, tokenizing, the token
strings, the answer's JSON) runs off the event loop; and each request goes
through the server's admission control (429 at capacity, 503 at shutdown),
counted until its work is done.

In-process: the real app (build_app) over an AsyncLLM whose engine cores are
fakes (tests/engine/conftest.py); tokenizing needs no core."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

import raylm.engine.supervisor as supervisor_module
from raylm.config import create_engine_config
from raylm.engine.async_llm import AsyncLLM
from raylm.entrypoints.openai import serving_tokenize
from raylm.entrypoints.openai.api_server import build_app
from tests.engine.conftest import FakeCore, FakeLauncher, make_engine  # noqa: F401 - the fixture

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
MAX_MODEL_LEN = 64


@pytest.fixture
def served(make_engine):  # noqa: F811 (the fixture imported above)
    engine, _ = make_engine(max_model_len=MAX_MODEL_LEN)
    return engine, build_app(engine, ["tiny"])


async def _post(app, path: str, body: dict) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
        return await client.post(path, json=body)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text[:500]
    return response.json()["error"]


# ---- past max_model_len: a 400 naming the field -----------------------------------


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": "word " * 100, "return_token_strs": True}, "prompt"),
        # What froze the loop: a 16 MiB prompt's strings (here 4 MiB; the body limit is 16).
        ("/tokenize", {"prompt": "word " * 800_000, "return_token_strs": True}, "prompt"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "word " * 100}], "return_token_strs": True},
            "messages",
        ),
        ("/detokenize", {"tokens": [5] * (MAX_MODEL_LEN + 1)}, "tokens"),
    ],
)
def test_past_max_model_len_is_a_400(served, path, body, param):
    _, app = served
    error = _error(asyncio.run(_post(app, path, {"model": "tiny", **body})), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert f"max_model_len ({MAX_MODEL_LEN})" in error["message"], error


def test_within_max_model_len_answers_as_before(served):
    engine, app = served
    tokenizer = engine.tokenizer
    prompt = "But soft, what light ✨"
    result = asyncio.run(_post(app, "/tokenize", {"model": "tiny", "prompt": prompt, "return_token_strs": True}))
    assert result.status_code == 200 and result.headers["content-type"] == "application/json"
    ids = tokenizer.encode(prompt)
    assert result.json() == {
        "count": len(ids),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids),
    }
    back = asyncio.run(_post(app, "/detokenize", {"model": "tiny", "tokens": ids}))
    assert back.status_code == 200 and back.json() == {"prompt": tokenizer.decode(ids)}
    exactly = asyncio.run(_post(app, "/detokenize", {"model": "tiny", "tokens": [5] * MAX_MODEL_LEN}))
    assert exactly.status_code == 200


# ---- off the event loop --------------------------------------------------------------


class _ThreadRecorder:
    """Wraps callables to note which threads called them."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def wrap(self, name: str, function):
        def recorded(*args, **kwargs):
            self.calls.append((name, threading.get_ident()))
            return function(*args, **kwargs)

        return recorded


def test_the_work_runs_off_the_event_loop(served, monkeypatch):
    engine, app = served
    tokenizer = engine.tokenizer
    recorder = _ThreadRecorder()
    for name in ("encode", "convert_ids_to_tokens", "decode", "apply_chat_template"):
        monkeypatch.setattr(tokenizer, name, recorder.wrap(name, getattr(tokenizer, name)))
    # The module's JSON: the body parsed, the answer written.
    json_module = serving_tokenize.json
    monkeypatch.setattr(
        serving_tokenize,
        "json",
        type(
            "RecordedJson",
            (),
            {
                "loads": staticmethod(recorder.wrap("json.loads", json_module.loads)),
                "dumps": staticmethod(recorder.wrap("json.dumps", json_module.dumps)),
            },
        ),
    )

    async def requests() -> tuple[int, list[httpx.Response]]:
        loop_thread = threading.get_ident()
        responses = [
            await _post(app, "/tokenize", {"model": "tiny", "prompt": "Hello there", "return_token_strs": True}),
            await _post(app, "/tokenize", {"model": "tiny", "messages": MESSAGES, "return_token_strs": True}),
            await _post(app, "/detokenize", {"model": "tiny", "tokens": [5, 6, 7]}),
        ]
        return loop_thread, responses

    loop_thread, responses = asyncio.run(requests())
    assert [r.status_code for r in responses] == [200, 200, 200], [r.text for r in responses]
    called = {name for name, _ in recorder.calls}
    assert {"encode", "convert_ids_to_tokens", "decode", "apply_chat_template", "json.loads"} <= called, called
    on_loop = sorted({name for name, thread in recorder.calls if thread == loop_thread})
    assert on_loop == [], f"ran on the event loop: {on_loop}"


@pytest.fixture
def long_served(monkeypatch, tiny_model_dir):
    """A model whose context holds millions of tokens: a large answer is allowed."""
    monkeypatch.setattr(supervisor_module, "make_launcher", FakeLauncher)
    monkeypatch.setattr(FakeLauncher, "on_start", None)
    monkeypatch.setattr(FakeLauncher, "core_class", FakeCore)
    engine = AsyncLLM(
        create_engine_config(tiny_model_dir("llama", max_position_embeddings=1 << 22), max_model_len=1 << 22)
    )
    try:
        yield engine, build_app(engine, ["tiny"])
    finally:
        engine.shutdown()


def test_a_large_allowed_answer_leaves_the_loop_running(long_served):
    """3M tokens and their strings (a 26 MB answer): the loop ticks on while
    they are made, as the thread lets go of the GIL between slices of JSON
    (was: ~0.8 s frozen here, the answer written on the loop). Loose: a
    stream's tokens come every few tens of ms."""
    _, app = long_served

    async def measure() -> tuple[httpx.Response, float]:
        gaps, done = [], asyncio.Event()

        async def ticker() -> None:
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticking = asyncio.ensure_future(ticker())
        response = await _post(
            app, "/tokenize", {"model": "tiny", "prompt": "word " * 1_000_000, "return_token_strs": True}
        )
        done.set()
        await ticking
        return response, max(gaps)

    response, longest_gap = asyncio.run(measure())
    assert response.status_code == 200 and response.json()["count"] == 3_000_002
    assert longest_gap < 0.4, f"the event loop stood still for {longest_gap:.2f} s"


# ---- admission --------------------------------------------------------------------


def test_at_capacity_tokenize_and_detokenize_are_429(served):
    _, app = served
    admission = app.state.admission
    full = admission.admit(admission.capacity, None)
    try:
        for path, body in (("/tokenize", {"prompt": "Hello"}), ("/detokenize", {"tokens": [5]})):
            response = asyncio.run(_post(app, path, {"model": "tiny", **body}))
            assert _error(response, 429)["type"] == "rate_limit_exceeded"
            assert response.headers["Retry-After"]
    finally:
        full.release()
    assert asyncio.run(_post(app, "/tokenize", {"model": "tiny", "prompt": "Hello"})).status_code == 200
    admission.close()
    assert _error(asyncio.run(_post(app, "/tokenize", {"model": "tiny", "prompt": "Hello"})), 503)


def test_counted_while_its_work_runs_even_after_the_client_left(served, monkeypatch):
    engine, app = served
    admission = app.state.admission
    started, finish = threading.Event(), threading.Event()
    encode = engine.tokenizer.encode

    def slow_encode(*args, **kwargs):
        started.set()
        finish.wait(30)
        return encode(*args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", slow_encode)

    async def scenario() -> list[int]:
        seen = [admission.in_flight]
        request = asyncio.ensure_future(_post(app, "/tokenize", {"model": "tiny", "prompt": "Hello"}))
        while not started.is_set():
            await asyncio.sleep(0.01)
        seen.append(admission.in_flight)  # admitted, tokenizing
        request.cancel()  # the client goes away
        await asyncio.gather(request, return_exceptions=True)
        seen.append(admission.in_flight)  # the thread still works for it
        finish.set()
        while admission.in_flight:
            await asyncio.sleep(0.01)
        seen.append(admission.in_flight)
        return seen

    assert asyncio.run(asyncio.wait_for(scenario(), 60)) == [0, 1, 1, 0]
