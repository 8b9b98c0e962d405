"""Speculative decoding end to end (raylm.core.spec_decode): for every
architecture, greedy outputs with speculation equal Hugging Face's and equal
decoding without it, whether the drafts are n-gram lookups, always right
(the known continuation) or always wrong; a seeded random request gives the
same tokens with and without; stop tokens, stop strings, max_tokens and
min_tokens cut inside an accepted run where they cut one token at a time;
blocks cached after rejected drafts hold the right K/V; and requests whose
features speculation does not serve yet decode plainly, counted."""

from __future__ import annotations

import pytest

import raylm.core.spec_decode as spec_decode
from raylm import LLM, SamplingParams
from raylm.core.spec_propose import NgramProposer
from raylm.model.arch_config import ArchConfig
from raylm.testing.hf_oracle import hf_greedy
from tests.conftest import ARCHS

MAX_TOKENS = 24
K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(autouse=True)
def _speculate_at_any_batch_size(monkeypatch):
    """These tests check what speculation computes, several requests at once:
    the batch-size rule is off here (one test turns it back on)."""
    monkeypatch.setattr(spec_decode, "MAX_SPECULATIVE_BATCH", 64)


class ScriptedProposer:
    """Drafts by prompt: the known continuation ("right"), the known
    continuation with every token changed ("wrong"), or n-gram lookup."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.scripts: list[tuple[list[int], str, list[int]]] = []  # (prompt, mode, continuation)
        self.ngram = NgramProposer(1, 3)

    def add(self, prompt: list[int], mode: str, continuation: list[int] | None = None) -> None:
        self.scripts.append((list(prompt), mode, list(continuation or [])))

    def request_finished(self, request) -> None:
        pass

    def propose(self, request, max_tokens: int) -> list[int]:
        token_ids = request.all_token_ids
        for prompt, mode, continuation in self.scripts:
            if list(token_ids[: len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                draft = continuation[done : done + max_tokens]
                if mode == "right":
                    return draft
                if mode == "wrong":
                    return [(t + 1) % self.vocab_size for t in draft]
                break
        return self.ngram.propose(request, max_tokens)


def _use_proposer(monkeypatch, proposer) -> None:
    monkeypatch.setattr(spec_decode, "make_proposer", lambda config: proposer)


def _run(model, prompts, params, speculative_config=None, **engine_args):
    """(token ids, finish reason, stop reason, text) per prompt, and the engine's stats."""
    engine_args = {"dtype": "float32", "distributed_executor_backend": "uni", **engine_args}
    with LLM(model, kv_cache_memory_bytes=32 << 20, speculative_config=speculative_config, **engine_args) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.llm_engine.stats()
    return [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason, o.outputs[0].text) for o in outs
    ], stats


def _prompts(vocab_size: int) -> dict[str, list[int]]:
    return {
        # Repeats itself: n-gram lookup finds drafts from the first step on.
        "repeating": [(11 * i) % 97 + 3 for i in range(9)] * 4,
        "right": [5, 9, 11, 13, 200, 7, 40],
        "wrong": [17, 3, 250, 8, 8, 60, 61, 62, 63, 1],
        "random": [(37 * i + 5) % (vocab_size - 3) + 3 for i in range(30)],
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_hf_and_plain_decoding(arch, tiny_model_dir, monkeypatch):
    model = tiny_model_dir(arch)
    vocab_size = ArchConfig.from_model_dir(model).vocab_size
    prompts = _prompts(vocab_size)
    hf = {name: g.token_ids for name, g in zip(prompts, hf_greedy(model, list(prompts.values()), MAX_TOKENS))}
    proposer = ScriptedProposer(vocab_size)
    proposer.add(prompts["right"], "right", hf["right"])
    proposer.add(prompts["wrong"], "wrong", hf["wrong"])
    _use_proposer(monkeypatch, proposer)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    plain, _ = _run(model, list(prompts.values()), greedy)
    spec, stats = _run(model, list(prompts.values()), greedy, NGRAM)
    assert [o[0] for o in plain] == list(hf.values())
    assert [o[0] for o in spec] == list(hf.values())
    assert stats["spec_decode_num_drafts"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0
    # The right drafts are all accepted: at least (MAX_TOKENS - 1) // (K + 1) runs of K + 1.
    assert stats["spec_decode_num_accepted_tokens_per_pos"][K - 1] >= (MAX_TOKENS - 1) // (K + 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_suffix_drafts_from_earlier_outputs_equal_hf(arch, tiny_model_dir):
    """Method suffix: the same prompts a second time draft from the first
    time's outputs (accepted), and every output is Hugging Face's."""
    model = tiny_model_dir(arch)
    all_prompts = _prompts(ArchConfig.from_model_dir(model).vocab_size)
    prompts = [all_prompts["random"], all_prompts["right"]]
    hf = [g.token_ids for g in hf_greedy(model, prompts, MAX_TOKENS)]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    suffix = {**NGRAM, "method": "suffix"}
    with LLM(model, dtype="float32", kv_cache_memory_bytes=32 << 20, speculative_config=suffix) as llm:
        first = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        accepted_before = llm.llm_engine.stats()["spec_decode_num_accepted_tokens"]
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        accepted = llm.llm_engine.stats()["spec_decode_num_accepted_tokens"] - accepted_before
    assert [o.outputs[0].token_ids for o in first] == hf
    assert [o.outputs[0].token_ids for o in again] == hf
    # Nearly every token of the second pass was drafted and accepted.
    assert accepted >= len(prompts) * (MAX_TOKENS - 1) * K // (K + 1) - len(prompts) * K


def test_drafts_accepted_by_ngram_lookup_alone(tiny_model_dir):
    """No scripted drafts: on a prompt that repeats itself, lookup's drafts are accepted."""
    model = tiny_model_dir("llama")
    prompt = _prompts(512)["repeating"]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain, _ = _run(model, [prompt], greedy)
    spec, stats = _run(model, [prompt], greedy, NGRAM)
    assert spec == plain
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_draft_tokens"] >= stats["spec_decode_num_accepted_tokens"]


@pytest.mark.parametrize("back_off", [False, True], ids=["drafting-on", "backing-off"])
def test_always_rejected_drafts_commit_one_token_each(back_off, tiny_model_dir, monkeypatch):
    model = tiny_model_dir("llama")
    prompt = _prompts(512)["wrong"]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain, _ = _run(model, [prompt], greedy)
    proposer = ScriptedProposer(512)
    proposer.add(prompt, "wrong", plain[0][0])
    _use_proposer(monkeypatch, proposer)
    if not back_off:
        monkeypatch.setattr(spec_decode, "LOW_ACCEPTANCE", 0.0)
    spec, stats = _run(model, [prompt], greedy, NGRAM)
    assert spec == plain
    assert stats["spec_decode_num_accepted_tokens"] == 0
    if back_off:
        # One window of drafts, all rejected: no more drafts for the rest of it.
        assert stats["spec_decode_num_draft_tokens"] == spec_decode.ACCEPTANCE_WINDOW
        assert stats["spec_decode_steps_aside_by_reason"]["low_acceptance"] > 0
    else:
        # Every step drafted but the first (a prefill) and the last (max_tokens leaves no room).
        assert stats["spec_decode_num_drafts"] == MAX_TOKENS - 2


def test_seeded_random_sampling_is_the_same_with_speculation(tiny_model_dir, monkeypatch):
    """One generator draw per committed token: the seeded stream, and so the
    text, does not depend on how many drafts were accepted."""
    model = tiny_model_dir("qwen2")
    prompts = _prompts(512)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)
    names = ["repeating", "right", "wrong"]
    plain, _ = _run(model, [prompts[n] for n in names], seeded)
    proposer = ScriptedProposer(512)
    proposer.add(prompts["right"], "right", plain[1][0])
    proposer.add(prompts["wrong"], "wrong", plain[2][0])
    _use_proposer(monkeypatch, proposer)
    spec, stats = _run(model, [prompts[n] for n in names], seeded, NGRAM)
    assert spec == plain
    assert stats["spec_decode_num_accepted_tokens"] >= MAX_TOKENS // (K + 1)


def test_stops_and_max_tokens_cut_inside_an_accepted_run(tiny_model_dir, monkeypatch):
    model = tiny_model_dir("llama")
    prompt = _prompts(512)["right"]
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = _run(model, [prompt], long)[0][0][0]
    proposer = ScriptedProposer(512)
    proposer.add(prompt, "right", full)
    _use_proposer(monkeypatch, proposer)
    # A token that first comes inside a run of accepted drafts (after the
    # prefill's token, runs are K + 1 long, the last one not a draft's).
    at = next(i for i in range(2, len(full)) if (i - 1) % (K + 1) != K and full[i] not in full[:i])
    stop_token = full[at]
    text = _run(model, [prompt], long)[0][0][3]
    stop_string = text[len(text) // 2 : len(text) // 2 + 3]
    params = [
        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),  # K + 1 does not divide it
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_token]),
        # Masked until 9 tokens are out: the stop comes later, if at all.
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_token], min_tokens=9),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop_string]),
    ]
    plain, _ = _run(model, [prompt] * len(params), params)
    spec, stats = _run(model, [prompt] * len(params), params, NGRAM)
    assert spec == plain
    assert len(plain[0][0]) == 13 and plain[0][1] == "length"
    assert plain[1][0] == full[: at + 1] and plain[1][1:3] == ("stop", stop_token)
    assert plain[3][1:3] == ("stop", stop_string)
    # Both stops came inside a run of accepted drafts, not at its end.
    assert all((len(plain[i][0]) - 1) % (K + 1) != 0 for i in (1, 3))
    assert stats["spec_decode_steps_aside_by_reason"].get("min_tokens", 0) > 0


def test_prefix_cache_after_rejected_drafts_holds_committed_kv(tiny_model_dir, monkeypatch):
    """A request whose drafts were rejected leaves blocks in the prefix cache;
    a later request that reuses them continues as an engine without a cache."""
    model = tiny_model_dir("llama")
    prompt = _prompts(512)["wrong"]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS + 16, ignore_eos=True)
    first = _run(model, [prompt], greedy)[0][0][0]
    proposer = ScriptedProposer(512)
    proposer.add(prompt, "wrong", first)
    _use_proposer(monkeypatch, proposer)
    monkeypatch.setattr(spec_decode, "LOW_ACCEPTANCE", 0.0)  # rejected drafts at every step
    follow_up = prompt + first + [7, 8]
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(
        model,
        dtype="float32",
        kv_cache_memory_bytes=32 << 20,
        distributed_executor_backend="uni",
        speculative_config=NGRAM,
    ) as llm:
        llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
        cached = llm.generate([{"prompt_token_ids": follow_up}], short, use_tqdm=False)[0]
        stats = llm.llm_engine.stats()
    # Every full block of the first request's computed tokens (all but its last).
    assert stats["prefix_cache_hits"] == 16 * ((len(prompt) + len(first) - 1) // 16)
    assert stats["spec_decode_num_draft_tokens"] > 0
    uncached, _ = _run(model, [follow_up], short, enable_prefix_caching=False)
    assert cached.outputs[0].token_ids == uncached[0][0]


def test_unserved_features_and_large_batches_step_aside(tiny_model_dir, monkeypatch):
    model = tiny_model_dir("llama")
    prompt = _prompts(512)["repeating"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.2),
    ]
    plain, _ = _run(model, [prompt] * 2, params)
    spec, stats = _run(model, [prompt] * 2, params, NGRAM)
    assert [o[:3] for o in spec] == [o[:3] for o in plain]
    assert stats["spec_decode_num_drafts"] == 0
    assert set(stats["spec_decode_steps_aside_by_reason"]) == {"penalties"}

    monkeypatch.setattr(spec_decode, "MAX_SPECULATIVE_BATCH", 1)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain, _ = _run(model, [prompt] * 2, greedy, num_scheduler_steps=1)
    spec, stats = _run(model, [prompt] * 2, greedy, NGRAM, num_scheduler_steps=1)
    assert spec == plain
    assert stats["spec_decode_num_drafts"] == 0
    assert stats["spec_decode_steps_aside_by_reason"]["large_batch"] == stats["spec_decode_num_steps_aside"] > 0


@pytest.mark.parametrize(
    "engine_args,reason",
    [
        pytest.param({"async_scheduling": True}, "async_scheduling", id="async-scheduling"),
        pytest.param({"dtype": "bfloat16"}, "cpu_kernels", id="bf16-cpu-kernels"),
    ],
)
def test_an_engine_that_cannot_speculate_decodes_plainly(engine_args, reason, tiny_model_dir):
    model = tiny_model_dir("llama")
    prompt = _prompts(512)["repeating"]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain, _ = _run(model, [prompt], greedy, **engine_args)
    spec, stats = _run(model, [prompt], greedy, NGRAM, **engine_args)
    assert spec == plain
    assert stats["spec_decode_num_drafts"] == 0
    assert set(stats["spec_decode_steps_aside_by_reason"]) == {reason}


def test_two_tensor_parallel_workers_verify_alike(tiny_model_dir, monkeypatch):
    """The drafts travel to both ranks in the step's message (mp), each verifies
    them; a seeded random row commits the same tokens as without speculation."""
    model = tiny_model_dir("llama")
    prompts = _prompts(512)
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True),
    ]
    tp = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    chosen = [prompts["repeating"], prompts["right"]]
    plain, _ = _run(model, chosen, params, **tp)
    proposer = ScriptedProposer(512)
    proposer.add(prompts["right"], "right", plain[1][0])
    _use_proposer(monkeypatch, proposer)
    spec, stats = _run(model, chosen, params, NGRAM, **tp)
    assert spec == plain
    assert stats["spec_decode_num_accepted_tokens"] > 0


def test_raylm_bench_reports_acceptance(tiny_model_dir):
    from raylm.entrypoints.bench import bench_latency, format_latency

    with LLM(tiny_model_dir("llama"), dtype="float32", kv_cache_memory_bytes=32 << 20, speculative_config=NGRAM) as llm:
        result = bench_latency(llm, input_len=8, output_len=16, batch_size=1, num_iters_warmup=0, num_iters=1)
    spec = result["spec_decode"]
    assert spec["num_draft_tokens"] >= spec["num_accepted_tokens"] and len(spec["num_accepted_tokens_per_pos"]) == K
    assert "Speculative decoding: acceptance" in format_latency(result)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_recovery_mid_decode_gives_the_same_outputs(method, tiny_model_dir):
    """A step that raises mid-decode (a poison request joins): the executor is
    rebuilt, the others recompute and go on speculating; greedy and seeded
    outputs are those of decoding without speculation or failure (a resumed
    seeded request's generator is advanced one draw per committed token).
    A draft model's K/V is rebuilt with the target's (the recompute)."""
    from tests.engine.faulty_executors import POISON, PoisonedUniProcExecutor

    model = tiny_model_dir("llama")
    speculative_config = NGRAM if method == "ngram" else {"method": method, "model": model, "num_speculative_tokens": K}
    prompts = [_prompts(512)["repeating"], _prompts(512)["right"]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True),
    ]
    plain, _ = _run(model, prompts, params)
    with LLM(
        model,
        dtype="float32",
        kv_cache_memory_bytes=32 << 20,
        num_threads=1,
        distributed_executor_backend=PoisonedUniProcExecutor,
        max_restarts=1,
        speculative_config=speculative_config,
    ) as llm:
        engine = llm.llm_engine
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, p)
        core = engine.engine_core.engine_core
        results, struck = {}, False
        while engine.has_unfinished_requests():
            for output in engine.step():
                results[output.request_id] = output
            drafted = core.scheduler.stats()["spec_decode_num_drafts"]
            if not struck and drafted and all(r.num_output_tokens >= 6 for r in core.scheduler.requests.values()):
                engine.add_request("poison", {"prompt_token_ids": [5, POISON, 7]}, params[0])
                struck = True
        assert struck and core.recoveries
        assert results["poison"].outputs[0].finish_reason == "error"
        spec = [results[f"r{i}"].outputs[0] for i in range(len(prompts))]
    assert [(o.token_ids, o.finish_reason) for o in spec] == [o[:2] for o in plain]
