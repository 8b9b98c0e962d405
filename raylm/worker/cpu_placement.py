"""Which CPU cores each model rank runs on, and with how many threads.

The planner (`plan_cpu_placement`) is a pure function of the usable cores and
the layout, so it can be tested on made-up machines; `read_topology` and
`apply_rank_placement` are the two places that touch the real one.

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
(ThreadGovernor): it gets every core, gives the engine loop's core back
while its threads wait for CPUs, and tries every core again after a
back-off. The decode kernels now stream weights at the memory's speed, where
one thread leaves much of batch-1 decode on the table. One request 128 in /
128 out, bf16, 2 cores, alternating processes, best of 2 (quiet | beside one
busy process):
- 111M: governed 1.33-1.44 s | 2.37-2.55 s (it dropped); 1 thread 2.37-2.46 |
  2.18-2.39; 2 threads 1.39-1.48 | 4.5-5.2.
- 7M: governed 0.14-0.17 | 0.28-0.40; 1 thread 0.21 | 0.21-0.26; 2 threads
  0.18-0.20 | 0.64-0.79.
(A short OpenMP spin, GOMP_SPINCOUNT=1000, was tried instead of the governor:
it kept 2 threads within 10% of 1 beside other work, but made the 7M model
3x slower on a quiet machine, every parallel region waking its threads.)

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

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

# Parsing lives with the setting (config validates it); re-exported here for callers of the planner.
from raylm.cpu_bind import AUTO, NO_BIND, parse_cpu_bind, parse_cpu_list  # noqa: F401

# What Linux says of this process's threads (shared with the K/V copies' CPU budget).
from raylm.thread_accounting import process_run_queue_wait_s, thread_ids

logger = logging.getLogger(__name__)

# The engine loop's share on a node that runs it: one physical core.
ENGINE_LOOP_CORES = 1


# ---- topology ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuTopology:
    """The usable logical CPUs of a machine, grouped into physical cores
    (SMT siblings together), in an order that keeps NUMA nodes contiguous."""

    cores: tuple[tuple[int, ...], ...]
    # The NUMA node of each entry of `cores`.
    core_numa_nodes: tuple[int, ...]

    @classmethod
    def build(cls, usable: set[int] | frozenset[int], siblings: dict[int, set[int]] | None = None,
              numa_nodes: dict[int, set[int]] | None = None) -> CpuTopology:
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


# ---- the flag -----------------------------------------------------------------------------


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


def plan_cpu_placement(topology: CpuTopology, num_ranks: int, *, engine_loop_here: bool = True,
                       num_threads: int | None = None, cpu_bind: str | list[set[int]] = AUTO,
                       max_threads_per_rank: int | None = None) -> CpuPlacement:
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
        ranks = tuple(RankPlacement(num_threads or 1, (cores[i % len(cores)][0],) if cpu_bind == AUTO else None)
                      for i in range(num_ranks))
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
    ranks = tuple(RankPlacement(num_threads or per_rank, tuple(core[0] for core in group) if pin else None, auto=pin)
                  for group in groups)
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
            return [cores[i * per_rank:(i + 1) * per_rank] for cores in by_node for i in range(ranks_per_node)]
    usable = list(topology.cores)[: len(topology.cores) - reserve]
    return [usable[i * per_rank:(i + 1) * per_rank] for i in range(num_ranks)]


def _plan_explicit(topology: CpuTopology, num_ranks: int, groups: list[set[int]],
                   num_threads: int | None) -> CpuPlacement:
    if len(groups) < num_ranks:
        raise ValueError(f"cpu_bind has {len(groups)} CPU groups but this node runs {num_ranks} ranks; "
                         "give one group per rank, separated by '|'")
    usable = topology.cpus
    for i, group in enumerate(groups[:num_ranks]):
        if not group <= usable:
            raise ValueError(f"cpu_bind group {i} names CPUs {sorted(group - usable)} that this process may not "
                             f"use (usable: {format_cpus(usable)})")
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


class ContentionWatch:
    """Tells a pinned rank that something else runs on its cores.

    Around each forward pass it reads the wall clock and the process's CPU
    time. Uncontended, a rank's threads are on CPU for nearly all of a pass
    (a short wait for a peer at an all-reduce spins or yields, which counts);
    when another process shares its cores, the OS gives it a fraction. Once
    a window of passes (at least `window_s` long and `min_steps` passes) has
    had less than `min_cpu_share` of threads x wall time, `end` answers True,
    once; the watch then stops measuring. Measured on 2 cores, TP=2: 0.78-0.99
    idle (the engine loop's own work shares a core now and then; the 7M model
    is the low end), 0.46-0.61 beside one busy process."""

    def __init__(self, num_threads: int, *, window_s: float = 1.0, min_steps: int = 16,
                 min_cpu_share: float = 0.65, clocks=None):
        self.num_threads = max(1, num_threads)
        self.window_s = window_s
        self.min_steps = min_steps
        self.min_cpu_share = min_cpu_share
        self._wall, self._cpu = clocks or (time.perf_counter, time.process_time)
        self._started: tuple[float, float] | None = None
        self._steps = 0
        self._wall_sum = 0.0
        self._cpu_sum = 0.0
        self.triggered = False
        # The CPU share of the last full window (for the log line).
        self.last_share: float | None = None

    def begin(self) -> None:
        if not self.triggered:
            self._started = (self._wall(), self._cpu())

    def end(self, work: int = 1) -> bool:
        """After a pass (of `work` tokens, unused here): True once, when the
        window just completed was starved."""
        if self._started is None:
            return False
        wall0, cpu0 = self._started
        self._started = None
        self._wall_sum += self._wall() - wall0
        self._cpu_sum += self._cpu() - cpu0
        self._steps += 1
        if self._steps < self.min_steps or self._wall_sum < self.window_s:
            return False
        self.last_share = self._cpu_sum / (self._wall_sum * self.num_threads)
        self._steps, self._wall_sum, self._cpu_sum = 0, 0.0, 0.0
        self.triggered = self.last_share < self.min_cpu_share
        return self.triggered


class ThreadGovernor:
    """A single rank's thread count, set from how long its threads wait for a
    CPU and from how fast its passes then go.

    Around each forward pass it keeps the wall time and the pass's work (its
    scheduled tokens); once a window of passes (at least `window_s` and
    `min_steps` passes) is complete it reads how long this process's threads
    were runnable but not running over the window (the kernel's run-queue
    delay, /proc/self/task/*/schedstat). Waiting is what other work on the
    cores costs a parallel pass: every region ends at a barrier, so one thread
    kept off a core holds all of them. CPU time, as ContentionWatch reads it,
    cannot tell this apart from a region that keeps only one thread busy, or
    (with a short OpenMP spin) from a thread asleep at a barrier.

    Above `tolerated_wait` (at first `max_wait_share`) of the window's pass
    time per thread, the rank drops to its `contended_threads` (two threads
    beside one busy process on two cores wait about a third of the time;
    quiet, well under a tenth), and the next window says whether that paid:
    unless its passes went faster (seconds per token, by `min_gain`), the rank
    takes every core back and tolerates that much waiting (with a margin), so
    that only more contention drops it again. Waiting alone cannot tell: a
    server's own front end makes the threads wait for the other core without
    taking much of it (`raylm serve` of the ~111M model, 64 streams on 2 cores:
    146 output tok/s when it dropped for good, 209 so), where a busy process
    beside the rank takes it.
    After `probe_after_s` on fewer threads it tries every core again for one
    window; a probe that does not wait keeps them, one that waits keeps them
    only if its passes went faster than in the window before it. A probe that
    loses doubles the back-off (up to `max_probe_after_s`), one that wins
    resets it; under contention a probe costs one window of slower passes,
    which the back-off bounds to a few per cent.

    begin()/end() wrap each pass like ContentionWatch's; end() answers False
    (there is nothing to unpin), having set the thread count itself."""

    def __init__(self, placement: RankPlacement, *, window_s: float = 0.5, min_steps: int = 4,
                 max_wait_share: float = 0.15, probe_after_s: float = 10.0, max_probe_after_s: float = 160.0,
                 min_gain: float = 0.05, clock=time.monotonic, read_wait_s=None, set_threads=None):
        if placement.contended_threads is None:
            raise ValueError("a ThreadGovernor needs a placement with contended_threads")
        self.every_core = placement.num_threads
        self.contended = placement.contended_threads
        self.window_s = window_s
        self.min_steps = min_steps
        self.max_wait_share = max_wait_share
        self.tolerated_wait = max_wait_share
        self.probe_after_s = probe_after_s
        self.max_probe_after_s = max_probe_after_s
        self.min_gain = min_gain
        self._clock = clock
        self._read_wait_s = read_wait_s or process_run_queue_wait_s
        self._set_threads = set_threads or _set_torch_threads
        self.threads = self.every_core
        self.last_wait_share: float | None = None
        self._wait_s_backoff = probe_after_s
        self._probing = False
        self._next_probe: float | None = None  # while contended: when to try every core again
        # Seconds per token of the last window on fewer threads, and on every core.
        self._contended_pace: float | None = None
        self._every_core_pace: float | None = None
        self._checking = False  # the window after a drop for waiting: does it pay?
        self._pass_started: float | None = None
        # (wait at its start, passes, pass seconds, tokens)
        self._window: tuple[float, int, float, int] | None = None

    def begin(self) -> None:
        now = self._clock()
        if self._next_probe is not None and now >= self._next_probe:
            # A window of the old count measured nothing of the new one.
            self._next_probe, self._probing, self._window = None, True, None
            self._switch(self.every_core)
        if self._window is None:
            self._window = (self._read_wait_s(), 0, 0.0, 0)
        self._pass_started = now

    def end(self, work: int = 1) -> bool:
        """After a pass of `work` tokens."""
        if self._pass_started is None:
            return False
        wait_at_start, passes, seconds, tokens = self._window
        passes, seconds, tokens = passes + 1, seconds + self._clock() - self._pass_started, tokens + max(work, 1)
        self._pass_started = None
        if passes < self.min_steps or seconds < self.window_s:
            self._window = (wait_at_start, passes, seconds, tokens)
            return False
        self._window = None
        pace = seconds / tokens
        if self.threads != self.every_core:
            self._contended_pace = pace
            if self._checking:
                self._checking = False
                if pace > self._every_core_pace * (1 - self.min_gain):
                    logger.info("%d thread(s) went no faster than %d waiting for a CPU %.0f%% of the time: back to %d",
                                self.contended, self.every_core, 100 * self.last_wait_share, self.every_core)
                    self._next_probe = None
                    self._switch(self.every_core)
                    self._keep_every_core(tolerating_this_wait=True)
            return False
        self.last_wait_share = (self._read_wait_s() - wait_at_start) / (seconds * self.every_core)
        self._every_core_pace = pace
        if self._probing:
            self._probing = False
            if self.last_wait_share <= self.max_wait_share:
                self._keep_every_core(tolerating_this_wait=False)
            elif self._contended_pace is not None and pace <= self._contended_pace * (1 - self.min_gain):
                self._keep_every_core(tolerating_this_wait=True)
                logger.info("this rank's threads waited for a CPU %.0f%% of the time on %d threads, but its passes "
                            "went %.0f%% faster: keeping %d", 100 * self.last_wait_share, self.every_core,
                            100 * (1 - pace / self._contended_pace), self.every_core)
            else:
                # A probe that waited for nothing waits longer.
                self._drop(min(2 * self._wait_s_backoff, self.max_probe_after_s))
        elif self.last_wait_share > self.tolerated_wait:
            self._drop(self.probe_after_s)
            self._checking = True
        return False

    def _keep_every_core(self, tolerating_this_wait: bool) -> None:
        """Every core stays; with `tolerating_this_wait`, waiting as much as the
        last window did (with a margin) no longer drops them."""
        self._wait_s_backoff = self.probe_after_s
        self.tolerated_wait = (min(1.0, 1.5 * self.last_wait_share + 0.05) if tolerating_this_wait
                               else self.max_wait_share)

    def _drop(self, backoff_s: float) -> None:
        """Give the core back; try every core again after `backoff_s`."""
        self._wait_s_backoff, self.tolerated_wait = backoff_s, self.max_wait_share
        self._switch(self.contended)
        self._next_probe = self._clock() + backoff_s
        logger.info("this rank's threads waited for a CPU %.0f%% of the time: down to %d thread(s), trying %d "
                    "again in %.0f s", 100 * self.last_wait_share, self.contended, self.every_core, backoff_s)

    def _switch(self, threads: int) -> None:
        if threads != self.threads:
            self._set_threads(threads)
            self.threads = threads


def _set_torch_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def watch_for(placement: RankPlacement) -> ContentionWatch | ThreadGovernor | None:
    """What watches a CPU rank's forward passes: a governor for a single rank
    with a fallback count, a contention watch for a rank the plan pinned,
    nothing for a placement the user fixed."""
    if placement.contended_threads is not None:
        return ThreadGovernor(placement)
    if placement.auto:
        return ContentionWatch(placement.num_threads)
    return None
