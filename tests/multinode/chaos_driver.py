"""A driver for the chaos harness on the two-host cluster, run on the head
host by TwoHosts.run_driver: `python -m tests.multinode.chaos_driver '<json spec>'`.

Two data-parallel replicas, one per host, serve greedy float32 streams while
a seeded schedule (raylm.testing.chaos.schedule) runs against them, with one
operation that only two hosts have: a network partition (the hosts' link
down at both ends, then up again). A short partition ends inside every
deadline: the streams must go on as if nothing happened. A long one outlasts
the step deadline (`execute_model_timeout`): the front end gives the
far replica up as hung, kills it (the kill reaches it once the link is
back), resubmits its requests on the near one and starts a replacement;
whatever the far replica sends after the link returns must be ignored.

Each replay prints a line; `RESULT <json>` holds every replay's outputs,
operations and end state, checked by tests/multinode/test_chaos_two_hosts.py."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from tests.multinode.driver import _wait_for_nodes
from tests.multinode.harness import set_link

# The step deadline the replicas run under, and the two partitions'
# lengths: one well inside it, one well past it (but inside Ray's own node
# health check, ~30 s at its defaults: the far node stays in the cluster).
STEP_DEADLINE_S = 3.0
SHORT_PARTITION_S = 1.0
LONG_PARTITION_S = 6.0
OPERATIONS = ("kill", "freeze", "migrate", "restart", "abort", "partition", "cut")
# A cut (a partition past the step deadline) ends the far core as a kill
# does: at most one of the two a schedule (make_schedule's `deaths`). With
# both, a request present at the two deaths is quarantined and, killed again
# while it ran alone, failed as a poison request: the rules cannot tell the
# harness's faults from a poison's (seed 10 framed one so, before this).
DEATHS = ("kill", "cut")


class Partition:
    """The schedule's `partition` (short) and `cut` (long) operations: the
    link down at both hosts' ends, up again after `seconds`, on a timer
    beside the schedule. One at a time; `heal` ends one early."""

    def __init__(self, netns: list[str]):
        self.netns = netns
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self.count = 0

    def operation(self, seconds: float):
        return lambda arg: self(seconds)

    def __call__(self, seconds: float) -> str:
        with self._lock:
            if self._timer is not None:
                return "not sent: the link is down already"
            for name in self.netns:
                set_link(name, up=False)
            self.count += 1
            self._timer = threading.Timer(seconds, self.heal)
            self._timer.daemon = True
            self._timer.start()
            return f"partitioned the hosts for {seconds} s"

    def heal(self) -> None:
        with self._lock:
            if self._timer is None:
                return
            self._timer.cancel()
            self._timer = None
            for name in self.netns:
                set_link(name, up=True)

    def wait_healed(self) -> None:
        timer = self._timer
        if timer is not None:
            timer.join()
        self.heal()


def _replay(spec: dict, seed: int) -> dict:
    from raylm import LLM, SamplingParams
    from raylm.testing.chaos.schedule import ScheduleRunner, make_schedule

    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    requests = {f"s{i}": (prompt, params) for i, prompt in enumerate(spec["prompts"])}
    schedule = make_schedule(
        seed,
        num_ops=spec.get("num_ops", 6),
        span_steps=spec.get("span_steps", 300),
        operations=OPERATIONS,
        deaths=DEATHS,
    )
    partition = Partition(spec["netns"])
    started, fds = time.monotonic(), len(os.listdir("/proc/self/fd"))
    with LLM(
        spec["model"],
        dtype="float32",
        data_parallel_size=2,
        data_parallel_placement="spread",
        ray_address=spec["address"],
        num_threads=1,
        kv_cache_memory_bytes=16 << 20,
        execute_model_timeout=STEP_DEADLINE_S,
    ) as llm:
        sup = llm.llm_engine.engine_core
        runner = ScheduleRunner(
            llm,
            schedule,
            extra={"partition": partition.operation(SHORT_PARTITION_S), "cut": partition.operation(LONG_PARTITION_S)},
        )
        try:
            result = runner.run(requests)
        finally:
            partition.wait_healed()
        end = {
            "dead_error": str(sup.dead_error) if sup.dead_error is not None else None,
            "restarts": sup.restart_budget.num_restarts,
            "migrations": sup.migration_counts,
            "serving": sorted(sup.channels),
            "steps": runner.steps,
        }
    end["left"] = _left_behind(fds)
    return {
        "seed": seed,
        "tokens": result.tokens,
        "finished": sorted(result.finished),
        "aborted": sorted(result.aborted),
        "errors": result.errors,
        "done": result.done,
        "partitions": partition.count,
        "seconds": time.monotonic() - started,
        **end,
    }


def _left_behind(fds: int, wait_s: float = 60.0) -> list[str]:
    """What the replay left in the cluster and in this process: live actors,
    placement groups not removed, descriptors (given `wait_s` to go: a kill
    sent to the far host while it was cut off lands when the link is back)."""
    import ray

    deadline = time.monotonic() + wait_s
    while True:
        actors = [a["ActorID"] for a in ray._private.state.actors().values() if a["State"] != "DEAD"]
        groups = [g for g, v in ray.util.placement_group_table().items() if v["state"] != "REMOVED"]
        open_fds = len(os.listdir("/proc/self/fd"))
        left = ([f"live actors {actors}"] if actors else []) + ([f"placement groups {groups}"] if groups else [])
        if open_fds > fds + 4:
            left.append(f"descriptors: {fds} before, {open_fds} after")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def main(spec: dict) -> dict:
    from raylm.config import ParallelConfig
    from raylm.executor import ray_cluster

    ray_cluster.connect_ray(ParallelConfig(ray_address=spec["address"]), num_cpus_hint=0)
    _wait_for_nodes(2, timeout=60)
    replays = []
    for seed in spec["seeds"]:
        replay = _replay(spec, seed)
        print(f"seed {seed}: {replay['seconds']:.0f} s; " + "; ".join(replay["done"]), file=sys.stderr, flush=True)
        replays.append(replay)
        _wait_for_nodes(2, timeout=60)  # the far host is back in the cluster before the next replay
    return {"replays": replays}


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
