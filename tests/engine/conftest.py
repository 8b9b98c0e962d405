"""An AsyncLLM front end whose supervisor runs scripted fake engine cores.

`FakeLauncher` stands in for the process launcher: each start makes a
`FakeCore`, which records what the supervisor sends it (decoded) and sends
back what the test puts in its `script` (EngineCoreOutputs; an
EngineCoreDiedError, as if the core process died; an EngineDeadError, as if
the core reported its error). The supervisor itself, its sockets included,
is the real one."""

from __future__ import annotations

import itertools
import time

import msgspec
import pytest
import zmq

import raylm.engine.supervisor as supervisor_module
from raylm.config import create_engine_config
from raylm.engine.async_llm import AsyncLLM
from raylm.engine.core_channel import CoreChannel, CoreLauncher
from raylm.engine.errors import EngineCoreDiedError, EngineDeadError
from raylm.engine.protocol import ClientMessage, EngineCoreOutputs, EngineCoreRequest, Ping, RecoveryKind
from raylm.engine.stat_logger import StatLoggerBase

_LAST_WORDS_S = 0.2


class FakeCore:
    """One start of a fake engine core."""

    started: list[FakeCore] = []

    def __init__(self, launcher: FakeLauncher, channel: CoreChannel):
        self.launcher = launcher
        self.channel = channel
        self.requests = []
        self.aborted: list[str] = []
        self.closed = False
        self.script = _Script(self)
        self._output = launcher.ctx.socket(zmq.PUSH)
        self._output.connect(launcher.address)
        FakeCore.started.append(self)

    def receive(self, message) -> None:
        if isinstance(message, EngineCoreRequest):
            self.requests.append(message.to_request())
        elif isinstance(message, Ping):
            self.on_ping(message.nonce)
        elif hasattr(message, "request_ids"):
            self.aborted.extend(message.request_ids)

    def on_ping(self, nonce: int) -> None:
        """This fake does not answer pings."""

    def emit(self, outputs: EngineCoreOutputs) -> None:
        outputs.engine_index, outputs.incarnation = self.channel.index, self.channel.incarnation
        self._output.send(msgspec.msgpack.encode(outputs))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._output.close(linger=0)


class _Script:
    """What a test makes the core do next."""

    def __init__(self, core: FakeCore):
        self.core = core

    def put_nowait(self, item) -> None:
        if isinstance(item, EngineCoreDiedError):
            self.core.launcher.pending_deaths.append((time.monotonic(), self.core.channel.index, str(item)))
        elif isinstance(item, EngineDeadError):
            self.core.emit(EngineCoreOutputs(error=f"Traceback\nRuntimeError: {item}"))
        else:
            self.core.emit(item)


class _FakeChannel(CoreChannel):
    """Delivers what the supervisor sends straight to its fake core."""

    core: FakeCore | None = None

    def flush(self) -> None:
        decoder = msgspec.msgpack.Decoder(ClientMessage)
        while self.unsent and self.core is not None:
            self.core.receive(decoder.decode(self.unsent.popleft()))


class FakeLauncher(CoreLauncher):
    recovery_kind = RecoveryKind.ENGINE_CORE
    # Called with the start's number (0 for the first core) before it makes
    # its core; it may block (a start that hangs) or raise (one that fails).
    on_start = None
    core_class = FakeCore
    _addresses = itertools.count()

    def __init__(self, config):
        self.config = config
        self.pending_deaths: list[tuple[float, int, str]] = []
        self.cores: dict[int, FakeCore] = {}
        self.num_starts = 0
        self.address = f"inproc://fake-cores-{next(self._addresses)}"
        self._incarnations = itertools.count(1)

    def bind_output(self, ctx):
        self.ctx = ctx
        socket = ctx.socket(zmq.PULL)
        socket.bind(self.address)
        return socket

    def new_channel(self, ctx, index):
        return _FakeChannel(index, input=None, address="", incarnation=next(self._incarnations))

    def close_channel(self, channel):
        pass

    def sender(self, frame, outputs, channels):
        channel = channels.get(outputs.engine_index)
        return channel if channel is not None and channel.incarnation == outputs.incarnation else None

    def start(self, channel, target=None):
        attempt, self.num_starts = self.num_starts, self.num_starts + 1
        if FakeLauncher.on_start is not None:
            FakeLauncher.on_start(attempt)
        core = self.core_class(self, channel)
        channel.core = core
        self.cores[channel.index] = core
        channel.flush()

    def stop(self, index, wait_s):
        core = self.cores.pop(index, None)
        if core is not None:
            core.close()

    def deaths(self):
        """Like the process launcher, a death is reported a moment after it
        happened: what the core sent before is read first."""
        now = time.monotonic()
        found = [(index, cause) for died, index, cause in self.pending_deaths if now - died >= _LAST_WORDS_S]
        self.pending_deaths = [d for d in self.pending_deaths if now - d[0] < _LAST_WORDS_S]
        for index, _ in found:
            self.stop(index, 0)
        return found

    def take_running_alone(self, index):
        return None  # this fake never quarantines

    def shutdown(self):
        for index in list(self.cores):
            self.stop(index, 0)


class Recoveries(StatLoggerBase):
    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def record_recovery(self, kind: str, seconds: float, num_requests: int) -> None:
        self.seen.append((kind, num_requests))


@pytest.fixture
def make_engine(monkeypatch, tiny_model_dir):
    monkeypatch.setattr(supervisor_module, "make_launcher", FakeLauncher)
    monkeypatch.setattr(FakeLauncher, "on_start", None)
    monkeypatch.setattr(FakeLauncher, "core_class", FakeCore)
    FakeCore.started = []
    engines = []

    def make(**kwargs) -> tuple[AsyncLLM, Recoveries]:
        stats = Recoveries()
        engine = AsyncLLM(create_engine_config(tiny_model_dir("llama"), **kwargs), [stats])
        engines.append(engine)
        return engine, stats

    yield make
    for engine in engines:
        engine.shutdown()
