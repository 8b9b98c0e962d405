"""What a live migration costs, against recomputing the request instead.

    python benchmarks/bench_migration.py [--model large] [--lengths 256 1024 2048] [--repeats 5] \\
        [--model-root /tmp/raylm_bench_models] [--two-hosts [--pin-hosts]] [--output-json migration.json]

One engine with two local engine-core processes (data_parallel_size=2,
data_parallel_backend="mp", num_threads=1 each), the ~111M ("large") or ~7M
("small") bf16 Llama of `compare_vllm.py --make-model`. `--two-hosts` (root):
two Ray replicas on the two hosts of tests/multinode's network-namespace
harness instead, the requests moved from the worker host's to the head's,
their K/V over the CURVE sockets between the hosts; `--pin-hosts`: each host
on its own half of the CPUs (on two cores, one each: the copies share a core
only with their own host's steps, as on two machines with no spare core).
For each length L, `--repeats` times:

  migration  one request of L random prompt tokens decodes alone on a core;
             once it has 8 tokens it is migrated live to the other core.
             downtime: its last token at the source -> its first at the
             destination (raylm:migration_downtime_seconds); of it, the
             handover: its last token at the source -> the destination
             holding it, ready to schedule (the rest is the destination's
             steps: those launched before it arrived, then its own); also
             the whole migration's time and the KV bytes moved. Its
             inter-token gap while not moving is the baseline the downtime
             adds to; "over a normal gap" is the downtime less that gap
             (the destination steps on its own clock, so its first token
             comes one step after the next boundary of its steps: at best
             one normal gap, on average another half step later).
  recompute  the same request sent to an idle core as a continuation (the
             prompt plus its 8 tokens: what recovery and scale-in without
             migration do): time from sending it to its first new token.
  slowdown   with `--bystanders N` (default 4) short requests decoding on
             each core throughout: their mean step time (the gap between
             their tokens) on the source and on the destination while a
             migration runs (from `migrate()` to its end), against the mean
             over the 1 s before it. Also over the pre-copy alone (from
             `migrate()` to the request's pause): there both batches are as
             in the baseline, while after it the destination decodes one
             request more (and the source one less), which is serving, not
             migrating. The bystanders (started afresh for each repeat)
             grow their contexts meanwhile, each step reading more K/V:
             their steps drift slower by a few ms a second, which slows
             a long window by itself. So each side's pre-copy is also
             compared with its batch's step time then: "against the same
             batch before and after", the window before and a window of
             the same batch after, interpolated in time to the pre-copy's
             middle (at the destination its 1 s after the move, the
             request aborted; at the source, whose window after lacks the
             request, its null twin's window before: right after each
             migration the same request decodes at the source again,
             nothing copied, through 1 s and then a window as long as the
             pre-copy). Median, and mean with its standard error. Also the
             CPU time each core's process uses per step over the
             pre-copy against before it: the copy's own cost, little moved
             by other work on a shared machine. And the copies' own CPU
             (each process's threads named raylm-kv-...) over the
             migration and over the pre-copy, as a share of a core: what the
             copy budget holds to RAYLM_MIGRATION_COPY_CPU_SHARE (2%) at each
             end, by thread in --output-json. And where the pre-copy's steps
             lose their time, per step against the window before: the time
             each core's step thread ran (net of its null twin's drift),
             waited runnable for a CPU and was blocked, and their sum
             ("held in all"): drift moves only the run, so the wait is a
             drift-free reading of what the copies take from the steps
             where no core is spare.

`--sync-precopy` copies every stage on the cores' loops (the behaviour
before the overlapped pre-copy), for comparison.

`--copy-cost` measures instead what one stage's copy costs a rank, in
isolation (one thread, no engine): the ~111M model's cache geometry, bf16,
`--copy-mib` of blocks exported into a reused transfer file and imported
into blocks already used and into blocks never touched (a fresh cache's
pages are allocated at first write), by the ranks' vector I/O and by a
mapping of the file (`index_select` / `index_copy_`, the accelerator path);
the copying thread's CPU time and the wall time, median of `--repeats`.

Reported: median and P99 (the maximum, at these few repeats) per length.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import statistics
import sys
import time

import psutil

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests.multinode, for --two-hosts

from compare_vllm import MODEL_PRESETS, make_model, random_prompts

from raylm import LLM, SamplingParams
from raylm.engine.protocol import EngineCoreRequest

logger = logging.getLogger("bench_migration")
_WARM_TOKENS = 8


# Token arrivals of every request: request id -> times.
_arrivals: dict[str, list[float]] = {}
# The engine-core processes, and the CPU seconds each had used
# at every arrival time: core -> {time: seconds}.
_core_processes: dict[int, psutil.Process] = {}
_core_cpu: dict[int, dict[float, float]] = {}
# Each core's step thread (its busiest thread but the copies', found at its
# first migration) and, at every arrival, the seconds it had run on a CPU
# and waited runnable for one: core -> {time: (run, wait)}.
_step_threads: dict[int, int] = {}
_step_sched: dict[int, dict[float, tuple[float, float]]] = {}
# The copies' CPU seconds, read every 0.1 s: core -> {time: seconds}; from the
# threads found at the migration's start (_kv_threads: listing them all is a
# few ms of the head's core, which the destination and the supervisor share).
_copy_cpu: dict[int, dict[float, float]] = {}
_kv_threads: dict[int, list[int]] = {}
_COPY_CPU_EVERY_S = 0.1


def _pump(supervisor):
    """One get_output, every new token's arrival recorded (with the cores' CPU time then)."""
    outputs = supervisor.get_output()
    now = time.perf_counter()
    for o in outputs.outputs:
        if o.new_token_ids:
            _arrivals.setdefault(o.request_id, []).append(now)
    if outputs.outputs:
        for core, process in _core_processes.items():
            cpu = process.cpu_times()
            _core_cpu.setdefault(core, {})[now] = cpu.user + cpu.system
            if core in _step_threads:
                sched = _schedstat_s(process.pid, _step_threads[core])
                if sched is not None:
                    _step_sched.setdefault(core, {})[now] = sched
            copies = _copy_cpu.setdefault(core, {})
            if core in _kv_threads and (not copies or now - max(copies) >= _COPY_CPU_EVERY_S):
                copies[now] = sum(
                    sched[0]
                    for sched in (_schedstat_s(process.pid, tid) for tid in _kv_threads[core])
                    if sched is not None
                )
    return outputs


def _schedstat_s(pid: int, tid: int) -> tuple[float, float] | None:
    """Seconds the thread `tid` of process `pid` has run on a CPU, and waited runnable for one."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            run_ns, wait_ns = f.read().split()[:2]
    except OSError:
        return None
    return int(run_ns) / 1e9, int(wait_ns) / 1e9


def _named_threads(pid: int) -> list[tuple[int, str]]:
    """The threads of process `pid` alive now: (id, name)."""
    threads = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                threads.append((int(tid), f.read().strip()))
        except OSError:  # the thread ended
            continue
    return threads


def _find_step_threads() -> None:
    """Each core's step thread: the one of its process that has run longest, the copies' aside."""
    for core, process in _core_processes.items():
        if core in _step_threads:
            continue
        busiest = (0.0, None)
        for tid, name in _named_threads(process.pid):
            sched = None if name.startswith("raylm-kv-") else _schedstat_s(process.pid, tid)
            if sched is not None and sched[0] > busiest[0]:
                busiest = (sched[0], tid)
        if busiest[1] is not None:
            _step_threads[core] = busiest[1]


def _step_thread_per_step(core: int, times: list[float], start: float, end: float) -> dict | None:
    """Per step of core `core`'s bystander (arrivals `times`) in [start, end]:
    the wall time, and the seconds its step thread ran, waited runnable for a
    CPU (another thread held it: the copies, where no core is spare), and
    was off a CPU otherwise (blocked: on the GIL, on a socket)."""
    sched = _step_sched.get(core, {})
    inside = [t for t in times if start <= t <= end and t in sched]
    if len(inside) < 2:
        return None
    steps = len(inside) - 1
    run, wait = (b - a for a, b in zip(sched[inside[0]], sched[inside[-1]]))
    wall = inside[-1] - inside[0]
    return {"wall": wall / steps, "run": run / steps, "wait": wait / steps, "blocked": (wall - run - wait) / steps}


def _copy_share(core: int, start: float, end: float) -> float | None:
    """The share of a core that core `core`'s copies took in [start, end] (its readings nearest inside)."""
    readings = sorted(t for t in _copy_cpu.get(core, {}) if start <= t <= end)
    if len(readings) < 2:
        return None
    spent = _copy_cpu[core]
    return (spent[readings[-1]] - spent[readings[0]]) / (readings[-1] - readings[0])


def _copy_cpu_by_thread(core: int) -> dict[str, float] | None:
    """CPU seconds that core `core`'s process has spent on its K/V copies so
    far, by thread name: its threads named raylm-kv-... (raylm.kv_transfer.background,
    kv_network: the copying threads, the K/V server's and ZMQ's I/O threads
    of the K/V sockets). Remembers their ids for _pump's sampling (_kv_threads)."""
    process = _core_processes.get(core)
    if process is None:
        return None
    spent: dict[str, float] = {}
    tids = []
    for tid, name in _named_threads(process.pid):
        sched = _schedstat_s(process.pid, tid) if name.startswith("raylm-kv-") else None
        if sched is not None:  # (None: not a copy's, or it ended)
            spent[name] = spent.get(name, 0.0) + sched[0]
            tids.append(tid)
    _kv_threads[core] = tids
    return spent


def _cpu_per_step(core: int, times: list[float], start: float, end: float) -> float | None:
    """CPU seconds core `core`'s process used per step of its bystander
    (arrivals `times`) in [start, end]. Unlike a step's wall time, hardly
    moved by other work on the machine: what a migration adds to it is the
    copying's own CPU, which slows the steps where no core is spare."""
    cpu = _core_cpu.get(core, {})
    inside = [t for t in times if start <= t <= end and t in cpu]
    if len(inside) < 2:
        return None
    return (cpu[inside[-1]] - cpu[inside[0]]) / (len(inside) - 1)


def _decode_until(supervisor, request_id: str, num_tokens: int) -> list[float]:
    """Step until `request_id` has `num_tokens` tokens; the arrival time of each new one."""
    while len(supervisor.ledger[request_id].token_ids) < num_tokens:
        _pump(supervisor)
    return _arrivals.get(request_id, [])


def _mean_gap(times: list[float], start: float, end: float) -> float | None:
    """Mean gap between consecutive tokens that arrived in [start, end] (the
    gap ending in the window counts: a stalled step ends there)."""
    gaps = [b - a for a, b in zip(times, times[1:]) if start < b <= end]
    return statistics.fmean(gaps) if gaps else None


def _bystander_window(supervisor, clocks: dict[int, str]) -> tuple[float, float]:
    """Serve for 1 s and at least 4 of core 0's bystander steps; (start, end)."""
    start = time.perf_counter()
    while clocks and (time.perf_counter() - start < 1.0 or len([t for t in _arrivals[clocks[0]] if t > start]) < 4):
        if clocks[0] not in supervisor.ledger:
            raise RuntimeError(f"bystander {clocks[0]} finished: give it more positions")
        _pump(supervisor)
    return start, time.perf_counter()


def _migration(
    llm: LLM, prompt: list[int], params: SamplingParams, rid: str, clocks: dict[int, str], source: int
) -> dict:
    """`clocks`: core -> a bystander request decoding there (its token gaps
    time the core's steps); the request starts on core `source`."""
    supervisor = llm.llm_engine.engine_core
    supervisor.add_request(EngineCoreRequest(rid, prompt, params, None), data_parallel_rank=source)
    arrivals = list(_decode_until(supervisor, rid, _WARM_TOKENS))
    # The baseline of the bystanders' steps, with the request decoding at its source.
    baseline_from, _ = _bystander_window(supervisor, clocks)
    source = supervisor.ledger[rid].channel
    copy_cpu_before = {core: _copy_cpu_by_thread(core) for core in (0, 1)}
    started = time.perf_counter()
    assert supervisor.migrate(rid, 1 - source, reason="manual")
    event = None
    while event is None:
        if rid not in supervisor.ledger:
            raise RuntimeError(f"{rid} finished before its migration was measured: give it more positions")
        outputs = _pump(supervisor)
        event = next((m for m in outputs.migrated), None)
    ended = time.perf_counter()
    copy_cpu_after = {core: _copy_cpu_by_thread(core) for core in (0, 1)}
    assert event.ok, event
    supervisor.abort_requests([rid])
    # A second baseline after the move: the bystanders' contexts grow all the
    # while (each step reads more K/V), so a pre-copy window is slower than
    # the window before it without any copying. At the destination this one
    # holds the same batch as the window before (the request is gone again);
    # the source's window of the same batch is its null twin's (_control).
    after_from, after_to = _bystander_window(supervisor, clocks)
    gaps = [b - a for a, b in zip(arrivals[1:], arrivals[2:])]
    result = {
        "downtime_s": event.downtime_s,
        "handover_s": event.handover_s,
        "seconds": event.seconds,
        "num_bytes": event.num_bytes,
        "inter_token_s": statistics.median(gaps) if gaps else 0.0,
    }
    # The pause: the request's longest gap in the migration (its last token at the
    # source, then its first at the destination). Before it, both cores' batches
    # are as in the baseline and only the pre-copy runs beside their steps; from
    # it on, the source has one request less and the destination one more, whose
    # cost is decoding, not migrating.
    mine = [t for t in _arrivals[rid] if started - 1.0 < t <= ended]
    paused_at = max(zip(mine, mine[1:]), key=lambda gap: gap[1] - gap[0])[0] if len(mine) > 1 else ended
    result["precopy_s"] = paused_at - started
    # The windows' bounds (perf_counter seconds), for a look at the drift in --output-json.
    result["windows"] = {
        "before": (baseline_from, started),
        "precopy": (started, paused_at),
        "after": (after_from, after_to),
    }
    for side, core in (("source", source), ("destination", 1 - source)):
        if core in clocks:
            times = _arrivals[clocks[core]]
            before = _mean_gap(times, baseline_from, started)
            windows = {"slowdown": (started, ended), "precopy_slowdown": (started, paused_at)}
            after = _mean_gap(times, after_from, after_to)
            for name, (start, end) in windows.items():
                during = _mean_gap(times, start, end)
                if before and during:
                    result[f"{side}_{name}"] = during / before - 1
                if name == "precopy_slowdown" and before and during:
                    result[f"{side}_precopy_gaps"] = (before, during, after)
            cpu_before, cpu_during = (
                _cpu_per_step(core, times, baseline_from, started),
                _cpu_per_step(core, times, started, paused_at),
            )
            if cpu_before and cpu_during:
                result[f"{side}_precopy_cpu"] = cpu_during / cpu_before - 1
            # Where the pre-copy's steps lost their time, against the window before: a
            # thread that waits runnable for a CPU, or blocks, longer per step is held
            # by something beside it; a longer run is the step's own work (which the
            # drift grows too, and the copies' traffic through the caches).
            step_before, step_during = (
                _step_thread_per_step(core, times, baseline_from, started),
                _step_thread_per_step(core, times, started, paused_at),
            )
            if step_before and step_during:
                for part in ("run", "wait", "blocked"):
                    added = step_during[part] - step_before[part]
                    result[f"{side}_precopy_{part}_added"] = added / step_before["wall"]
            share = _copy_share(core, started, paused_at)
            if share is not None:
                result[f"{side}_precopy_copy_cpu"] = share
        if copy_cpu_before[core] is not None and copy_cpu_after[core] is not None:
            # The share of a core the copies took over the migration, in all and by thread.
            by_thread = {
                name: (spent - copy_cpu_before[core].get(name, 0.0)) / (ended - started)
                for name, spent in copy_cpu_after[core].items()
            }
            result[f"{side}_copy_cpu"] = sum(by_thread.values())
            result[f"{side}_copy_cpu_by_thread"] = by_thread
    return result


def _control(
    llm: LLM, prompt: list[int], params: SamplingParams, rid: str, clocks: dict[int, str], source: int, window_s: float
) -> dict:
    """A migration's null twin: the same request decodes at `source` through
    the same 1 s window, then for `window_s` (the pre-copy's length), with
    nothing copied. Its bystanders' mean gaps over both and the windows'
    bounds: the first is the source's window of the same batch after the
    migration (see _against_the_same_batch)."""
    supervisor = llm.llm_engine.engine_core
    supervisor.add_request(EngineCoreRequest(rid, prompt, params, None), data_parallel_rank=source)
    _decode_until(supervisor, rid, _WARM_TOKENS)
    baseline_from, started = _bystander_window(supervisor, clocks)
    while time.perf_counter() - started < window_s:
        _pump(supervisor)
    ended = time.perf_counter()
    supervisor.abort_requests([rid])
    result = {}
    for side, core in (("source", source), ("destination", 1 - source)):
        if core in clocks:
            times = _arrivals[clocks[core]]
            before, during = _mean_gap(times, baseline_from, started), _mean_gap(times, started, ended)
            if before and during:
                result[f"{side}_control_before"], result[f"{side}_control_during"] = before, during
            step_before, step_during = (
                _step_thread_per_step(core, times, baseline_from, started),
                _step_thread_per_step(core, times, started, ended),
            )
            if step_before and step_during:
                result[f"{side}_control_run_drift"] = step_during["run"] - step_before["run"]
    result["windows"] = {"before": (baseline_from, started), "during": (started, ended)}
    return result


def _center(window: tuple[float, float]) -> float:
    return (window[0] + window[1]) / 2


def _against_the_same_batch(moved: dict, control: dict) -> None:
    """Each side's pre-copy against the step time its batch had then: the
    windows before and after of the same batch, interpolated in time to the
    pre-copy's middle (the bystanders' steps grow by a few ms a second, a
    drift linear in time: in one run the destination's windows at -0.5,
    2.5, 5.5, 8.4 and 11.4 s from the pre-copy's start read +0, +12, +22,
    +34 and +45%). At the destination the window after is its own after the
    move; at the source, whose window after lacks the request, its null
    twin's window before. (A twin's own slowdown is no null figure for the
    pre-copy's: its window before is already slower, so the same drift in
    ms is a smaller share of it.)"""
    for side, gaps in (
        ("source", moved.get("source_precopy_gaps")),
        ("destination", moved.get("destination_precopy_gaps")),
    ):
        if not gaps:
            continue
        before, during, after = gaps
        if side == "source":
            twin_before = control.get("source_control_before")
            if twin_before is None:
                continue
            later, later_at = twin_before, _center(control["windows"]["before"])
        elif after:
            later, later_at = after, _center(moved["windows"]["after"])
        else:
            continue
        before_at, during_at = _center(moved["windows"]["before"]), _center(moved["windows"]["precopy"])
        expected = before + (later - before) * (during_at - before_at) / (later_at - before_at)
        moved[f"{side}_precopy_same_batch"] = during / expected - 1
        # The step thread's run per step grew by the drift and by what the copies
        # cost it (their traffic through the caches); the twin's grew by the
        # drift alone, in seconds the same over a window as long (linear in time).
        drift = control.get(f"{side}_control_run_drift")
        if drift is not None and f"{side}_precopy_run_added" in moved:
            net_run = moved[f"{side}_precopy_run_added"] - drift / before
            moved[f"{side}_precopy_run_net"] = net_run
            moved[f"{side}_precopy_held"] = (
                net_run + moved[f"{side}_precopy_wait_added"] + moved[f"{side}_precopy_blocked_added"]
            )
    for side in ("source", "destination"):
        if f"{side}_control_before" in control:
            moved[f"{side}_control_gaps"] = (control[f"{side}_control_before"], control[f"{side}_control_during"])
    moved["twin_windows"] = control["windows"]


def _recompute(llm: LLM, prompt: list[int], params: SamplingParams, rid: str, core: int) -> float:
    """The request decodes on `core` (the migrations' destination), then is sent there again."""
    supervisor = llm.llm_engine.engine_core
    supervisor.add_request(EngineCoreRequest(rid, prompt, params, None), data_parallel_rank=core)
    _decode_until(supervisor, rid, _WARM_TOKENS)
    tokens = list(supervisor.ledger[rid].token_ids)
    supervisor.abort_requests([rid])
    started = time.perf_counter()
    supervisor.add_request(
        EngineCoreRequest(rid + "-again", prompt, params, None, output_token_ids=tokens), data_parallel_rank=core
    )
    _decode_until(supervisor, rid + "-again", len(tokens) + 1)
    seconds = time.perf_counter() - started
    supervisor.abort_requests([rid + "-again"])
    return seconds


def _summary(values: list[float]) -> dict:
    return {"median_ms": 1000 * statistics.median(values), "p99_ms": 1000 * max(values)}


def _fresh_bystanders(llm: LLM, vocab: int, spec: dict, tag: str) -> dict[int, str]:
    """`spec["bystanders"]` short requests decoding on each core (the last
    ones aborted), so that their contexts, which slow their steps as they
    grow, stay short and alike from one repeat to the next; once each has
    its first token. Core -> the one whose token gaps time its steps."""
    supervisor = llm.llm_engine.engine_core
    supervisor.abort_requests([rid for rid in list(supervisor.ledger) if rid.startswith("bystander-")])
    params = llm.llm_engine.input_processor.finish_params(
        SamplingParams(temperature=0, max_tokens=spec["max_len"] - 64, ignore_eos=True)
    )
    clocks: dict[int, str] = {}
    started = []
    for core in range(2 if spec["bystanders"] else 0):
        for i, prompt in enumerate(random_prompts(spec["bystanders"], 16, vocab, seed=core)):
            rid = f"bystander-{tag}-{core}-{i}"
            supervisor.add_request(EngineCoreRequest(rid, prompt, params, None), data_parallel_rank=core)
            clocks.setdefault(core, rid)
            started.append(rid)
    for rid in started:
        _decode_until(supervisor, rid, 1)
    return clocks


def measure(llm: LLM, folder: pathlib.Path, spec: dict) -> dict:
    """Every length's figures on `llm` (two cores), its requests starting on
    core `spec["source"]` and moved to the other one."""
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    supervisor = llm.llm_engine.engine_core
    results = {}
    for length in spec["lengths"]:
        # Room to decode through the baseline window and the migration (then it is aborted).
        params = llm.llm_engine.input_processor.finish_params(
            SamplingParams(temperature=0, max_tokens=spec["max_len"] - length - 16, ignore_eos=True)
        )
        prompts = random_prompts(spec["repeats"] + 1, length, vocab, seed=length)
        source = spec["source"]
        clocks = _fresh_bystanders(llm, vocab, spec, f"{length}-warm")
        _migration(llm, prompts[-1], params, f"warm-{length}", clocks, source)  # first use of each size: not timed
        _find_step_threads()
        moved = []
        for i, p in enumerate(prompts[:-1]):
            clocks = _fresh_bystanders(llm, vocab, spec, f"{length}-{i}")
            moved.append(_migration(llm, p, params, f"m-{length}-{i}", clocks, source))
            if clocks:  # its null twin, right after it
                control = _control(llm, p, params, f"c-{length}-{i}", clocks, source, moved[-1]["precopy_s"])
                _against_the_same_batch(moved[-1], control)
        supervisor.abort_requests([rid for rid in list(supervisor.ledger) if rid.startswith("bystander-")])
        recomputed = (
            []
            if spec["skip_recompute"]
            else [_recompute(llm, p, params, f"r-{length}-{i}", 1 - source) for i, p in enumerate(prompts[:-1])]
        )
        results[length] = {
            "downtime": _summary([m["downtime_s"] for m in moved]),
            "handover": _summary([m["handover_s"] for m in moved]),
            "migration": _summary([m["seconds"] for m in moved]),
            "inter_token": _summary([m["inter_token_s"] for m in moved]),
            # What the move added to the gap the client would have seen anyway.
            "extra_pause": _summary([m["downtime_s"] - m["inter_token_s"] for m in moved]),
            "recompute": _summary(recomputed) if recomputed else None,
            "mib_moved": moved[0]["num_bytes"] / 2**20,
            "per_repeat": moved,  # every figure of every repeat, for --output-json
        }
        for side in ("source", "destination"):
            for name in (
                "slowdown",
                "precopy_slowdown",
                "precopy_same_batch",
                "precopy_cpu",
                "copy_cpu",
                "precopy_copy_cpu",
                "precopy_run_added",
                "precopy_wait_added",
                "precopy_blocked_added",
                "precopy_run_net",
                "precopy_held",
            ):
                values = [m[f"{side}_{name}"] for m in moved if f"{side}_{name}" in m]
                results[length][f"{side}_{name}_pct"] = 100 * statistics.median(values) if values else None
            # The same-batch figure's mean and standard error too: one window's figure scatters
            # by several points on a shared machine; many repeats resolve a few percent.
            for name in ("precopy_same_batch", "precopy_held"):
                values = [m[f"{side}_{name}"] for m in moved if f"{side}_{name}" in m]
                if len(values) > 1:
                    results[length][f"{side}_{name}_mean_pct"] = 100 * statistics.fmean(values)
                    results[length][f"{side}_{name}_sem_pct"] = 100 * statistics.stdev(values) / len(values) ** 0.5
        if not spec.get("quiet"):
            _print_row(length, results[length])
    return results


def _print_row(length: int, r: dict) -> None:
    recompute = (
        f"  | recompute {r['recompute']['median_ms']:7.1f} ms (max {r['recompute']['p99_ms']:7.1f})"
        if r["recompute"]
        else ""
    )

    def pct(side: str, name: str = "slowdown", sign: str = "+") -> str:
        value = r.get(f"{side}_{name}_pct")
        return "n/a" if value is None else f"{value:{sign}.1f}%"

    def mean_sem(name: str) -> str:
        return (
            f"mean {pct('source', name + '_mean')} +- {pct('source', name + '_sem', sign='')} /"
            f" {pct('destination', name + '_mean')} +- {pct('destination', name + '_sem', sign='')}"
        )

    slowdown = (
        f"  | step slowdown source {pct('source')} destination {pct('destination')}"
        f" (pre-copy only: {pct('source', 'precopy_slowdown')} / {pct('destination', 'precopy_slowdown')};"
        f" against the same batch before and after: {pct('source', 'precopy_same_batch')} /"
        f" {pct('destination', 'precopy_same_batch')} ({mean_sem('precopy_same_batch')});"
        f" CPU per step {pct('source', 'precopy_cpu')} / {pct('destination', 'precopy_cpu')};"
        f" the copies' CPU {pct('source', 'copy_cpu', sign='')} / {pct('destination', 'copy_cpu', sign='')}"
        f" of a core, over the pre-copy {pct('source', 'precopy_copy_cpu', sign='')} /"
        f" {pct('destination', 'precopy_copy_cpu', sign='')};"
        f" the step thread's time per step added over the pre-copy, run"
        f" {pct('source', 'precopy_run_added')} / {pct('destination', 'precopy_run_added')},"
        f" waiting for a CPU {pct('source', 'precopy_wait_added')} /"
        f" {pct('destination', 'precopy_wait_added')},"
        f" blocked {pct('source', 'precopy_blocked_added')} / {pct('destination', 'precopy_blocked_added')};"
        f" run net of the twin's drift {pct('source', 'precopy_run_net')} /"
        f" {pct('destination', 'precopy_run_net')}; held in all {pct('source', 'precopy_held')} /"
        f" {pct('destination', 'precopy_held')} ({mean_sem('precopy_held')}))"
    )
    print(
        f"L={int(length):5d}  downtime {r['downtime']['median_ms']:7.1f} ms (max {r['downtime']['p99_ms']:7.1f}, "
        f"handover {r['handover']['median_ms']:5.1f}, over a normal gap {r['extra_pause']['median_ms']:5.1f})"
        f"{recompute}  | inter-token {r['inter_token']['median_ms']:6.1f} ms  | whole migration "
        f"{r['migration']['median_ms']:6.1f} ms  | {r['mib_moved']:.1f} MiB{slowdown}",
        flush=True,
    )


def copy_cost(mib: int, repeats: int) -> dict:
    """One stage's export and import CPU and wall time (see the module's doc)."""
    import tempfile

    import torch

    from raylm.kv_transfer import files as kv_transfer

    torch.set_num_threads(1)
    preset = MODEL_PRESETS["large"]
    heads, head_dim = preset["num_key_value_heads"], preset["hidden_size"] // preset["num_attention_heads"]
    block_size, num_layers = 16, preset["num_hidden_layers"]
    bytes_per_block = 2 * num_layers * block_size * heads * head_dim * 2
    n = max(1, (mib << 20) // bytes_per_block)
    # Room for the source's blocks plus a fresh destination range for every import into untouched pages.
    total = n * (2 + 2 * repeats + 2)
    caches = [torch.empty(2, total, block_size, heads, head_dim, dtype=torch.bfloat16) for _ in range(num_layers)]
    for cache in caches:
        cache[:, : 2 * n].normal_()  # the source's blocks and the "already used" destination's
    source, used = list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2))
    fresh = iter(range(2 * n, total, n))

    def mapped_export(path: str, size: int) -> None:
        kv_transfer._gather(caches, source, kv_transfer._map(path, torch.bfloat16, size, writable=True))

    def mapped_import(path: str, size: int, blocks: list[int]) -> None:
        kv_transfer._scatter(caches, blocks, kv_transfer._map(path, torch.bfloat16, size, writable=False))

    ways = {
        "vector I/O": (
            lambda path, size: kv_transfer._copy_with_file(caches, source, path, True, None),
            lambda path, size, blocks: kv_transfer._copy_with_file(caches, blocks, path, False, None),
        ),
        "mapping": (mapped_export, mapped_import),
    }
    timings: dict[str, list[tuple[float, float]]] = {}

    def timed(name: str, fn, *args) -> None:
        cpu, wall = time.thread_time(), time.perf_counter()
        fn(*args)
        timings.setdefault(name, []).append((time.thread_time() - cpu, time.perf_counter() - wall))

    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as folder:
        path = os.path.join(folder, "stage")
        size = kv_transfer.create_file(caches, n, path)  # its pages allocated once, as a kept file's are
        kv_transfer.fill_file(caches, source, path)
        for _ in range(repeats):
            for way, (export, import_) in ways.items():  # alternating
                timed(f"{way}: export into a reused file", export, path, size)
                timed(f"{way}: import into used blocks", import_, path, size, used)
                fresh_blocks = list(range(next(fresh), total))[:n]
                timed(f"{way}: import into untouched blocks", import_, path, size, fresh_blocks)
                assert all(torch.equal(c[:, fresh_blocks], c[:, source]) for c in caches)
    mib_moved = n * bytes_per_block / 2**20
    results = {}
    for name, values in timings.items():
        cpu_ms = 1000 * statistics.median(c for c, _ in values)
        wall_ms = 1000 * statistics.median(w for _, w in values)
        results[name] = {"cpu_ms": cpu_ms, "wall_ms": wall_ms, "mib": mib_moved}
        print(
            f"{name:45s} {mib_moved:5.1f} MiB: CPU {cpu_ms:6.1f} ms, wall {wall_ms:6.1f} ms (median of {len(values)})",
            flush=True,
        )
    return results


def _engine_args(spec: dict) -> dict:
    return dict(
        dtype="bfloat16",
        data_parallel_size=2,
        num_threads=1,
        max_model_len=spec["max_len"],
        kv_cache_memory_bytes=1 << 30,
        enable_prefix_caching=False,
        num_scheduler_steps=spec.get("num_scheduler_steps"),
    )


def drive(spec: dict) -> dict:
    """On the head host of the two-host harness: one replica per host, the
    requests started on the worker host's and moved to the head's (the K/V
    crosses the hosts' link)."""
    import ray

    from raylm.config import ParallelConfig
    from raylm.executor import ray_cluster
    from tests.multinode.driver import _wait_for_nodes

    logging.basicConfig(level=logging.WARNING)
    # Each migration and its stages' times, on stderr (shown when the driver fails).
    logging.getLogger("raylm.engine.supervisor").setLevel(logging.DEBUG)
    ray_cluster.connect_ray(ParallelConfig(ray_address=spec["address"]), num_cpus_hint=0)
    _wait_for_nodes(2, timeout=60)
    folder = pathlib.Path(spec["folder"])
    with LLM(str(folder), data_parallel_placement="spread", ray_address=spec["address"], **_engine_args(spec)) as llm:
        channels = llm.llm_engine.engine_core.channels
        head_ip = ray.util.get_node_ip_address()
        [worker_core] = [i for i, c in channels.items() if c.node_ip != head_ip]
        # The hosts share this machine's process table (network namespaces only):
        # each replica's actor is a process here, its CPU time readable.
        replicas = llm.llm_engine.engine_core.launcher.manager.replicas
        _core_processes.update({i: psutil.Process(h.pid) for i, h in replicas.items()})
        return measure(llm, folder, {**spec, "source": worker_core, "quiet": True})


def _halves_of_the_cpus() -> tuple[str, str]:
    """This machine's usable CPUs in two halves (taskset lists): the head's and the worker's."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit("--pin-hosts needs at least two CPUs")
    half = len(cpus) // 2
    return ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODEL_PRESETS), default="large")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model-root", default="/tmp/raylm_bench_models")
    parser.add_argument(
        "--bystanders",
        type=int,
        default=4,
        help="short requests decoding on each core throughout (their steps time the slowdown)",
    )
    parser.add_argument(
        "--sync-precopy", action="store_true", help="copy every stage on the cores' loops (no overlap), for comparison"
    )
    parser.add_argument("--skip-recompute", action="store_true")
    parser.add_argument(
        "--two-hosts",
        action="store_true",
        help="the cores on two hosts of the network-namespace harness (root), K/V over CURVE",
    )
    parser.add_argument(
        "--pin-hosts",
        action="store_true",
        help="--two-hosts: each host on its own half of this machine's CPUs (as two machines), "
        "instead of both sharing them all",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="--two-hosts: the driver's limit, seconds")
    parser.add_argument(
        "--copy-cost", action="store_true", help="only one stage's export and import cost, in isolation (no engine)"
    )
    parser.add_argument("--copy-mib", type=int, default=32, help="--copy-cost: the stage's size")
    parser.add_argument(
        "--num-scheduler-steps", type=int, help="the engine's decode bursts; default: LLM's (8); `raylm serve` runs 1"
    )
    parser.add_argument("--output-json")
    args = parser.parse_args()
    if args.copy_cost:
        results = copy_cost(args.copy_mib, args.repeats)
        if args.output_json:
            pathlib.Path(args.output_json).write_text(json.dumps({"copy_cost": results}, indent=2))
        return
    if args.pin_hosts and not args.two_hosts:
        parser.error("--pin-hosts goes with --two-hosts")
    if args.sync_precopy:  # read by the core processes (raylm.engine.core_migration)
        os.environ["RAYLM_MIGRATION_SYNC_PRECOPY"] = "1"
    logging.basicConfig(level=logging.WARNING)
    max_len = max(args.lengths) + 4096
    # The preset's weights, with room for the longest request (the presets hold 1024 positions).
    folder = pathlib.Path(args.model_root) / f"{args.model}-{max_len}-positions"
    if not (folder / "config.json").is_file():
        make_model(args.model, str(folder), max_position_embeddings=max_len)
    spec = {
        "lengths": args.lengths,
        "repeats": args.repeats,
        "bystanders": args.bystanders,
        "skip_recompute": args.skip_recompute,
        "max_len": max_len,
        "source": 0,
        "num_scheduler_steps": args.num_scheduler_steps,
    }
    if args.two_hosts:
        from tests.multinode.harness import netns_unavailable, two_hosts

        reason = netns_unavailable()
        if reason:
            sys.exit(f"cannot build two hosts here: {reason}")
        with two_hosts(pinned=_halves_of_the_cpus() if args.pin_hosts else None) as hosts:
            results = hosts.run_driver(
                {**spec, "address": hosts.address, "folder": str(folder.resolve())},
                timeout=args.timeout,
                module="benchmarks.bench_migration",
            )
        for length, row in results.items():
            _print_row(length, row)
    else:
        with LLM(str(folder), data_parallel_backend="mp", **_engine_args(spec)) as llm:
            # (The launcher's own record of its processes: a benchmark may peek.)
            launcher = llm.llm_engine.engine_core.launcher
            _core_processes.update({i: psutil.Process(p.pid) for i, p in launcher._processes.items()})
            results = measure(llm, folder, spec)
    if args.output_json:
        pathlib.Path(args.output_json).write_text(
            json.dumps(
                {
                    "model": args.model,
                    "sync_precopy": args.sync_precopy,
                    "two_hosts": args.two_hosts,
                    "pin_hosts": args.pin_hosts,
                    "results": results,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):  # the driver, on the head host
        print("RESULT " + json.dumps(drive(json.loads(sys.argv[1]))), flush=True)
    else:
        main()
