"""The chaos harness's real-engine tier: a seeded schedule of operations
against a real engine (LLM with data-parallel engine-core processes), under
greedy float32 streams, and what it ended with.

A schedule is a list of operations, each at a step of the front end's loop
(`make_schedule(seed)`: the same seed, the same schedule). The cores run
beside that loop, so the same schedule meets the engine in another state
each time it is replayed: a replay is a sample, and the tier reports how
often a seed's replays fail. The fast tier (sim.py) is where a schedule
replays exactly and shrinks.

Operations: kill -9 of a core process, SIGSTOP then SIGCONT of one (shorter
than the step deadline), a scale to 1..3 replicas (started beside the loop,
as the server's /scale does), a migration, a replica restart, a client
abort, a late request (one whose prompt extends an early one's: routed to
a core without its prefix, it is pulled there), and a stranger sending junk
to every socket the engine listens on:
the supervisor's output socket, and each TCP port its processes listen on
(a rank's K/V server, with RAYLM_MIGRATION_NETWORK=1 the path every
migration takes; raylm.kv_transfer.admission refuses strangers). A harness
adds its own operations (the two-host harness: a network partition,
tests/multinode/chaos_driver.py). At most one kill per schedule: the quarantine rules cannot tell a kill from a
poison request, and a request exposed to one failure is never failed.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

import psutil
import zmq

OPERATIONS = ("kill", "freeze", "scale", "migrate", "restart", "abort", "stranger", "late")
# A frozen core is thawed after this long: well short of the step deadline.
FREEZE_S = 0.3
STRANGER_FRAMES = 32
# Junk connections to each listening TCP port, by kind: random bytes, a
# ZMTP greeting with the NULL mechanism and a message, a greeting that
# stops short (a silent peer). Bounded: a stranger, not a flood.
STRANGER_CONNECTIONS = 6
_ZMTP_NULL_GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL" + b"\x00" * 16 + b"\x00" + b"\x00" * 31


@dataclass(frozen=True)
class Operation:
    at_step: int  # the front end's step before which it runs
    name: str
    arg: int  # which core, request or size (taken modulo what exists)


def make_schedule(
    seed: int,
    num_ops: int = 8,
    span_steps: int = 60,
    operations: tuple[str, ...] = OPERATIONS,
    deaths: tuple[str, ...] = ("kill",),
) -> list[Operation]:
    """`deaths`: the operations that end a core (at most one of them a
    schedule: the quarantine rules cannot tell the harness's kill from a
    poison request's, and a request present at two would be framed)."""
    rng = random.Random(seed)
    ops, killed = [], False
    for _ in range(num_ops):
        name = rng.choice(operations)
        if name in deaths:
            if killed:
                name = "migrate"
            killed = True
        ops.append(Operation(rng.randrange(1, span_steps), name, rng.randrange(0, 1 << 16)))
    return sorted(ops, key=lambda op: op.at_step)


@dataclass
class Replay:
    """What one replay of a schedule did and ended with."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    aborted: set[str] = field(default_factory=set)
    errors: dict[str, str] = field(default_factory=dict)
    done: list[str] = field(default_factory=list)  # the operations as they ran (or why not)

    def failures(self, reference: dict[str, list[int]]) -> list[str]:
        """The invariants a replay must hold, broken (empty: it held)."""
        broken = []
        for rid, expected in reference.items():
            got = self.tokens.get(rid, [])
            if rid in self.errors:
                broken.append(f"{rid} failed: {self.errors[rid]}")
            elif rid in self.aborted:
                if got != expected[: len(got)]:
                    broken.append(f"aborted {rid} diverged before its abort: {got} vs {expected}")
            elif rid not in self.finished:
                broken.append(f"{rid} never finished")
            elif got != expected:
                broken.append(f"{rid} differs from an undisturbed run: {got} vs {expected}")
        return broken


class ScheduleRunner:
    """Runs one schedule against `llm` (an LLM with data_parallel_size > 1,
    its cores local processes or Ray replicas) while it serves `requests`
    (id -> (prompt, params)). `extra`: a harness's own operations, by name
    (each takes the operation's arg and says what it did)."""

    def __init__(self, llm, schedule: list[Operation], extra: dict | None = None):
        self.engine = llm.llm_engine
        self.sup = self.engine.engine_core
        self.schedule = list(schedule)
        self.extra = dict(extra or {})
        self.steps = 0  # the front end's steps the run took
        self.replay = Replay()
        self._late_requests: list = []
        self._scale_up = None
        self._scale_thread: threading.Thread | None = None
        self._scale_error: list[BaseException] = []

    def run(self, requests: dict, max_steps: int = 20000, late: dict | None = None) -> Replay:
        """`late`: requests (as `requests`) sent one by one by the schedule's
        `late` operations, the rest once the schedule has run: prompts that
        extend an early one's meet its blocks in another core's cache (a
        prefix pull, raylm.engine.prefix_pull) while the schedule strikes."""
        self._late_requests = list((late or {}).items())
        for rid, (prompt, params) in requests.items():
            self.engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        step = 0
        while (
            self.engine.has_unfinished_requests() or self.schedule or self._scale_up is not None or self._late_requests
        ):
            while self.schedule and self.schedule[0].at_step <= step:
                self._apply(self.schedule.pop(0))
            while not self.schedule and self._late_requests:
                self._late(0)
            self._end_scale_if_started()
            if self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    self._record(out)
            else:
                time.sleep(0.01)
            step += 1
            self.steps = step
            if step > max_steps:
                raise AssertionError(f"the schedule did not end within {max_steps} steps")
        return self.replay

    def _record(self, out) -> None:
        self.replay.tokens[out.request_id] = list(out.outputs[0].token_ids)
        if out.finished:
            self.replay.finished.add(out.request_id)
            if out.outputs[0].finish_reason == "error":
                self.replay.errors[out.request_id] = out.outputs[0].error or "error (no reason given)"

    # ---- the operations ----------------------------------------------------------------

    def _apply(self, op: Operation) -> None:
        try:
            what = (self.extra.get(op.name) or getattr(self, f"_{op.name}"))(op.arg)
        except ValueError as e:  # refused, as the server would answer 400/409
            what = f"refused: {e}"
        self.replay.done.append(f"{op.name}({op.arg}): {what}")

    def _core_pid(self, arg: int) -> tuple[int, int] | None:
        """(index, pid) of a live core: a local process or a Ray replica's actor."""
        launcher = self.sup.launcher
        if hasattr(launcher, "manager"):  # Ray replicas (engine/ray_launcher.py)
            pids = {i: h.pid for i, h in dict(launcher.manager.replicas).items() if psutil.pid_exists(h.pid)}
        else:
            pids = {i: p.pid for i, p in launcher._processes.items() if p.is_alive()}
        if not pids:
            return None
        index = sorted(pids)[arg % len(pids)]
        return index, pids[index]

    def _kill(self, arg: int) -> str:
        core = self._core_pid(arg)
        if core is None:
            return "no core"
        os.kill(core[1], signal.SIGKILL)
        return f"killed core {core[0]}"

    def _freeze(self, arg: int) -> str:
        core = self._core_pid(arg)
        if core is None:
            return "no core"
        os.kill(core[1], signal.SIGSTOP)
        timer = threading.Timer(FREEZE_S, _thaw, args=(core[1],))
        timer.daemon = True
        timer.start()
        return f"froze core {core[0]} for {FREEZE_S} s"

    def _scale(self, arg: int) -> str:
        size = 1 + arg % 3
        if self._scale_up is not None:
            return f"scale to {size} not sent: the last one still starts"
        scale_up = self.sup.begin_scale(size)
        if scale_up is None:
            return f"scaled in to {size}"
        self._scale_up, self._scale_error = scale_up, []
        self._scale_thread = threading.Thread(target=self._start_scaled, name="chaos-scale", daemon=True)
        self._scale_thread.start()
        return f"scaling out to {size}"

    def _start_scaled(self) -> None:
        try:
            self.sup.start_scaled(self._scale_up)
        except BaseException as e:
            self._scale_error.append(e)

    def _end_scale_if_started(self) -> None:
        if self._scale_up is None or self._scale_thread.is_alive():
            return
        self.sup.end_scale(self._scale_up, started=not self._scale_error)
        self._scale_up = None

    def _late(self, arg: int) -> str:
        if not self._late_requests:
            return "no late request left"
        rid, (prompt, params) = self._late_requests.pop(0)
        self.engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        entry = self.sup.ledger.get(rid)
        pulling = entry is not None and entry.held
        return f"sent {rid} to core {entry.channel if entry else '?'}" + (" (its prefix pulled)" if pulling else "")

    def _in_flight(self, arg: int) -> str | None:
        ids = sorted(self.sup.ledger)
        return ids[arg % len(ids)] if ids else None

    def _migrate(self, arg: int) -> str:
        rid = self._in_flight(arg)
        return f"{rid}: {self.sup.migrate(rid)}" if rid is not None else "nothing in flight"

    def _restart(self, arg: int) -> str:
        index = sorted(self.sup.channels)[arg % len(self.sup.channels)]
        return f"restarting {index}, {self.sup.begin_restart(index)} moving"

    def _abort(self, arg: int) -> str:
        rid = self._in_flight(arg)
        if rid is None:
            return "nothing in flight"
        self.engine.abort_request(rid)
        self.replay.aborted.add(rid)
        return f"aborted {rid}"

    def _stranger(self, arg: int) -> str:
        """Junk on every socket the engine listens on: the supervisor's
        output socket (a process of the same user: the socket's folder admits
        no other), and each TCP port a process of the engine listens on."""
        rng = random.Random(arg)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        try:
            sock.connect(self.sup.launcher.output_address)
            for _ in range(STRANGER_FRAMES):
                sock.send(rng.randbytes(rng.randrange(1, 256)))
        finally:
            sock.close()
            ctx.term()
        ports = listening_tcp_ports(descendants())
        # Every other one from another loopback address: a K/V server admits
        # only its offers' destinations' (raylm.kv_transfer.peer_filter), so
        # its kernel drops those SYNs unanswered; the rest meet the handshake.
        elsewhere = f"127.0.{rng.randrange(1, 255)}.{rng.randrange(2, 255)}"
        for address in ports:
            for kind in range(STRANGER_CONNECTIONS):
                _junk_connection(address, kind, rng, source=elsewhere if kind % 2 else "")
        return (
            f"{STRANGER_FRAMES} junk frames, {STRANGER_CONNECTIONS} junk connections to each of {sorted(ports)} "
            f"(half from {elsewhere})"
        )


def _thaw(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def listening_tcp_ports(pids: set[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket processes `pids` listen on."""
    found = set()
    for pid in pids:
        try:
            for conn in psutil.Process(pid).net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    found.add((conn.laddr.ip, conn.laddr.port))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def _junk_connection(address: tuple[str, int], kind: int, rng: random.Random, source: str = "") -> None:
    """One stranger's connection (from `source`, "": the kernel's choice):
    random bytes, a ZMTP NULL greeting and a message, or a greeting cut
    short; closed at once (a refused or reset connection is what a stranger
    expects, and a SYN left unanswered is given up after 0.3 s)."""
    host, port = address
    target = ("127.0.0.1" if host in ("0.0.0.0", "::") else host, port)
    try:
        with socket.create_connection(
            target, timeout=0.3 if source else 1.0, source_address=(source, 0) if source else None
        ) as s:
            if kind % 3 == 0:
                s.sendall(rng.randbytes(rng.randrange(1, 512)))
            elif kind % 3 == 1:
                s.sendall(_ZMTP_NULL_GREETING + bytes([0, 8]) + rng.randbytes(8))
            else:
                s.sendall(_ZMTP_NULL_GREETING[:10])
    except OSError:
        pass


def descendants() -> set[int]:
    """This process's descendants but multiprocessing's resource tracker
    (it lives as long as this process)."""
    pids = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(proc.cmdline()):
                pids.add(proc.pid)
        except psutil.NoSuchProcess:
            pass
    return pids
