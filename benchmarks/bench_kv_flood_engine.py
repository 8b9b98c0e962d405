"""Victim streams' inter-token latency while a stranger floods a replica's
K/V server, against a control run in which the same attacker process sends
at the same rate to a closed port (issue 48's flood check, at the engine).

    python benchmarks/bench_kv_flood_engine.py [--seconds 20] [--rate 2000] [--repeats 2]

An offline engine of two local replicas (`-dp 2 --data-parallel-backend mp`,
the embedded model, float32), its migrations on the sealed network path
(RAYLM_MIGRATION_NETWORK=1: the K/V server a rank starts at its first offer
listens on 127.0.0.1 for the rank's life). A warm-up migration starts it;
then each run submits the victim streams, starts the attacker
(bench_kv_flood's: an endless multipart message, 200 idle connections and
`--rate` junk connections a second), moves one stream to the other replica
once they all decode (a migration under the flood, whose offer the server
makes while it refuses the strangers), and times every token's arrival at
the front end. Runs alternate control and flood. Reported per run: the
victims' inter-token gaps (p50/p99), the migration's outcome, and the junk
the attacker sent.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_kv_flood import _attacker, _closed_port, _percentiles

from raylm import LLM, SamplingParams
from raylm.testing.chaos.schedule import listening_tcp_ports

NUM_STREAMS = 16


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


def _gaps(arrivals: dict[str, list[float]]) -> list[float]:
    gaps = []
    for times in arrivals.values():
        gaps += [b - a for a, b in zip(times[1:], times[2:])]  # from the second token: no prefill
    return gaps


def _listening_core(llm: LLM) -> tuple[int, int]:
    """(core index, port) of the K/V server a core process listens with."""
    sup = llm.llm_engine.engine_core
    for index, process in sup.launcher._processes.items():
        ports = listening_tcp_ports({process.pid})
        if ports:
            return index, sorted(ports)[0][1]
    raise SystemExit("no K/V server listens (the warm-up migration did not run over the network)")


def run(llm: LLM, mode: str, flooded: tuple[int, int], seconds: float, rate: float,
        params: SamplingParams) -> dict:
    sup = llm.llm_engine.engine_core
    counts = mp.Manager().dict()
    index, port = flooded
    target = port if mode == "flood" else _closed_port()
    attacker = mp.Process(target=_attacker, args=("127.0.0.1", target, seconds, rate, counts), daemon=True)
    requests = {f"{mode}-{i}-{time.monotonic_ns()}": [(7 * i + j) % 200 + 3 for j in range(8 + 3 * i)]
                for i in range(NUM_STREAMS)}
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
    return {"mode": mode, "gaps": _gaps(arrivals), "elapsed": elapsed, "moved": moved.get("started"),
            "migrated": after["migrated"] - before["migrated"], "abandoned": after["abandoned"] - before["abandoned"],
            "counts": dict(counts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the attacker runs each time")
    parser.add_argument("--rate", type=float, default=2000.0, help="junk connections a second")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode (alternating)")
    parser.add_argument("--max-tokens", type=int, default=400, help="tokens per victim stream")
    args = parser.parse_args()
    os.environ["RAYLM_MIGRATION_NETWORK"] = "1"
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    # One token a step (no decode bursts): a gap is one step of the replica.
    with LLM(None, dtype="float32", num_threads=1, data_parallel_size=2, data_parallel_backend="mp",
             kv_cache_memory_bytes=32 << 20, num_scheduler_steps=1) as llm:
        # Warm-up: one migration starts the source rank's K/V server.
        _decode_all(llm, {"warm-up": list(range(3, 20))}, SamplingParams(temperature=0, max_tokens=60,
                                                                         ignore_eos=True),
                    lambda: llm.llm_engine.engine_core.migrate("warm-up"))
        flooded = _listening_core(llm)
        print(f"core {flooded[0]}'s K/V server listens on port {flooded[1]}: the flood aims there")
        results = []
        for repeat in range(args.repeats):
            for mode in ("control", "flood"):
                r = run(llm, mode, flooded, args.seconds, args.rate, params)
                results.append(r)
                print(f"{mode:7s} #{repeat}: inter-token {_percentiles(r['gaps'])}; {r['elapsed']:.1f} s; "
                      f"migration started {r['moved']}, migrated {r['migrated']}, abandoned {r['abandoned']}; "
                      f"attacker {r['counts']}")
        for mode in ("control", "flood"):
            gaps = [g for r in results if r["mode"] == mode for g in r["gaps"]]
            print(f"{mode:7s} all runs: inter-token {_percentiles(gaps)}")


if __name__ == "__main__":
    main()
