"""How long this core takes to compute a prompt token, measured on its own
steps: the supervisor weighs it against a prefix pull's expected time
(raylm.engine.pull_estimate), so that a pull slower than recomputing the
prefix where the request runs is not waited for.

Only steps that compute at least MIN_TOKENS tokens are measured: a decode
step's time is mostly the step's fixed cost, and would make a prompt token
look many times dearer than it is. A step mixing decodes into a prefill
counts its decode tokens as tokens, which they are (one position each).
"""

from __future__ import annotations

MIN_TOKENS = 64

# Weight of the newest step in the moving average: a few steps follow a
# change of load (another replica's prefill on the same cores), one odd step
# does not swing it.
_WEIGHT = 0.25


class PrefillPace:
    def __init__(self) -> None:
        self.seconds_per_token = 0.0  # 0: not measured yet

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One step that computed `num_tokens` tokens in `seconds`."""
        if num_tokens < MIN_TOKENS or seconds <= 0:
            return
        sample = seconds / num_tokens
        old = self.seconds_per_token
        self.seconds_per_token = sample if old == 0 else (1 - _WEIGHT) * old + _WEIGHT * sample
