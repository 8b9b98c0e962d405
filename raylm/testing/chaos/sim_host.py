"""The fast tier's host (sim.py): what the real supervisor and engine cores
run on instead of processes, sockets, threads and a clock.

- `SimClock`: seconds that pass only when the harness says, installed in
  place of `time` in the engine's modules;
- `SimHost`: the machine's state that the parts below share: the frames on
  the supervisor's socket, the core processes and their deaths, the
  supervisor's background tasks, the clock (sim.World is one);
- `SimEngineCore` and `SimCoreProc`: the real EngineCore on the content model,
  and its real loop on in-memory sockets, turned one step at a time;
- `SimLauncher`: starts, stops and reports the death of those processes,
  where the supervisor's launcher would;
- `ScheduledBackground` and `ChaosSupervisor`: the real supervisor, whose
  background threads wait as tasks for the schedule to run them.
"""

from __future__ import annotations

import itertools
import time
import types
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from raylm.config import EngineConfig
from raylm.core import request as request_module
from raylm.core import scheduler as scheduler_module
from raylm.engine import (
    core_channel,
    core_migration,
    core_proc,
    core_recovery,
    engine_core,
    handoff,
    ledger,
    migration,
    prefix_pull,
    scaling,
    supervisor,
)
from raylm.engine.core_channel import CoreChannel, CoreLauncher
from raylm.engine.engine_core import EngineCore
from raylm.engine.protocol import ClientMessage, EngineCoreOutputs, RecoveryKind
from raylm.testing.chaos.content_model import ContentModelExecutor

# Modules whose `time.monotonic` (and `time.sleep`) the simulated clock replaces.
_CLOCKED_MODULES = (
    supervisor,
    ledger,
    migration,
    prefix_pull,
    handoff,
    core_recovery,
    core_channel,
    scaling,
    engine_core,
    core_migration,
    core_proc,
    scheduler_module,
    request_module,
)


class SimClock:
    """Seconds that pass only when the harness says; a sleep passes them."""

    def __init__(self):
        # Where the real clock is: values some dataclass read from it at
        # import (their default factories) stay comparable. A whole second:
        # from a fraction of one, the same schedule's sums of ticks rounded
        # differently from one replay to the next, and a deadline met in
        # one was missed in the other (Hypothesis: FlakyStrategyDefinition).
        self.now = float(int(time.monotonic()))

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)

    def install(self) -> Callable[[], None]:
        """Make the engine's modules read this clock; returns the undo."""
        fake = types.SimpleNamespace(
            monotonic=self.monotonic,
            sleep=self.sleep,
            perf_counter=time.perf_counter,
            time=time.time,
            monotonic_ns=time.monotonic_ns,
        )
        saved = [(m, m.time) for m in _CLOCKED_MODULES]
        for module in _CLOCKED_MODULES:
            module.time = fake
        # A rebuild's gc.collect() frees a real model's memory; here it would
        # only cost a quarter of a second each time.
        free_released_memory, engine_core._free_released_memory = engine_core._free_released_memory, lambda: None

        def undo() -> None:
            for module, original in saved:
                module.time = original
            engine_core._free_released_memory = free_released_memory

        return undo


@dataclass
class BackgroundTask:
    """A task the supervisor would run in a thread, due at `due`."""

    due: float
    run: Callable[[], None]
    cancelled: Callable[[], None]
    name: str


class SimHost:
    """What the simulated processes share, as a machine's processes share its
    sockets, process table and clock."""

    def __init__(self, config: EngineConfig, num_blocks: int):
        self.config = config
        self.num_blocks = num_blocks  # each core's KV cache
        self.clock = SimClock()
        self.inbox: deque[bytes] = deque()  # the supervisor's output socket
        self.cores: dict[int, SimCoreProc] = {}  # by index: the current start of each core
        self.procs: list[SimCoreProc] = []  # every start, for the leak checks
        self.running_alone: dict[int, str | None] = {}
        self.deaths: list[tuple[int, str]] = []  # what the launcher reports next
        self.background: list[BackgroundTask] = []
        self.fail_next_start = False

    def set_clock_of(self, owner) -> None:
        """Restart budgets read their clock through an argument bound at import."""
        owner.restart_budget._clock = self.clock.monotonic
        owner.blame._blamed._clock = self.clock.monotonic


# ---- a core --------------------------------------------------------------------------------


class Frame:
    """What a zmq.Frame is to its readers here: bytes behind `.buffer`."""

    def __init__(self, data: bytes):
        self.buffer = memoryview(data)
        self.bytes = data


class _Inbox:
    """A core's input socket, as its loop reads it."""

    def __init__(self):
        self.frames: deque[bytes] = deque()

    def poll(self, timeout=None) -> bool:
        return bool(self.frames)

    def recv(self, copy: bool = True):
        return Frame(self.frames.popleft())

    def close(self, linger=None) -> None:
        self.frames.clear()


class _Outbox:
    """A core's output socket: what it sends lands in the supervisor's inbox."""

    def __init__(self, inbox: deque):
        self.inbox = inbox
        self.closed = False

    def send(self, data, copy: bool = True) -> None:
        if not self.closed:
            self.inbox.append(bytes(data))

    def close(self, linger=None) -> None:
        self.closed = True


class SimEngineCore(EngineCore):
    """The real EngineCore on the content model; `faults` are the harness's
    to fill (ContentModelExecutor)."""

    def __init__(self, config: EngineConfig, num_blocks: int):
        self.faults: list[str] = []
        self.transfer_faults: list[str] = []
        self._num_blocks = num_blocks
        super().__init__(config)

    def _make_executor(self):
        self.batch_queue_size = 1
        return ContentModelExecutor(self.config, self._num_blocks, self.faults, transfer_faults=self.transfer_faults)


class SimCoreProc(core_proc.EngineCoreProc):
    """The real core loop (EngineCoreProc.run_once) on the harness's sockets."""

    def __init__(self, core: SimEngineCore, engine_index: int, incarnation: int, host: SimHost):
        self.core = core
        self.incarnation = incarnation
        self.engine_index = engine_index
        self.core_start = incarnation  # distinct for each start of an index, as the real one's random draw
        self.watch_parent = False
        core.on_rebuilding = self._announce_rebuilding
        core.record_kv_events()
        core.on_running_alone = lambda rid: host.running_alone.__setitem__(engine_index, rid)
        self.input = _Inbox()
        self.output = _Outbox(host.inbox)
        self.decoder = msgspec.msgpack.Decoder(ClientMessage)
        self.encoder = msgspec.msgpack.Encoder()
        self._num_reported_recoveries = 0
        self.alive = True  # False once killed (kill -9) or stopped by the supervisor
        self.frozen = False  # SIGSTOP: alive, but its loop does not turn
        self.shut_down = False  # left its loop on a Shutdown message
        self.released = False

    def turn(self) -> bool:
        """One turn of its loop, if it can; whether anything happened."""
        if not self.alive or self.frozen or self.shut_down:
            return False
        if not self.input.frames and not self._has_work() and not self.core.migrations.copying:
            return False
        if not self.run_once():
            self.shut_down = True
            self._release()
        return True

    def kill(self) -> None:
        """kill -9: nothing more is read or sent; what it sent stays sent."""
        self.alive = False
        self.output.close()
        self._release()

    def _release(self) -> None:
        """What the process's exit would free (the core's grammar threads)."""
        if not self.released:
            self.released = True
            self.core.shutdown()


# ---- the launcher ---------------------------------------------------------------------------


class _SimChannel(CoreChannel):
    """Delivers what the supervisor sends to its core's inbox once the core
    runs; a dead core's frames are lost, as a killed process's are."""

    proc: SimCoreProc | None = None

    def flush(self) -> None:
        if self.proc is None:
            return
        while self.unsent:
            frame = self.unsent.popleft()
            if self.proc.alive:
                self.proc.input.frames.append(frame)


class SimLauncher(CoreLauncher):
    recovery_kind = RecoveryKind.DP_REPLICA
    can_scale = True

    def __init__(self, host: SimHost):
        self.host = host
        self._incarnations = itertools.count(1)

    def bind_output(self, ctx):
        host = self.host

        class Output:
            def poll(self, timeout=None) -> bool:
                return bool(host.inbox)

            def recv(self, copy: bool = True):
                return Frame(host.inbox.popleft())

            def close(self, linger=None) -> None:
                pass

        return Output()

    def new_channel(self, ctx, index: int) -> CoreChannel:
        return _SimChannel(index, input=None, address="", incarnation=next(self._incarnations))

    def close_channel(self, channel: CoreChannel) -> None:
        pass

    def sender(self, frame, outputs: EngineCoreOutputs, channels: dict[int, CoreChannel]) -> CoreChannel | None:
        channel = channels.get(outputs.engine_index)
        return channel if channel is not None and channel.incarnation == outputs.incarnation else None

    def start(self, channel: CoreChannel, target=None) -> None:
        host = self.host
        if host.fail_next_start:
            host.fail_next_start = False
            raise RuntimeError("chaos: the replica failed to start")
        core = SimEngineCore(host.config, host.num_blocks)
        host.set_clock_of(core)
        proc = SimCoreProc(core, channel.index, channel.incarnation, host)
        channel.node_ip = "127.0.0.1"
        channel.proc = proc
        host.procs.append(proc)
        host.cores[channel.index] = proc
        channel.flush()

    def stop(self, index: int, wait_s: float) -> None:
        proc = self.host.cores.pop(index, None)
        if proc is not None and proc.alive:
            proc.kill()

    def deaths(self) -> list[tuple[int, str]]:
        found, self.host.deaths = self.host.deaths, []
        for index, _ in found:
            proc = self.host.cores.get(index)
            if proc is not None and not proc.alive:
                del self.host.cores[index]
        return found

    def is_local(self, index: int) -> bool:
        return True

    def take_running_alone(self, index: int) -> str | None:
        return self.host.running_alone.pop(index, None)

    def shutdown(self) -> None:
        for index in list(self.host.cores):
            self.stop(index, 0)


# ---- the supervisor -------------------------------------------------------------------------


class ScheduledBackground:
    """The supervisor's background tasks (core_recovery.BackgroundThreads),
    waiting in `host.background` for the schedule to run them."""

    def __init__(self, host: SimHost):
        self.host = host

    def run(self, delay_s: float, run, cancelled, name: str) -> None:
        self.host.background.append(BackgroundTask(self.host.clock.now + delay_s, run, cancelled, name))


class ChaosSupervisor(supervisor.SyncEngineCoreSupervisor):
    """The real supervisor, but what it would run in threads waits in
    `host.background` for the schedule to run it."""

    def __init__(self, config: EngineConfig, host: SimHost):
        self.host = host
        super().__init__(config, SimLauncher(host), background=ScheduledBackground(host))
