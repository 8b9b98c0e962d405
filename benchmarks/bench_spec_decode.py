"""Speculative decoding (n-gram prompt lookup, or suffix decoding with
--method suffix) against decoding without it:
batch-1 decode tokens/s on the embedded default model (float32), engine
defaults otherwise (decode bursts on, as offline).

Two prompt sets:
- self-quoting: a passage the model generated (greedy, from "Story i:"),
  then the passage's first words again, so that its continuation quotes the
  passage, whose n-grams the drafts find;
- short: short prompts, greedy, where drafts can only come from the model's
  own output so far (this small model's greedy text repeats itself, so
  lookup still finds much);
- sampled: the same short prompts, seeded sampling at temperature 0.8, where
  drafts mostly miss (few n-grams recur, and those that do rarely match).

Both engines live side by side in this process; every round runs each set
through both engines, one request (or --batch requests) at a time, the two
engines taking turns request by request, the first alternating, so that a
noisy machine shifts them alike. Printed: tok/s per
engine and set (median over rounds), the ratio with speculation / without
(median, min-max over rounds), the acceptance (accepted / draft tokens, and
per draft position), the steps where speculation stepped aside, and whether
both engines gave the same tokens (they must: greedy).

    python benchmarks/bench_spec_decode.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import raylm.core.spec_decode as spec_decode
from raylm import LLM, SamplingParams


def _engines(method: str, k: int, lookup_max: int, lookup_min: int, threads: int | None) -> dict[str, LLM]:
    settings = dict(kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False, num_threads=threads)
    spec = {
        "method": method,
        "num_speculative_tokens": k,
        "prompt_lookup_max": lookup_max,
        "prompt_lookup_min": lookup_min,
    }
    return {"plain": LLM(**settings), "spec": LLM(speculative_config=spec, **settings)}


def _prompt_sets(llm: LLM, num_prompts: int, passage_tokens: int, quote_tokens: int) -> dict[str, list[list[int]]]:
    tokenizer = llm.get_tokenizer()
    starts = [tokenizer(f"Story {i}:").input_ids for i in range(num_prompts)]
    greedy = SamplingParams(temperature=0.0, max_tokens=passage_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": s} for s in starts], greedy, use_tqdm=False)
    passages = [s + list(o.outputs[0].token_ids) for s, o in zip(starts, outs)]
    return {
        "self-quoting": [p + p[:quote_tokens] for p in passages],
        "short": [tokenizer(f"Chapter {i}. The").input_ids for i in range(num_prompts)],
        "sampled": [tokenizer(f"Chapter {i}. The").input_ids for i in range(num_prompts)],
    }


def _params(prompt_set: str, tokens: int, index: int) -> SamplingParams:
    if prompt_set == "sampled":
        return SamplingParams(temperature=0.8, seed=index, max_tokens=tokens, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)


def _run_set(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], batch: int = 1) -> tuple:
    """(wall seconds, CPU seconds of this process, tokens) of the prompts,
    `batch` at a time. The engine runs in this process (uni executor), so
    its CPU time is less exposed than the wall clock to other work on a
    shared machine (not immune: caches and memory bandwidth are shared too)."""
    outputs, start, cpu_start = [], time.perf_counter(), time.process_time()
    for i in range(0, len(prompts), batch):
        chunk = [{"prompt_token_ids": p} for p in prompts[i : i + batch]]
        outs = llm.generate(chunk, params[i : i + batch], use_tqdm=False)
        outputs.extend(list(out.outputs[0].token_ids) for out in outs)
    return time.perf_counter() - start, time.process_time() - cpu_start, outputs


def _spec_totals(llm: LLM) -> dict:
    stats = llm.llm_engine.stats()
    return {k: v for k, v in stats.items() if k.startswith("spec_decode")}


def _delta(before: dict, after: dict) -> dict:
    out = {}
    for key, value in after.items():
        if isinstance(value, list):
            old = before.get(key) or [0] * len(value)
            out[key] = [a - b for a, b in zip(value, old)]
        elif isinstance(value, dict):
            out[key] = {r: n - before.get(key, {}).get(r, 0) for r, n in value.items()}
        else:
            out[key] = value - before.get(key, 0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompts", type=int, default=4, help="prompts per set")
    p.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--passage", type=int, default=200, help="tokens of a self-quoting prompt's passage")
    p.add_argument("--quote", type=int, default=16, help="first tokens of the passage repeated at its end")
    p.add_argument(
        "--method",
        choices=("ngram", "suffix"),
        default="ngram",
        help="suffix drafts from earlier outputs: from the second round on, every prompt was seen before",
    )
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    p.add_argument("--lookup-max", type=int, default=4)
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--threads", type=int, help="torch threads of each engine (default: planned)")
    p.add_argument("--batch", type=int, default=1, help="requests at once (the prompts of a set, repeated to fill it)")
    p.add_argument(
        "--max-speculative-batch",
        type=int,
        help="override raylm.core.spec_decode.MAX_SPECULATIVE_BATCH (to measure where speculation stops paying)",
    )
    args = p.parse_args()
    if args.max_speculative_batch is not None:
        spec_decode.MAX_SPECULATIVE_BATCH = args.max_speculative_batch

    engines = _engines(args.method, args.num_speculative_tokens, args.lookup_max, args.lookup_min, args.threads)
    try:
        sets = _prompt_sets(engines["plain"], args.prompts, args.passage, args.quote)
        if args.batch > 1:  # each set fills the batch (its prompts repeated: same drafts, other requests)
            sets = {s: (prompts * args.batch)[: max(args.batch, len(prompts))] for s, prompts in sets.items()}
        for llm in engines.values():  # warm-up
            _run_set(llm, sets["short"][:1], [SamplingParams(temperature=0.0, max_tokens=16)])
        rates = {(clock, name, s): [] for clock in ("wall", "cpu") for name in engines for s in sets}
        same = {s: True for s in sets}
        acceptance = {}
        for r in range(args.rounds):
            for s, prompts in sets.items():
                seconds = {(clock, name): 0.0 for clock in ("wall", "cpu") for name in engines}
                tokens = {name: [] for name in engines}
                before = _spec_totals(engines["spec"])
                # The engines take turns batch by batch, the first alternating:
                # a burst of load from elsewhere falls on both alike.
                for i in range(0, len(prompts), args.batch):
                    order = list(engines) if (r + i) % 2 == 0 else list(reversed(engines))
                    for name in order:
                        batch = prompts[i : i + args.batch]
                        params = [_params(s, args.tokens, i + j) for j in range(len(batch))]
                        wall, cpu, out = _run_set(engines[name], batch, params, args.batch)
                        seconds[("wall", name)] += wall
                        seconds[("cpu", name)] += cpu
                        tokens[name].extend(out)
                for (clock, name), total in seconds.items():
                    rates[(clock, name, s)].append(len(prompts) * args.tokens / total)
                acceptance.setdefault(s, []).append(_delta(before, _spec_totals(engines["spec"])))
                same[s] &= tokens["plain"] == tokens["spec"]
        _report(args, sets, rates, same, acceptance)
    finally:
        for llm in engines.values():
            llm.shutdown()


def _report(args, sets, rates, same, acceptance) -> None:
    print(
        f"batch-{args.batch} decode, embedded default model (float32), {len(next(iter(sets.values())))} prompts x "
        f"{args.tokens} tokens per set (prefill included), "
        f"{args.rounds} rounds; {args.method} k={args.num_speculative_tokens} "
        f"lookup {args.lookup_min}..{args.lookup_max}"
    )
    for s in sets:
        plain, spec = rates[("wall", "plain", s)], rates[("wall", "spec", s)]
        ratios = [b / a for a, b in zip(plain, spec)]
        cpu_ratios = [b / a for a, b in zip(rates[("cpu", "plain", s)], rates[("cpu", "spec", s)])]
        runs = acceptance[s]
        drafted = sum(a["spec_decode_num_draft_tokens"] for a in runs)
        accepted = sum(a["spec_decode_num_accepted_tokens"] for a in runs)
        drafts = sum(a["spec_decode_num_drafts"] for a in runs)
        per_pos = [sum(col) for col in zip(*(a["spec_decode_num_accepted_tokens_per_pos"] for a in runs))]
        aside = sum(a["spec_decode_num_steps_aside"] for a in runs)
        print(
            f"{s:>13}: without {statistics.median(plain):7.1f} tok/s, with {args.method} "
            f"{statistics.median(spec):7.1f} tok/s; ratio median {statistics.median(ratios):.2f}x "
            f"(min {min(ratios):.2f}, max {max(ratios):.2f}), "
            f"by CPU time {statistics.median(cpu_ratios):.2f}x ({min(cpu_ratios):.2f}-{max(cpu_ratios):.2f}); "
            f"acceptance {accepted / max(drafted, 1):.2f} ({accepted}/{drafted} draft tokens, {drafts} drafts), "
            f"per position {[round(n / max(drafts, 1), 2) for n in per_pos]}; steps aside {aside}; "
            f"same tokens: {same[s]}"
        )


if __name__ == "__main__":
    main()
