"""Streaming requests read in a background thread, for tests that act while
streams run (limits, shutdown, kills), one read on the event loop
(`stream_completion`), and a wait for an idle server."""

from __future__ import annotations

import json
import threading

import httpx

from tests.conftest import wait_until
from tests.entrypoints.openai.server_utils import MODEL_NAME, RaylmServer, scrape_metric


def long_body(prompt: str = "ROMEO:", max_tokens: int = 400, stream: bool = True, **extra) -> dict:
    """A completion that runs for a while: greedy, EOS ignored."""
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
        **extra,
    }


async def stream_completion(client: httpx.AsyncClient, prompt: str, max_tokens: int, on_chunk=None) -> str:
    """One greedy streamed completion (EOS ignored) through `client`: its text.
    No chunk may be an error, and it must end for its length. `on_chunk()`
    is called after each chunk."""
    body = long_body(prompt, max_tokens)
    text, finish = [], None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                text.append(choice["text"])
                finish = choice.get("finish_reason") or finish
            if on_chunk is not None:
                on_chunk()
    assert finish == "length"
    return "".join(text)


class BackgroundStream:
    """One streaming request (completions or chat) read in a thread: its
    status, headers, events, finish reasons, error events, and whether it
    ended with [DONE]."""

    def __init__(
        self,
        server: RaylmServer,
        body: dict,
        path: str = "/v1/completions",
        timeout: float = 120.0,
        headers: dict | None = None,
    ):
        self.status: int | None = None
        self.headers: httpx.Headers | None = None
        self.body_text = ""
        self.events: list[dict] = []
        self.errors: list = []
        self.finish_reasons: list[str] = []
        self.got_done = False
        self.num_chunks = 0
        self.done = False
        self._close = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(server, body, path, timeout, headers), daemon=True)
        self.thread.start()

    def _run(self, server: RaylmServer, body: dict, path: str, timeout: float, headers: dict | None) -> None:
        try:
            with httpx.stream("POST", server.url(path), json=body, timeout=timeout, headers=headers) as response:
                self.status, self.headers = response.status_code, response.headers
                if response.status_code != 200:
                    self.body_text = response.read().decode()
                    return
                for line in response.iter_lines():
                    if self._close.is_set():
                        return  # leaving the with-block hangs up
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        self.got_done = True
                        continue
                    event = json.loads(data)
                    self.events.append(event)
                    if "error" in event:
                        self.errors.append(event["error"])
                        continue
                    for choice in event["choices"]:
                        if choice.get("finish_reason"):
                            self.finish_reasons.append(choice["finish_reason"])
                    self.num_chunks += 1
        except httpx.HTTPError as e:
            self.errors.append(repr(e))
        finally:
            self.done = True

    def hang_up(self) -> None:
        """Close the connection at the next event (a client that gives up)."""
        self._close.set()


class BackgroundPost:
    """One non-streaming request in a thread: status and JSON body."""

    def __init__(self, server: RaylmServer, body: dict, path: str = "/v1/completions", timeout: float = 120.0):
        self.status: int | None = None
        self.json: dict | None = None
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, args=(server, body, path, timeout), daemon=True)
        self.thread.start()

    def _run(self, server: RaylmServer, body: dict, path: str, timeout: float) -> None:
        try:
            response = httpx.post(server.url(path), json=body, timeout=timeout)
            self.status = response.status_code
            self.json = response.json()
        except (httpx.HTTPError, ValueError) as e:
            self.error = e


def metric(server: RaylmServer, name: str, labels: str = "") -> float:
    return scrape_metric(server.base_url, name, labels)


def wait_idle(server: RaylmServer, timeout: float = 60.0) -> None:
    """Nothing admitted, running or waiting: whatever the test did is gone."""
    wait_until(
        lambda: (
            metric(server, "raylm:num_sequences_admitted") == 0
            and metric(server, "vllm:num_requests_running") == 0
            and metric(server, "vllm:num_requests_waiting") == 0
        ),
        timeout,
        step=0.2,
        message="the server to hold no request",
    )
