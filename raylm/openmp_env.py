"""How long an idle OpenMP thread spins before it sleeps, set before torch
loads its OpenMP runtime (which reads the setting once, when it loads).

libgomp (torch's CPU wheels) spins a waiting thread for 300,000 iterations
by default, a few hundred microseconds, before it sleeps. On a machine whose
cores something else also wants, that spin is the collapse the CPU placement
notes describe: at the end of every parallel region one thread spins on a
core while the thread it waits for sits preempted. 111M bf16 model, one
request 128 in / 128 out, 2 threads, 2 cores at load 5-6 (alternating
processes): 12.9-16.2 s with the default spin, 3.7-4.4 s with
OMP_WAIT_POLICY=PASSIVE, 4.9-6.9 s with GOMP_SPINCOUNT=10000, 2.9-3.5 s with
GOMP_SPINCOUNT=1000, and 3.0-3.4 s on one thread. So raylm asks for 1,000
iterations (a few microseconds: back-to-back regions of one decode step still
find their threads awake). Intel's OpenMP, which other torch builds use,
takes the same hint as KMP_BLOCKTIME in milliseconds.

A value the user set is kept. Child processes (mp workers, the engine-core
process) inherit the environment; Ray actors get it forwarded
(executor/ray_placement.py). If torch was imported before raylm, the runtime
has already read its settings: `spin_is_limited()` then says False and the
single-rank thread governor (worker/cpu_placement.py) is what keeps a
contended rank from spinning on both cores.
"""

from __future__ import annotations

import os
import sys

SPIN_SETTINGS = {"GOMP_SPINCOUNT": "1000", "KMP_BLOCKTIME": "1"}
# Any of these set by the user means they chose how threads wait.
_USER_CHOICES = ("OMP_WAIT_POLICY", *SPIN_SETTINGS)

_limited: bool | None = None


def limit_openmp_spinning() -> None:
    """Ask the OpenMP runtime for a short spin, unless torch has loaded it
    already or the user chose a wait policy; idempotent."""
    global _limited
    if _limited is not None:
        return
    if any(name in os.environ for name in _USER_CHOICES):
        _limited = "torch" not in sys.modules and _user_limits_spinning()
        return
    if "torch" in sys.modules:
        _limited = False
        return
    os.environ.update(SPIN_SETTINGS)
    _limited = True


def _user_limits_spinning() -> bool:
    if os.environ.get("OMP_WAIT_POLICY", "").lower() == "passive":
        return True
    try:
        return int(os.environ.get("GOMP_SPINCOUNT", "300000")) <= 10_000
    except ValueError:
        return False


def spin_is_limited() -> bool:
    """Whether this process's OpenMP threads sleep soon after they go idle."""
    return bool(_limited)
