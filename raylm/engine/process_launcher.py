"""Engine cores as local processes (`spawn`), over ipc:// ZMQ sockets in a
private folder (0700, made by mkdtemp): only processes of this user on this
machine can reach them, so frames are trusted to say which core sent them.

The supervisor's usual launcher: one core process when data_parallel_size is
1 (whatever the executor backend; with Ray the core process starts the
workers), or N with data_parallel_backend="mp".
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time

import zmq

from raylm.config import EngineConfig
from raylm.engine.core_channel import CoreChannel, CoreLauncher
from raylm.engine.core_proc import RunningAloneRecord, run_engine_core
from raylm.engine.errors import EngineDeadError, EngineStartTimeoutError
from raylm.engine.protocol import EngineCoreOutputs, RecoveryKind

logger = logging.getLogger(__name__)

# How often a starting core's readiness (and liveness) is checked.
_READY_POLL_S = 0.5
# A core that failed sends its error, then exits: once it is gone, what it
# sent last is already in the output socket's queue or arrives within this time.
_LAST_WORDS_S = 0.2
_SHUTDOWN_TIMEOUT_S = 30.0
# How often the cores' liveness is looked at.
_DEATH_POLL_S = 0.05


class ProcessCoreLauncher(CoreLauncher):
    recovery_kind = RecoveryKind.ENGINE_CORE

    def __init__(self, config: EngineConfig, log_level: int | None = None):
        self.config = config
        # Local data parallelism scales like replicas on Ray (one core is not
        # data parallelism: it has nowhere to move its requests to).
        self.can_scale = config.parallel_config.data_parallel_size > 1 or config.autoscale is not None
        self.log_level = logging.getLogger().getEffectiveLevel() if log_level is None else log_level
        self._tmpdir = tempfile.mkdtemp(prefix="raylm-core-")
        self.output_address = f"ipc://{os.path.join(self._tmpdir, 'output')}"
        self._processes: dict[int, multiprocessing.process.BaseProcess] = {}
        # When a core was first seen dead: its death is reported _LAST_WORDS_S later.
        self._seen_dead: dict[int, float] = {}
        self._lock = threading.Lock()
        self._incarnations = itertools.count(1)
        self._last_look = 0.0

    def _path(self, name: str) -> str:
        return os.path.join(self._tmpdir, name)

    def bind_output(self, ctx: zmq.Context) -> zmq.Socket:
        socket = ctx.socket(zmq.PULL)
        socket.bind(self.output_address)
        return socket

    def new_channel(self, ctx: zmq.Context, index: int) -> CoreChannel:
        socket = ctx.socket(zmq.PUSH)
        # No high-water mark: a full queue would make sends fail while the core lives.
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        address = f"ipc://{self._path(f'input-{index}')}"
        socket.bind(address)
        return CoreChannel(index, socket, address, incarnation=next(self._incarnations))

    def close_channel(self, channel: CoreChannel) -> None:
        channel.input.close(linger=0)

    def sender(self, frame, outputs: EngineCoreOutputs, channels: dict[int, CoreChannel]) -> CoreChannel | None:
        # Only our own core processes can reach the folder's sockets; a
        # replaced core's last messages may still arrive: not the new one's.
        channel = channels.get(outputs.engine_index)
        if channel is None or channel.incarnation != outputs.incarnation:
            logger.debug("dropped a message from an engine core no longer serving")
            return None
        return channel

    def start(self, channel: CoreChannel, target=None) -> None:
        mp = multiprocessing.get_context("spawn")
        ready_recv, ready_send = mp.Pipe(duplex=False)
        record = RunningAloneRecord(self._path(f"running_alone-{channel.index}"))
        record.write(None)
        # Not a daemon: the core may start worker processes of its own.
        process = mp.Process(
            target=run_engine_core,
            name=f"RaylmEngineCore-{channel.index}",
            args=(
                self.core_config(self.config, channel.index),
                channel.address,
                self.output_address,
                ready_send,
                self.log_level,
                record.path,
                channel.index,
                channel.incarnation,
            ),
        )
        process.start()
        ready_send.close()
        try:
            num_blocks = self._wait_ready(process, ready_recv)
        except BaseException:
            _stop_process(process, 0)
            raise
        finally:
            ready_recv.close()
        with self._lock:
            self._processes[channel.index] = process
        channel.node_ip = "127.0.0.1"
        logger.info("engine core %d ready (pid %d, %s KV blocks)", channel.index, process.pid, num_blocks)

    def _wait_ready(self, process, ready_recv):
        timeout = self.config.fault_tolerance.engine_start_timeout_s
        deadline = time.monotonic() + timeout
        while not ready_recv.poll(min(_READY_POLL_S, max(0.0, deadline - time.monotonic()))):
            if not process.is_alive():
                raise EngineDeadError(f"engine core process exited with code {process.exitcode} during startup")
            if time.monotonic() >= deadline:
                # Hung: it would not read a Shutdown (its sockets are not
                # connected yet). Its mp workers exit on their death pipes,
                # its Ray actors and placement group go with their owner.
                logger.error(
                    "engine core (pid %d) was not ready within %g s (engine_start_timeout): killing it",
                    process.pid,
                    timeout,
                )
                raise EngineStartTimeoutError(
                    f"engine core was not ready within {timeout:g} s (engine_start_timeout; hung loading the "
                    "model or starting its workers); killed it"
                )
        try:
            status, detail = ready_recv.recv()
        except EOFError:
            raise EngineDeadError("engine core process exited during startup") from None
        if status != "ready":
            # The core's own message (a bad setting, a missing file) says what to fix.
            raise ValueError(f"engine core failed to start: {detail}")
        return detail

    def stop(self, index: int, wait_s: float) -> None:
        with self._lock:
            process = self._processes.pop(index, None)
            self._seen_dead.pop(index, None)
        if process is not None:
            _stop_process(process, wait_s)

    def deaths(self) -> list[tuple[int, str]]:
        now = time.monotonic()
        # The supervisor asks at every message it reads: look (a waitpid per
        # core) at most every _DEATH_POLL_S, which bounds detection instead.
        if now - self._last_look < _DEATH_POLL_S and not self._seen_dead:
            return []
        self._last_look = now
        found = []
        with self._lock:
            for index, process in list(self._processes.items()):
                if process.is_alive():
                    continue
                first_seen = self._seen_dead.setdefault(index, now)
                if now - first_seen >= _LAST_WORDS_S:
                    del self._processes[index], self._seen_dead[index]
                    found.append((index, f"engine core process exited with code {process.exitcode}"))
        return found

    def dying(self) -> list[int]:
        with self._lock:
            return list(self._seen_dead)

    def is_local(self, index: int) -> bool:
        return True

    def take_running_alone(self, index: int) -> str | None:
        record = RunningAloneRecord(self._path(f"running_alone-{index}"))
        request_id = record.read()
        record.write(None)
        return request_id

    def shutdown(self) -> None:
        with self._lock:
            processes = list(self._processes.values())
            self._processes.clear()
        deadline = time.monotonic() + _SHUTDOWN_TIMEOUT_S
        for process in processes:
            _stop_process(process, max(0.0, deadline - time.monotonic()))
        shutil.rmtree(self._tmpdir, ignore_errors=True)


def _stop_process(process, wait_s: float) -> None:
    """Let the core leave its loop (it was sent Shutdown) for `wait_s`, then
    SIGKILL it: it ignores SIGTERM (see run_engine_core)."""
    if wait_s > 0:
        process.join(wait_s)
    if process.is_alive():
        if wait_s > 0:
            logger.warning("engine core (pid %d) did not stop in %.0f s; killing it", process.pid, wait_s)
        process.kill()
        process.join(5)
