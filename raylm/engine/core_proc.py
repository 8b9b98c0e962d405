"""The engine core in its own process: a loop that takes requests and aborts over
ZMQ, steps the core while there is work, and sends EngineCoreOutputs back.

Its messages are those of raylm.engine.protocol; the process is started with
the `spawn` context and builds everything (executor, Ray) inside itself.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import time
import traceback
from collections.abc import Callable

import msgspec
import zmq

from raylm.config import EngineConfig
from raylm.engine.protocol import (
    AbortRequests,
    ClientMessage,
    EngineCoreOutputs,
    EngineCoreRequest,
    MigrateEnd,
    MigrateExport,
    MigrateImport,
    Ping,
    PullEnd,
    PullExport,
    PullImport,
    RecoveryStats,
    SchedulerStats,
    Shutdown,
    TierLoad,
)
from raylm.startup_heap import freeze_startup_heap

logger = logging.getLogger(__name__)

# How often an idle core wakes up to check that its parent is still alive.
_IDLE_POLL_MS = 1000
_COPY_POLL_MS = 2  # idle while a migration's background import runs


class RunningAloneRecord:
    """A file that names the quarantined request a core is running alone.

    Written (atomically) before the core runs such a request, so that when the
    core process dies in that step (a poison request that kills it), its
    front end can read whom to blame: a message on a socket could still sit
    in a queue of the killed process. Written only when the request running
    alone changes, never on an ordinary step."""

    def __init__(self, path: str):
        self.path = path

    def write(self, request_id: str | None) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            f.write(request_id or "")
        os.replace(tmp, self.path)

    def read(self) -> str | None:
        try:
            with open(self.path) as f:
                return f.read() or None
        except OSError:
            return None


class EngineCoreProc:
    """Owns an EngineCore and its two sockets; `run` is the busy loop.

    `watch_parent`: exit when the parent process is gone (a core process); a
    replica actor is not a child of its front end, Ray ends it instead.
    `secure_socket`: applied to both sockets before they connect (a replica's
    CURVE keys, see dp_manager.ReplicaChannel)."""

    def __init__(
        self,
        core,
        input_address: str,
        output_address: str,
        engine_index: int = 0,
        watch_parent: bool = True,
        secure_socket: Callable[[zmq.Socket], None] | None = None,
        running_alone_path: str | None = None,
        incarnation: int = 0,
    ):
        self.core = core
        self.incarnation = incarnation
        if running_alone_path is not None:
            core.on_running_alone = RunningAloneRecord(running_alone_path).write
        core.on_rebuilding = self._announce_rebuilding
        core.record_kv_events()  # its supervisor follows its prefix cache (engine/prefix_index.py)
        self.engine_index = engine_index
        # Which start of a core this is, in its stats (SchedulerStats.core_start):
        # random, so that no two starts of a replica share one.
        self.core_start = secrets.randbits(63)
        self.watch_parent = watch_parent
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.output = self.ctx.socket(zmq.PUSH)
        # Unsent outputs must not be dropped at close, nor block exit forever.
        self.output.setsockopt(zmq.LINGER, 5000)
        if secure_socket is not None:
            secure_socket(self.input)
            secure_socket(self.output)
        self.input.connect(input_address)
        self.output.connect(output_address)
        self.decoder = msgspec.msgpack.Decoder(ClientMessage)
        self.encoder = msgspec.msgpack.Encoder()
        # How many of the core's recoveries the front end has been told about.
        self._num_reported_recoveries = 0

    def _has_work(self) -> bool:
        # With PP, batches can still be in flight after their requests were aborted.
        return self.core.has_unfinished_requests() or self.core.has_work_in_flight()

    def run(self) -> None:
        parent_pid = os.getppid() if self.watch_parent else None
        while True:
            if not self._wait_for_work(parent_pid) or not self.run_once():
                return

    def _wait_for_work(self, parent_pid: int | None) -> bool:
        """Block until there is something to do; False: the parent is gone, exit."""
        if not self._has_work() and self.core.migrations.copying:
            # Idle but for K/V being imported beside the steps: look again soon.
            self.input.poll(_COPY_POLL_MS)
        elif not self._has_work():
            # Idle: block on the input socket, so an idle server costs ~0 CPU;
            # wake now and then so an orphaned core exits instead of lingering.
            while not self.input.poll(_IDLE_POLL_MS):
                if parent_pid is not None and os.getppid() != parent_pid:
                    logger.warning("engine core: parent process is gone, exiting")
                    self._orphaned()
                    return False
                self._check_health_while_idle()
        elif parent_pid is not None and os.getppid() != parent_pid:  # busy, yet nobody reads the outputs
            logger.warning("engine core: parent process is gone, exiting")
            self._orphaned()
            return False
        return True

    def run_once(self) -> bool:
        """One turn of the loop: apply every waiting message, report, step
        once if there is work. False once told to shut down. (The chaos
        harness, raylm.testing.chaos, turns a core's loop by this.)"""
        handled, keep_running = self._drain_inputs()
        if not keep_running:
            return False
        reports = self.core.take_migration_reports()
        if reports:
            self._send(EngineCoreOutputs(migrations=reports, stats=self._stats()))
        if self._has_work():
            outputs = self.core.step()
            self._send(
                EngineCoreOutputs(
                    outputs=outputs,
                    stats=self._stats(),
                    recoveries=self._new_recoveries(),
                    migrations=self.core.take_migration_reports(),
                )
            )
        elif handled:
            # Aborts change the counts without a step; report them anyway.
            self._send(EngineCoreOutputs(stats=self._stats()))
        return True

    def _orphaned(self) -> None:
        """Nobody will read the outputs still queued for a front end that is
        gone: closing must not linger on them."""
        self.output.setsockopt(zmq.LINGER, 0)

    def _drain_inputs(self) -> tuple[bool, bool]:
        """Apply every waiting message: (any handled, keep running)."""
        handled = False
        while self.input.poll(0):
            message = self._decode_input(self.input.recv(copy=False))
            if message is None:
                continue
            handled = True
            if isinstance(message, EngineCoreRequest):
                self.core.add_request(message)
            elif isinstance(message, AbortRequests):
                self.core.abort_requests(message.request_ids)
            elif isinstance(message, Ping):
                self._send(EngineCoreOutputs(pong=message.nonce, stats=self._stats()))
            elif isinstance(message, (MigrateExport, MigrateImport, MigrateEnd)):
                reports = self.core.take_migration_reports(message)
                if reports:
                    self._send(EngineCoreOutputs(migrations=reports, stats=self._stats()))
            elif isinstance(message, (PullExport, PullImport, PullEnd)):
                pulls = self.core.handle_pull(message)
                if pulls:
                    self._send(EngineCoreOutputs(pulls=pulls, stats=self._stats()))
            elif isinstance(message, TierLoad):
                self.core.host_tier.load_for(message)  # adds the request, whatever the tiers held
            elif isinstance(message, Shutdown):
                return handled, False
        return handled, True

    def _decode_input(self, frame: zmq.Frame) -> ClientMessage | None:
        """One input message, or None to drop the frame. Here a frame that
        does not decode raises (only our own front end can write to this
        socket); a replica drops it instead (dp_manager.ReplicaCoreProc)."""
        return self.decoder.decode(frame.buffer)

    def _check_health_while_idle(self) -> None:
        """A dead or hung worker is found (and replaced) before a request needs
        it; the core decides how often it actually asks its workers."""
        self.core.check_health_if_due()
        recoveries = self._new_recoveries()
        if recoveries:
            self._send(EngineCoreOutputs(stats=self._stats(), recoveries=recoveries))

    def _new_recoveries(self) -> list[RecoveryStats]:
        """The core's recoveries since the last report, for the front end's metrics."""
        events = self.core.recoveries[self._num_reported_recoveries :]
        self._num_reported_recoveries += len(events)
        return [RecoveryStats(e.kind, e.seconds, e.num_requests, e.charged, e.culprits) for e in events]

    def _announce_rebuilding(self) -> None:
        self._send(EngineCoreOutputs(rebuilding=True))

    def _stats(self) -> SchedulerStats:
        return SchedulerStats(
            **self.core.stats(),
            worker_threads=self.core.worker_threads,
            unhealthy=self.core.unhealthy_reason,
            engine_index=self.engine_index,
            core_start=self.core_start,
        )

    def _send(self, outputs: EngineCoreOutputs) -> None:
        outputs.engine_index = self.engine_index
        outputs.incarnation = self.incarnation
        outputs.kv_events = self.core.take_kv_events()
        self.output.send(self.encoder.encode(outputs), copy=False)

    def close(self) -> None:
        self.input.close(linger=0)
        self.output.close()
        self.ctx.term()


def run_engine_core(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    ready_conn,
    log_level: int = logging.WARNING,
    running_alone_path: str | None = None,
    engine_index: int = 0,
    incarnation: int = 0,
) -> None:
    """Entry point of the engine-core process: build the core, report readiness
    (or the error) on `ready_conn`, loop, and always shut the executor down."""
    from raylm.engine.engine_core import EngineCore

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group; the front end decides when the
    # core stops (after in-flight streams end), so SIGINT is not ours to act on.
    # SIGTERM too: sent to the whole process group (systemd, docker stop), it
    # must not cut the streams the front end is still draining. The front end
    # stops the core with a Shutdown message (or SIGKILL), and the core exits
    # by itself when the front end is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        core = EngineCore(config)
    except BaseException as e:
        ready_conn.send(("error", f"{type(e).__name__}: {e}"))
        ready_conn.close()
        return
    proc = EngineCoreProc(
        core,
        input_address,
        output_address,
        engine_index,
        running_alone_path=running_alone_path,
        incarnation=incarnation,
    )
    freeze_startup_heap()  # before "ready": the first requests must not wait for its collection
    ready_conn.send(("ready", config.cache_config.num_blocks))
    ready_conn.close()
    try:
        proc.run()
    except Exception:
        error = traceback.format_exc()
        logger.error("engine core failed:\n%s", error)
        try:
            proc._send(EngineCoreOutputs(error=error))
        except Exception:  # the front end will notice the exit code instead
            pass
        raise
    finally:
        started = time.monotonic()
        core.shutdown()
        proc.close()
        logger.info("engine core stopped (executor shutdown took %.1fs)", time.monotonic() - started)
