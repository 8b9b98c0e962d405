"""What the supervisor knows of each engine core it runs (`CoreChannel`), and
what a launcher must do to run one (`CoreLauncher`): a local core process
(process_launcher.py) or a data-parallel replica on Ray (ray_launcher.py).

A channel is a core's input socket (the supervisor's PUSH; requests, aborts,
pings) and its share of the supervisor's one output socket (a PULL every
core sends to, tagged with its index). The supervisor does the rest, the same
for every launcher: the ledger of requests, routing, recovery, scaling.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from raylm.config import EngineConfig
from raylm.engine.protocol import EngineCoreOutputs, RecoveryKind, SchedulerStats

logger = logging.getLogger(__name__)

# Aborted requests remembered per core: their last outputs may cross the abort.
_ABORTS_REMEMBERED = 1024


def send_pending(socket: zmq.Socket, unsent: deque) -> None:
    """Send what the socket takes now, in order, without blocking; the rest
    waits in `unsent` (a bound PUSH socket refuses while no peer is connected:
    a core not yet connected, or one that died)."""
    while unsent:
        try:
            socket.send(unsent[0], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        unsent.popleft()


@dataclass(eq=False)
class CoreChannel:
    """One engine core as the supervisor sees it. Sends never block: a frame
    the socket cannot take yet waits in `unsent` (resent between reads)."""

    index: int
    input: zmq.Socket
    address: str
    # Which start of core `index` this is (its messages say so).
    incarnation: int = 0
    unsent: deque = field(default_factory=deque)
    aborted: deque = field(default_factory=lambda: deque(maxlen=_ABORTS_REMEMBERED))
    in_flight: set[str] = field(default_factory=set)
    stats: SchedulerStats | None = None
    draining: bool = False
    num_routed: int = 0
    node_ip: str = ""
    # When it last sent anything, or was given work while idle (a silence
    # while idle is no hang): see core_recovery.Recovery.kill_hung_cores.
    last_heard: float = field(default_factory=lambda: time.monotonic())
    # Since when it has been rebuilding its executor (it says so before each
    # attempt, and sends nothing else until done); None while it serves.
    rebuilding_since: float | None = None

    def send(self, frame: bytes) -> None:
        self.unsent.append(frame)
        self.flush()

    def flush(self) -> None:
        send_pending(self.input, self.unsent)

    def heard(self, outputs: EngineCoreOutputs) -> None:
        """Any message but a rebuild announcement says its loop runs again."""
        now = time.monotonic()
        if not outputs.rebuilding:
            self.rebuilding_since = None
        elif self.rebuilding_since is None:
            self.rebuilding_since = now
            logger.warning("engine core %d is rebuilding its executor", self.index)
        self.last_heard = now


class DropLog:
    """Counts dropped frames or outputs of one kind and warns (on `log`, the
    dropping module's) at the 1st, 2nd, 4th, 8th...: what a misbehaving peer
    sends must not flood the log."""

    def __init__(self, what: str, log: logging.Logger = logger):
        self.what = what
        self.log = log
        self.count = 0

    def dropped(self, detail: str) -> None:
        self.count += 1
        if self.count & (self.count - 1) == 0:
            self.log.warning("dropped %s (%d so far): %s", self.what, self.count, detail)


class CoreLauncher(ABC):
    """Starts, watches and stops engine cores for an EngineCoreSupervisor,
    and owns their sockets' security. `start` and `stop` block (the
    supervisor calls them from threads); everything else is quick."""

    # What a recovery of one of its cores is, for logs and metrics.
    recovery_kind: RecoveryKind
    # Whether the number of cores may change at run time.
    can_scale: bool = False
    # P/D: core `index`'s role now (the supervisor's Handoffs.role_of, which
    # follows a role autoscaler's changes); None: the config's own roles.
    role_of: Callable[[int], str] | None = None

    def core_config(self, config: EngineConfig, index: int) -> EngineConfig:
        """The config core `index` starts with: its role's threads per
        worker (EngineConfig.for_role). A core keeps what it started with
        when its role changes later; its next start takes the new role's."""
        role = self.role_of(index) if self.role_of is not None else config.parallel_config.role_of(index)
        return config.for_role(role)

    @abstractmethod
    def bind_output(self, ctx: zmq.Context) -> zmq.Socket:
        """The PULL socket every core sends its outputs to (bound, secured)."""

    @abstractmethod
    def new_channel(self, ctx: zmq.Context, index: int) -> CoreChannel:
        """Core `index`'s input socket, bound and secured (the core connects while it starts)."""

    @abstractmethod
    def close_channel(self, channel: CoreChannel) -> None:
        """Close its socket; from now on nothing signed as this channel is believed."""

    @abstractmethod
    def sender(
        self, frame: zmq.Frame, outputs: EngineCoreOutputs, channels: dict[int, CoreChannel]
    ) -> CoreChannel | None:
        """The serving channel that sent `frame`, or None to drop it (logged)."""

    def plan_targets(self, num_cores: int) -> list:
        """Where the next `num_cores` cores should go (None: anywhere)."""
        return [None] * num_cores

    @abstractmethod
    def start(self, channel: CoreChannel, target) -> None:
        """Start the core of `channel` and block until it serves (sets
        `channel.node_ip`); on failure nothing of it is left and it raises."""

    @abstractmethod
    def stop(self, index: int, wait_s: float) -> None:
        """Stop core `index` (after its channel sent Shutdown): wait up to
        `wait_s` for it to leave its loop, then kill it."""

    @abstractmethod
    def deaths(self) -> list[tuple[int, str]]:
        """(index, cause) of each core found dead since the last call."""

    def dying(self) -> list[int]:
        """Cores seen dead but not yet reported by `deaths` (a launcher that
        waits for a dead core's last words first): what depends on nothing
        they could still say (a prefix pull from one) need not wait."""
        return []

    def is_local(self, index: int) -> bool:
        """Whether core `index` runs on this machine (its workers can read
        this machine's shared memory: live migration needs it)."""
        return False

    @abstractmethod
    def take_running_alone(self, index: int) -> str | None:
        """The quarantined request core `index` last said it runs alone (its
        last words, for a core that died), and forget it."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every core (they were sent Shutdown), bounded in time;
        idempotent. Nothing of theirs is left after."""
