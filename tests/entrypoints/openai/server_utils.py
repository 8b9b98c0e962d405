"""A real `raylm serve` subprocess on a free 127.0.0.1 port, waited for on
/health and torn down with a check that its whole process tree is gone;
plus a /metrics scraper."""

from __future__ import annotations

import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time

import httpx
import psutil

API_KEY = "test-key"
MODEL_NAME = "tiny-llama"
# One torch thread and a small KV cache keep the shared two-core machine usable.
ENGINE_FLAGS = ["--num-threads", "1", "--kv-cache-memory-bytes", "4MiB", "--max-model-len", "512"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# uvicorn's exit status when it cannot bind its port (or start at all).
_UVICORN_STARTUP_FAILURE = 3
_PORT_ATTEMPTS = 3


class _PortTaken(RuntimeError):
    pass


class RaylmServer:
    """`model_dir` None: raylm's embedded model. `new_session`: the server leads
    a process group of its own (for signals sent to the whole group)."""

    def __init__(
        self,
        model_dir: str | None,
        extra_args: list[str],
        log_path: str,
        startup_timeout: float = 180.0,
        new_session: bool = False,
        tls_ca_file: str | None = None,
        env: dict[str, str] | None = None,
    ):
        """`tls_ca_file`: the server was given --ssl-keyfile/--ssl-certfile; it is
        reached over https, trusting this certificate. `env`: added to os.environ."""
        self.log_path = log_path
        self.verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=tls_ca_file) if tls_ca_file else True
        scheme = "https" if tls_ca_file else "http"
        model = [model_dir] if model_dir is not None else []
        for attempt in range(_PORT_ATTEMPTS):
            self.port = free_port()
            self.base_url = f"{scheme}://127.0.0.1:{self.port}"
            command = [
                sys.executable,
                "-m",
                "raylm.entrypoints.cli",
                "serve",
                *model,
                "--port",
                str(self.port),
                "--served-model-name",
                MODEL_NAME,
                *ENGINE_FLAGS,
                *extra_args,
            ]
            self._log = open(log_path, "wb")
            self.proc = subprocess.Popen(
                command,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                start_new_session=new_session,
            )
            try:
                self._wait_healthy(startup_timeout)
                break
            except _PortTaken:
                # Another process took the free port before the server bound it.
                self._log.close()
                if attempt == _PORT_ATTEMPTS - 1:
                    raise
        # Remembered now, so teardown can check that none of them outlive the server.
        self.tree = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if self.proc.returncode == _UVICORN_STARTUP_FAILURE and "address already in use" in self.log().lower():
                    raise _PortTaken(self.log())
                raise RuntimeError(f"raylm serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url("/health"), timeout=2, verify=self.verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.kill()
        raise RuntimeError(f"raylm serve not healthy after {timeout}s:\n{self.log()}")

    def url(self, path: str) -> str:
        return self.base_url + path

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-5000:]

    def core_process(self) -> psutil.Process:
        """The engine-core child (not multiprocessing's resource tracker)."""
        for child in psutil.Process(self.proc.pid).children():
            if "spawn_main" in " ".join(child.cmdline()):
                return child
        raise AssertionError("no engine-core process found")

    def alive_tree(self) -> list[psutil.Process]:
        alive = []
        for p in self.tree:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        return alive

    def wait_tree_gone(self, timeout: float) -> list[psutil.Process]:
        """Processes of the tree still alive after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.proc.poll()
            if not self.alive_tree():
                return []
            time.sleep(0.1)
        return self.alive_tree()

    def terminate(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        leftovers = self.wait_tree_gone(timeout)
        self.kill()
        self._log.close()
        assert not leftovers, f"processes outlived the server: {leftovers}\n{self.log()}"

    def kill(self) -> None:
        for p in getattr(self, "tree", []):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def scrape_metric(base_url: str, name: str, labels: str = "") -> float:
    """Sum of the samples of `name` (whose labels contain `labels`) on /metrics."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    total, found = 0.0, False
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if match and labels in (match.group(1) or ""):
            total += float(match.group(2))
            found = True
    assert found, f"{name}{{{labels}}} not in /metrics"
    return total
