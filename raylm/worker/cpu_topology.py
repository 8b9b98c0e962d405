"""A machine's CPUs as the placement plan sees them: the usable logical CPUs
grouped into physical cores (SMT siblings together), NUMA nodes kept
contiguous.

Apart from the plan (raylm.worker.cpu_placement) so that the plan stays a pure
function of a topology that tests make up (`CpuTopology.build`), and the one
place that reads the real machine (`read_topology`, from sysfs) is small.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from raylm.cpu_bind import parse_cpu_list


@dataclass(frozen=True)
class CpuTopology:
    """The usable logical CPUs of a machine, grouped into physical cores
    (SMT siblings together), in an order that keeps NUMA nodes contiguous."""

    cores: tuple[tuple[int, ...], ...]
    # The NUMA node of each entry of `cores`.
    core_numa_nodes: tuple[int, ...]

    @classmethod
    def build(
        cls,
        usable: set[int] | frozenset[int],
        siblings: dict[int, set[int]] | None = None,
        numa_nodes: dict[int, set[int]] | None = None,
    ) -> CpuTopology:
        """From the usable CPU ids, each CPU's SMT siblings (itself included;
        missing: a core of its own) and the CPUs of each NUMA node (missing:
        one node)."""
        if not usable:
            raise ValueError("no usable CPUs")
        node_of = {}
        for node, cpus in (numa_nodes or {}).items():
            for cpu in cpus:
                node_of[cpu] = node
        cores: dict[tuple[int, ...], int] = {}
        for cpu in sorted(usable):
            group = tuple(sorted((siblings or {}).get(cpu, {cpu}) & set(usable) | {cpu}))
            cores.setdefault(group, node_of.get(group[0], 0))
        ordered = sorted(cores.items(), key=lambda item: (item[1], item[0][0]))
        return cls(tuple(core for core, _ in ordered), tuple(node for _, node in ordered))

    @property
    def cpus(self) -> frozenset[int]:
        return frozenset(cpu for core in self.cores for cpu in core)

    def cores_of_node(self, node: int) -> list[tuple[int, ...]]:
        return [core for core, n in zip(self.cores, self.core_numa_nodes) if n == node]

    @property
    def numa_nodes(self) -> list[int]:
        return sorted(set(self.core_numa_nodes))


def read_topology(usable: set[int] | None = None, sysfs: str | Path = "/sys/devices/system") -> CpuTopology:
    """This machine's topology, restricted to the CPUs this thread may use
    (its affinity: a cgroup cpuset, `taskset`, a container's --cpuset-cpus).
    Missing sysfs files (other OSes, some containers) mean no SMT, one node."""
    if usable is None:
        usable = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    root = Path(sysfs)
    siblings = {}
    for cpu in usable:
        try:
            siblings[cpu] = parse_cpu_list((root / f"cpu/cpu{cpu}/topology/thread_siblings_list").read_text())
        except (OSError, ValueError):
            pass
    numa_nodes = {}
    for node_dir in root.glob("node/node[0-9]*"):
        try:
            numa_nodes[int(node_dir.name[4:])] = parse_cpu_list((node_dir / "cpulist").read_text())
        except (OSError, ValueError):
            pass
    return CpuTopology.build(usable, siblings, numa_nodes)
