"""Poison quarantine: who pays for a recovery (docs/architecture.md, "The failure model").

Recovery re-queues every request in flight, so a request that kills or hangs
a worker, the core or a replica (a "poison request") would be replayed into
every rebuild until the restart budget is gone, taking the server down with
it. Instead, every recovery of any kind charges the requests that were
exposed to the failure (in the failed step, or on the core that died):

- a request charged twice is quarantined: it runs alone from then on;
- a request exposed alone is quarantined at once (its first lone failure is
  retried once, alone, in case the failure was transient);
- a quarantined request that is exposed alone again is the culprit: it is
  failed, never runs again, and the others quarantined with it are released.

The same rules run in the engine core (worker death, hang, step error) and in
the front ends (a core process or a data-parallel replica that died), on the
same two fields of `Request`, which travel with a request that is resubmitted
elsewhere (`EngineCoreRequest`), so quarantine holds across restarts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from raylm.core.outputs import EngineCoreOutput

# Recoveries a request may be present at before it runs alone.
QUARANTINE_AFTER = 2


class Chargeable(Protocol):
    request_id: str
    num_recoveries: int
    quarantined: bool


@dataclass
class Verdict:
    """What one recovery decided."""

    charged: list[str] = field(default_factory=list)  # requests charged (and kept)
    culprits: list[str] = field(default_factory=list)  # requests to fail
    # The earlier recoveries the culprit was present at: its doing too.
    culprit_recoveries: int = 0

    @property
    def found_culprit(self) -> bool:
        return bool(self.culprits)


def charge(exposed: list[Chargeable]) -> Verdict:
    """Apply one recovery to the requests exposed to it; the caller fails the
    culprits and, if there are any, calls `release` on the others."""
    verdict = Verdict()
    if len(exposed) == 1 and exposed[0].quarantined:
        verdict.culprits.append(exposed[0].request_id)
        verdict.culprit_recoveries = exposed[0].num_recoveries
        return verdict
    for request in exposed:
        request.num_recoveries += 1
        if len(exposed) == 1 or request.num_recoveries >= QUARANTINE_AFTER:
            request.quarantined = True
        verdict.charged.append(request.request_id)
    return verdict


def release(requests: Iterable[Chargeable]) -> list[str]:
    """The culprit was found: the failures the others were charged for were
    its doing. Their record is cleared; returns the ids that changed."""
    released = []
    for request in requests:
        if request.num_recoveries or request.quarantined:
            request.num_recoveries = 0
            request.quarantined = False
            released.append(request.request_id)
    return released


def culprit_output(verdict: Verdict, cause: str) -> EngineCoreOutput:
    """How the culprit ends, for its client."""
    error = (
        f"this request was present at {verdict.culprit_recoveries + 1} engine failures and failed again "
        f"running alone, so it is not retried; last failure: {cause}"
    )
    return EngineCoreOutput(request_id=verdict.culprits[0], new_token_ids=[], finish_reason="error", error=error)


def mirror(records: dict[str, Chargeable], charged: list[str], culprits: list[str]) -> None:
    """Apply to a front end's records what a core decided in a recovery of
    its own (RecoveryStats), so that the records a request carries to another
    core are the ones it had: `records` are that core's requests in flight."""
    if culprits:
        release(records.values())
    elif charged:
        charge([records[rid] for rid in charged if rid in records])


def charge_death(records: dict[str, Chargeable], running_alone: str | None) -> Verdict:
    """A core (or replica) that held `records` died. The requests exposed are
    the quarantined one it ran alone, when its record names one (a core runs
    only quarantined requests alone), else all it held; on a culprit the
    others are released."""
    if running_alone in records:
        records[running_alone].quarantined = True
        verdict = charge([records[running_alone]])
    else:
        verdict = charge(list(records.values()))
    if verdict.found_culprit:
        release(r for rid, r in records.items() if rid not in verdict.culprits)
    return verdict
