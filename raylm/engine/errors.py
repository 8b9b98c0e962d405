"""The engine's errors, in one module that imports nothing of the engine, so
that every layer can raise and catch them without an import circle.

EngineDeadError and its kin mean the engine (or one of its cores) cannot go
on; RequestFailedError means one request failed and the engine goes on."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core is gone; no request can be served any more."""


class EngineCoreDiedError(EngineDeadError):
    """A core vanished without saying why (killed, crashed), or hung and was
    killed: unlike a core that gave up on its own, a new one may well do better."""

    def __init__(self, exitcode: int | None, hung_s: float | None = None, rebuilding: bool = False):
        if hung_s is None:
            super().__init__(f"engine core process exited with code {exitcode}")
        elif rebuilding:
            super().__init__(
                f"engine core process was rebuilding its executor for {hung_s:.0f} s, past "
                f"engine_start_timeout; killed it"
            )
        else:
            super().__init__(
                f"engine core process made no progress for {hung_s:.0f} s with requests in flight; killed it"
            )
        self.exitcode = exitcode


class EngineStartTimeoutError(EngineDeadError, TimeoutError):
    """A new engine core (a process, or a data-parallel replica on Ray) was
    not ready within `engine_start_timeout_s` (hung loading, or in an
    executor start-up call); it was killed. Like a death, a new core may do
    better: the supervisor counts it as a failed restart. A RuntimeError, as
    the engine's callers expect of a start that failed (POST /scale answers
    409, the autoscaler tries again later), and a TimeoutError for those
    that catch timeouts."""


class EngineUnhealthyError(EngineDeadError):
    """Raised by health checks only: the engine still serves, but failed
    requests caused more recoveries than it forgives, so its operator
    should look (HTTP 503 on /health, like a dead engine)."""


class EngineRecoveryTimeoutError(EngineUnhealthyError):
    """Raised by health checks only: a recovery (a core restart, or the core
    rebuilding its executor) has run longer than `engine_start_timeout_s`,
    so it is presumably stuck: HTTP 503 on /health, for an operator to act."""

    def __init__(self, what: str, seconds: float, limit_s: float):
        super().__init__(
            f"the engine has been recovering ({what}) for {seconds:.0f} s, past its limit of "
            f"{limit_s:g} s (engine_start_timeout)"
        )
        self.seconds = seconds


class RequestFailedError(RuntimeError):
    """This request made the engine's steps fail and was dropped (docs/architecture.md,
    "The failure model"); the engine goes on serving the others (HTTP 500)."""
