"""Lifecycle: SIGTERM during a stream ends it cleanly once the grace period is
over (the streams still queued end with "abort") and the whole process tree
exits; an engine core that dies with no restart left
turns /health into 503, fails in-flight and new requests with an error, and the
server exits non-zero by itself (test_core_recovery.py has the restarts)."""

from __future__ import annotations

import signal
import threading

import httpx
import pytest

from tests.conftest import wait_until
from tests.entrypoints.openai.server_utils import MODEL_NAME, RaylmServer, scrape_metric

pytestmark = pytest.mark.server

GRACE_S = 0.5
LONG_STREAM = {
    "model": MODEL_NAME,
    "prompt": "ROMEO:",
    "max_tokens": 500,
    "ignore_eos": True,
    "stream": True,
    "temperature": 0,
}


def _stream_in_background(
    server: RaylmServer, body: dict = LONG_STREAM, wait_started: bool = True
) -> tuple[threading.Thread, dict]:
    """Start a long stream; `result` gets its events once it ends."""
    result: dict = {"events": [], "started": threading.Event()}

    def run() -> None:
        try:
            with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60) as response:
                result["status"] = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        result["events"].append(line[len("data: ") :])
                        result["started"].set()
        except httpx.HTTPError as e:
            result["error"] = e
        finally:
            result["started"].set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if wait_started:
        assert result["started"].wait(60)
    return thread, result


def test_sigterm_during_stream_exits_within_grace(llama_dir, tmp_path):
    # One request runs at a time and two more wait behind it: however fast the
    # machine, the last one is unfinished when the grace period ends.
    server = RaylmServer(
        llama_dir,
        ["--shutdown-grace-period", str(GRACE_S), "--max-num-seqs", "1", "--max-model-len", "1024"],
        str(tmp_path / "server.log"),
    )
    body = {**LONG_STREAM, "max_tokens": 1000}
    try:
        assert len(server.tree) >= 2, "the engine core should run in its own process"
        streams = [_stream_in_background(server, body)]
        streams += [_stream_in_background(server, body, wait_started=False) for _ in range(2)]

        # Every stream in the engine before the signal (>= 1 waiting let the
        # last one still be on its way, refused at the signal on a slow machine).
        def all_in_the_engine() -> bool:
            held = sum(scrape_metric(server.base_url, f"vllm:num_requests_{s}") for s in ("running", "waiting"))
            return held + sum(not thread.is_alive() for thread, _ in streams) >= len(streams)

        wait_until(all_in_the_engine, 120, message="the queued streams to reach the engine")
        assert scrape_metric(server.base_url, "vllm:num_requests_waiting") >= 1
        assert scrape_metric(server.base_url, "vllm:num_requests_running") == 1
        server.proc.send_signal(signal.SIGTERM)
        # Against hanging only (the grace period is judged by the streams
        # ending with "abort" below): the tree may take its time on a loaded machine.
        leftovers = server.wait_tree_gone(120)
        assert not leftovers, server.log()
        for thread, _ in streams:
            thread.join(60)
        assert server.proc.returncode == 0, server.log()
        # The streams were ended by the server (finish_reason "abort"), not cut
        # off; the one running may have finished within the grace period.
        reasons = []
        for _, result in streams:
            assert result.get("status") == 200 and result["events"][-1] == "[DONE]", result
            reasons.append(next(r for r in ("abort", "length") if f'"finish_reason":"{r}"' in result["events"][-2]))
        assert "abort" in reasons, reasons  # the last in the queue, at least
    finally:
        server.terminate(timeout=5)


def test_dead_engine_core_gives_503(llama_dir, tmp_path):
    server = RaylmServer(llama_dir, ["--max-restarts", "0"], str(tmp_path / "server.log"))
    try:
        thread, result = _stream_in_background(server)
        server.core_process().kill()
        thread.join(30)
        assert result["events"][-1] == "[DONE]"
        assert '"error"' in result["events"][-2] and '"code":503' in result["events"][-2]
        wait_until(
            lambda: httpx.get(server.url("/health")).status_code == 503, 60, step=0.2, message="/health to answer 503"
        )
        response = httpx.post(server.url("/v1/completions"), json={"model": MODEL_NAME, "prompt": "hi"})
        assert response.status_code == 503 and "error" in response.json()
        # Then it exits by itself, for its supervisor to start a new one.
        assert not server.wait_tree_gone(30), server.log()
        assert server.proc.returncode not in (0, None), server.log()
    finally:
        server.terminate(timeout=20)
