"""What an executor raises when it can no longer run steps. Every backend raises
the same types, so the engine core recovers the same way whatever failed."""

from __future__ import annotations


class ExecutorFailedError(RuntimeError):
    """The executor is unusable: the engine core rebuilds it (docs/architecture.md,
    "The failure model"). The message names the rank, its node and pid, and why."""


class WorkerDiedError(ExecutorFailedError):
    """A worker process or actor died, or failed outside a call that could
    report it (its peers may be stuck in a collective)."""


class WorkerHungError(ExecutorFailedError, TimeoutError):
    """A worker is alive but did not answer within its deadline (a step past
    `execute_model_timeout`, or a health check past its timeout)."""


class WorkerStepError(ExecutorFailedError):
    """A worker raised during a call that other ranks take part in (a step): its
    peers may wait for it in a collective forever, so the executor is unusable,
    but nothing died. The engine core blames the step's requests for it."""
