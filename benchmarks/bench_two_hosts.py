"""TP=2 x PP=2 across two hosts against the same layout on one host.

The hosts are network namespaces of this machine joined by a veth pair
(tests/multinode/harness.py; needs root and `ip`), each with a Ray node: the
cross-host run has 2 CPUs per host, so PACK puts one TP group on each host and
the step reaches the worker host over ZMQ, the activations between stages over
gloo on the link; the one-host run gives the head 4 CPUs and packs every rank
there (shared memory, loopback). Both use this machine's cores, so the
difference is the transport, not compute.

    sudo python benchmarks/bench_two_hosts.py [--transport mq|cgraph] [--rounds 2]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from compare_vllm import make_model  # noqa: E402

from tests.multinode.harness import netns_unavailable, two_hosts  # noqa: E402


def run(model: str, args, head_cpus: int, strategy: str) -> dict:
    spec = {
        "model": model,
        "tp": 2,
        "pp": 2,
        "strategy": strategy,
        "transport": args.transport,
        "dtype": "bfloat16",
        "prompts": [],
        "max_tokens": 1,
        "bench": {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len},
    }
    with two_hosts(head_cpus=head_cpus) as hosts:
        return hosts.run_driver(spec, timeout=600)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model folder (default: the 7M bf16 Llama of compare_vllm.py, built here)")
    parser.add_argument("--transport", default="mq", choices=["mq", "cgraph"])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    reason = netns_unavailable()
    if reason:
        sys.exit(f"cannot build two hosts here: {reason}")
    model = args.model or str(make_model("small", tempfile.mkdtemp(prefix="raylm-bench-")))
    rows = []
    for _ in range(args.rounds):  # alternating, so the machine's load falls on both alike
        for name, head_cpus, strategy in (("one host", 4, "STRICT_PACK"), ("two hosts", 2, "PACK")):
            result = run(model, args, head_cpus, strategy)
            bench = result["bench"]
            rows.append((name, result["placed"]["node_ips"], bench))
            tokens_per_s = bench["tokens"] / bench["elapsed_s"]
            print(
                f"{name:9s} ranks on {result['placed']['node_ips']}: {tokens_per_s:7.1f} tok/s, "
                f"median step {bench['median_step_ms']:.2f} ms ({bench['steps']} steps)",
                flush=True,
            )
    best = {
        name: min((b for n, _, b in rows if n == name), key=lambda b: b["median_step_ms"])
        for name in ("one host", "two hosts")
    }
    extra = best["two hosts"]["median_step_ms"] - best["one host"]["median_step_ms"]
    throughput = {name: b["tokens"] / b["elapsed_s"] for name, b in best.items()}
    print(
        f"crossing hosts adds {extra:.2f} ms per step (best of {args.rounds}); throughput ratio "
        f"{throughput['two hosts'] / throughput['one host']:.2f}"
    )


if __name__ == "__main__":
    main()
