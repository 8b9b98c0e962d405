"""MessageQueue micro-benchmark: enqueue -> dequeue latency of small messages to
2 reader processes, the CPU an idle reader burns while it waits, and the cost
of the message codec on a typical step (encode + decode of the call carrying a
SchedulerOutput, and of the reply carrying a ModelRunnerOutput).

    python benchmarks/bench_mq.py [--messages 2000] [--idle-seconds 2] [--codec-only]
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import time
import timeit

import psutil

from raylm.distributed.message_codec import MessageCodec
from raylm.distributed.mq_wait import QueueClosedError
from raylm.distributed.rpc_messages import RpcReply, RpcRequest
from raylm.distributed.shm_broadcast import MessageQueue
from raylm.messages import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from raylm.sampling_params import SamplingParams


def _reader(handle, rank: int, ack_handle_pipe) -> None:
    """Dequeue (send_time_ns, seq) messages; record one-way latency; ack each one."""
    inbox = MessageQueue.create_from_handle(handle, rank)
    acks = MessageQueue(num_local_readers=1, chunk_bytes=1 << 16, max_chunks=4)
    ack_handle_pipe.send(acks.export_handle())
    latencies: list[int] = []
    try:
        while True:
            msg = inbox.dequeue()
            now = time.perf_counter_ns()  # CLOCK_MONOTONIC: comparable across processes
            if msg == "report":
                acks.enqueue(latencies)
                continue
            sent_ns, seq = msg
            if seq >= 0:
                latencies.append(now - sent_ns)
            acks.enqueue(seq)
    except QueueClosedError:
        pass
    finally:
        acks.close()
        inbox.close()


def _percentiles(values_ns: list[int]) -> str:
    us = sorted(v / 1000 for v in values_ns)
    pick = lambda q: us[min(len(us) - 1, int(q * len(us)))]  # noqa: E731
    return (
        f"p50 {pick(0.5):7.1f} us  p90 {pick(0.9):7.1f} us  p99 {pick(0.99):7.1f} us  "
        f"mean {statistics.fmean(us):7.1f} us"
    )


def _run_round(queue: MessageQueue, acks: list[MessageQueue], count: int, gap_s: float, label: str) -> None:
    for seq in range(count):
        queue.enqueue((time.perf_counter_ns(), seq))
        for a in acks:
            assert a.dequeue(timeout=30) == seq
        if gap_s:
            time.sleep(gap_s)
    queue.enqueue("report")
    per_reader = [a.dequeue(timeout=30) for a in acks]
    merged = [v for lat in per_reader for v in lat[-count:]]
    print(f"{label:<34} {_percentiles(merged)}")


def _typical_step(decoding: int = 64, prefills: int = 2, prompt_len: int = 512):
    """A decode-heavy step: `decoding` running requests plus `prefills` new
    ones; and its output, without and with top-5 logprobs."""
    rng = random.Random(0)
    new = [
        NewRequestData(
            f"new-{i}",
            [rng.randrange(32000) for _ in range(prompt_len)],
            [],
            SamplingParams(temperature=0.7, top_p=0.9, max_tokens=128, stop=["\n\n"]),
            list(range(32)),
            0,
        )
        for i in range(prefills)
    ]
    cached = [
        CachedRequestData(f"req-{i}", [rng.randrange(32000)], [i] if i % 16 == 0 else [], 600 + i)
        for i in range(decoding)
    ]
    scheduled = {c.req_id: 1 for c in cached} | {n.req_id: prompt_len for n in new}
    step = SchedulerOutput(new, cached, scheduled, sum(scheduled.values()), {"done-1"})
    ids = [c.req_id for c in cached]
    sampled = [[rng.randrange(32000)] for _ in ids]
    logprobs = {r: ([rng.randrange(32000) for _ in range(6)], [rng.random() for _ in range(6)], 3) for r in ids}
    return step, ModelRunnerOutput(ids, sampled), ModelRunnerOutput(ids, sampled, logprobs)


def bench_codec(repeat: int = 5, number: int = 2000) -> None:
    """Best-of-`repeat` microseconds per encode and per decode, as the step
    path sends them (the rpc envelopes around the messages)."""
    codec = MessageCodec()
    step, output, output_with_logprobs = _typical_step()
    cases = {
        "call: SchedulerOutput (66 reqs)": RpcRequest(7, "execute_model", (step,), {}, 0),
        "reply: ModelRunnerOutput": RpcReply(7, "ok", output),
        "reply: ModelRunnerOutput + logprobs": RpcReply(7, "ok", output_with_logprobs),
    }
    print("codec, best of", repeat, "x", number)
    for label, message in cases.items():
        data = codec.encode(message)
        assert codec.decode(data) == message
        # The case is bound as a default argument, not read from the loop's variable later.
        encode = min(timeit.repeat(lambda m=message: codec.encode(m), number=number, repeat=repeat)) / number * 1e6
        decode = min(timeit.repeat(lambda d=data: codec.decode(d), number=number, repeat=repeat)) / number * 1e6
        print(f"  {label:<38} {len(data):6d} B  encode {encode:6.1f} us  decode {decode:6.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--idle-seconds", type=float, default=2.0)
    parser.add_argument("--codec-only", action="store_true", help="only the codec micro-benchmark")
    args = parser.parse_args()
    bench_codec()
    if args.codec_only:
        return

    ctx = multiprocessing.get_context("spawn")
    queue = MessageQueue(num_local_readers=2, chunk_bytes=1 << 16, max_chunks=8)
    procs, acks = [], []
    try:
        for rank in range(2):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_reader, args=(queue.export_handle(), rank, child_end), daemon=True)
            p.start()
            procs.append(p)
            acks.append(MessageQueue.create_from_handle(parent_end.recv(), 0))
        for seq in range(-50, 0):  # warm-up, not recorded
            queue.enqueue((time.perf_counter_ns(), seq))
            for a in acks:
                a.dequeue(timeout=30)

        print(f"2 readers, {args.messages} small messages each round")
        _run_round(queue, acks, args.messages, 0.0, "back-to-back (readers spinning)")
        _run_round(queue, acks, max(100, args.messages // 10), 0.002, "paced 2 ms apart (readers asleep)")

        readers = [psutil.Process(p.pid) for p in procs]
        for r in readers:
            r.cpu_percent(None)
        time.sleep(args.idle_seconds)
        usage = [r.cpu_percent(None) for r in readers]
        print(f"idle readers over {args.idle_seconds:.0f} s: CPU " + ", ".join(f"{u:.1f}%" for u in usage))
    finally:
        queue.close()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        for a in acks:
            a.close()


if __name__ == "__main__":
    main()
