"""A fault-injection hook for tests of the failure model (docs/architecture.md,
"The failure model"): off unless `RAYLM_FAULT_INJECTION` names one.

    RAYLM_FAULT_INJECTION="ACTION:token=ID[:rank=R]"

ACTION is `kill` (the process SIGKILLs itself), `hang` (it stops making
progress) or `raise` (the step raises). The worker of rank R (default: the
highest rank; with the `uni` backend, the process that runs the model) does
it whenever a request whose prompt contains token id ID is in its step: a
"poison request", as a real one (a prompt that crashes a kernel, exhausts
memory or deadlocks a collective) would behave.

    RAYLM_FAULT_INJECTION="slow:token=ID:ms=N[:rank=R]"

makes each such step N ms longer instead (a straggler: a replica on a slow
or busy host): tests of what must happen while a request still runs
(migration, rebalancing) then do not depend on how fast the machine is.

The front end reads the variable once into `FaultToleranceConfig.fault_injection`,
so it reaches mp workers, Ray actors and data-parallel replicas with the
config, whatever environment they were started in.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

from raylm.messages import SchedulerOutput

logger = logging.getLogger(__name__)

ENV_VAR = "RAYLM_FAULT_INJECTION"
ACTIONS = ("kill", "hang", "raise", "slow")


class InjectedFault(RuntimeError):
    """The step of a poison request raised, as the fault-injection hook asked."""


@dataclass(frozen=True)
class FaultSpec:
    action: str
    token_id: int
    rank: int | None = None  # None: the highest rank
    delay_ms: int = 0  # `slow`: how much longer each step is

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """`kill:token=7`, `hang:token=7:rank=0`, `slow:token=7:ms=5`; ValueError naming the variable."""
        action, *fields = text.strip().split(":")
        if action not in ACTIONS:
            raise ValueError(f"{ENV_VAR}: action must be one of {', '.join(ACTIONS)}, got {action!r}")
        values: dict[str, int] = {}
        for item in fields:
            key, sep, value = item.partition("=")
            if not sep or key not in ("token", "rank", "ms") or not value.strip().lstrip("-").isdigit():
                raise ValueError(f"{ENV_VAR}: expected token=ID[:rank=R][:ms=N], got {item!r} in {text!r}")
            values[key] = int(value)
        if "token" not in values:
            raise ValueError(f"{ENV_VAR}: token=ID is required, got {text!r}")
        if (action == "slow") != ("ms" in values) or values.get("ms", 1) <= 0:
            raise ValueError(f"{ENV_VAR}: ms=N (N > 0) goes with the slow action, and only with it: {text!r}")
        return cls(action, values["token"], values.get("rank"), values.get("ms", 0))


def spec_from_env() -> str | None:
    """The variable's value, validated (so a typo fails at start-up, not never)."""
    text = os.environ.get(ENV_VAR) or None
    if text is not None:
        FaultSpec.parse(text)
    return text


class FaultInjector:
    """Lives in one worker; `before_step` acts when a poison request is scheduled."""

    def __init__(self, spec: FaultSpec, rank: int, world_size: int):
        self.spec = spec
        self.armed = rank == (spec.rank if spec.rank is not None else world_size - 1)
        # Requests seen with the poison token: later steps name them by id only.
        self._poisoned: set[str] = set()
        if self.armed:
            logger.warning(
                "fault injection armed on rank %d: %s on any step with token %d (%s)",
                rank,
                spec.action,
                spec.token_id,
                ENV_VAR,
            )

    @classmethod
    def from_config(cls, text: str | None, rank: int, world_size: int) -> FaultInjector | None:
        return cls(FaultSpec.parse(text), rank, world_size) if text else None

    def before_step(self, scheduler_output: SchedulerOutput) -> None:
        if not self.armed:
            return
        for new in scheduler_output.scheduled_new_reqs:
            if self.spec.token_id in new.prompt_token_ids:
                self._poisoned.add(new.req_id)
        self._poisoned.difference_update(scheduler_output.finished_req_ids)
        if not any(rid in self._poisoned for rid in scheduler_output.num_scheduled_tokens):
            return
        if self.spec.action == "slow":
            time.sleep(self.spec.delay_ms / 1000)
            return
        logger.warning(
            "fault injection: %s (a request with token %d is in this step)", self.spec.action, self.spec.token_id
        )
        if self.spec.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.spec.action == "hang":
            threading.Event().wait()  # never set: this rank makes no more progress
        raise InjectedFault(f"injected fault: a request with token {self.spec.token_id} is in this step")
