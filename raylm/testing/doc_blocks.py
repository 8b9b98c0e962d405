"""The code blocks of README.md and docs/ that a test runs, and their runner.

A block is marked by an HTML comment on the line right before its fence
(docs/README.md, "Code blocks the tests run"):

    <!-- doc-test: fast|slow [serve|client] [cleanup] [expect="TEXT"] [timeout=S] -->

Each block runs in a subprocess: a temporary folder as its cwd and HOME,
offline, with a token in its environment by which every process it leaves
behind is found afterwards (and ended, and reported).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

TIERS = ("fast", "slow")
ROLES = ("serve", "client")
FLAGS = ("cleanup",)  # the block leaves daemons on purpose (`ray start`): end them, do not fail
LANGS = {"bash": ["bash", "-e"], "python": [sys.executable]}
DEFAULT_TIMEOUT_S = {"fast": 120.0, "slow": 600.0}
PAGE_PORT = "8000"  # the port the pages write; serve and client blocks get a free one instead
# Not a RAYLM_ setting: raylm never reads it (tests/executor/test_worker_env.py lists those).
TOKEN_VAR = "DOC_BLOCK_RUN_TOKEN"
# How long a block's processes may take to end by themselves after it (a local
# Ray stops a few seconds after its driver) before they count as left behind.
LEFTOVER_GRACE_S = 10.0

_MARKER = re.compile(r"^<!--\s*doc-test:(?P<body>.*?)-->\s*$")
_FENCE = re.compile(r"^(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")


@dataclass(frozen=True)
class DocBlock:
    path: Path
    line: int  # of the fence, 1-based
    lang: str
    code: str
    tier: str | None = None  # None: not marked, not run
    role: str = ""
    cleanup: bool = False
    expect: str | None = None
    timeout_s: float | None = None

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"

    def limit_s(self) -> float:
        return self.timeout_s if self.timeout_s is not None else DEFAULT_TIMEOUT_S[self.tier or "fast"]


def parse_marker(body: str, where: str) -> dict:
    """The marker's words as DocBlock fields; ValueError naming the word that is wrong."""
    words = shlex.split(body)
    if not words or words[0] not in TIERS:
        raise ValueError(f"{where}: a doc-test marker starts with one of {TIERS}, not {words[:1]}")
    fields: dict = {"tier": words[0]}
    for word in words[1:]:
        key, eq, value = word.partition("=")
        if not eq and key in ROLES and "role" not in fields:
            fields["role"] = key
        elif not eq and key in FLAGS:
            fields[key] = True
        elif eq and key == "expect" and value:
            fields["expect"] = value
        elif eq and key == "timeout" and value.replace(".", "", 1).isdigit() and float(value) > 0:
            fields["timeout_s"] = float(value)
        else:
            raise ValueError(f"{where}: unknown doc-test marker word {word!r}")
    return fields


def extract(path: Path) -> list[DocBlock]:
    """Every fenced block of a page, marked or not. A marker not right before a
    fence, a misspelt one, or one on a block in a language without a runner is
    a ValueError."""
    lines = path.read_text().splitlines()
    blocks: list[DocBlock] = []
    pending: tuple[int, dict] | None = None
    i = 0
    while i < len(lines):
        text = lines[i]
        where = f"{path}:{i + 1}"
        fence = _FENCE.match(text)
        if fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence["fence"]), None)
            if end is None:
                raise ValueError(f"{where}: a fence that is never closed")
            fields = pending[1] if pending and pending[0] == i - 1 else {}
            if fields and fence["lang"] not in LANGS:
                raise ValueError(f"{where}: a marked block must be one of {sorted(LANGS)}, not {fence['lang']!r}")
            blocks.append(DocBlock(path, i + 1, fence["lang"], "\n".join(lines[i + 1 : end]) + "\n", **fields))
            pending = None
            i = end + 1
            continue
        if pending:
            raise ValueError(f"{path}:{pending[0] + 1}: a doc-test marker must be right before a fence")
        marker = _MARKER.match(text)  # at the line's start: an indented one is an example, in code
        if marker:
            pending = (i, parse_marker(marker["body"], where))
        elif text.lstrip().startswith("<!--") and "doc-test" in text and not text.startswith((" ", "\t")):
            raise ValueError(f"{where}: a malformed doc-test marker: {text.strip()!r}")
        i += 1
    if pending:
        raise ValueError(f"{path}:{pending[0] + 1}: a doc-test marker must be right before a fence")
    return blocks


def doc_pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def marked(root: Path, tier: str) -> list[DocBlock]:
    return [b for page in doc_pages(root) for b in extract(page) if b.tier == tier]


@dataclass
class Result:
    block: DocBlock
    returncode: int | None  # None: timed out
    stdout: str
    stderr: str
    seconds: float
    leftovers: list[str] = field(default_factory=list)  # processes it left, ended by the runner

    def problem(self) -> str | None:
        b = self.block
        if self.returncode is None:
            return f"{b.where}: timed out after {b.limit_s():.0f} s"
        if self.returncode != 0:
            return f"{b.where}: exit status {self.returncode}\n{self.stderr[-3000:]}"
        if b.expect and b.expect not in self.stdout:
            return f"{b.where}: {b.expect!r} not in its output:\n{self.stdout[-2000:]}"
        if self.leftovers and not b.cleanup:
            return f"{b.where}: left processes behind: {self.leftovers}"
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sandbox:
    """A temporary home, cwd and Ray folder for a run of blocks, and the
    environment each block gets."""

    def __init__(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="raylm-doc-")
        self.root = Path(self._tmp.name)
        self.home = self.root / "home"
        self.cwd = self.root / "cwd"
        # Ray's socket paths must stay short: its own folder, directly under /tmp.
        self.ray_tmp = Path(tempfile.mkdtemp(prefix="rd", dir="/tmp"))
        for d in (self.home, self.cwd):
            d.mkdir()
        self.token = self.root.name
        self._runs = 0

    def run_token(self) -> str:
        """A token for one block's run: a server's processes are told apart
        from those of the client blocks run beside it."""
        self._runs += 1
        return f"{self.token}/{self._runs}"

    def env(self, token: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RAYLM_", "VLLM_", "OPENAI_"))}
        # The kernels' build is a minute on two cores: reuse the real cache's build, the only thing kept.
        kernels = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache/raylm/torch_extensions")
        loopback = "127.0.0.1,localhost,::1," + ",".join(_own_addresses())
        env.update(
            HOME=str(self.home),
            XDG_CACHE_HOME=str(self.home / ".cache"),
            HF_HOME=str(self.home / "hf"),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            # Any HTTP(S) a block tries beyond this machine goes to a closed loopback port.
            HTTP_PROXY="http://127.0.0.1:9",
            HTTPS_PROXY="http://127.0.0.1:9",
            http_proxy="http://127.0.0.1:9",
            https_proxy="http://127.0.0.1:9",
            NO_PROXY=loopback,
            no_proxy=loopback,
            TORCH_EXTENSIONS_DIR=kernels,
            RAY_TMPDIR=str(self.ray_tmp),
            RAY_USAGE_STATS_ENABLED="0",
            PYTHONUNBUFFERED="1",
        )
        env[TOKEN_VAR] = token
        return env

    def close(self) -> list[str]:
        left = end_processes(self.token)
        self._tmp.cleanup()
        shutil.rmtree(self.ray_tmp, ignore_errors=True)
        return left


def _own_addresses() -> list[str]:
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)})
    except OSError:
        return []


def processes_of(token: str) -> list[int]:
    """Processes whose environment carries the token (or one of the sandbox's,
    below it): the ones a block started, and theirs."""
    needle = f"{TOKEN_VAR}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if any(v == needle or v.startswith(needle + b"/") for v in (entry / "environ").read_bytes().split(b"\0")):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _describe(pid: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return str(pid)
    return f"{pid} {cmdline[:120]}"


def end_processes(token: str) -> list[str]:
    """Wait up to LEFTOVER_GRACE_S for the token's processes to end on their
    own, then end the rest; returns those that had to be ended."""
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while (pids := processes_of(token)) and time.monotonic() < deadline:
        time.sleep(0.5)
    described = [_describe(pid) for pid in pids]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + 5
        while (pids := processes_of(token)) and time.monotonic() < end:
            time.sleep(0.2)
        if not pids:
            break
    return described


def _command(block: DocBlock, port: int | None) -> list[str]:
    code = block.code.replace(PAGE_PORT, str(port)) if port is not None else block.code
    return [*LANGS[block.lang], "-c", code]


def run_block(block: DocBlock, sandbox: Sandbox, port: int | None = None) -> Result:
    token = sandbox.run_token()
    start = time.monotonic()
    try:
        done = subprocess.run(
            _command(block, port),
            cwd=sandbox.cwd,
            env=sandbox.env(token),
            capture_output=True,
            text=True,
            timeout=block.limit_s(),
            start_new_session=True,
        )
        result = Result(block, done.returncode, done.stdout, done.stderr, time.monotonic() - start)
    except subprocess.TimeoutExpired as e:
        out, err = (s.decode(errors="replace") if isinstance(s, bytes) else (s or "") for s in (e.stdout, e.stderr))
        result = Result(block, None, out, err, time.monotonic() - start)
    result.leftovers = end_processes(token)
    return result


def _wait_healthy(port: int, server: subprocess.Popen, within_s: float) -> str | None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            return f"the server exited with status {server.returncode}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    return None
        except OSError:
            pass
        time.sleep(0.5)
    return f"no healthy /health within {within_s:.0f} s"


def run_serve(block: DocBlock, clients: list[DocBlock], sandbox: Sandbox) -> list[Result]:
    """Start a serve block in the background, run its client blocks against it, stop it."""
    port = free_port()
    token = sandbox.run_token()
    start = time.monotonic()
    log = (sandbox.root / f"serve-{block.line}.log").open("w+")
    server = subprocess.Popen(
        _command(block, port),
        cwd=sandbox.cwd,
        env=sandbox.env(token),
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    results = []
    try:
        trouble = _wait_healthy(port, server, block.limit_s())
        if trouble is None:
            results = [run_block(client, sandbox, port) for client in clients]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        log.seek(0)
        output = log.read()
        log.close()
    serve = Result(block, 0 if trouble is None else 1, output, trouble or "", time.monotonic() - start)
    # A server stopped by SIGTERM exits by itself; what it leaves is a leak.
    serve.leftovers = end_processes(token)
    return [serve, *results]


def run_page_blocks(blocks: list[DocBlock], sandbox: Sandbox) -> list[Result]:
    """One page's marked blocks in order; a serve block takes the client blocks after it."""
    results: list[Result] = []
    i = 0
    while i < len(blocks):
        block = blocks[i]
        if block.role == "client":
            raise ValueError(f"{block.where}: a client block with no serve block before it")
        if block.role == "serve":
            j = i + 1
            while j < len(blocks) and blocks[j].role == "client":
                j += 1
            results += run_serve(block, blocks[i + 1 : j], sandbox)
            i = j
        else:
            results.append(run_block(block, sandbox))
            i += 1
    return results


def run_tier(root: Path, tier: str, pages: list[Path] | None = None) -> list[Result]:
    """Every block of the tier, page by page (all pages, or those given), each
    page in a sandbox of its own."""
    results: list[Result] = []
    for page in pages or doc_pages(root):
        blocks = [b for b in extract(page) if b.tier == tier]
        if not blocks:
            continue
        sandbox = Sandbox()
        try:
            results += run_page_blocks(blocks, sandbox)
        finally:
            left = sandbox.close()
            if left and results:
                results[-1].leftovers += left
    return results
