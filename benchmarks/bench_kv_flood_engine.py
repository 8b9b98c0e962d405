"""Victim streams' inter-token latency while a stranger floods a replica's
K/V server, against a control run in which the same attacker process sends
at the same rate to a closed port (issue 48's flood check, at the engine).

    python benchmarks/bench_kv_flood_engine.py [--seconds 20] [--rate 2000] [--repeats 2]

An offline engine of two local replicas (`-dp 2 --data-parallel-backend mp`,
the embedded model, float32), its migrations on the sealed network path
(RAYLM_MIGRATION_NETWORK=1). A rank's K/V server listens only while it
offers a stage, on a fresh port each time. A warm-up migration out of core
0 shows the port it listened on. Each run submits the victim streams,
starts the attacker (bench_kv_flood's: an endless multipart message, 200
idle connections and `--rate` junk connections a second), moves one stream
of core 0 to core 1 once they all decode (a migration under the flood), and
times every token's arrival at the front end. Three modes, alternating:
`control` aims at a closed port; `flood` at the port the server listened on
at the warm-up (an attacker who found it once); `chase` at the port it
listens on now, found within 5 ms by reading /proc (a local attacker who
follows it: the flood meets every stage of the migration). The
destination core is on this host, at 127.0.0.1, the one address its
source's server admits (raylm.kv_transfer.peer_filter): an attacker there
is refused at the handshake; with `--attacker-address 127.0.0.2` it stands
for any other stranger (across nodes, anyone not on the destination's
host), whose SYNs the kernel drops. Reported per
run: the victims' inter-token gaps (p50/p99), the migration's outcome, and
the junk the attacker sent.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pathlib
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_kv_flood import _attacker, _closed_port, _percentiles

from raylm import LLM, SamplingParams
from raylm.testing.chaos.schedule import listening_tcp_ports

NUM_STREAMS = 16
MODES = ("control", "flood", "chase")
_last_port = [0]  # where the K/V server of core 0 listened at the warm-up


def _decode_all(llm: LLM, requests: dict[str, list[int]], params: SamplingParams, on_all_decoding=None):
    """Run `requests` to their end; per request, the arrival time of each token."""
    engine = llm.llm_engine
    arrivals: dict[str, list[float]] = {rid: [] for rid in requests}
    for rid, prompt in requests.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    called = on_all_decoding is None
    while engine.has_unfinished_requests():
        for out in engine.step(stream=True):  # a delta per request that changed
            arrivals[out.request_id] += [time.monotonic()] * len(out.outputs[0].token_ids)
        if not called and all(len(a) >= 4 for a in arrivals.values()):
            on_all_decoding()
            called = True
    return arrivals


def _gaps(arrivals: dict[str, list[float]], window: tuple[float, float] | None = None) -> list[float]:
    """Inter-token gaps, from the second token (no prefill); `window`: only
    those that ended inside it."""
    gaps = []
    for times in arrivals.values():
        gaps += [b - a for a, b in zip(times[1:], times[2:]) if window is None or window[0] <= b <= window[1]]
    return gaps


class _PortWatch:
    """Points a shared value at the port core `index`'s K/V server listens on
    (it listens only while it offers, on a fresh port each time), looking
    every _WATCH_S: the attacker that follows it, a local one reading /proc.
    `follow=False`: it looks as often, and leaves the value alone (the
    control's and the flood's attacker spend the same on looking)."""

    def __init__(self, pid: int, port, stop_after_s: float, follow: bool = True):
        self.pid, self.port, self.stop_at, self.follow = pid, port, time.monotonic() + stop_after_s, follow
        self.seen: set[int] = set()
        self.listening: list[float] = []  # when it saw the server listen (CLOCK_MONOTONIC: every process's)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while time.monotonic() < self.stop_at:
            ports = listening_tcp_ports({self.pid})
            if ports:
                self.listening.append(time.monotonic())
                self.seen.add(sorted(ports)[0][1])
                if self.follow:
                    self.port.value = sorted(ports)[0][1]
            time.sleep(_WATCH_S)


def _watching_attacker(pid: int, follow: bool, port, seconds: float, rate: float, counts, source: str) -> None:
    """The attacker's process: it reads /proc for the server's port itself
    (in the engine's process the reading would take the front end's CPU
    and GIL from the victims), in every mode alike."""
    watch = _PortWatch(pid, port, seconds, follow)
    _attacker("127.0.0.1", port, seconds, rate, counts, source)
    counts["ports_followed"] = len(watch.seen) if follow else 0
    counts["listening"] = (min(watch.listening), max(watch.listening)) if watch.listening else None


_WATCH_S = 0.005


def run(llm: LLM, mode: str, seconds: float, rate: float, params: SamplingParams, source: str = "") -> dict:
    """`mode`: control (the attacker aims at a closed port), flood (at the
    port the server listened on last, as an attacker that found it once
    would), chase (at the port it listens on now, found within _WATCH_S)."""
    sup = llm.llm_engine.engine_core
    counts = mp.Manager().dict()
    index = 0
    port = mp.Value("i", _closed_port() if mode == "control" else _last_port[0])
    attacker = mp.Process(
        target=_watching_attacker,
        args=(sup.launcher._processes[index].pid, mode == "chase", port, seconds, rate, counts, source),
        daemon=True,
    )
    requests = {
        f"{mode}-{i}-{time.monotonic_ns()}": [(7 * i + j) % 200 + 3 for j in range(8 + 3 * i)]
        for i in range(NUM_STREAMS)
    }
    moved = {}

    def migrate_one() -> None:
        # A stream of the flooded core moves: its server offers the blocks
        # while it refuses the strangers.
        rid = next((r for r in requests if sup.ledger[r].channel == index), None)
        moved["started"] = rid is not None and sup.migrate(rid, 1 - index)

    before = dict(sup.migration_counts)
    attacker.start()
    time.sleep(0.5)  # the flood is on before the streams start
    started = time.monotonic()
    arrivals = _decode_all(llm, requests, params, migrate_one)
    elapsed = time.monotonic() - started
    attacker.join(seconds + 30)
    after = dict(sup.migration_counts)
    return {
        "mode": mode,
        "gaps": _gaps(arrivals),
        # While the server listened (the only time a flood can reach it).
        "listening_gaps": _gaps(arrivals, counts.get("listening")) if counts.get("listening") else [],
        "elapsed": elapsed,
        "moved": moved.get("started"),
        "migrated": after["migrated"] - before["migrated"],
        "abandoned": after["abandoned"] - before["abandoned"],
        "counts": dict(counts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the attacker runs each time")
    parser.add_argument("--rate", type=float, default=2000.0, help="junk connections a second")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode (alternating)")
    parser.add_argument(
        "--attacker-address",
        default="",
        help="the address the attacker connects from (default: 127.0.0.1, the destination's, which the "
        "server admits; another one, e.g. 127.0.0.2: a stranger the kernel drops)",
    )
    parser.add_argument("--max-tokens", type=int, default=400, help="tokens per victim stream")
    args = parser.parse_args()
    os.environ["RAYLM_MIGRATION_NETWORK"] = "1"
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    # One token a step (no decode bursts): a gap is one step of the replica.
    with LLM(
        None,
        dtype="float32",
        num_threads=1,
        data_parallel_size=2,
        data_parallel_backend="mp",
        kv_cache_memory_bytes=32 << 20,
        num_scheduler_steps=1,
    ) as llm:
        # Warm-up: one migration out of core 0 starts its rank's K/V server;
        # the port it listened on is where the `flood` mode aims.
        sup = llm.llm_engine.engine_core
        seen = mp.Value("i", 0)
        watch = _PortWatch(sup.launcher._processes[0].pid, seen, 60)
        _decode_all(
            llm,
            {"warm-up": list(range(3, 20))},
            SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
            lambda: sup.migrate("warm-up", 1) if sup.ledger["warm-up"].channel == 0 else None,
        )
        watch.stop_at = 0
        if not seen.value:
            raise SystemExit("no K/V server listened (the warm-up migration did not run over the network)")
        _last_port[0] = seen.value
        print(f"core 0's K/V server listened on port {seen.value}: the flood aims there, the chase follows it")
        results = []
        for repeat in range(args.repeats):
            for mode in MODES:
                r = run(llm, mode, args.seconds, args.rate, params, args.attacker_address)
                results.append(r)
                print(
                    f"{mode:7s} #{repeat}: inter-token {_percentiles(r['gaps'])}; "
                    f"while the K/V server listened {_percentiles(r['listening_gaps'])}; {r['elapsed']:.1f} s; "
                    f"migration started {r['moved']}, migrated {r['migrated']}, abandoned {r['abandoned']}; "
                    f"attacker {r['counts']}"
                )
        for mode in MODES:
            gaps = [g for r in results if r["mode"] == mode for g in r["gaps"]]
            listening = [g for r in results if r["mode"] == mode for g in r["listening_gaps"]]
            print(
                f"{mode:7s} all runs: inter-token {_percentiles(gaps)}; "
                f"while the K/V server listened {_percentiles(listening)}"
            )


if __name__ == "__main__":
    main()
