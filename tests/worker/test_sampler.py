"""Sampler checks against plain per-row Python references, on small CPU tensors.

Covers greedy, logprobs, truncation supports, seeded determinism, sampling frequencies, penalties, min_tokens,
allowed_token_ids, bad_words and logit_bias.
"""

from __future__ import annotations

import math

import pytest
import torch

from raylm.sampling_params import SamplingParams
from raylm.worker.sampler import Sampler, apply_penalties, compute_prompt_logprobs, greedy_tokens
from raylm.worker.sampling_metadata import SamplingRow, build_sampling_metadata

VOCAB = 32


def make_rows(params_list, prompts=None, outputs=None, generators=None):
    n = len(params_list)
    prompts = prompts or [[1, 2, 3]] * n
    outputs = outputs or [[] for _ in range(n)]
    generators = generators or [None] * n
    return [
        SamplingRow(params=p, prompt_token_ids=list(pr), output_token_ids=list(out), generator=g)
        for p, pr, out, g in zip(params_list, prompts, outputs, generators)
    ]


def sample(logits, params_list, **kwargs):
    metadata = build_sampling_metadata(make_rows(params_list, **kwargs), logits.shape[1], "cpu")
    return Sampler()(logits, metadata)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax():
    logits = torch.randn(64, VOCAB, generator=seeded(0))
    out = sample(logits, [SamplingParams(temperature=0.0) for _ in range(64)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None


def test_plain_greedy_takes_the_first_maximum_like_the_full_sampler():
    logits = torch.randn(6, VOCAB, generator=seeded(1))
    logits[1] = float("-inf")  # a row a grammar masked out entirely
    logits[2, 3] = logits[2, 9] = logits[2].max() + 1  # a tie: the first one wins
    logits[3, VOCAB - 1] = float("inf")
    metadata = build_sampling_metadata(make_rows([SamplingParams(temperature=0.0)] * 6), VOCAB, "cpu")
    assert metadata.plain_greedy
    expected = Sampler()._sample(logits, metadata)  # the general path's greedy pick
    assert expected[2] == 3
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(greedy_tokens(logits.to(dtype)), Sampler()._sample(logits.to(dtype).float(), metadata))
    assert torch.equal(greedy_tokens(logits), expected)
    assert greedy_tokens(logits).dtype == torch.int64
    assert torch.equal(sample(logits, [SamplingParams(temperature=0.0)] * 6).sampled_token_ids, expected)


@pytest.mark.parametrize(
    "knob",
    [
        {"temperature": 0.5},
        {"logprobs": 0},
        {"repetition_penalty": 1.2},
        {"logit_bias": {3: 1.0}},
        {"allowed_token_ids": [1, 2]},
        {"bad_words_token_ids": [[4]]},
        {"min_tokens": 2, "stop_token_ids": [5]},
    ],
)
def test_plain_greedy_is_off_when_anything_edits_or_reads_the_logits(knob):
    params = SamplingParams(**{"temperature": 0.0, **knob})
    metadata = build_sampling_metadata(make_rows([SamplingParams(temperature=0.0), params]), VOCAB, "cpu")
    assert metadata.all_greedy == (knob.get("temperature", 0.0) == 0.0)
    assert not metadata.plain_greedy


def test_all_greedy_metadata_skips_optional_tensors():
    metadata = build_sampling_metadata(make_rows([SamplingParams(temperature=0.0)] * 4), VOCAB, "cpu")
    assert metadata.all_greedy and not metadata.all_random and metadata.no_penalties
    assert metadata.top_k is None and metadata.top_p is None and metadata.min_p is None
    assert metadata.prompt_token_ids is None and metadata.max_num_logprobs is None


def test_logprobs_are_raw_log_softmax_with_correct_rank():
    torch.manual_seed(1)
    logits = torch.randn(6, VOCAB, generator=seeded(1)) * 3
    # Penalties and temperature must not leak into the reported logprobs.
    params = [
        SamplingParams(temperature=0.7, logprobs=3, repetition_penalty=1.5, presence_penalty=1.0) for _ in range(5)
    ] + [SamplingParams(temperature=0.0, logprobs=1)]
    out = sample(logits, params, outputs=[[4, 5]] * 6)
    lp = out.logprobs
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert lp.token_ids.shape == (6, 4) and lp.logprobs.shape == (6, 4)
    for row in range(6):
        token = int(out.sampled_token_ids[row])
        assert int(lp.token_ids[row, 0]) == token
        order = sorted(range(VOCAB), key=lambda t: -reference[row, t].item())
        assert lp.token_ids[row, 1:].tolist() == order[:3]
        expected = [reference[row, t].item() for t in lp.token_ids[row].tolist()]
        assert lp.logprobs[row].tolist() == pytest.approx(expected, abs=1e-5)
        assert int(lp.ranks[row]) == order.index(token) + 1


def test_compute_prompt_logprobs():
    logits = torch.randn(5, VOCAB, generator=seeded(2))
    targets = torch.tensor([0, 7, 31, 3, 3])
    lp = compute_prompt_logprobs(logits, targets, num_top=2)
    reference = torch.log_softmax(logits.double(), dim=-1)
    for row, target in enumerate(targets.tolist()):
        assert lp.logprobs[row, 0].item() == pytest.approx(reference[row, target].item(), abs=1e-5)
        assert int(lp.ranks[row]) == int((reference[row] > reference[row, target]).sum()) + 1
        assert lp.token_ids[row, 1:].tolist() == reference[row].topk(2).indices.tolist()
    zero_top = compute_prompt_logprobs(logits, targets, num_top=0)
    assert zero_top.token_ids.shape == (5, 1)


def reference_support(logits_row: torch.Tensor, params: SamplingParams) -> set[int]:
    """Brute-force set of tokens a row may sample, in float64 and plain Python."""
    scaled = [x / params.temperature for x in logits_row.double().tolist()]
    order = sorted(range(len(scaled)), key=lambda t: -scaled[t])
    if params.top_k != -1:
        order = order[: params.top_k]
    weights = [math.exp(scaled[t] - scaled[order[0]]) for t in order]
    total = sum(weights)
    kept, mass = [], 0.0
    for token, w in zip(order, weights):
        if mass >= params.top_p:
            break
        kept.append(token)
        mass += w / total
    probs = {t: math.exp(scaled[t] - scaled[kept[0]]) for t in kept}
    norm = sum(probs.values())
    top = max(probs.values()) / norm
    return {t for t in kept if probs[t] / norm >= params.min_p * top}


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.8, top_p=0.6),
        SamplingParams(temperature=1.3, min_p=0.2),
        SamplingParams(temperature=1.0, top_k=10, top_p=0.8, min_p=0.05),
    ],
    ids=["top_k", "top_p", "min_p", "all_three"],
)
def test_truncation_never_leaves_support(params):
    torch.manual_seed(3)
    # Well separated logits keep every boundary away from float rounding.
    row = torch.linspace(3.0, -3.0, VOCAB)[torch.randperm(VOCAB, generator=seeded(4))]
    support = reference_support(row, params)
    assert 1 < len(support) < VOCAB
    draws = 4000
    out = sample(row.expand(draws, VOCAB).clone(), [params] * draws)
    seen = set(out.sampled_token_ids.tolist())
    assert seen <= support
    assert seen == support, "every allowed token should show up in 4000 draws"


def test_seeded_rows_independent_of_batch_neighbours():
    torch.manual_seed(5)
    target_params = SamplingParams(temperature=1.0, top_p=0.9, seed=123)
    steps = 6
    target_logits = [torch.randn(VOCAB, generator=seeded(100 + s)) for s in range(steps)]

    def run(batch_builder):
        generator = seeded(123)
        tokens = []
        for step in range(steps):
            logits, params, generators, position = batch_builder(step, generator)
            out = sample(logits, params, generators=generators)
            tokens.append(int(out.sampled_token_ids[position]))
        return tokens

    def alone(step, generator):
        return target_logits[step].unsqueeze(0), [target_params], [generator], 0

    neighbour_gens = [seeded(900 + i) for i in range(8)]

    def crowded(step, generator):
        logits = torch.randn(8, VOCAB) * 2
        logits[3] = target_logits[step]
        params = [
            SamplingParams(temperature=0.5 + 0.1 * i, seed=900 + i if i % 2 else None, top_k=4 if i == 5 else -1)
            for i in range(8)
        ]
        params[6] = SamplingParams(temperature=0.0)
        params[3] = target_params
        gens = [neighbour_gens[i] if i % 2 else None for i in range(8)]
        gens[3] = generator
        return logits, params, gens, 3

    tokens_alone = run(alone)
    assert tokens_alone == run(crowded)
    assert tokens_alone == run(alone)

    flat = torch.zeros(1, VOCAB)
    other_seed = [
        int(sample(flat, [SamplingParams(seed=7)], generators=[g]).sampled_token_ids)
        for g in [seeded(7)]
        for _ in range(20)
    ]
    this_seed = [
        int(sample(flat, [SamplingParams(seed=8)], generators=[g]).sampled_token_ids)
        for g in [seeded(8)]
        for _ in range(20)
    ]
    assert other_seed != this_seed


def test_temperature_sampling_matches_softmax_frequencies():
    torch.manual_seed(6)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -2.0])
    temperature = 0.8
    draws = 20000
    out = sample(logits.expand(draws, -1).clone(), [SamplingParams(temperature=temperature)] * draws)
    counts = torch.bincount(out.sampled_token_ids, minlength=6).double()
    expected = torch.softmax(logits.double() / temperature, dim=-1) * draws
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    # 5 degrees of freedom: the 99.9% quantile is ~20.5.
    assert chi_square < 20.5, (counts, expected)


def reference_penalties(logits_row, prompt, output, params):
    row = logits_row.double().tolist()
    for token in set(prompt) | set(output):
        p = params.repetition_penalty
        row[token] = row[token] / p if row[token] > 0 else row[token] * p
    for token in set(output):
        row[token] -= params.frequency_penalty * output.count(token)
        row[token] -= params.presence_penalty
    return torch.tensor(row, dtype=torch.float64)


def test_penalties_match_reference():
    gen = seeded(7)
    rows = 5
    logits = torch.randn(rows, VOCAB, generator=gen) * 2
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.7),
        SamplingParams(temperature=0.0, frequency_penalty=0.9),
        SamplingParams(temperature=0.0, presence_penalty=-1.5),
        SamplingParams(temperature=0.0, repetition_penalty=0.6, frequency_penalty=0.4, presence_penalty=1.2),
        SamplingParams(temperature=0.0),
    ]
    prompts = [[1, 2, 3, 2], [5], [], [0, 31, 9, 9, 9, 4, 4], [6, 7]]
    outputs = [[2, 8, 8], [5, 5, 5, 10], [11, 12, 11], [4, 20, 20, 21], [6, 7, 6]]
    metadata = build_sampling_metadata(make_rows(params, prompts=prompts, outputs=outputs), VOCAB, "cpu")
    penalised = apply_penalties(logits.clone(), metadata)
    for i in range(rows):
        expected = reference_penalties(logits[i], prompts[i], outputs[i], params[i])
        torch.testing.assert_close(penalised[i].double(), expected, atol=1e-5, rtol=1e-5)
    out = Sampler()(logits, metadata)
    assert torch.equal(out.sampled_token_ids, penalised.argmax(dim=-1))


def test_penalties_change_greedy_choice():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 1.0
    logits[0, 4] = 0.9
    out = sample(logits, [SamplingParams(temperature=0.0, presence_penalty=0.5)], outputs=[[3]])
    assert int(out.sampled_token_ids) == 4


def test_min_tokens_masks_stop_tokens():
    eos, stop = 0, 5
    logits = torch.zeros(3, VOCAB)
    logits[:, eos] = 10.0
    logits[:, stop] = 9.0
    params = []
    for _ in range(3):
        p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop])
        p.all_stop_token_ids = {eos, stop}
        params.append(p)
    outputs = [[], [7, 7], [7, 7, 7]]
    out = sample(logits, params, outputs=outputs)
    assert int(out.sampled_token_ids[0]) not in (eos, stop)
    assert int(out.sampled_token_ids[1]) not in (eos, stop)
    # min_tokens reached: the stop token is allowed again.
    assert int(out.sampled_token_ids[2]) == eos
    # Random rows too, and the caller's logits are untouched.
    before = logits.clone()
    random_params = SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[stop])
    random_params.all_stop_token_ids = {eos, stop}
    random_out = sample(logits, [random_params] * 3)
    assert torch.equal(logits, before)
    assert not set(random_out.sampled_token_ids.tolist()) & {eos, stop}


def test_mixed_greedy_and_random_batch():
    torch.manual_seed(8)
    logits = torch.randn(8, VOCAB, generator=seeded(9)) * 3
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 == 0 else 1.0, top_k=-1 if i % 2 == 0 else 3, logprobs=2 if i == 1 else None
        )
        for i in range(8)
    ]
    metadata = build_sampling_metadata(make_rows(params), VOCAB, "cpu")
    assert not metadata.all_greedy and not metadata.all_random and metadata.max_num_logprobs == 2
    for _ in range(50):
        tokens = Sampler()(logits, metadata).sampled_token_ids
        greedy = logits.argmax(dim=-1)
        top3 = logits.topk(3, dim=-1).indices
        for i in range(8):
            if i % 2 == 0:
                assert int(tokens[i]) == int(greedy[i])
            else:
                assert int(tokens[i]) in top3[i].tolist()


# ---- allowed_token_ids, bad_words, logit_bias ----------------------------------------


def test_rows_without_token_constraints_build_nothing_for_them():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=0, seed=1)]
    metadata = build_sampling_metadata(make_rows(params), VOCAB, "cpu")
    assert metadata.disallowed_mask is None and metadata.logit_bias is None
    assert metadata.bad_words_token_ids == {}


def test_allowed_token_ids_mask_only_their_rows():
    torch.manual_seed(20)
    logits = torch.randn(4, VOCAB, generator=seeded(20)) * 3
    allowed = [3, 9, 30]
    logits[2, allowed] = 0.0  # equally likely: 200 draws see each of them
    params = [
        SamplingParams(temperature=0.0, allowed_token_ids=allowed),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, allowed_token_ids=allowed),
        SamplingParams(temperature=1.0),
    ]
    metadata = build_sampling_metadata(make_rows(params), VOCAB, "cpu")
    assert metadata.disallowed_mask[[0, 2]].sum(dim=1).tolist() == [VOCAB - 3] * 2
    assert not metadata.disallowed_mask[[1, 3]].any()
    best_allowed = allowed[int(logits[0, allowed].argmax())]
    seen = set()
    for _ in range(200):
        tokens = Sampler()(logits, metadata).sampled_token_ids.tolist()
        assert tokens[0] == best_allowed and tokens[1] == int(logits[1].argmax())
        assert tokens[2] in allowed
        seen.add(tokens[2])
    assert seen == set(allowed)  # every allowed token keeps its chance


def _bad_words_reference(sequences, output):
    """Tokens a row may not sample next, straight from the definition."""
    return {
        seq[-1] for seq in sequences if len(seq) - 1 <= len(output) and output[len(output) - len(seq) + 1 :] == seq[:-1]
    }


def test_bad_words_ban_last_token_after_the_prefix():
    sequences = [[4], [7, 8], [1, 2, 3], [2, 5]]
    outputs = [[], [7], [9, 7], [1, 2], [2], [8, 1, 2], [3, 7, 1]]
    logits = torch.zeros(len(outputs), VOCAB)
    logits[:, [4, 8, 3, 5]] = 5.0  # the banned candidates lead; greedy picks one unless banned
    params = []
    for _ in outputs:
        p = SamplingParams(temperature=0.0)
        p.bad_words_token_ids = sequences
        params.append(p)
    metadata = build_sampling_metadata(make_rows(params, outputs=outputs), VOCAB, "cpu")
    before = logits.clone()
    out = Sampler()(logits, metadata)
    assert torch.equal(logits, before)  # the caller's logits are untouched
    for row, output in enumerate(outputs):
        banned = _bad_words_reference(sequences, output)
        expected = int(
            logits[row]
            .masked_fill(torch.isin(torch.arange(VOCAB), torch.tensor(sorted(banned))), float("-inf"))
            .argmax()
        )
        assert int(out.sampled_token_ids[row]) == expected, (output, banned)


def test_logit_bias_adds_to_raw_logits_and_leaves_logprobs_raw():
    logits = torch.randn(3, VOCAB, generator=seeded(21)) * 2
    biases = [{0: 100.0}, {int(logits[1].argmax()): -100.0, 7: 0.5}, {}]
    params = [SamplingParams(temperature=0.0, logit_bias=b or None, logprobs=2) for b in biases]
    out = sample(logits, params)
    dense = torch.zeros(3, VOCAB)
    for row, bias in enumerate(biases):
        for token_id, value in bias.items():
            dense[row, token_id] = value
    assert out.sampled_token_ids.tolist() == (logits + dense).argmax(dim=-1).tolist()
    assert out.sampled_token_ids.tolist()[0] == 0
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(out.logprobs.logprobs[:, 0], raw.gather(1, out.sampled_token_ids[:, None]).squeeze(1))


def test_top_k_0_is_no_truncation():
    logits = torch.randn(2, VOCAB, generator=seeded(22))
    disabled = sample(
        logits, [SamplingParams(temperature=1.0, top_k=-1)] * 2, generators=[seeded(5), seeded(6)]
    ).sampled_token_ids
    zero = sample(
        logits, [SamplingParams(temperature=1.0, top_k=0)] * 2, generators=[seeded(5), seeded(6)]
    ).sampled_token_ids
    assert torch.equal(disabled, zero)
    assert build_sampling_metadata(make_rows([SamplingParams(top_k=0)]), VOCAB, "cpu").top_k is None
