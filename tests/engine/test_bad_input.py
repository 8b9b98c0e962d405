"""Bad input raises ValueError naming the field, and the engine keeps serving."""

from __future__ import annotations

import pytest
import torch

from raylm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=64, kv_cache_memory_bytes=16 << 20) as engine:
        yield engine


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),  # 0 and -1 both mean "no top-k", as in vLLM
        ({"top_k": 1.5}, "top_k"),
        ({"n": 0}, "n"),
        ({"min_p": 2.0}, "min_p"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "prompt, field",
    [
        ("", "prompt"),
        ({"prompt_token_ids": []}, "prompt"),
        ({"prompt_token_ids": [1, 2, 10**6]}, "prompt_token_ids"),
        ({"prompt_token_ids": [-1]}, "prompt_token_ids"),
        ({"prompt_token_ids": [1] * 65}, "max_model_len"),
        (12, "prompt"),
    ],
)
def test_bad_prompt_then_engine_still_serves(llm, prompt, field):
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match=field):
        llm.generate(["fine prompt", prompt], good, use_tqdm=False)
    # Nothing of the failed batch was left in the engine.
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate("fine prompt", good, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_out_of_vocab_stop_token(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate("x", SamplingParams(stop_token_ids=[10**7]), use_tqdm=False)


def test_unknown_model_path(tmp_path):
    with pytest.raises(ValueError, match="model path"):
        LLM(str(tmp_path / "nope"))


def test_unsupported_architecture(tiny_model_dir, tmp_path):
    import json
    import shutil

    folder = tmp_path / "gpt"
    shutil.copytree(tiny_model_dir("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="LlamaForCausalLM") as err:
        LLM(str(folder))
    assert "Qwen3ForCausalLM" in str(err.value) and "MistralForCausalLM" in str(err.value)


def test_corrupt_safetensors(tiny_model_dir, tmp_path):
    import shutil

    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_model_dir("llama"), folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(folder), kv_cache_memory_bytes=16 << 20)


def test_bad_engine_arguments(tiny_model_dir):
    model = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="dtype"):
        LLM(model, dtype="int3")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model, max_model_len=10**6)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        LLM(model, distributed_executor_backend="carrier-pigeon")


# ---- Bounds on what one request may ask for (issue 20) ---------------------------

from raylm.sampling_params import (  # noqa: E402
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_BAD_WORDS_TOTAL_CHARS,
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_PROMPT_LOGPROBS_ENTRIES,
    MAX_STOP_TOKEN_IDS,
    StructuredOutputsParams,
)
from raylm.worker.sampler import apply_bad_words  # noqa: E402
from raylm.worker.sampling_metadata import BadWordsIndex  # noqa: E402


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"bad_words": ["w"] * (MAX_BAD_WORDS + 1)}, "bad_words"),
        ({"bad_words": ["w" * (MAX_BAD_WORD_CHARS + 1)]}, "bad_words"),
        (
            {"bad_words": ["w" * MAX_BAD_WORD_CHARS] * (MAX_BAD_WORDS_TOTAL_CHARS // MAX_BAD_WORD_CHARS + 1)},
            "bad_words",
        ),
        ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
    ],
)
def test_oversized_token_constraints_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kwargs)


def test_stop_token_ids_are_deduplicated_before_the_cap():
    params = SamplingParams(stop_token_ids=[5, 3, 5] * MAX_STOP_TOKEN_IDS)
    assert params.stop_token_ids == [5, 3]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"json": {"type": "object", "description": "x" * MAX_GRAMMAR_CHARS}}, "structured_outputs.json"),
        ({"regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, "structured_outputs.regex"),
        ({"grammar": "root ::= " + '"a" ' * MAX_GRAMMAR_CHARS}, "structured_outputs.grammar"),
        ({"choice": ["c"] * (MAX_CHOICES + 1)}, "structured_outputs.choice"),
        ({"choice": ["c" * 1000] * (MAX_GRAMMAR_CHARS // 1000 + 1)}, "structured_outputs.choice"),
    ],
)
def test_oversized_grammars_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        StructuredOutputsParams(**kwargs)


def test_prompt_logprobs_past_the_cap_are_refused_and_engine_serves(llm):
    # The tiny engine's 64-token context cannot reach the cap by length alone;
    # prompt_logprobs (top k) large enough to does, and is refused before the
    # vocabulary check would pass it.
    positions = 40
    k = MAX_PROMPT_LOGPROBS_ENTRIES // positions
    with pytest.raises(ValueError, match="^prompt_logprobs"):
        llm.generate(
            {"prompt_token_ids": [1] * positions}, SamplingParams(max_tokens=1, prompt_logprobs=k), use_tqdm=False
        )
    out = llm.generate(
        {"prompt_token_ids": [1] * positions}, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False
    )
    assert len(out[0].prompt_logprobs) == positions


def test_bad_words_at_the_cap_still_generate(llm):
    """MAX_BAD_WORDS words, tokenized once, ban what they should: greedy
    output without them is what it was, with the first generated token's
    text banned it changes."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    free = llm.generate("ROMEO:", greedy, use_tqdm=False)[0].outputs[0]
    filler = [f"zqxj{i}" for i in range(MAX_BAD_WORDS - 1)]
    kept = llm.generate(
        "ROMEO:", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, bad_words=filler), use_tqdm=False
    )[0].outputs[0]
    assert kept.token_ids == free.token_ids  # words the model never writes change nothing
    first = llm.get_tokenizer().decode(free.token_ids[:1]).strip()
    if first:
        banned = llm.generate(
            "ROMEO:",
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, bad_words=filler + [first]),
            use_tqdm=False,
        )[0].outputs[0]
        assert banned.token_ids[0] != free.token_ids[0]


def _reference_banned(sequences, output):
    """Tokens a row may not sample next, straight from the definition."""
    return {
        seq[-1] for seq in sequences if len(seq) - 1 <= len(output) and output[len(output) - len(seq) + 1 :] == seq[:-1]
    }


def test_bad_words_index_matches_the_definition_and_looks_only_at_candidates():
    gen = torch.Generator().manual_seed(7)
    vocab = 50
    sequences = [
        torch.randint(0, vocab, (int(n),), generator=gen).tolist()
        for n in torch.randint(1, 4, (2 * MAX_BAD_WORDS,), generator=gen)
    ]
    index = BadWordsIndex(sequences)
    for _ in range(200):
        output = torch.randint(0, vocab, (int(torch.randint(0, 6, (1,), generator=gen)),), generator=gen).tolist()
        logits = torch.zeros(1, vocab)
        apply_bad_words(logits, {0: index}, [output])
        banned = set(torch.nonzero(torch.isinf(logits[0])).flatten().tolist())
        assert banned == _reference_banned(sequences, output)
    # A step examines the words whose prefix ends with the output's last token
    # (here ~1/vocab of the multi-token ones), never the whole list.
    multi = [s for s in sequences if len(s) > 1]
    assert max(len(v) for v in index.by_prefix_end.values()) < len(multi) / 10


@pytest.mark.parametrize(
    "field, value", [("seed", 2**70), ("n", 2**70), ("max_tokens", 2**64), ("top_k", -(2**63) - 1), ("n", 129)]
)
def test_integers_past_what_the_engine_carries_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
