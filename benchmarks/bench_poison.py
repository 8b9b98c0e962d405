"""What a poison request costs (docs/architecture.md, "The failure model"; raylm.core.quarantine):
how long from its first failure until it is failed alone, how many rebuilds that
took, and how much longer the good requests beside it took than without it.

    python benchmarks/bench_poison.py [--models small large] [--scenarios uni-raise mp-kill mp-hang ray-kill] \\
        [--repeats 2] [--hang-timeout 5] [--model-root /tmp/raylm_bench_models]

Models: the ~7M ("small") and ~111M ("large") random-weight bf16 Llama folders of
`compare_vllm.py --make-model`, written under --model-root on first use.

Each scenario builds one engine with RAYLM_FAULT_INJECTION set (ACTION on any step that
holds a prompt with the poison token, on the highest rank) and runs, alternating over
--repeats rounds: the 16 good requests alone (64 random prompt tokens -> 64 greedy tokens),
then the same 16 with one poison request among them. Reported per round:
  clean       seconds for the good requests alone
  poisoned    seconds for the good requests plus the poison one (until all have ended)
  detect->culprit   first failure noticed -> the culprit failed (RecoveryEvent.noticed_at of
              the first recovery of the round to that of the one that names the culprit)
  recoveries  rebuilds in the round (2 or 3: twice batched, then alone)
The good requests' outputs must equal the clean run's (float32 would make that exact;
bf16 random-weight models are near-flat, so a mismatch after a recompute is reported, not fatal).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from compare_vllm import make_model, random_prompts

from raylm import LLM, SamplingParams

MODELS = {"small": "llama-7m", "large": "llama-111m"}
NUM_GOOD, PROMPT_LEN, MAX_TOKENS = 16, 64, 64
POISON = 15  # below the ids random_prompts draws, so no good prompt holds it
SCENARIOS = {  # name -> (action, backend, tensor-parallel size)
    "uni-raise": ("raise", "uni", 1),
    "mp-kill": ("kill", "mp", 2),
    "mp-hang": ("hang", "mp", 2),
    "ray-kill": ("kill", "ray", 2),
}


def model_folder(root: str, name: str) -> pathlib.Path:
    folder = pathlib.Path(root) / MODELS[name]
    if not (folder / "config.json").exists():
        make_model(name, str(folder))
    return folder


def run_scenario(folder: pathlib.Path, name: str, repeats: int, hang_timeout: float) -> dict:
    action, backend, tp = SCENARIOS[name]
    os.environ["RAYLM_FAULT_INJECTION"] = f"{action}:token={POISON}"
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    good = [{"prompt_token_ids": p} for p in random_prompts(NUM_GOOD, PROMPT_LEN, vocab, seed=0)]
    poisoned = good[:5] + [{"prompt_token_ids": [POISON] * PROMPT_LEN}] + good[5:]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = LLM(
        str(folder),
        dtype="bfloat16",
        tensor_parallel_size=tp,
        distributed_executor_backend=backend,
        num_threads=1,
        enable_prefix_caching=False,
        execute_model_timeout=hang_timeout,
    )
    rounds = []
    try:
        core = llm.llm_engine.engine_core.engine_core
        llm.generate(good[:2], params, use_tqdm=False)  # warm-up
        for _ in range(repeats):
            started = time.monotonic()
            clean = [o.outputs[0].token_ids for o in llm.generate(good, params, use_tqdm=False)]
            clean_s = time.monotonic() - started
            first_event = len(core.recoveries)
            started = time.monotonic()
            outputs = llm.generate(poisoned, params, use_tqdm=False)
            poisoned_s = time.monotonic() - started
            events = core.recoveries[first_event:]
            bad = outputs.pop(5).outputs[0]
            culprit = next(e for e in events if e.culprits)
            rounds.append(
                {
                    "clean_s": clean_s,
                    "poisoned_s": poisoned_s,
                    "detect_to_culprit_s": culprit.noticed_at - events[0].noticed_at,
                    "recoveries": len(events),
                    "poison_failed": bad.finish_reason == "error",
                    "good_equal": [o.outputs[0].token_ids for o in outputs] == clean,
                    "budget_left": core.restart_budget.max_restarts - core.restart_budget.num_recent,
                }
            )
    finally:
        llm.shutdown()
    return {
        "scenario": name,
        "rounds": rounds,
        "median_detect_to_culprit_s": statistics.median(r["detect_to_culprit_s"] for r in rounds),
        "median_extra_s": statistics.median(r["poisoned_s"] - r["clean_s"] for r in rounds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["small"], choices=sorted(MODELS))
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hang-timeout", type=float, default=5.0)
    parser.add_argument("--model-root", default="/tmp/raylm_bench_models")
    args = parser.parse_args()
    for model in args.models:
        folder = model_folder(args.model_root, model)
        for name in args.scenarios:
            result = run_scenario(folder, name, args.repeats, args.hang_timeout)
            print(json.dumps({"model": model, **result}), flush=True)


if __name__ == "__main__":
    main()
