"""Which CPU cores each model rank runs on, and with how many threads.

The planner (`plan_cpu_placement`) is a pure function of the usable cores and
the layout (raylm.worker.cpu_topology), so it can be tested on made-up
machines; `read_topology` and `apply_rank_placement` are the two places that
touch the real one. What watches the ranks' passes at run time and changes
their threads or pinning lives in raylm.worker.thread_governance.

Why the defaults are what they are (2-core host, 7M-param bf16 llama, uni
backend, `raylm bench throughput`; see the issue "Fast by default"):

- torch on both cores: 5424 out tok/s idle, but 1741 with one other busy
  process. A torch parallel region ends at a barrier, so when the other
  process takes one of the two cores every step waits for the preempted
  thread, and the engine loop's Python work (scheduling, detokenizing) lands
  on a core the model also wants.
- torch on one core, the other left to the engine loop: 3855 under the same
  load, within 25% of the idle figure.

A single rank (uni, mp TP=1) makes that trade at run time instead
(ThreadGovernor, in raylm.worker.thread_governance): it gets every core, gives
the engine loop's core back while its threads wait for CPUs, and tries every
core again after a back-off.

Several ranks keep the static trade: one physical core is kept out of the
ranks' way whenever the ranks of the node can still have at least one core
each; the other cores are split evenly between the ranks of the node (TP
ranks wait for each other, so uneven shares buy nothing), whole physical
cores at a time (one thread per core: SMT siblings share the FMA units that
matmuls saturate), a rank's cores taken from one NUMA node when the ranks
divide evenly over the nodes.

Pinning (sched_setaffinity) is what keeps the ranks of one engine from
landing on each other's cores, so by default it is done when a node holds
more than one rank. But a pinned rank cannot move away from another busy
process that lands on its core, and its peers wait for it at every
all-reduce; so a rank pinned by the plan watches how much CPU its forward
passes get (ContentionWatch) and unpins itself, for good, when it is starved
(mp TP=2, 7M model, 2 cores, 64 x 128/128, alternating runs: pinned 5021
out tok/s idle on average, unpinned 4826; with one busy process pinned
2255/2192, unpinned 2507/2696; 111M latency pinned 1.67 s, unpinned 1.76 s).
A single rank (uni backend, a one-rank Ray engine) only
gets its thread count: it shares its process, and often its thread, with the
engine loop, so pinning it would pin the caller's thread too, and two
engines on one machine would both pile onto core 0 while the scheduler could
have spread them. An explicit `cpu_bind` always pins.

`cpu_bind` takes vLLM's VLLM_CPU_OMP_THREADS_BIND syntax: "auto" (the plan
above), "all" or "nobind" (no pinning), or one group of CPUs per rank of a
node, "0-3|4-7", each a list of ids and ranges ("0,2,4-6").
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from raylm.cpu_bind import AUTO, parse_cpu_bind
from raylm.thread_accounting import thread_ids
from raylm.worker.cpu_topology import CpuTopology

# The engine loop's share on a node that runs it: one physical core.
ENGINE_LOOP_CORES = 1


# ---- the plan -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RankPlacement:
    """One rank's threads; `cpus` None: not pinned (the OS places them)."""

    num_threads: int
    cpus: tuple[int, ...] | None = None
    # Pinned by the plan, not by the user: the rank may unpin itself when it
    # finds its cores contended (see ContentionWatch).
    auto: bool = False
    # The threads a single rank falls back to while its threads wait for CPUs
    # (see ThreadGovernor); None: its count is fixed.
    contended_threads: int | None = None

    def describe(self) -> str:
        threads = f"{self.num_threads} thread{'s' if self.num_threads != 1 else ''}"
        if self.contended_threads is not None:
            threads += f", {self.contended_threads} while other work needs the cores"
        where = "not pinned" if self.cpus is None else f"cores {format_cpus(self.cpus)}"
        return f"{where} ({threads})"


@dataclass(frozen=True)
class CpuPlacement:
    """The plan for the ranks of one node (and its engine loop, if it runs there)."""

    ranks: tuple[RankPlacement, ...]
    # CPUs no rank is pinned to and that were set aside for the engine loop;
    # empty when the engine loop shares the ranks' cores (or runs elsewhere).
    engine_loop_cpus: tuple[int, ...]
    # Why, in a few words (oversubscribed, user override, ...).
    note: str = ""

    def describe(self) -> str:
        if not self.engine_loop_cpus:
            loop = "engine loop shares the ranks' cores"
        elif any(r.cpus is not None for r in self.ranks):
            loop = f"engine loop on cores {format_cpus(self.engine_loop_cpus)}"
        else:
            loop = f"{len(self.engine_loop_cpus)} CPU(s) left to the engine loop"
        ranks = "; ".join(f"rank {i} -> {r.describe()}" for i, r in enumerate(self.ranks))
        return f"{loop}; {ranks}" + (f" ({self.note})" if self.note else "")


def format_cpus(cpus) -> str:
    """[0, 1, 2, 5] -> "[0-2,5]": short for big machines."""
    cpus = sorted(cpus)
    runs, start = [], None
    for i, cpu in enumerate(cpus):
        if start is None:
            start = cpu
        if i + 1 == len(cpus) or cpus[i + 1] != cpu + 1:
            runs.append(f"{start}" if start == cpu else f"{start}-{cpu}")
            start = None
    return "[" + ",".join(runs) + "]"


def plan_cpu_placement(
    topology: CpuTopology,
    num_ranks: int,
    *,
    engine_loop_here: bool = True,
    num_threads: int | None = None,
    cpu_bind: str | list[set[int]] = AUTO,
    max_threads_per_rank: int | None = None,
) -> CpuPlacement:
    """Place the `num_ranks` ranks that run on one node.

    engine_loop_here: the engine loop (the driver's Python work) runs on this
      node and is kept a core when there are enough.
    num_threads: the user's threads per rank (overrides the count, not the cores).
    cpu_bind: "auto", "all", or parsed groups (see parse_cpu_bind).
    max_threads_per_rank: a cap, e.g. the CPUs of a Ray actor's bundle.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if isinstance(cpu_bind, str):
        cpu_bind = parse_cpu_bind(cpu_bind)
    if isinstance(cpu_bind, list):
        return _plan_explicit(topology, num_ranks, cpu_bind, num_threads)
    all_cpus = tuple(sorted(topology.cpus))
    cores = list(topology.cores)
    reserve = ENGINE_LOOP_CORES if engine_loop_here and len(cores) >= num_ranks + ENGINE_LOOP_CORES else 0
    per_rank = (len(cores) - reserve) // num_ranks
    if num_threads and num_threads > per_rank and num_threads * num_ranks <= len(cores):
        # The user's thread count gets a core per thread, at the engine loop's expense.
        reserve, per_rank = 0, num_threads
    if num_threads:
        per_rank = min(per_rank, num_threads)
    if max_threads_per_rank is not None:
        per_rank = min(per_rank, max(1, max_threads_per_rank))
    if per_rank == 0:
        # More ranks than cores: they must share; one thread each keeps a
        # rank's barrier from waiting on its own preempted threads.
        ranks = tuple(
            RankPlacement(num_threads or 1, (cores[i % len(cores)][0],) if cpu_bind == AUTO else None)
            for i in range(num_ranks)
        )
        return CpuPlacement(ranks, (), f"oversubscribed: {num_ranks} ranks on {len(cores)} cores")
    if num_ranks == 1 and reserve and not num_threads:
        # A single rank is not pinned: it takes the engine loop's core too while
        # nothing else wants it (ThreadGovernor gives it back when it does).
        every_core = min(len(cores), max_threads_per_rank or len(cores))
        if every_core > per_rank:
            return CpuPlacement((RankPlacement(every_core, contended_threads=per_rank),), ())
    groups = _split_cores(topology, num_ranks, per_rank, reserve)
    used = {cpu for group in groups for core in group for cpu in core}
    engine_loop = tuple(cpu for cpu in all_cpus if cpu not in used) if reserve else ()
    # One thread per physical core, pinned to the core's first sibling.
    pin = cpu_bind == AUTO and num_ranks > 1
    ranks = tuple(
        RankPlacement(num_threads or per_rank, tuple(core[0] for core in group) if pin else None, auto=pin)
        for group in groups
    )
    note = "user threads" if num_threads else ""
    return CpuPlacement(ranks, engine_loop, note)


def _split_cores(topology: CpuTopology, num_ranks: int, per_rank: int, reserve: int) -> list[list[tuple[int, ...]]]:
    """`per_rank` cores for each rank, the last `reserve` cores kept out;
    within NUMA nodes when the ranks divide evenly over them and fit."""
    nodes = topology.numa_nodes
    if len(nodes) > 1 and num_ranks % len(nodes) == 0:
        ranks_per_node = num_ranks // len(nodes)
        by_node = [topology.cores_of_node(n) for n in nodes]
        by_node[-1] = by_node[-1][: len(by_node[-1]) - reserve]
        if all(len(cores) >= ranks_per_node * per_rank for cores in by_node):
            return [cores[i * per_rank : (i + 1) * per_rank] for cores in by_node for i in range(ranks_per_node)]
    usable = list(topology.cores)[: len(topology.cores) - reserve]
    return [usable[i * per_rank : (i + 1) * per_rank] for i in range(num_ranks)]


def _plan_explicit(
    topology: CpuTopology, num_ranks: int, groups: list[set[int]], num_threads: int | None
) -> CpuPlacement:
    if len(groups) < num_ranks:
        raise ValueError(
            f"cpu_bind has {len(groups)} CPU groups but this node runs {num_ranks} ranks; "
            "give one group per rank, separated by '|'"
        )
    usable = topology.cpus
    for i, group in enumerate(groups[:num_ranks]):
        if not group <= usable:
            raise ValueError(
                f"cpu_bind group {i} names CPUs {sorted(group - usable)} that this process may not "
                f"use (usable: {format_cpus(usable)})"
            )
    ranks = tuple(RankPlacement(num_threads or len(g), tuple(sorted(g))) for g in groups[:num_ranks])
    taken = set().union(*groups[:num_ranks])
    return CpuPlacement(ranks, tuple(sorted(usable - taken)), "cpu_bind")


# ---- applying it ----------------------------------------------------------------------------


# What apply_rank_placement(whole_process=True) set in this process: the
# worker then knows its executor placed it.
_process_placement: RankPlacement | None = None
# This process's CPUs before that pinning (what unpin_process restores).
_affinity_before_pinning: set[int] | None = None


def process_placement() -> RankPlacement | None:
    return _process_placement


def apply_rank_placement(placement: RankPlacement, whole_process: bool) -> None:
    """Size torch's (and OpenMP's) thread pool and pin it.

    whole_process: every thread of this process (a worker process or Ray
    actor, which is the rank); else only the calling thread and the threads
    it starts later (the model shares the engine's process), so that the
    engine loop's other threads stay free.
    """
    import torch

    if whole_process:
        # For libraries loaded and processes started from now on (torch's own
        # pool follows set_num_threads); not in a process the rank only shares.
        os.environ["OMP_NUM_THREADS"] = str(placement.num_threads)
    if placement.cpus is not None:
        cpus = set(placement.cpus)
        if whole_process:
            global _affinity_before_pinning
            _affinity_before_pinning = os.sched_getaffinity(0)
            for tid in thread_ids():
                try:
                    os.sched_setaffinity(tid, cpus)
                except OSError:  # a thread that ended meanwhile
                    pass
        # On Linux pid 0 is the calling thread; new threads inherit its mask.
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(placement.num_threads)
    if whole_process:
        global _process_placement
        _process_placement = placement


def unpin_process() -> set[int]:
    """Give every thread of this process back the CPUs it had before
    apply_rank_placement pinned it (the OS places them from now on); those
    CPUs. A process it never pinned is left as it is."""
    if _affinity_before_pinning is None:
        return os.sched_getaffinity(0)
    cpus = _affinity_before_pinning
    for tid in thread_ids():
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that ended meanwhile
            pass
    global _process_placement
    if _process_placement is not None:
        _process_placement = RankPlacement(_process_placement.num_threads, None)
    return cpus
