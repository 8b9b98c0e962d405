"""Bounded resources, clear refusals: a request beyond the waiting limit is a
429 with Retry-After; an oversized body a 413 (declared or streamed in); too
many prompts, completions or stop strings a 400 naming the field. After each,
the server is healthy, serves the next request, and holds nothing the refused
(or finished) requests left behind."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
from fastapi import FastAPI, Request

from raylm.entrypoints.openai.limits import (
    MAX_PROMPTS_PER_REQUEST,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    RETRY_AFTER_S,
    AdmissionControl,
    BodySizeLimitMiddleware,
    Overloaded,
    ShuttingDown,
)
from raylm.entrypoints.openai.protocol import MAX_N
from raylm.entrypoints.openai.serving_common import OpenAIError
from tests.conftest import wait_until
from tests.entrypoints.openai.server_utils import MODEL_NAME, RaylmServer
from tests.entrypoints.openai.stream_utils import BackgroundStream, long_body, metric, wait_idle

MAX_NUM_SEQS = 1
MAX_WAITING = 2
CAPACITY = MAX_NUM_SEQS + MAX_WAITING
BODY_LIMIT = 64 * 1024
# The tiny model's whole context: fillers that run as long as they can.
MAX_MODEL_LEN = 1024
FILLER_TOKENS = 1000
SHORT = {"model": MODEL_NAME, "prompt": "ROMEO:", "max_tokens": 3}
SHORT_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    srv = RaylmServer(
        llama_dir,
        [
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            "--max-waiting-requests",
            str(MAX_WAITING),
            "--max-request-body-bytes",
            str(BODY_LIMIT),
            "--max-model-len",
            str(MAX_MODEL_LEN),
        ],
        str(tmp_path_factory.mktemp("limits") / "server.log"),
    )
    try:
        yield srv
    finally:
        srv.terminate()


def _assert_error(
    response: httpx.Response, status: int, param: str | None = None, error_type: str = "invalid_request_error"
) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == error_type and error["code"] == status
    assert error["param"] == param, error
    return error


def _assert_serves_next(server: RaylmServer) -> None:
    wait_idle(server)
    assert httpx.get(server.url("/health"), timeout=30).status_code == 200
    response = httpx.post(server.url("/v1/completions"), json=SHORT, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3, response.text
    wait_idle(server)


# ---- 429 beyond the waiting limit --------------------------------------------------------


def _fill(server: RaylmServer, fillers: list[BackgroundStream]) -> None:
    """Top the server up to capacity with long streams: one runs (max-num-seqs
    1), the others wait; returns once all are admitted and one makes progress."""
    fillers[:] = [s for s in fillers if not s.done]
    while len(fillers) < CAPACITY:
        fillers.append(BackgroundStream(server, long_body(f"Story {len(fillers)}:", max_tokens=FILLER_TOKENS)))
    wait_until(lambda: all(s.status is not None or s.done for s in fillers), 60, message="the fillers to be admitted")
    assert all(s.status == 200 for s in fillers), [s.body_text for s in fillers]
    wait_until(lambda: any(s.num_chunks >= 2 for s in fillers), 60, message="a filler to make progress")


def _strike(server: RaylmServer, fillers: list[BackgroundStream], path: str, body: dict) -> httpx.Response:
    """The request sent while the server is full. Should a filler finish around
    it (a machine fast enough to generate a whole context meanwhile), the
    server was not full for sure: top it up and strike again."""
    for _ in range(5):
        _fill(server, fillers)
        response = httpx.post(server.url(path), json=body, timeout=60)
        if response.status_code == 429:
            return response
        # A filler that freed the place shows up as done (however slow the
        # machine, within the bound); none did: full all along, yet admitted,
        # and the assertion will say so. A server that wrongly admits fails
        # every round, so a filler finishing by chance cannot hide it.
        try:
            wait_until(lambda: any(s.done for s in fillers), 30)
        except AssertionError:
            return response
    raise AssertionError("the fillers kept finishing: could not keep the server full")


def test_429_beyond_the_waiting_limit(server):
    refused_before = metric(server, "raylm:requests_refused_total", 'reason="queue_full"')
    fillers: list[BackgroundStream] = []
    try:
        _fill(server, fillers)
        assert metric(server, "raylm:num_sequences_admitted") == CAPACITY
        refused = [
            _strike(server, fillers, "/v1/completions", SHORT),
            _strike(server, fillers, "/v1/completions", {**SHORT, "stream": True}),
            _strike(server, fillers, "/v1/chat/completions", SHORT_CHAT),
            _strike(server, fillers, "/v1/chat/completions", {**SHORT_CHAT, "stream": True}),
        ]
        for response in refused:
            error = _assert_error(response, 429, error_type="rate_limit_exceeded")
            assert "capacity" in error["message"]
            assert response.headers["Retry-After"] == str(RETRY_AFTER_S)
        assert metric(server, "raylm:requests_refused_total", 'reason="queue_full"') == refused_before + len(refused)
        # Refusing is not being unhealthy, and the admitted requests go on.
        assert httpx.get(server.url("/health"), timeout=30).status_code == 200
    finally:
        for stream in fillers:
            stream.hang_up()
        for stream in fillers:
            stream.thread.join(120)
    assert all(s.done for s in fillers)
    for stream in fillers:
        assert not stream.errors and stream.finish_reasons in ([], ["length"]), (stream.errors, stream.finish_reasons)
    _assert_serves_next(server)


def test_a_finished_request_frees_its_place(server):
    """Admission counts what is in flight, not what ever came: one after another,
    many more requests than the limit all pass."""
    for i in range(2 * CAPACITY):
        body = {**SHORT, "stream": i % 2 == 1}
        path = "/v1/completions"
        if i % 3 == 2:
            body, path = {**SHORT_CHAT, "stream": i % 2 == 1}, "/v1/chat/completions"
        response = httpx.post(server.url(path), json=body, timeout=60)
        assert response.status_code == 200, response.text
    _assert_serves_next(server)


# ---- 413 for oversized bodies ----------------------------------------------------------


def _raw_request(server: RaylmServer, head: bytes, body_parts: list[bytes]) -> tuple[int, dict, bytes]:
    """Send a request by hand (the body in parts, stopping early if the server
    answers first and hangs up); the status, headers and body of its answer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(head)
        for part in body_parts:
            try:
                sock.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server answered and hung up: read its answer
        # Read until the server closes (no half-close from here: uvicorn takes
        # it for a client that went away). Every request here ends in a close.
        data = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    lines = head_bytes.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        body = _unchunk(body)
    return status, headers, body


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out, data = out + data[:size], data[size + 2 :]
    return out


def _head(server: RaylmServer, extra: str) -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Content-Type: application/json\r\n{extra}\r\n"
    ).encode()


def _oversized_json() -> bytes:
    """Past the limit, yet within what the server drains before answering."""
    body = json.dumps({**SHORT, "prompt": "x" * (BODY_LIMIT + BODY_LIMIT // 2)}).encode()
    assert BODY_LIMIT < len(body) < 2 * BODY_LIMIT
    return body


def _assert_413(status: int, headers: dict, body: bytes) -> None:
    assert status == 413, body
    error = json.loads(body)["error"]
    assert error["code"] == 413 and error["type"] == "invalid_request_error" and str(BODY_LIMIT) in error["message"]
    assert headers.get("connection") == "close"


def test_413_from_content_length_before_reading(server):
    refused_before = metric(server, "raylm:requests_refused_total", 'reason="body_too_large"')
    # It claims 1 GiB and sends a little: the answer comes without the rest.
    _assert_413(*_raw_request(server, _head(server, f"Content-Length: {2**30}\r\n"), [b'{"prompt": "']))
    # An honest client with a body too large, through a normal HTTP client.
    response = httpx.post(
        server.url("/v1/completions"),
        content=_oversized_json(),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    _assert_error(response, 413)
    assert metric(server, "raylm:requests_refused_total", 'reason="body_too_large"') == refused_before + 2
    _assert_serves_next(server)


def test_413_for_a_chunked_body(server):
    body = _oversized_json()
    parts = [body[i : i + 8192] for i in range(0, len(body), 8192)]
    chunks = [f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in parts] + [b"0\r\n\r\n"]
    _assert_413(*_raw_request(server, _head(server, "Transfer-Encoding: chunked\r\n"), chunks))
    # A chunked body under the limit is served.
    small = json.dumps(SHORT).encode()
    status, _, answer = _raw_request(
        server,
        _head(server, "Transfer-Encoding: chunked\r\nConnection: close\r\n"),
        [f"{len(small):x}\r\n".encode() + small + b"\r\n0\r\n\r\n"],
    )
    assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] == 3
    _assert_serves_next(server)


def test_a_body_at_the_limit_is_read():
    """Just under the limit passes the middleware (the app may still find it bad)."""
    body = json.dumps({**SHORT, "prompt": "x" * (BODY_LIMIT - 200)}).encode()
    assert len(body) <= BODY_LIMIT
    status, _, seen = asyncio.run(_through_middleware([body], declared=len(body)))
    assert status == 200 and seen == len(body)


# ---- 400 for too many prompts, n, stop strings ----------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        ({**SHORT, "prompt": ["hi"] * (MAX_PROMPTS_PER_REQUEST + 1)}, "prompt"),
        ({**SHORT, "prompt": [[1, 2]] * (MAX_PROMPTS_PER_REQUEST + 1)}, "prompt"),
        ({**SHORT, "n": MAX_N + 1}, "n"),
        ({**SHORT, "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
        ({**SHORT, "stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
        ({**SHORT, "stop": ["ok", "y" * (MAX_STOP_STRING_CHARS + 1)]}, "stop"),
        # More sequences (prompts x n) than the server ever holds: no retry would help.
        ({**SHORT, "n": CAPACITY + 1}, "n"),
        ({**SHORT, "prompt": ["a"] * (CAPACITY + 1)}, "prompt"),
    ],
)
def test_400_for_request_limits(server, body, param):
    _assert_error(httpx.post(server.url("/v1/completions"), json=body, timeout=30), 400, param)


@pytest.mark.parametrize(
    "body, param",
    [
        ({**SHORT_CHAT, "n": MAX_N + 1}, "n"),
        ({**SHORT_CHAT, "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
        ({**SHORT_CHAT, "stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
        ({**SHORT_CHAT, "n": CAPACITY + 1}, "n"),
    ],
)
def test_400_for_chat_request_limits(server, body, param):
    _assert_error(httpx.post(server.url("/v1/chat/completions"), json=body, timeout=30), 400, param)


def test_limits_at_the_bound_are_accepted(server):
    body = {
        **SHORT,
        "max_tokens": 1,
        "n": CAPACITY,
        "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS - 1)] + ["z" * MAX_STOP_STRING_CHARS],
    }
    response = httpx.post(server.url("/v1/completions"), json=body, timeout=60)
    assert response.status_code == 200 and len(response.json()["choices"]) == CAPACITY, response.text
    _assert_serves_next(server)


# ---- the pieces, without a server -------------------------------------------------------


def test_admission_control_counts_sequences_and_closes():
    seen: list[int] = []
    refusals: list[str] = []
    admission = AdmissionControl(2, 3, on_change=seen.append, on_refused=refusals.append)
    first = admission.admit(4, "n")
    with pytest.raises(Overloaded) as overloaded:
        admission.admit(2, "n")
    assert overloaded.value.response().headers["Retry-After"] == str(RETRY_AFTER_S)
    second = admission.admit(1, "prompt")
    with pytest.raises(OpenAIError) as too_big:
        admission.admit(6, "prompt")
    assert too_big.value.status_code == 400 and too_big.value.param == "prompt"
    first.release()
    first.release()  # idempotent
    assert admission.in_flight == 1
    admission.close()
    with pytest.raises(ShuttingDown):
        admission.admit(1, "n")
    second.release()
    assert admission.in_flight == 0 and seen == [4, 5, 1, 0]
    assert refusals == ["queue_full", "shutting_down"]


async def _through_middleware(
    parts: list[bytes], declared: int | None, limit: int = BODY_LIMIT
) -> tuple[int, dict, int]:
    """Run a body through BodySizeLimitMiddleware around an app that reads it:
    the status, the JSON answer, and how many body bytes were handed out."""
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"size": len(await request.body())}

    wrapped = BodySizeLimitMiddleware(app, limit)
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    handed_out = 0
    sent: list[dict] = []

    async def receive():
        nonlocal handed_out
        if messages:
            message = messages.pop(0)
            handed_out += len(message["body"])
            return message
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    headers = [(b"content-type", b"application/json")]
    if declared is not None:
        headers.append((b"content-length", str(declared).encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/echo",
        "raw_path": b"/echo",
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    await wrapped(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body), handed_out


def test_middleware_refuses_a_declared_length_without_reading():
    status, body, handed_out = asyncio.run(_through_middleware([b"x" * 10], declared=2 * BODY_LIMIT + 1))
    assert status == 413 and body["error"]["code"] == 413 and handed_out == 0
    # Somewhat too large: refused from the header, the body read only to be dropped.
    parts = [b"x" * 4096] * (BODY_LIMIT // 4096 + 1)
    status, body, handed_out = asyncio.run(_through_middleware(parts, declared=BODY_LIMIT + 4096))
    assert status == 413 and handed_out == BODY_LIMIT + 4096


@pytest.mark.parametrize("declared", [None, 10], ids=["chunked", "lying-content-length"])
def test_middleware_counts_the_body_as_it_streams_in(declared):
    parts = [b"x" * 4096] * (4 * BODY_LIMIT // 4096)
    status, body, handed_out = asyncio.run(_through_middleware(parts, declared=declared))
    assert status == 413 and body["error"]["code"] == 413
    # The app saw none of it past the limit; the middleware drained another
    # limit's worth at most, not the whole body.
    assert BODY_LIMIT < handed_out <= 2 * BODY_LIMIT + 4096


def test_middleware_passes_bodies_within_the_limit():
    status, body, _ = asyncio.run(_through_middleware([b"a" * 100, b"b" * 100], declared=None))
    assert status == 200 and body == {"size": 200}
    status, body, _ = asyncio.run(_through_middleware([b"{}"], declared="bad"))  # type: ignore[arg-type]
    assert status == 400
