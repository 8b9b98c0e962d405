"""The cpu_bind setting ("auto", "all", or one CPU group per rank: "0-3|4-7",
vLLM's syntax) and the kernel's cpulist format it is written in.

At the root, beside the config (EngineConfig validates the setting), so that
the config layer needs nothing from the worker layer that applies it
(cpu_placement).
"""

from __future__ import annotations

AUTO = "auto"
NO_BIND = ("all", "nobind")


def parse_cpu_list(text: str) -> set[int]:
    """ "0-3,8" -> {0, 1, 2, 3, 8} (the kernel's cpulist format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        first, last = int(low), int(high or low)
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(first, last + 1))
    return cpus


def parse_cpu_bind(value: str | None) -> str | list[set[int]]:
    """ "auto", "all" (also "nobind"), or one set of CPU ids per rank of a node.
    A ValueError names the field."""
    if value is None:
        return AUTO
    text = str(value).strip()
    if text.lower() == AUTO or text.lower() in NO_BIND:
        return text.lower() if text.lower() == AUTO else NO_BIND[0]
    groups = []
    for i, part in enumerate(text.split("|")):
        try:
            group = parse_cpu_list(part)
        except ValueError:
            group = set()
        if not group:
            raise ValueError(
                f"cpu_bind must be 'auto', 'all' or CPU groups like '0-3|4-7' (one per rank); "
                f"group {i} of {value!r} is not a CPU list"
            )
        groups.append(group)
    for i, group in enumerate(groups):
        for j in range(i):
            if group & groups[j]:
                raise ValueError(f"cpu_bind groups {j} and {i} of {value!r} share CPUs {sorted(group & groups[j])}")
    return groups
