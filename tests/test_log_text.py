"""Client strings reach the logs escaped and cut (issue 48, finding 9): a
request id, a decoded path or an exception text with a newline or an ANSI
escape is one escaped line, never a forged log line or a repainted terminal."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import httpx
from fastapi import FastAPI, Request

from raylm.engine.output_processor import OutputProcessor, ParentState
from raylm.entrypoints.openai.api_server import UnhandledErrorMiddleware, _install_error_handlers, build_app
from raylm.log_text import LOG_TEXT_LIMIT, loggable
from raylm.sampling_params import SamplingParams

# A newline that starts a log line of the server's own, then ANSI red and a
# bidi override.
EVIL = "req-1\n2025-01-01 00:00:00 ERROR engine core 1 died\x1b[31m\u202eevil\r"


def test_controls_separators_and_backslashes_are_escaped():
    text = loggable(EVIL + "\\n\t\u2028")
    assert text.isprintable()
    assert text == ("req-1\\n2025-01-01 00:00:00 ERROR engine core 1 died\\x1b[31m\\u202eevil\\r\\\\n\\t\\u2028")
    assert loggable("plain text, ünïcode ok") == "plain text, ünïcode ok"  # printable text is left alone
    assert loggable(ValueError("bad\nvalue")) == "bad\\nvalue"


def test_long_text_is_cut_and_says_how_much():
    text = loggable("x" * 10_000)
    assert text.startswith("x" * LOG_TEXT_LIMIT) and text.endswith(f"...[{10_000 - LOG_TEXT_LIMIT} more chars]")
    # Escapes count towards the limit: a prompt of controls cannot make a longer line.
    assert len(loggable("\x00" * 10_000)) < LOG_TEXT_LIMIT + 30


def test_an_engine_log_of_a_request_id_is_one_escaped_line(caplog):
    processor = OutputProcessor(tokenizer=None)
    parent = ParentState(EVIL, None, [1, 2, 3], SamplingParams(prompt_logprobs=1), {}, prompt_logprobs=[None])
    out = SimpleNamespace(prompt_logprobs_start=3, new_prompt_logprobs=[])  # positions 1-2 never arrived
    with caplog.at_level(logging.ERROR, logger="raylm.engine.output_processor"):
        processor._add_prompt_logprobs(parent, out)
    [record] = caplog.records
    message = record.getMessage()
    assert "\n" not in message and "\x1b" not in message and "\u202e" not in message
    assert "req-1\\n2025-01-01" in message


def test_an_unhandled_error_logs_the_decoded_path_and_the_message_escaped(caplog):
    app = FastAPI()
    _install_error_handlers(app)

    # Any fault the server did not foresee, its message quoting the client
    # (before routing: a route's pattern would not match a newline).
    @app.middleware("http")
    async def boom(request: Request, call_next):
        raise ValueError(f"cannot handle {(await request.body()).decode()}")

    app.add_middleware(UnhandledErrorMiddleware)  # as build_app adds it, around the app's middleware

    async def go() -> int:
        # As uvicorn hands it over: the path percent-decoded (%0A is a newline,
        # %1B an ESC, %E2%80%A8 a line separator). An HTTP client would
        # normalise some of it away.
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/x\n\u2028FORGED path\x1b[2J",
            "raw_path": b"/v1/x%0A%E2%80%A8FORGED%20path%1B[2J",
            "root_path": "",
            "query_string": b"",
            "headers": [(b"host", b"test")],
            "server": ("test", 80),
            "client": ("client", 1),
        }
        body = [{"type": "http.request", "body": EVIL.encode(), "more_body": False}]
        sent = []

        async def receive():
            return body.pop(0) if body else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        await app(scope, receive, send)  # nothing is raised on to uvicorn, which would log it raw
        return sent[0]["status"]

    with caplog.at_level(logging.ERROR, logger="raylm.entrypoints.openai.api_server"):
        status = asyncio.run(go())
    assert status == 500
    [record] = [r for r in caplog.records if "unhandled error" in r.getMessage()]
    first, *frames = record.getMessage().split("\n")
    assert "/v1/x\\n\\u2028FORGED path\\x1b[2J" in first and "cannot handle req-1\\n2025-01-01" in first
    assert "\x1b" not in record.getMessage() and "\u2028" not in record.getMessage()
    # The rest is the traceback's frames: the server's files, no client text.
    assert frames and not any("FORGED" in line or "engine core 1 died" in line for line in frames)
    assert record.exc_info is None  # logging would append the raw message again


class _FaultyModelConfig:
    @property
    def max_model_len(self):
        raise RuntimeError("a fault quoting the client: \nFORGED\x1b[2J")


def test_the_app_answers_a_fault_and_raises_nothing_on_to_uvicorn(caplog):
    # build_app's own stack: a fault in a route is a 500 with the CORS headers,
    # logged once, escaped; nothing is raised on to uvicorn, which would log
    # the raw message again ("Exception in ASGI application").
    engine = SimpleNamespace(
        config=SimpleNamespace(
            model_config=_FaultyModelConfig(),
            scheduler_config=SimpleNamespace(max_num_seqs=1),
            parallel_config=SimpleNamespace(data_parallel_size=1),
        ),
        replica_states=lambda: None,
    )

    async def go():
        transport = httpx.ASGITransport(app=build_app(engine, ["m"]))  # raises what the app raises
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/v1/models", headers={"Origin": "https://app.example"})

    with caplog.at_level(logging.ERROR, logger="raylm.entrypoints.openai.api_server"):
        response = asyncio.run(go())
    assert response.status_code == 500 and response.headers["access-control-allow-origin"] == "*"
    assert response.json()["error"]["message"] == "internal server error: RuntimeError"
    [record] = caplog.records
    assert "client: \\nFORGED\\x1b[2J" in record.getMessage().split("\n")[0]
