"""How a step and a collective_rpc travel from the Ray executor to its rank
actors: one interface, `StepTransport`, which RayDistributedExecutor calls
without knowing which transport it has, so that placement, liveness and
shutdown (the executor's) are written once for both:

- `mq` (ray_mq_transport): a broadcast message queue read by a loop thread in
  every actor, the same code as the multiprocess executor;
- `cgraph` (ray_cgraph): each step one execution of a Ray Compiled Graph, and
  other calls plain Ray actor calls.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from raylm.config import EngineConfig
from raylm.messages import GrammarOutput, SchedulerOutput


@dataclass
class RankActors:
    """The executor's rank actors, in rank order, as a transport sees them.
    Lists and a closure over lists, never the executor itself: a transport
    must not keep the executor alive (its finalizer would never run)."""

    workers: list
    node_ids: list[str]
    node_ips: list[str]
    # rank -> "rank 1 (pid 4242, node 10.0.0.2 1a2b3c4d5e6f)"
    describe: Callable[[int], str]


class StepTransport(ABC):
    """One executor's way to its actors. The executor checks its own state
    (a dead worker, shut down) before every call; the transport only carries.

    Shutdown comes in three hooks around the executor's own steps (killing
    the actors, removing the placement group), each a no-op by default:
    `stop` before the actors are killed, `after_kill` once they are (only
    while Ray is up), and `release` last, whether or not Ray is up."""

    def __init__(self, config: EngineConfig, step_timeout_s: float, output_rank: int):
        self.config = config
        self.step_timeout_s = step_timeout_s
        # The rank whose reply is the step's (the first TP rank of the last PP stage).
        self.output_rank = output_rank

    @abstractmethod
    def start(
        self,
        ranks: RankActors,
        startup_get: Callable[[list, str], list],
        start_timeout_s: float,
        driver_node_id: str,
        on_failure: Callable[[str], None],
    ) -> None:
        """Set up the transport once the actors have their ranks, before any
        call. `startup_get(refs, call)`: the executor's bounded ray.get of
        start-up calls; `on_failure(reason)`: the transport saw the executor
        fail (it must not refer to the executor strongly)."""

    @abstractmethod
    def collective_rpc(
        self,
        method: str | Callable,
        timeout: float | None,
        args: tuple,
        kwargs: dict | None,
        non_block: bool,
        unique_reply_rank: int | None,
    ) -> Any:
        """The executor contract's collective_rpc, on this transport."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool) -> Any:
        """Phase one of a step: None (or a Future of None) until sample_tokens."""

    @abstractmethod
    def sample_tokens(self, grammar_output: GrammarOutput | None, non_block: bool) -> Any:
        """Phase two: the output rank's ModelRunnerOutput, or a Future of it."""

    @abstractmethod
    def check_health(self, timeout: float) -> None:
        """Every rank answers a heartbeat within `timeout` (skipped while a
        step is in flight: its own deadline watches it)."""

    def mark_failed(self, reason: str) -> None:  # noqa: B027 (optional hook: nothing to do by default)
        """The executor saw a worker die: fail what is in flight now."""

    def raise_if_failed(self) -> None:  # noqa: B027 (optional hook: nothing to do by default)
        """Raise when the transport itself saw the executor fail."""

    @property
    def shm_segment_names(self) -> list[str]:
        """The /dev/shm segments this transport created (none by default)."""
        return []

    @property
    def resources(self) -> Any:
        """What must be released even when the executor is never shut down:
        an object with stop/after_kill/release like the transport's, held by
        the executor's finalizer (so it refers to neither); None if nothing."""
        return None

    def stop(self, workers: list, wait_for_loops: bool) -> None:  # noqa: B027 (optional hook: nothing to do by default)
        """Before the actors are killed."""

    def after_kill(self) -> None:  # noqa: B027 (optional hook: nothing to do by default)
        """Once the actors are killed (Ray is up)."""

    def release(self) -> None:  # noqa: B027 (optional hook: nothing to do by default)
        """Last, at shutdown."""


class RefFuture(Future):
    """A Future over Ray refs, resolved lazily on the caller's thread by
    `getter(timeout)`."""

    def __init__(self, getter):
        super().__init__()
        self._getter = getter
        self._lock = threading.Lock()

    def result(self, timeout=None):
        with self._lock:
            if not self.done():
                try:
                    self.set_result(self._getter(timeout))
                except BaseException as e:
                    self.set_exception(e)
        return super().result()
