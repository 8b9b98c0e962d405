"""vLLM's token-level sampling knobs through the whole engine: logit_bias,
allowed_token_ids, bad_words, truncate_prompt_tokens and top_k=0.

The oracle is the Hugging Face model itself: a greedy loop that edits each
step's logits the way the knob is documented to (add the bias, mask the
disallowed tokens, ban a bad word's last token), then takes the argmax.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import psutil
import pytest
import torch

from raylm import LLM, SamplingParams
from raylm.distributed.shm_broadcast import SEGMENT_PREFIX
from raylm.testing.hf_oracle import load_hf_model

PROMPT = "The quick brown fox"
MAX_TOKENS = 24
GREEDY = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = dict(temperature=1.0, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)

# (step's logits [V], tokens generated so far) -> None, editing the logits in place.
LogitsEdit = Callable[[torch.Tensor, list[int]], None]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(model):
    with LLM(model, dtype="float32", kv_cache_memory_bytes=32 << 20) as engine:
        yield engine


@torch.inference_mode()
def hf_greedy_edited(model_path: str, prompt: list[int], max_new_tokens: int, edit: LogitsEdit) -> list[int]:
    """Greedy decoding of the HF model with `edit` applied to every step's
    logits. Recomputes the whole sequence each step: slow but obviously right."""
    hf_model = load_hf_model(model_path)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        logits = hf_model(input_ids=torch.tensor([prompt + generated])).logits[0, -1].float().clone()
        edit(logits, generated)
        generated.append(int(torch.argmax(logits)))
    return generated


def _generate(llm, prompt, **params) -> list[int]:
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0].token_ids


def _prompt_ids(llm, text: str = PROMPT) -> list[int]:
    return llm.get_tokenizer().encode(text)


# ---- logit_bias ----------------------------------------------------------------


def test_logit_bias_plus_100_makes_the_token_every_output_token(llm):
    base = _generate(llm, PROMPT, **GREEDY)
    target = next(t for t in range(300, 768) if t not in base)
    assert _generate(llm, PROMPT, **GREEDY, logit_bias={target: 100.0}) == [target] * MAX_TOKENS
    # Values past OpenAI's range are clamped, not rejected.
    assert _generate(llm, PROMPT, **GREEDY, logit_bias={target: 1e6}) == [target] * MAX_TOKENS


def test_logit_bias_minus_100_gives_the_models_second_choice(llm, model):
    prompt = _prompt_ids(llm)
    first_greedy = _generate(llm, PROMPT, **GREEDY)[0]
    hf_logits = load_hf_model(model)(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    best, second = hf_logits.topk(2).indices.tolist()
    assert first_greedy == best

    out = _generate(llm, PROMPT, **GREEDY, logit_bias={best: -100.0})
    assert out[0] == second

    def bias(logits, generated):
        logits[best] -= 100.0

    assert out == hf_greedy_edited(model, prompt, MAX_TOKENS, bias)


# ---- allowed_token_ids -----------------------------------------------------------


def test_allowed_token_ids_bound_every_sampled_token(llm, model):
    allowed = [5, 17, 42, 99, 256, 400, 511, 700]
    sampled = _generate(llm, PROMPT, **SEEDED, allowed_token_ids=allowed)
    assert set(sampled) <= set(allowed)
    assert len(set(sampled)) > 1  # temperature 1 really samples among them

    def mask(logits, generated):
        keep = logits[allowed].clone()
        logits.fill_(float("-inf"))
        logits[allowed] = keep

    greedy = _generate(llm, PROMPT, **GREEDY, allowed_token_ids=allowed)
    assert greedy == hf_greedy_edited(model, _prompt_ids(llm), MAX_TOKENS, mask)


# ---- bad_words -------------------------------------------------------------------


def _single_token_word(tokenizer, token_ids: list[int]) -> tuple[str, set[int]] | None:
    """A word, spelled by one of `token_ids`, whose vLLM variants (bare and
    with a leading space) are all one token: (word, the tokens it bans)."""
    for token_id in token_ids:
        word = tokenizer.decode([token_id]).strip()
        if not word.isalpha():
            continue
        bare = tokenizer.encode(word, add_special_tokens=False)
        spaced = tokenizer.encode(" " + word, add_special_tokens=False)
        variants = [bare] + ([spaced] if len(spaced) == len(bare) and spaced[0] != bare[0] else [])
        if all(len(v) == 1 for v in variants) and token_id in {v[0] for v in variants}:
            return word, {v[0] for v in variants}
    return None


def test_single_token_bad_word_never_appears(llm, model):
    tokenizer = llm.get_tokenizer()
    base = _generate(llm, PROMPT, **GREEDY)
    found = _single_token_word(tokenizer, base)
    assert found is not None, f"no plain word among the greedy tokens {base}"
    word, banned = found
    first = min(base.index(t) for t in banned if t in base)

    out = _generate(llm, PROMPT, **GREEDY, bad_words=[word])
    assert not banned & set(out)
    assert out[:first] == base[:first] and out[first] != base[first]

    def ban(logits, generated):
        logits[list(banned)] = float("-inf")

    assert out == hf_greedy_edited(model, _prompt_ids(llm), MAX_TOKENS, ban)


def test_multi_token_bad_word_bans_its_last_token_only_after_the_rest(llm, model):
    tokenizer = llm.get_tokenizer()
    prompt = "Hello world, this is"
    base = _generate(llm, prompt, **GREEDY)
    # A two-token piece of the greedy output that re-tokenizes to itself,
    # whose second token also occurs elsewhere (where it must stay allowed).
    pair_at = None
    for i in range(len(base) - 1):
        text = tokenizer.decode(base[i : i + 2])
        if text == text.lstrip() and tokenizer.encode(text, add_special_tokens=False) == base[i : i + 2]:
            pair_at = i
            break
    assert pair_at is not None, f"no re-tokenizable pair in {base}"
    pair = base[pair_at : pair_at + 2]
    word = tokenizer.decode(pair)
    spaced = tokenizer.encode(" " + word, add_special_tokens=False)
    sequences = [pair] + ([spaced] if len(spaced) == 2 and spaced[0] != pair[0] else [])

    out = _generate(llm, prompt, **GREEDY, bad_words=[word])
    assert out[: pair_at + 1] == base[: pair_at + 1] and out[pair_at + 1] != pair[1]
    assert all(out[i : i + 2] != seq for seq in sequences for i in range(len(out) - 1))

    def ban(logits, generated):
        for first, last in sequences:
            if generated and generated[-1] == first:
                logits[last] = float("-inf")

    assert out == hf_greedy_edited(model, _prompt_ids(llm, prompt), MAX_TOKENS, ban)


def test_bad_words_are_tokenized_bare_and_with_a_leading_space(llm):
    tokenizer = llm.get_tokenizer()
    processor = llm.llm_engine.input_processor
    word = "side"
    bare = tokenizer.encode(word, add_special_tokens=False)
    spaced = tokenizer.encode(" " + word, add_special_tokens=False)
    expected = [bare] + ([spaced] if len(spaced) == len(bare) and spaced[0] != bare[0] else [])
    # Leading spaces of the word itself are dropped before both spellings.
    params = processor.finish_params(SamplingParams(bad_words=[word, "  " + word]))
    assert params.bad_words_token_ids == expected + expected


# ---- truncate_prompt_tokens -----------------------------------------------------------


def test_truncate_prompt_tokens_equals_the_truncated_prompt(llm):
    ids = _prompt_ids(llm, "Once upon a time there was a quick brown fox who jumped over the lazy dog")
    assert len(ids) > 8
    for params in (GREEDY, SEEDED):
        truncated = llm.generate(
            {"prompt_token_ids": ids}, SamplingParams(**params, truncate_prompt_tokens=6), use_tqdm=False
        )[0]
        assert truncated.prompt_token_ids == ids[-6:]
        assert truncated.outputs[0].token_ids == _generate(llm, {"prompt_token_ids": ids[-6:]}, **params)


def test_truncate_prompt_tokens_applies_before_the_length_check(llm):
    processor = llm.llm_engine.input_processor
    max_len = llm.llm_engine.config.model_config.max_model_len
    too_long = list(range(1, 100)) * (max_len // 99 + 2)
    with pytest.raises(ValueError, match="max_model_len"):
        processor.process_prompt({"prompt_token_ids": too_long})
    kept = processor.process_prompt({"prompt_token_ids": too_long}, SamplingParams(truncate_prompt_tokens=-1))
    assert kept.prompt_token_ids == too_long[-max_len:]
    text = processor.process_prompt(PROMPT, SamplingParams(truncate_prompt_tokens=2))
    assert text.prompt_token_ids == _prompt_ids(llm)[-2:]


# ---- top_k=0 -------------------------------------------------------------------------


def test_top_k_0_means_disabled(llm):
    assert SamplingParams(top_k=0).top_k == -1
    assert _generate(llm, PROMPT, **SEEDED, top_k=0) == _generate(llm, PROMPT, **SEEDED, top_k=-1)


# ---- batches and bad input ----------------------------------------------------------


def test_knobs_stay_on_their_own_rows(llm):
    """Requests with and without the knobs share a batch: each row gets
    exactly the output it gets alone."""
    prompts = [PROMPT, "Hello world, this is", "Once upon a time", PROMPT]
    params = [
        SamplingParams(**GREEDY, logit_bias={300: 100.0}),
        SamplingParams(**GREEDY),
        SamplingParams(**SEEDED, allowed_token_ids=[5, 17, 42]),
        SamplingParams(**SEEDED, bad_words=["men"], top_k=0),
    ]
    batched = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert batched == alone
    assert batched[0] == [300] * MAX_TOKENS and set(batched[2]) <= {5, 17, 42}


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(logit_bias={"5": 1.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={5: "high"}), "logit_bias"),
        (dict(logit_bias={5: float("nan")}), "logit_bias"),
        (dict(logit_bias=[5]), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
        (dict(allowed_token_ids="12"), "allowed_token_ids"),
        (dict(bad_words="word"), "bad_words"),
        (dict(bad_words=["ok", ""]), "bad_words"),
        (dict(bad_words=["ok", 3]), "bad_words"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
        (dict(truncate_prompt_tokens=2.5), "truncate_prompt_tokens"),
        (dict(top_k=-3), "top_k"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_ids_outside_the_vocabulary_name_the_field(llm):
    vocab = llm.llm_engine.config.model_config.vocab_size
    for kwargs, field in (
        (dict(logit_bias={vocab: 1.0}), "logit_bias"),
        (dict(allowed_token_ids=[1, vocab + 5]), "allowed_token_ids"),
    ):
        with pytest.raises(ValueError, match=field):
            llm.generate(PROMPT, SamplingParams(**kwargs), use_tqdm=False)
    # The engine is unharmed.
    assert len(_generate(llm, PROMPT, **GREEDY)) == MAX_TOKENS


def test_fields_survive_the_engine_core_and_worker_codecs(llm):
    """The front end -> engine core request (msgspec) and the scheduler ->
    worker step message (MessageCodec) both re-run __post_init__ on decode:
    every field, and what the front end filled in, must come through."""
    import msgspec

    from raylm.distributed.message_codec import MessageCodec
    from raylm.engine.protocol import EngineCoreRequest
    from raylm.messages import NewRequestData

    params = llm.llm_engine.input_processor.finish_params(
        SamplingParams(
            temperature=0.7,
            top_k=0,
            logit_bias={3: 250.0, 9: -1.5},
            allowed_token_ids=[9, 3, 12],
            bad_words=["side", "men"],
            truncate_prompt_tokens=4,
            min_tokens=2,
        )
    )
    assert params.bad_words_token_ids and params.all_stop_token_ids
    request = EngineCoreRequest("r", [1, 2], params, 0, 0.0)
    via_core = msgspec.msgpack.Decoder(EngineCoreRequest).decode(msgspec.msgpack.encode(request)).sampling_params
    codec = MessageCodec()
    step = NewRequestData("r", [1, 2], [], params, [0], 0)
    via_workers = codec.decode(codec.encode(step)).sampling_params
    for decoded in (via_core, via_workers):
        assert decoded == params
        assert decoded.logit_bias == {3: 100.0, 9: -1.5} and decoded.allowed_token_ids == [3, 9, 12]
        assert decoded.bad_words_token_ids == params.bad_words_token_ids
        assert decoded.all_stop_token_ids == params.all_stop_token_ids  # min_tokens on workers needs EOS


# ---- across processes ----------------------------------------------------------------


def test_fields_cross_to_tensor_parallel_worker_processes(llm, model):
    """TP=2 on the mp backend: SamplingParams travel through the step queues
    to worker processes, which must apply the knobs exactly as one process."""
    prompts = [PROMPT, "Hello world, this is", "Once upon a time", "Once upon a time there was"]
    params = [
        SamplingParams(**GREEDY, logit_bias={300: 100.0}),
        SamplingParams(**SEEDED, allowed_token_ids=[5, 17, 42, 99]),
        SamplingParams(**GREEDY, bad_words=["men", "ngu"]),
        SamplingParams(**SEEDED, top_k=0, truncate_prompt_tokens=3, logit_bias={7: 5.0}),
    ]
    reference = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert reference[0] == [300] * MAX_TOKENS and set(reference[1]) <= {5, 17, 42, 99}
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    segments_before = set(os.listdir("/dev/shm"))
    with LLM(
        model,
        dtype="float32",
        kv_cache_memory_bytes=32 << 20,
        distributed_executor_backend="mp",
        tensor_parallel_size=2,
        num_threads=1,
    ) as tp_llm:
        outputs = [out.outputs[0].token_ids for out in tp_llm.generate(prompts, params, use_tqdm=False)]
        new_children = {p.pid for p in psutil.Process().children(recursive=True)} - children_before
    assert outputs == reference
    # Workers and shared memory are gone; multiprocessing's resource tracker is
    # a per-process singleton that lives until the test process exits.
    assert [pid for pid in new_children if _alive(pid) and not _is_resource_tracker(pid)] == []
    # Other processes on this machine create segments too: look at ours only
    # (raylm names a segment after the pid that created it).
    ours = {f"{SEGMENT_PREFIX}{pid}_" for pid in new_children | {os.getpid()}}
    left = set(os.listdir("/dev/shm")) - segments_before
    assert [name for name in left if name.startswith(tuple(ours))] == []


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _is_resource_tracker(pid: int) -> bool:
    try:
        return any("multiprocessing.resource_tracker" in part for part in psutil.Process(pid).cmdline())
    except psutil.NoSuchProcess:
        return False
