"""The engine-core process dies (kill -9): the server starts a new core and
resubmits every in-flight request as a continuation, so streams pause and then
finish with the text of an uninterrupted greedy run; past the restart budget,
requests get 503s and the server exits non-zero by itself. Plus RestartBudget."""

from __future__ import annotations

import json
import threading

import httpx
import psutil
import pytest

from raylm.engine.restart_budget import RestartBudget, RestartBudgetExhausted
from tests.conftest import wait_until
from tests.entrypoints.openai.server_utils import MODEL_NAME, RaylmServer, scrape_metric

NUM_STREAMS = 12
# Long enough that no stream can finish between "each has a few tokens" and the kill.
MAX_TOKENS = 300
MIN_TOKENS_BEFORE_KILL = 3
PROMPTS = [f"Story {i}: once upon a time" for i in range(NUM_STREAMS)]


def _body(prompt: str | list[str], stream: bool, max_tokens: int = MAX_TOKENS) -> dict:
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


class _Streams:
    """Every prompt in one streaming completion, read in a thread: per prompt
    its text, finish reason and how many chunks have arrived so far, plus the
    error events. One HTTP request, so the engine admits the prompts together
    and they decode in step: however fast the machine, none can finish while
    another has yet to start (separate requests raced their own admission)."""

    def __init__(self, server: RaylmServer, prompts: list[str]):
        self.texts = [""] * len(prompts)
        self.finish_reasons: list[str | None] = [None] * len(prompts)
        self.num_chunks = [0] * len(prompts)
        self.errors: list = []
        self.done = False
        self.thread = threading.Thread(target=self._run, args=(server, prompts), daemon=True)
        self.thread.start()

    def _run(self, server: RaylmServer, prompts: list[str]) -> None:
        try:
            with httpx.stream(
                "POST", server.url("/v1/completions"), json=_body(prompts, True), timeout=120
            ) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: ") :])
                    if "error" in event:
                        self.errors.append(event["error"])
                        continue
                    for choice in event["choices"]:
                        i = choice["index"]
                        self.texts[i] += choice["text"]
                        self.finish_reasons[i] = choice["finish_reason"] or self.finish_reasons[i]
                        self.num_chunks[i] += 1
        except httpx.HTTPError as e:
            self.errors.append(repr(e))
        finally:
            self.done = True

    def each_has(self, num_chunks: int) -> bool:
        return all(n >= num_chunks for n in self.num_chunks)


class _HealthPoller:
    """Polls /health until stopped; keeps every status (or error) it saw."""

    def __init__(self, server: RaylmServer):
        self.results: list[int | str] = []
        self._stop = threading.Event()
        self._server = server
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.results.append(httpx.get(self._server.url("/health"), timeout=10).status_code)
            except httpx.HTTPError as e:
                self.results.append(type(e).__name__)
            self._stop.wait(0.1)

    def stop(self) -> list[int | str]:
        self._stop.set()
        self.thread.join(15)
        return self.results


def _start_streams(server: RaylmServer) -> _Streams:
    streams = _Streams(server, PROMPTS)
    wait_until(
        lambda: streams.each_has(MIN_TOKENS_BEFORE_KILL) or streams.done,
        60,
        message="every stream to receive a few tokens",
    )
    assert not streams.done, (streams.errors, streams.finish_reasons)
    return streams


def _kill_core(server: RaylmServer) -> int:
    core = server.core_process()
    core.kill()
    core.wait(10)
    return core.pid


def _wait_new_core(server: RaylmServer, old_pid: int) -> psutil.Process:
    found: list[psutil.Process] = []

    def started() -> bool:
        try:
            core = server.core_process()
        except (AssertionError, psutil.Error):  # none yet, or the old one half gone
            return False
        found[:] = [core]
        return core.pid != old_pid

    wait_until(started, 60, message="a new engine-core process")
    return found[0]


@pytest.mark.server
def test_killed_core_is_replaced_and_streams_continue(llama_dir, tmp_path):
    server = RaylmServer(llama_dir, [], str(tmp_path / "server.log"))
    try:
        streams = _start_streams(server)
        poller = _HealthPoller(server)
        old_pid = _kill_core(server)
        new_core = _wait_new_core(server, old_pid)
        # Whatever the new core starts (workers, Ray) must go at shutdown too.
        server.tree.extend([new_core, *new_core.children(recursive=True)])
        streams.thread.join(120)
        health = poller.stop()

        assert streams.done and not streams.errors, streams.errors
        assert streams.finish_reasons == ["length"] * NUM_STREAMS
        # The server kept answering /health while it recovered (a pause, not an outage).
        assert health and all(status == 200 for status in health), health
        log = server.log()
        assert "engine core 0 died (engine core process exited with code -9)" in log, log
        assert "restarting engine core 0 (restart 1 of 3)" in log, log
        assert f"{NUM_STREAMS} request(s) carried over" in log, log
        assert scrape_metric(server.base_url, "raylm:recoveries_total", 'kind="engine_core"') == 1
        assert scrape_metric(server.base_url, "raylm:recovered_requests_total", 'kind="engine_core"') == NUM_STREAMS
        assert scrape_metric(server.base_url, "raylm:recovery_seconds_count", 'kind="engine_core"') == 1

        # The oracle: the same prompts, uninterrupted, on the new core.
        reference = [
            httpx.post(server.url("/v1/completions"), json=_body(prompt, False), timeout=120).json()
            for prompt in PROMPTS
        ]
        assert streams.texts == [r["choices"][0]["text"] for r in reference]
    finally:
        server.terminate(timeout=30)


def _post_in_background(server: RaylmServer, prompt: str, max_tokens: int) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        try:
            response = httpx.post(server.url("/v1/completions"), json=_body(prompt, False, max_tokens), timeout=120)
            result["status"], result["body"] = response.status_code, response.json()
        except httpx.HTTPError as e:
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


@pytest.mark.server
def test_past_the_restart_budget_the_server_answers_503_and_exits(llama_dir, tmp_path):
    # Room for a non-streaming request three times the streams' length.
    server = RaylmServer(
        llama_dir,
        ["--max-restarts", "1", "--max-model-len", "1024", "--kv-cache-memory-bytes", "8MiB"],
        str(tmp_path / "server.log"),
    )
    try:
        streams = _start_streams(server)
        # In flight through both deaths (in the engine or, if it arrives during the
        # restart, held by the front end), then a 503. Sent after the streams and three
        # times as long, so it cannot end before them, however fast the machine.
        blocking, blocking_result = _post_in_background(server, "a request that is in flight", 3 * MAX_TOKENS)
        old_pid = _kill_core(server)
        new_core = _wait_new_core(server, old_pid)
        server.tree.extend([new_core, *new_core.children(recursive=True)])
        # The first death is within the budget: the streams continue on the new core.
        wait_until(
            lambda: streams.each_has(2 * MIN_TOKENS_BEFORE_KILL) or streams.done, 60, message="the streams to continue"
        )
        assert not streams.errors, streams.errors
        assert not streams.done, streams.finish_reasons

        poller = _HealthPoller(server)
        _kill_core(server)

        streams.thread.join(60)
        blocking.join(60)
        assert streams.done
        assert streams.errors and streams.errors[-1]["code"] == 503, streams.errors
        assert blocking_result.get("status") == 503, blocking_result
        assert "error" in blocking_result["body"]
        # New requests too, until the server is gone.
        response = httpx.post(server.url("/v1/completions"), json=_body("a new one", False), timeout=10)
        assert response.status_code == 503 and "error" in response.json()

        # It exits by itself, non-zero, leaving nothing behind.
        leftovers = server.wait_tree_gone(60)
        assert not leftovers, server.log()
        assert server.proc.returncode not in (0, None), server.log()
        health = poller.stop()
        assert 503 in health and 200 not in health[health.index(503) :], health
        log = server.log()
        assert "no restart left (1 allowed within 600s)" in log, log
    finally:
        server.terminate(timeout=10)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_restart_budget_window_slides_and_backoff_grows():
    clock = _Clock()
    budget = RestartBudget(max_restarts=3, window_s=60, clock=clock)
    allowed, delays = [], []
    for _ in range(3):  # at t = 0, 10, 20
        allowed.append(budget.allow())
        delays.append(budget.backoff_s())
        clock.now += 10
    assert allowed == [True, True, True] and delays == [0.0, 1.0, 2.0]
    assert not budget.allow()  # t = 30: a fourth within 60s
    assert budget.describe() == "restart 4 of 3"
    # t = 65: the restart of t = 0 has left the window, the refused one (t = 30) counts.
    clock.now += 35
    assert budget.num_recent == 3
    assert not budget.allow()
    # Quiet for a whole window: the budget is whole again, and the backoff starts over.
    clock.now += 60
    assert budget.num_recent == 0
    assert budget.allow() and budget.backoff_s() == 0.0
    clock.now += 5
    assert budget.allow() and budget.backoff_s() == 1.0
    assert budget.num_restarts == 7


def test_restart_budget_backoff_is_capped_and_record_raises_past_the_budget():
    clock = _Clock()
    budget = RestartBudget(max_restarts=100, window_s=600, clock=clock)
    delays = [budget.record() for _ in range(8)]
    assert delays == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    none_allowed = RestartBudget(max_restarts=0, window_s=600, clock=clock)
    with pytest.raises(RestartBudgetExhausted):
        none_allowed.record()
    with pytest.raises(ValueError):
        RestartBudget(max_restarts=-1, window_s=600)
