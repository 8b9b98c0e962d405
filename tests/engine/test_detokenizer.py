"""Tests for incremental detokenization and stop strings, against Hugging Face's full decode.
Small tokenizers are trained here so that multi-byte characters split across tokens."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from raylm.engine.detokenizer import IncrementalDetokenizer, detokenize_logprobs
from raylm.testing.tiny_models import build_tiny_tokenizer

REPLACEMENT = "\ufffd"
EOS, PAD = "<|eos|>", "<|pad|>"

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world!",
    "Héllo wörld, café naïve résumé, déjà vu, Ærøskøbing, ñandú.",
    "日本語のテキストです。東京は大きい都市です。中文也可以。",
    "emoji 😀🎉 test 👍🏽 and 👨‍👩‍👧 family, ❤️ love",
    "Stop words: STOP, END, ###, and the end of text.",
]

# Characters for random strings: some are merged into one token by training, the
# rest (rare CJK, emoji) stay split into byte tokens.
CHAR_POOL = (
    list("abcdefghij klmnop ,.!?\n")
    + list("éöïçñÆø")
    + list("日本語東京龍鬱")
    + [
        "😀",
        "🎉",
        "👍🏽",
        "🦀",
        "👨‍👩‍👧",
        "❤️",
        "𝔘",
    ]
)


@pytest.fixture(scope="module")
def hf_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 10, trainer)
    tokenizer.add_tokens(["<tool>"])  # an added token that is not special
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS, pad_token=PAD, clean_up_tokenization_spaces=False
    )


@pytest.fixture(scope="module")
def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2 style tokenizer: "▁" word marks, and unknown characters spelled as <0xNN> byte tokens."""
    marks = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = marks
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    trained.train_from_iterator(CORPUS * 10, trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = marks
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def random_texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = [line for line in CORPUS]
    for _ in range(count):
        texts.append("".join(rng.choice(CHAR_POOL) for _ in range(rng.randint(1, 40))))
    return texts


def encode(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def feed(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> list[str | None]:
    """Feed ``ids`` in chunks of the given sizes; returns what each update said."""
    results, pos = [], 0
    for size in chunks:
        results.append(detok.update(ids[pos : pos + size]))
        pos += size
    assert pos == len(ids)
    return results


def random_chunks(rng: random.Random, total: int) -> list[int]:
    chunks = []
    while total > 0:
        size = min(total, rng.randint(1, 4))
        chunks.append(size)
        total -= size
    return chunks


def test_tokenizer_splits_characters_across_tokens(hf_tokenizer):
    # Guards the other tests: they only mean something if some tokens hold partial characters.
    ids = encode(hf_tokenizer, "龍🦀👨‍👩‍👧")
    singles = [hf_tokenizer.decode([i]) for i in ids]
    assert any(REPLACEMENT in s for s in singles)
    assert hf_tokenizer.decode(ids) == "龍🦀👨‍👩‍👧"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_one_token_at_a_time_matches_full_decode(hf_tokenizer, skip_special_tokens):
    prompt = encode(hf_tokenizer, "Prompt: 日本 ")
    for text in random_texts(60, seed=1):
        ids = encode(hf_tokenizer, text)
        expected = hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        detok = IncrementalDetokenizer(hf_tokenizer, prompt, skip_special_tokens=skip_special_tokens)
        for i, token_id in enumerate(ids):
            assert detok.update([token_id]) is None
            # The text so far up to its last whole character: no stray U+FFFD, nothing rewritten.
            so_far = hf_tokenizer.decode(ids[: i + 1], skip_special_tokens=skip_special_tokens)
            assert detok.output_text == so_far.rstrip(REPLACEMENT), (text, i)
            assert expected.startswith(detok.output_text)
        assert detok.get_next_output_text(finished=True, delta=False) == expected
        assert detok.output_text == expected
        assert detok.token_ids == ids


def test_byte_fallback_tokenizer(byte_fallback_tokenizer):
    tok = byte_fallback_tokenizer
    # An incomplete character decodes to one U+FFFD per byte token here, not one per character.
    assert tok.decode(encode(tok, "龍")[:3]).count(REPLACEMENT) == 2
    prompt = encode(tok, "Hello there")
    for text in random_texts(40, seed=6):
        ids = encode(tok, text)
        for context in ([], prompt):
            # With a prompt the first word keeps its leading space, as in the decode of prompt + output.
            full = tok.decode(context + ids)
            expected = full[len(tok.decode(context)) :]
            detok = IncrementalDetokenizer(tok, context)
            for token_id in ids:
                detok.update([token_id])
                assert expected.startswith(detok.output_text)
                assert REPLACEMENT not in detok.output_text
            assert detok.get_next_output_text(finished=True, delta=False) == expected


def test_random_chunks_match_full_decode(hf_tokenizer):
    rng = random.Random(2)
    for text in random_texts(60, seed=3):
        ids = encode(hf_tokenizer, text)
        expected = hf_tokenizer.decode(ids, skip_special_tokens=True)
        detok = IncrementalDetokenizer(hf_tokenizer, encode(hf_tokenizer, "Hi"))
        pos = 0
        for size in random_chunks(rng, len(ids)):
            detok.update(ids[pos : pos + size])
            pos += size
            assert expected.startswith(detok.output_text)
            if REPLACEMENT not in expected:
                assert REPLACEMENT not in detok.output_text
        assert detok.get_next_output_text(finished=True, delta=False) == expected


def test_the_text_does_not_depend_on_how_tokens_are_grouped():
    """A decode burst delivers several tokens per update, a step one: the text
    must be the same either way. Here runs of byte tokens that never make a
    character are released as U+FFFD after a few tokens, and where a release
    falls decides what the bytes around it become; taken several at a time,
    the release fell elsewhere (a tiny model's greedy output, which made a
    recovered stream's text differ from an uninterrupted one)."""
    tok = build_tiny_tokenizer()
    ids = [127] * 97 + [309, 26] + [141] * 38 + [241]
    prompt = tok.encode("Story 8: once upon a time")
    single = IncrementalDetokenizer(tok, prompt)
    for token_id in ids:
        single.update([token_id])
    expected = single.get_next_output_text(finished=True, delta=False)
    rng = random.Random(1)
    for trial in range(60):
        grouped, deltas, pos = IncrementalDetokenizer(tok, prompt), "", 0
        while pos < len(ids):
            size = rng.randint(1, 12)
            grouped.update(ids[pos : pos + size])
            pos += size
            deltas += grouped.get_next_output_text(finished=False, delta=True)
        deltas += grouped.get_next_output_text(finished=True, delta=True)
        assert deltas == expected, trial


def test_prompt_not_in_output(hf_tokenizer):
    prompt = encode(hf_tokenizer, "The quick brown fox")
    output = encode(hf_tokenizer, " jumps over 😀")
    detok = IncrementalDetokenizer(hf_tokenizer, prompt)
    feed(detok, output, [1] * len(output))
    assert detok.get_next_output_text(finished=True, delta=False) == " jumps over 😀"


def test_prompt_ending_inside_a_character(hf_tokenizer):
    # The prompt holds the first bytes of a character and the output the rest:
    # the prompt's text must not leak in; the output decodes like Hugging Face's decode of it.
    ids = encode(hf_tokenizer, "ab 龍鬱 x")
    cuts = [cut for cut in range(1, len(ids)) if hf_tokenizer.decode(ids[:cut]).endswith(REPLACEMENT)]
    assert cuts
    for cut in cuts:
        detok = IncrementalDetokenizer(hf_tokenizer, ids[:cut])
        feed(detok, ids[cut:], [1] * (len(ids) - cut))
        expected = hf_tokenizer.decode(ids[cut:])
        assert "ab" not in detok.output_text
        assert detok.get_next_output_text(finished=True, delta=False) == expected


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens(hf_tokenizer, skip_special_tokens):
    eos, pad = hf_tokenizer.convert_tokens_to_ids([EOS, PAD])
    tool = hf_tokenizer.convert_tokens_to_ids("<tool>")
    ids = [pad] + encode(hf_tokenizer, "café") + [tool] + encode(hf_tokenizer, " 龍") + [eos]
    expected = hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    detok = IncrementalDetokenizer(
        hf_tokenizer, [eos] + encode(hf_tokenizer, "x"), skip_special_tokens=skip_special_tokens
    )
    feed(detok, ids, [1] * len(ids))
    text = detok.get_next_output_text(finished=True, delta=False)
    assert text == expected
    assert (EOS in text) is (not skip_special_tokens)
    assert "<tool>" in text


def first_token_count_containing(tok, ids: list[int], stop: str) -> int:
    """Reference: how many tokens it takes for the full decode to contain ``stop``."""
    for k in range(1, len(ids) + 1):
        if stop in tok.decode(ids[:k]):
            return k
    raise AssertionError("stop string never appears")


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize(
    "text,stop",
    [
        ("Hello world, this is the END of it", "END of"),
        ("Some text with 日本語東京 inside", "語東"),
        ("emoji 🦀🎉 then more", "🦀🎉 t"),
        ("déjà vu, naïve café", "à vu, n"),
    ],
)
def test_stop_string_spanning_tokens(hf_tokenizer, text, stop, include_stop):
    ids = encode(hf_tokenizer, text)
    k = first_token_count_containing(hf_tokenizer, ids, stop)
    # The stop string spans several tokens, so it starts in an earlier delta than it ends.
    assert stop not in hf_tokenizer.decode(ids[k - 1 : k])
    full = hf_tokenizer.decode(ids)
    position = full.index(stop)
    expected = full[: position + len(stop)] if include_stop else full[:position]

    detok = IncrementalDetokenizer(
        hf_tokenizer, encode(hf_tokenizer, "P:"), stop=["zzz", stop], include_stop_str_in_output=include_stop
    )
    results = feed(detok, ids[:k], [1] * k)
    assert results[:-1] == [None] * (k - 1)
    assert results[-1] == stop
    assert detok.matched_stop == stop
    assert detok.output_text == expected
    assert detok.get_next_output_text(finished=True, delta=False) == expected


def test_single_stop_string_given_as_str(hf_tokenizer):
    detok = IncrementalDetokenizer(hf_tokenizer, [], stop="xyz")
    assert detok.update(encode(hf_tokenizer, "abc xyz more")) == "xyz"
    assert detok.output_text == "abc "


def test_earliest_stop_string_wins(hf_tokenizer):
    ids = encode(hf_tokenizer, "abc xyz")
    detok = IncrementalDetokenizer(hf_tokenizer, [], stop=["xyz", "c x"])
    detok.update(ids)
    assert detok.matched_stop == "c x"
    assert detok.output_text == "ab"


@pytest.mark.parametrize("include_stop", [False, True])
def test_streamed_deltas_hold_back_stop_strings(hf_tokenizer, include_stop):
    rng = random.Random(4)
    stops = ["END of", "🦀🎉", "日本語"]
    texts = [
        "Hello world, this is the END of it",
        "emoji 😀 🦀🎉 then more",
        "ab 日本 日本 日本語 more text",
        "no stop string appears in here at all é",
    ]
    for text in texts:
        ids = encode(hf_tokenizer, text)
        full = hf_tokenizer.decode(ids)
        hits = [(full.index(s), s) for s in stops if s in full]
        if hits:
            position, stop = min(hits)
            final = full[: position + len(stop)] if include_stop else full[:position]
        else:
            stop, final = None, full
        # Streamed text before the stop completes may never reach into the stop string.
        safe = full[:position] if hits else full

        for _ in range(3):
            detok = IncrementalDetokenizer(
                hf_tokenizer, encode(hf_tokenizer, "Q"), stop=stops, include_stop_str_in_output=include_stop
            )
            streamed, pos, matched = "", 0, None
            for size in random_chunks(rng, len(ids)):
                matched = detok.update(ids[pos : pos + size])
                pos += size
                finished = matched is not None or pos == len(ids)
                streamed += detok.get_next_output_text(finished=finished, delta=True)
                if finished:
                    break
                assert safe.startswith(streamed), (streamed, safe)
                assert detok.get_next_output_text(finished=False, delta=False) == streamed
            assert matched == stop
            assert streamed == final == detok.output_text
            assert detok.get_next_output_text(finished=True, delta=True) == ""


def test_holdback_releases_when_finished(hf_tokenizer):
    detok = IncrementalDetokenizer(hf_tokenizer, [], stop=["12345"])
    detok.update(encode(hf_tokenizer, "hello"))
    assert detok.output_text == "hello"
    assert detok.get_next_output_text(finished=False, delta=True) == "h"
    assert detok.get_next_output_text(finished=True, delta=True) == "ello"


def test_finish_inside_a_character_matches_full_decode(hf_tokenizer):
    ids = encode(hf_tokenizer, "x 龍🦀")
    for cut in range(1, len(ids) + 1):
        partial = ids[:cut]
        expected = hf_tokenizer.decode(partial)
        detok = IncrementalDetokenizer(hf_tokenizer, [])
        detok.update(partial)
        assert REPLACEMENT not in detok.output_text
        assert expected.startswith(detok.output_text)
        # Finishing (e.g. at max_tokens) mid-character keeps the bytes, as the full decode shows them.
        assert detok.get_next_output_text(finished=True, delta=False) == expected


def lone_continuation_byte(tok: PreTrainedTokenizerFast) -> int:
    """A token holding a single UTF-8 continuation byte (it can never start a character)."""
    for token_id in range(len(tok)):
        if tok.decode([token_id]) == REPLACEMENT and tok.decode([token_id] * 3) == REPLACEMENT * 3:
            return token_id
    raise AssertionError("no lone continuation byte token")


def test_bytes_that_never_complete_are_released(hf_tokenizer):
    stray = lone_continuation_byte(hf_tokenizer)
    ids = encode(hf_tokenizer, "ok ") + [stray] * 100 + encode(hf_tokenizer, " after")
    detok = IncrementalDetokenizer(hf_tokenizer, [])
    for i, token_id in enumerate(ids):
        detok.update([token_id])
        assert hf_tokenizer.decode(ids[: i + 1]).startswith(detok.output_text)
        # Undecodable bytes are released after a few tokens, so the window stays small.
        assert len(detok._window_ids) - detok._prefix_offset <= 24
    assert detok.get_next_output_text(finished=True, delta=False) == hf_tokenizer.decode(ids)


def test_window_stays_small_on_long_outputs(hf_tokenizer):
    ids = encode(hf_tokenizer, " ".join(random_texts(40, seed=5)))
    assert len(ids) > 500
    detok = IncrementalDetokenizer(hf_tokenizer, encode(hf_tokenizer, "Go"))
    longest_window = 0
    for token_id in ids:
        detok.update([token_id])
        longest_window = max(longest_window, len(detok._window_ids) - detok._prefix_offset)
        assert len(detok._window_ids) <= 64
    assert longest_window <= 12
    assert detok.get_next_output_text(finished=True, delta=False) == hf_tokenizer.decode(ids)


def test_detokenize_logprobs(hf_tokenizer):
    ids = encode(hf_tokenizer, "café 龍 ok") + [hf_tokenizer.eos_token_id]
    assert detokenize_logprobs(hf_tokenizer, ids) == [hf_tokenizer.decode([i]) for i in ids]
    assert detokenize_logprobs(hf_tokenizer, []) == []


def test_non_fast_tokenizer_rejected():
    with pytest.raises(TypeError, match="fast tokenizer"):
        IncrementalDetokenizer(object(), [1, 2])
