"""AutoscaleConfig: data-parallel replicas scaled with the load
(--autoscale MIN:MAX and its settings; with P/D roles, each pool's own range),
checked where declared as every part of EngineConfig is; and the ceiling on
replicas that POST /scale and --autoscale share."""

from __future__ import annotations

from dataclasses import dataclass

# A sane ceiling on data-parallel replicas whatever the cluster (each is a
# whole engine: weights, KV cache, processes, sockets): POST /scale and
# --autoscale MAX both stop there.
MAX_DATA_PARALLEL_SIZE = 64


@dataclass
class AutoscaleConfig:
    """Data-parallel replicas scaled with the load (raylm.engine.autoscaler),
    in Ray Serve's terms: between MIN and MAX (--autoscale MIN:MAX)."""

    min_replicas: int
    max_replicas: int
    target_ongoing_requests: float = 2.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    # With P/D roles: each pool's own (MIN, MAX) within the total's; None:
    # 1 to MAX - 1 (raylm.engine.role_autoscaler).
    prefill_range: tuple[int, int] | None = None
    decode_range: tuple[int, int] | None = None

    @classmethod
    def from_setting(
        cls, autoscale: str, target_ongoing_requests, upscale_delay, downscale_delay, prefill=None, decode=None
    ) -> AutoscaleConfig:
        """--autoscale MIN:MAX and its settings (EngineArgs' autoscale_*)."""
        ranges = [_min_max(name, text) for name, text in (("autoscale_prefill", prefill), ("autoscale_decode", decode))]
        low, high = _min_max("autoscale", autoscale)
        return cls(low, high, target_ongoing_requests, upscale_delay, downscale_delay, *ranges)

    def role_range(self, role: str) -> tuple[int, int]:
        """The (MIN, MAX) of the `role` pool ("prefill" or "decode")."""
        given = self.prefill_range if role == "prefill" else self.decode_range
        return given or (1, max(1, self.max_replicas - 1))

    @property
    def setting(self) -> str:
        """As --autoscale writes it: MIN:MAX."""
        return f"{self.min_replicas}:{self.max_replicas}"

    def __post_init__(self):
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"autoscale: need 1 <= MIN <= MAX, got {self.setting!r}")
        if self.max_replicas == 1:
            raise ValueError("autoscale: MAX must be at least 2 (one replica has nothing to scale)")
        if self.max_replicas > MAX_DATA_PARALLEL_SIZE:
            raise ValueError(f"autoscale: MAX is at most {MAX_DATA_PARALLEL_SIZE} replicas, got {self.setting!r}")
        if not self.target_ongoing_requests > 0:
            raise ValueError(f"autoscale_target_ongoing_requests must be > 0, got {self.target_ongoing_requests!r}")
        # Named as the user gives them (EngineArgs: autoscale_upscale_delay, ...).
        for name in ("upscale_delay", "downscale_delay"):
            if not getattr(self, name + "_s") >= 0:
                raise ValueError(f"autoscale_{name} must be >= 0 seconds, got {getattr(self, name + '_s')!r}")
        self.target_ongoing_requests = float(self.target_ongoing_requests)
        self.upscale_delay_s = float(self.upscale_delay_s)
        self.downscale_delay_s = float(self.downscale_delay_s)
        for role in ("prefill", "decode"):
            given = getattr(self, f"{role}_range")
            if given is not None and not 1 <= given[0] <= given[1] < self.max_replicas:
                raise ValueError(
                    f"autoscale_{role}: need 1 <= MIN <= MAX < autoscale's MAX ({self.max_replicas}), got {given}"
                )
        (p_low, p_high), (d_low, d_high) = self.role_range("prefill"), self.role_range("decode")
        if p_low + d_low > self.max_replicas or p_high + d_high < self.min_replicas:
            raise ValueError(
                f"autoscale_prefill and autoscale_decode ({p_low}:{p_high}, {d_low}:{d_high}) do not fit "
                f"within autoscale {self.setting}"
            )

    def check_roles(self, data_parallel_size: int, prefill_replicas: int) -> None:
        """ValueError unless the starting pools are within their bounds
        (and pool bounds come with P/D roles)."""
        if not prefill_replicas:
            for role in ("prefill", "decode"):
                if getattr(self, f"{role}_range") is not None:
                    raise ValueError(f"autoscale_{role} needs prefill_replicas (prefill/decode roles)")
            return
        for role, count in (("prefill", prefill_replicas), ("decode", data_parallel_size - prefill_replicas)):
            low, high = self.role_range(role)
            if not low <= count <= high:
                raise ValueError(f"autoscale_{role}: the {role} pool starts with {count}, outside {low}:{high}")


def _min_max(name: str, text: str | None) -> tuple[int, int] | None:
    """ "MIN:MAX" -> (MIN, MAX); None for None; ValueError naming `name`."""
    if text is None:
        return None
    try:
        low, high = (int(part) for part in str(text).split(":"))
    except ValueError:
        raise ValueError(f"{name} must be MIN:MAX (two integers), got {text!r}") from None
    return low, high
