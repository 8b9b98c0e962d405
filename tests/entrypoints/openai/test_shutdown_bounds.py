"""Shutdown always finishes, and nothing outlives the server.

SIGTERM: an idle server exits at once (it does not sit out its grace period);
a busy one ends its streams after the grace period with finish_reason "abort"
and [DONE], its whole (non-streamed) responses cut short answered 503, never a
truncated 200. The same for SIGTERM sent to the whole process group (engine
core and mp workers ignore it: the front end ends them). SIGKILL to the front
end takes its engine core and workers with it, idle or busy. How long shutdown
takes is for benchmarks; the bounds here only end a wait for a process that
does not go (DESIGN: tests never assert a wall-clock time).

Speed-independent: max-num-seqs 1 queues most requests behind a long one, so
they are unfinished when the signal comes; the signal is sent only once
streams have made progress, and what is checked after it is judged by what
was still open when it was sent (a stream that ended before is not expected
to end with "abort"). The streams are long (hundreds to thousands of
tokens) and each of their steps takes at least 5 ms (fault injection's
straggler, on the BOS token every prompt starts with), so that more than one
is open at the signal however fast the machine decodes (1000 tokens took
~0.5 s, and a run ended its streams before the signal).
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from tests.conftest import bos_straggler_env, wait_until
from tests.entrypoints.openai.server_utils import MODEL_NAME, RaylmServer
from tests.entrypoints.openai.stream_utils import BackgroundPost, BackgroundStream, long_body, metric

pytestmark = pytest.mark.server

# Long enough that the streams queued behind the running one are still there
# when the signal comes, on any machine: each runs this many tokens.
LONG_TOKENS = 4000

GRACE_S = 0.5
# Against hanging only: how long the process tree may take to go on a loaded machine.
GONE_WITHIN_S = 120
# An idle server that waited out this grace period would outlast GONE_WITHIN_S.
IDLE_GRACE_S = 3600
MP_TP2 = ["--distributed-executor-backend", "mp", "-tp", "2"]


def _chat_body(max_tokens: int, stream: bool) -> dict:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


class _Load:
    """Streams and whole requests on a server with max-num-seqs 1: one runs,
    the rest wait behind it."""

    def __init__(self, server: RaylmServer, max_tokens: int, num_streams: int = 3):
        self.streams = [
            BackgroundStream(server, long_body(f"Story {i}:", max_tokens=max_tokens)) for i in range(num_streams)
        ]
        self.streams.append(BackgroundStream(server, _chat_body(max_tokens, True), path="/v1/chat/completions"))
        wait_until(
            lambda: all(s.status is not None or s.done for s in self.streams), 120, message="the streams to start"
        )
        assert all(s.status == 200 for s in self.streams), [s.body_text for s in self.streams]
        wait_until(lambda: any(s.num_chunks >= 3 for s in self.streams), 120, message="a stream to make progress")
        # Whole responses come last in the queue: they cannot finish before shutdown.
        self.posts = [
            BackgroundPost(server, long_body("Once", max_tokens=max_tokens, stream=False)),
            BackgroundPost(server, _chat_body(max_tokens, False), path="/v1/chat/completions"),
        ]
        expected = len(self.streams) + len(self.posts)

        def all_in_the_engine() -> bool:
            finished = sum(s.done for s in self.streams)
            held = metric(server, "vllm:num_requests_running") + metric(server, "vllm:num_requests_waiting")
            return held + finished >= expected

        wait_until(all_in_the_engine, 120, message="every request to reach the engine")
        self.open_at_signal: list[BackgroundStream] = []

    def just_before_the_signal(self) -> None:
        """What the checks after shutdown are judged by: the streams still open."""
        self.open_at_signal = [s for s in self.streams if not s.done]
        # max-num-seqs 1: at most one runs, the others wait. Fewer than two
        # open would leave nothing waiting to be aborted: the streams were too short.
        assert len(self.open_at_signal) >= 2, f"streams finished before the signal: {len(self.streams)} started"

    def join(self, timeout: float) -> None:
        for s in self.streams:
            s.thread.join(timeout)
        for p in self.posts:
            p.thread.join(timeout)

    def check_ended_by_shutdown(self) -> None:
        for s in self.streams:
            assert s.done and s.got_done and not s.errors, (s.errors, s.events[-2:])
            # The one running may have finished within the grace period; none is left open.
            assert len(s.finish_reasons) >= 1 and set(s.finish_reasons) <= {"abort", "length"}, s.finish_reasons
        # Of those open at the signal, every one waiting is aborted; the one
        # running may have finished within the grace period.
        aborted = [s for s in self.open_at_signal if "abort" in s.finish_reasons]
        assert len(aborted) >= len(self.open_at_signal) - 1, [s.finish_reasons for s in self.open_at_signal]
        for p in self.posts:
            assert p.error is None, p.error
            assert p.status == 503, (p.status, p.json)
            error = p.json["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == 503
            assert "shutting down" in error["message"]


def _sigterm_and_time(server: RaylmServer, load: _Load | None = None, to_group: bool = False) -> float:
    if load is not None:
        load.just_before_the_signal()
    sent = time.monotonic()
    if to_group:
        os.killpg(os.getpgid(server.proc.pid), signal.SIGTERM)
    else:
        server.proc.send_signal(signal.SIGTERM)
    leftovers = server.wait_tree_gone(GONE_WITHIN_S)
    elapsed = time.monotonic() - sent
    assert not leftovers, f"still alive after {elapsed:.1f}s: {leftovers}\n{server.log()}"
    return elapsed


def test_sigterm_while_idle_exits_at_once(llama_dir, tmp_path):
    # A grace period far beyond the wait for the tree to go: an idle server
    # has nobody to wait for, so it exits without sitting it out.
    server = RaylmServer(llama_dir, ["--shutdown-grace-period", str(IDLE_GRACE_S)], str(tmp_path / "server.log"))
    try:
        assert (
            httpx.post(
                server.url("/v1/completions"), json=long_body(max_tokens=4, stream=False), timeout=60
            ).status_code
            == 200
        )
        _sigterm_and_time(server)
        assert server.proc.returncode == 0, server.log()
    finally:
        server.terminate(timeout=5)


def test_sigterm_during_streams_ends_them_within_the_grace_period(llama_dir, tmp_path):
    server = RaylmServer(
        llama_dir,
        ["--shutdown-grace-period", str(GRACE_S), "--max-num-seqs", "1", "--max-model-len", "1024"],
        str(tmp_path / "server.log"),
        env=bos_straggler_env(llama_dir),
    )
    try:
        load = _Load(server, max_tokens=1000)
        _sigterm_and_time(server, load)
        load.join(60)
        assert server.proc.returncode == 0, server.log()
        load.check_ended_by_shutdown()
    finally:
        server.terminate(timeout=5)


def test_sigterm_to_the_process_group_during_streams(tiny_model_dir, tmp_path):
    """systemd and docker stop signal every process: the core and its mp
    workers must not die under the streams the front end is still ending."""
    # A tiny model with room for long streams (the embedded one stops at 512 positions).
    model = tiny_model_dir("llama", max_position_embeddings=LONG_TOKENS + 96)
    server = RaylmServer(
        model,
        [
            "--shutdown-grace-period",
            str(GRACE_S),
            "--max-num-seqs",
            "1",
            "--max-model-len",
            str(LONG_TOKENS + 96),
            *MP_TP2,
        ],
        str(tmp_path / "server.log"),
        new_session=True,
        env=bos_straggler_env(model),
    )
    try:
        assert len(server.tree) >= 4, server.tree  # front end, core, two workers (and the resource tracker)
        load = _Load(server, max_tokens=LONG_TOKENS)
        _sigterm_and_time(server, load, to_group=True)
        load.join(60)
        assert server.proc.returncode == 0, server.log()
        load.check_ended_by_shutdown()
    finally:
        server.terminate(timeout=5)


def _sigkill_and_time(server: RaylmServer) -> tuple[float, list[psutil.Process]]:
    """SIGKILL the front end; how long until every process it had started (as
    of now) is gone, and those still alive after GONE_WITHIN_S."""
    descendants = psutil.Process(server.proc.pid).children(recursive=True)
    assert descendants, "the engine core should run in its own process"
    killed = time.monotonic()
    server.proc.kill()
    server.proc.wait(60)
    deadline = killed + GONE_WITHIN_S
    alive = descendants
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.05)
    return time.monotonic() - killed, alive


def _run_sigkill(server: RaylmServer, busy: bool) -> None:
    streams = []
    try:
        if busy:
            streams = [BackgroundStream(server, long_body(f"Story {i}:", max_tokens=480)) for i in range(4)]
            wait_until(
                lambda: all(s.num_chunks >= 2 or s.done for s in streams), 120, message="every stream to make progress"
            )
            assert not any(s.done for s in streams), [s.errors for s in streams]
        elapsed, alive = _sigkill_and_time(server)
        assert not alive, f"outlived the front end by {elapsed:.1f}s: {alive}\n{server.log()}"
        for s in streams:
            s.thread.join(30)
            assert s.done  # cut off (the server is gone), not hanging
    finally:
        server.kill()


def test_sigkill_while_idle_takes_the_engine_core_along(tmp_path):
    server = RaylmServer(None, [], str(tmp_path / "server.log"))
    _run_sigkill(server, busy=False)


def test_sigkill_while_busy_takes_the_engine_core_and_workers_along(tmp_path):
    server = RaylmServer(None, [*MP_TP2], str(tmp_path / "server.log"), env=bos_straggler_env(None))
    assert len(server.tree) >= 4, server.tree  # front end, core, two workers (and the resource tracker)
    _run_sigkill(server, busy=True)
