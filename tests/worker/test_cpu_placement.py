"""The CPU placement planner on made-up machines (no pinning happens here),
plus reading a fake sysfs tree and applying a plan to this test's own thread."""

from __future__ import annotations

import os
import threading

import pytest

from raylm.cpu_bind import parse_cpu_bind, parse_cpu_list
from raylm.thread_accounting import process_run_queue_wait_s
from raylm.worker.cpu_placement import RankPlacement, apply_rank_placement, format_cpus, plan_cpu_placement
from raylm.worker.cpu_topology import CpuTopology, read_topology
from raylm.worker.thread_governance import ContentionWatch, ThreadGovernor, watch_for


def flat(n: int) -> CpuTopology:
    """n cores, no SMT, one NUMA node."""
    return CpuTopology.build(set(range(n)))


def smt(physical: int) -> CpuTopology:
    """`physical` cores with two hyperthreads each, numbered like Linux does on
    x86: cpu i and cpu i + physical are siblings."""
    siblings = {}
    for core in range(physical):
        pair = {core, core + physical}
        siblings[core] = siblings[core + physical] = pair
    return CpuTopology.build(set(range(2 * physical)), siblings)


def cores_of(plan):
    return [list(r.cpus) if r.cpus is not None else None for r in plan.ranks]


def threads_of(plan):
    return [r.num_threads for r in plan.ranks]


# ---- the defaults -------------------------------------------------------------------------


def test_two_cores_uni_takes_both_and_falls_back_to_one():
    plan = plan_cpu_placement(flat(2), 1)
    # Every core while nothing else wants them; the engine loop's core is
    # given back while the threads wait for CPUs (ThreadGovernor).
    assert threads_of(plan) == [2] and plan.ranks[0].contended_threads == 1
    # A single rank is not pinned by default (it shares the engine's thread).
    assert cores_of(plan) == [None]
    assert plan.engine_loop_cpus == ()
    assert "rank 0 -> not pinned (2 threads, 1 while other work needs the cores)" in plan.describe()


def test_a_single_rank_with_a_fixed_count_or_a_bundle_is_not_governed():
    assert plan_cpu_placement(flat(2), 1, num_threads=1).ranks[0].contended_threads is None
    # A Ray actor's bundle of one CPU: the static trade, one thread and a core for the loop.
    capped = plan_cpu_placement(flat(2), 1, max_threads_per_rank=1)
    assert threads_of(capped) == [1] and capped.ranks[0].contended_threads is None
    assert capped.engine_loop_cpus == (1,)
    # Several ranks keep the static plan.
    assert all(r.contended_threads is None for r in plan_cpu_placement(flat(8), 2).ranks)


def test_one_core_has_nothing_to_reserve():
    plan = plan_cpu_placement(flat(1), 1)
    assert threads_of(plan) == [1] and plan.engine_loop_cpus == ()


def test_two_cores_tp2_pins_one_core_per_rank_and_shares_the_loop():
    # What vLLM's VLLM_CPU_OMP_THREADS_BIND="0|1" does, measured faster in the issue.
    plan = plan_cpu_placement(flat(2), 2)
    assert cores_of(plan) == [[0], [1]]
    assert threads_of(plan) == [1, 1]
    assert plan.engine_loop_cpus == ()


def test_eight_cores_tp2_reserves_the_last_core():
    plan = plan_cpu_placement(flat(8), 2)
    assert cores_of(plan) == [[0, 1, 2], [3, 4, 5]]
    assert threads_of(plan) == [3, 3]
    # The leftover core 6 (TP ranks get equal shares) goes to the loop too.
    assert plan.engine_loop_cpus == (6, 7)
    assert "engine loop on cores [6-7]" in plan.describe()
    assert "rank 1 -> cores [3-5] (3 threads)" in plan.describe()


def test_a_node_without_the_engine_loop_gives_the_ranks_every_core():
    plan = plan_cpu_placement(flat(8), 2, engine_loop_here=False)
    assert cores_of(plan) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plan.engine_loop_cpus == ()


def test_more_ranks_than_cores_share_round_robin_with_one_thread():
    plan = plan_cpu_placement(flat(2), 4)
    assert cores_of(plan) == [[0], [1], [0], [1]]
    assert threads_of(plan) == [1, 1, 1, 1]
    assert "oversubscribed" in plan.describe()


def test_hyperthreads_a_rank_gets_whole_cores_one_thread_each():
    topo = smt(4)  # cpus 0-7, siblings (0,4) (1,5) (2,6) (3,7)
    assert topo.cores == ((0, 4), (1, 5), (2, 6), (3, 7))
    plan = plan_cpu_placement(topo, 2)
    # Ranks pinned to one sibling of each of their physical cores.
    assert cores_of(plan) == [[0], [1]]
    assert threads_of(plan) == [1, 1]
    # The engine loop keeps a whole physical core (both siblings) and the spare.
    assert set(plan.engine_loop_cpus) == {2, 6, 3, 7}
    uni = plan_cpu_placement(topo, 1)
    # One thread per physical core: all 4, or 3 when the loop needs its core.
    assert threads_of(uni) == [4] and uni.ranks[0].contended_threads == 3


def test_numa_ranks_stay_within_a_node():
    # Two nodes of 4 cores; a contiguous split of 7 usable cores would give
    # rank 1 cores 3-5, across both nodes.
    topo = CpuTopology.build(set(range(8)), numa_nodes={0: {0, 1, 2, 3}, 1: {4, 5, 6, 7}})
    plan = plan_cpu_placement(topo, 2)
    assert cores_of(plan) == [[0, 1, 2], [4, 5, 6]]
    assert plan.engine_loop_cpus == (3, 7)
    assert all(set(cores) <= {0, 1, 2, 3} or set(cores) <= {4, 5, 6, 7} for cores in cores_of(plan))


def test_numa_order_groups_nodes_even_when_ids_interleave():
    topo = CpuTopology.build(set(range(4)), numa_nodes={0: {0, 2}, 1: {1, 3}})
    assert topo.cores == ((0,), (2,), (1,), (3,))
    plan = plan_cpu_placement(topo, 2, engine_loop_here=False)
    assert cores_of(plan) == [[0, 2], [1, 3]]


def test_a_restricted_affinity_is_honoured():
    # Only cpus 4-7 usable (taskset / cpuset): the plan never leaves them.
    plan = plan_cpu_placement(CpuTopology.build({4, 5, 6, 7}), 2)
    assert cores_of(plan) == [[4], [5]]
    assert plan.engine_loop_cpus == (6, 7)


# ---- overrides ----------------------------------------------------------------------------


def test_num_threads_overrides_the_count():
    plan = plan_cpu_placement(flat(8), 2, num_threads=2)
    assert threads_of(plan) == [2, 2]
    assert cores_of(plan) == [[0, 1], [2, 3]]
    # A thread count that only fits without the reservation takes every core.
    plan = plan_cpu_placement(flat(8), 2, num_threads=4)
    assert cores_of(plan) == [[0, 1, 2, 3], [4, 5, 6, 7]] and plan.engine_loop_cpus == ()
    uni = plan_cpu_placement(flat(2), 1, num_threads=2)
    assert threads_of(uni) == [2] and uni.engine_loop_cpus == ()


def test_bundle_cap_limits_a_ray_rank():
    plan = plan_cpu_placement(flat(16), 2, max_threads_per_rank=2)
    assert cores_of(plan) == [[0, 1], [2, 3]]
    assert threads_of(plan) == [2, 2]


def test_explicit_groups_pin_even_a_single_rank():
    plan = plan_cpu_placement(flat(4), 2, cpu_bind="0-1|3")
    assert cores_of(plan) == [[0, 1], [3]]
    assert threads_of(plan) == [2, 1]
    assert plan.engine_loop_cpus == (2,)
    uni = plan_cpu_placement(flat(2), 1, cpu_bind="1")
    assert cores_of(uni) == [[1]] and threads_of(uni) == [1]


def test_all_means_no_pinning():
    plan = plan_cpu_placement(flat(8), 2, cpu_bind="all")
    assert cores_of(plan) == [None, None]
    assert threads_of(plan) == [3, 3]
    assert parse_cpu_bind("nobind") == "all"


def test_explicit_groups_errors_name_cpu_bind():
    with pytest.raises(ValueError, match="cpu_bind has 1 CPU groups"):
        plan_cpu_placement(flat(4), 2, cpu_bind="0-1")
    with pytest.raises(ValueError, match=r"cpu_bind group 1 names CPUs \[9\]"):
        plan_cpu_placement(flat(4), 2, cpu_bind="0|9")
    with pytest.raises(ValueError, match="cpu_bind"):
        parse_cpu_bind("0-1|x")
    with pytest.raises(ValueError, match="cpu_bind"):
        parse_cpu_bind("3-1")
    with pytest.raises(ValueError, match="share CPUs"):
        parse_cpu_bind("0-2|2-3")


def test_cpu_list_syntax():
    assert parse_cpu_list("0-3,8, 10") == {0, 1, 2, 3, 8, 10}
    assert parse_cpu_bind(" 0-1 | 2,3 ") == [{0, 1}, {2, 3}]
    assert format_cpus([5, 0, 1, 2, 7, 8]) == "[0-2,5,7-8]"


# ---- the real machine ---------------------------------------------------------------------


def test_read_topology_from_a_fake_sysfs(tmp_path):
    for cpu, sib in {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}.items():
        d = tmp_path / f"cpu/cpu{cpu}/topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(sib + "\n")
    for node, cpus in {0: "0,2", 1: "1,3"}.items():
        d = tmp_path / f"node/node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    topo = read_topology({0, 1, 2, 3}, sysfs=tmp_path)
    assert topo.cores == ((0, 2), (1, 3))
    assert topo.core_numa_nodes == (0, 1)
    # Missing files: every CPU a core of its own, one node.
    assert read_topology({0, 1}, sysfs=tmp_path / "nothing").cores == ((0,), (1,))


def test_read_topology_of_this_process_covers_its_affinity():
    assert read_topology().cpus == frozenset(os.sched_getaffinity(0))


def test_apply_pins_only_the_calling_thread_when_sharing_a_process():
    import torch

    usable = sorted(os.sched_getaffinity(0))
    seen = {}

    def pin_here():
        apply_rank_placement(RankPlacement(1, (usable[0],)), whole_process=False)
        seen["mask"] = os.sched_getaffinity(0)
        seen["threads"] = torch.get_num_threads()

    before_threads = torch.get_num_threads()
    worker = threading.Thread(target=pin_here)
    worker.start()
    worker.join()
    try:
        assert seen["mask"] == {usable[0]}
        assert seen["threads"] == 1
        # The main thread keeps every core.
        assert os.sched_getaffinity(0) == set(usable)
    finally:
        torch.set_num_threads(before_threads)


# ---- contention ---------------------------------------------------------------------------


class FakeClocks:
    """Wall and CPU clocks a test advances by hand."""

    def __init__(self):
        self.wall = 0.0
        self.cpu = 0.0

    def clocks(self):
        return (lambda: self.wall), (lambda: self.cpu)

    def step(self, watch, wall: float, cpu: float) -> bool:
        watch.begin()
        self.wall += wall
        self.cpu += cpu
        return watch.end()


def test_the_plan_marks_its_own_pinning_as_revisable():
    assert [r.auto for r in plan_cpu_placement(flat(2), 2).ranks] == [True, True]
    assert [r.auto for r in plan_cpu_placement(flat(2), 2, cpu_bind="0|1").ranks] == [False, False]
    assert [r.auto for r in plan_cpu_placement(flat(2), 1).ranks] == [False]  # not pinned at all


def test_contention_watch_fires_once_on_a_starved_window():
    fake = FakeClocks()
    watch = ContentionWatch(2, window_s=1.0, min_steps=4, min_cpu_share=0.7, clocks=fake.clocks())
    # Uncontended: 2 threads busy for 95% of each pass, windows of 4 x 0.25 s.
    assert not any(fake.step(watch, 0.25, 0.475) for _ in range(12))
    assert watch.last_share == pytest.approx(0.95)
    # Contended: half the CPU. Nothing until the window is full, then once.
    assert [fake.step(watch, 0.25, 0.25) for _ in range(4)] == [False, False, False, True]
    assert watch.last_share == pytest.approx(0.5) and watch.triggered
    assert not any(fake.step(watch, 0.25, 0.0) for _ in range(8))  # it stopped measuring


def test_contention_watch_needs_enough_steps_and_time():
    fake = FakeClocks()
    watch = ContentionWatch(1, window_s=1.0, min_steps=4, clocks=fake.clocks())
    # Three long starved passes: too few to judge.
    assert not any(fake.step(watch, 1.0, 0.1) for _ in range(3))
    # Many tiny ones that add up to less than the window: still nothing.
    watch = ContentionWatch(1, window_s=1.0, min_steps=4, clocks=fake.clocks())
    assert not any(fake.step(watch, 0.01, 0.001) for _ in range(50))
    assert fake.step(watch, 0.6, 0.06)


class FakeGovernor:
    """A governor on a fake clock (windows of 4 passes >= 1 s, passes of
    0.25 s) that records (time, thread count) at each change; each pass's
    threads wait for a CPU `wait` of its time, each of them."""

    def __init__(self):
        self.now = 0.0
        self.waited = 0.0
        self.changes: list[tuple[float, int]] = []
        self.governor = ThreadGovernor(
            RankPlacement(2, contended_threads=1),
            window_s=1.0,
            min_steps=4,
            max_wait_share=0.15,
            probe_after_s=10.0,
            max_probe_after_s=40.0,
            clock=lambda: self.now,
            read_wait_s=lambda: self.waited,
            set_threads=lambda n: self.changes.append((self.now, n)),
        )

    def run_for(self, seconds: float, wait: float, tokens_on_every_core: int = 4) -> None:
        """Passes of 0.25 s, of 4 tokens on fewer threads and `tokens_on_every_core`
        on every core (fewer: contention makes every core slower)."""
        for _ in range(round(seconds / 0.25)):
            self.governor.begin()  # a probe starts here
            threads = self.governor.threads
            self.now += 0.25
            self.waited += 0.25 * wait * threads
            assert self.governor.end(tokens_on_every_core if threads == 2 else 4) is False


def test_governor_keeps_every_core_while_its_threads_get_cpus():
    g = FakeGovernor()
    g.run_for(10, wait=0.05)
    assert g.governor.threads == 2 and g.changes == []
    assert g.governor.last_wait_share == pytest.approx(0.05)


def test_governor_drops_while_its_threads_wait_and_probes_with_back_off():
    g = FakeGovernor()
    slower = 2  # tokens a pass on every core does, against 4 on one thread
    g.run_for(1, wait=0.3, tokens_on_every_core=slower)  # one window waiting: down at once
    assert g.changes == [(1.0, 1)]
    g.run_for(11, wait=0.3, tokens_on_every_core=slower)  # one thread paid; the probe 10 s later waits too
    assert g.changes == [(1.0, 1), (11.0, 2), (12.0, 1)]
    g.run_for(21, wait=0.3, tokens_on_every_core=slower)  # so the next one waits 20 s
    assert g.changes[3:] == [(32.0, 2), (33.0, 1)]
    g.run_for(100, wait=0.3, tokens_on_every_core=slower)  # then 40 s, the cap, and 40 s again
    assert g.changes[5:] == [(73.0, 2), (74.0, 1), (114.0, 2), (115.0, 1)]
    # A probe that does not wait keeps every core and resets the back-off to 10 s.
    g.run_for(43, wait=0.02)  # to 176 s; the probe is at 155 s
    assert g.changes[9:] == [(155.0, 2)] and g.governor.threads == 2
    g.run_for(1, wait=0.3, tokens_on_every_core=slower)
    g.run_for(11, wait=0.02)
    assert g.changes[10:] == [(177.0, 1), (187.0, 2)]


def test_governor_keeps_every_core_where_it_waits_but_runs_faster():
    """A server's front end on the other core: the threads wait for it, yet
    passes on every core do more; only more waiting drops them again."""
    g = FakeGovernor()
    g.run_for(1, wait=0.3, tokens_on_every_core=8)  # waiting: down, to see whether one thread pays
    g.run_for(1, wait=0.3, tokens_on_every_core=8)  # it did half the work: back to two
    assert g.changes == [(1.0, 1), (2.0, 2)]
    assert g.governor.tolerated_wait == pytest.approx(0.5)
    g.run_for(60, wait=0.3, tokens_on_every_core=8)  # waiting as much is the price of every core: kept
    assert g.changes == [(1.0, 1), (2.0, 2)]
    g.run_for(1, wait=0.6, tokens_on_every_core=8)  # more waiting: down again, and the check
    g.run_for(1, wait=0.6, tokens_on_every_core=4)  # finds one thread as fast (within min_gain): back
    assert g.changes[2:] == [(63.0, 1), (64.0, 2)] and g.governor.tolerated_wait == pytest.approx(0.95)
    # Where one thread pays, it stays (and the plain threshold is back); a probe
    # that waits and gains too little gives the core back.
    g.run_for(1, wait=0.99, tokens_on_every_core=3)
    g.run_for(11, wait=0.3, tokens_on_every_core=4)
    assert g.governor.tolerated_wait == pytest.approx(0.15)
    assert g.changes[4:] == [(65.0, 1), (75.0, 2), (76.0, 1)]
    # One that waits but does more per second keeps every core.
    g.run_for(21, wait=0.3, tokens_on_every_core=8)
    assert g.changes[7:] == [(96.0, 2)] and g.governor.threads == 2


def test_watch_for_picks_by_placement():
    assert isinstance(watch_for(RankPlacement(2, contended_threads=1)), ThreadGovernor)
    assert isinstance(watch_for(RankPlacement(1, (0,), auto=True)), ContentionWatch)
    assert watch_for(RankPlacement(2)) is None
    with pytest.raises(ValueError, match="contended_threads"):
        ThreadGovernor(RankPlacement(2))


def test_run_queue_wait_is_read_from_this_process():
    first = process_run_queue_wait_s()
    sum(range(200_000))
    assert 0.0 <= first <= process_run_queue_wait_s()
