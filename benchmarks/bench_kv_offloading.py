"""The tier of evicted K/V blocks (`--kv-offloading-size`, issue 49 item
4): time to first token of a prompt whose prefix the prefix cache evicted,
loaded back from the tier, against computing it again (no tier), and
against a prefix still in the cache.

    python benchmarks/bench_kv_offloading.py [--prefix-tokens 480] [--rounds 5] [--threads 2]

The embedded model (512 positions), float32, a KV cache of 48 blocks (one
prompt of 512 tokens and a bit: every new prompt evicts the last one's
blocks). Each round, per engine: a fresh prefix of `--prefix-tokens`
tokens is computed (max_tokens=1), two other prompts of the same length
evict it, and a prompt with that prefix and a short new suffix is timed
(`evicted`); then the same prompt again, its prefix now in the cache
(`cached`). The two engines of a comparison run at once, the rounds
alternating between them. Engines: one core (`--kv-offloading-size 0.25`
against none),
and two local replicas (`-dp 2 --data-parallel-backend mp`) where the prefix
was computed and evicted on replica 1 and the timed prompt is pinned to
replica 0: loaded from replica 1's tier. Reported: TTFT p50 and spread
(min-max) per case, and the tier's against recomputing.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_prefix_pull import _ttft  # one request's time to first token, pinned or routed
from compare_vllm import bench_model

from raylm import LLM


def _block_bytes(model: str | None) -> int:
    """One 16-token block of K/V: the embedded model in float32, another in its own dtype."""
    folder = model or str(pathlib.Path(__file__).resolve().parents[1] / "raylm" / "data" / "default_model")
    c = json.loads((pathlib.Path(folder) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    size = 4 if model is None or c.get("torch_dtype", c.get("dtype")) == "float32" else 2
    return 16 * c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * size


def _engine(tier: bool, replicas: int, threads: int, model: str | None, prefix_tokens: int) -> LLM:
    dtype = "float32" if model is None else "auto"
    # Room for one prompt and a half: the two prompts after it evict it (48 blocks at 480 tokens).
    blocks = max(48, prefix_tokens // 16 * 8 // 5)
    settings = dict(dtype=dtype, num_threads=threads, kv_cache_memory_bytes=blocks * _block_bytes(model))
    if model is not None:  # a long-context model: its whole context would not fit that cache
        settings["max_model_len"] = prefix_tokens + 64
    if tier:
        settings["kv_offloading_size"] = 0.25
    if replicas > 1:
        settings.update(data_parallel_size=replicas, data_parallel_backend="mp")
    return LLM(model, **settings)


def _round(llm: LLM, rng: random.Random, r: int, prefix_tokens: int, replicas: int) -> tuple[float, float]:
    """(TTFT of the prompt whose prefix was evicted, TTFT of it again, cached)."""
    holder, timed = (1, 0) if replicas > 1 else (None, None)
    prefix = [rng.randrange(10, 4000) for _ in range(prefix_tokens)]
    _ttft(llm, f"p{r}", prefix + [7], holder)
    for k in range(2):  # two prompts as long: the prefix's blocks are evicted
        _ttft(llm, f"x{r}.{k}", [rng.randrange(10, 4000) for _ in range(prefix_tokens + 1)], holder)
    prompt = prefix + [rng.randrange(10, 4000) for _ in range(8)]
    evicted = _ttft(llm, f"e{r}", prompt, timed)
    cached = _ttft(llm, f"c{r}", prompt[:-1] + [11], timed)
    return evicted, cached


def run(replicas: int, prefix_tokens: int, rounds: int, threads: int, model: str | None = None) -> list[dict]:
    """Both engines (no tier, tier) up at once, the rounds alternating between
    them (which goes first alternates too): load from elsewhere on the
    machine meets both alike."""
    engines = {tier: _engine(tier, replicas, threads, model, prefix_tokens) for tier in (False, True)}
    cases = {tier: {"evicted": [], "cached": []} for tier in engines}
    rng = random.Random(0)
    try:
        for r in range(rounds + 1):  # the first round warms up
            for tier in (False, True) if r % 2 else (True, False):
                evicted, cached = _round(engines[tier], rng, r, prefix_tokens, replicas)
                if r:
                    cases[tier]["evicted"].append(evicted)
                    cases[tier]["cached"].append(cached)
        loads = dict(engines[True].llm_engine.engine_core.tier_loads.counts) if replicas > 1 else {}
    finally:
        for llm in engines.values():
            llm.shutdown()
    return [
        {
            "tier": tier,
            "replicas": replicas,
            **{f"{case}_ttft_ms": [round(1000 * t, 2) for t in times] for case, times in cases[tier].items()},
            "tier_loads": loads if tier else {},
        }
        for tier in (False, True)
    ]


def _p50(xs):
    return statistics.median(xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-tokens", type=int, default=480)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the raw results here")
    parser.add_argument("--model", default=None, help="a model folder, or 111m-8k (default: the embedded model)")
    args = parser.parse_args()
    results = []
    for replicas in (1, 2):
        for result in run(replicas, args.prefix_tokens, args.rounds, args.threads, bench_model(args.model)):
            results.append(result)
            ev, ca = result["evicted_ttft_ms"], result["cached_ttft_ms"]
            print(
                f"replicas {replicas}, tier {'on ' if result['tier'] else 'off'}: evicted prefix TTFT p50 "
                f"{_p50(ev):.1f} ms ({min(ev):.1f}-{max(ev):.1f}); cached {_p50(ca):.1f} ms "
                f"({min(ca):.1f}-{max(ca):.1f})"
                + (f"; supervisor tier loads {result['tier_loads']}" if result["tier_loads"] else "")
            )
    for replicas in (1, 2):
        off, on = (r for r in results if r["replicas"] == replicas)
        ratio = _p50(on["evicted_ttft_ms"]) / _p50(off["evicted_ttft_ms"])
        print(f"replicas {replicas}: an evicted prefix from the tier takes {100 * ratio:.0f}% of recomputing it")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"when": time.strftime("%Y-%m-%d"), "results": results}) + "\n")


if __name__ == "__main__":
    main()
