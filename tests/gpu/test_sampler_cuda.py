"""The sampler on CUDA draws from the same distribution as on CPU (both
against the exact truncated softmax), and greedy rows agree exactly."""

from __future__ import annotations

import pytest
import torch

from raylm.sampling_params import SamplingParams
from raylm.worker.sampler import Sampler
from raylm.worker.sampling_metadata import SamplingRow, build_sampling_metadata

VOCAB = 64
DRAWS = 40_000


def _expected(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The target distribution, the plain way on CPU in float64: the top_k most
    likely tokens, renormalized, then the smallest head of those reaching top_p."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = torch.argsort(probs, descending=True).tolist()[:top_k]
    head = probs[order] / probs[order].sum()
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    mass = 0.0
    for token, p in zip(order, head.tolist()):
        if mass >= top_p:
            break
        keep[token] = True
        mass += p
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


def _frequencies(device: str, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    rows = [SamplingRow(params, [1], []) for _ in range(DRAWS)]
    metadata = build_sampling_metadata(rows, VOCAB, device)
    out = Sampler()(logits.expand(DRAWS, VOCAB).contiguous().to(device), metadata)
    return torch.bincount(out.sampled_token_ids.cpu(), minlength=VOCAB).double() / DRAWS


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, VOCAB, 1.0), (0.7, 10, 1.0), (1.3, VOCAB, 0.8), (0.9, 20, 0.9)],
)
def test_cuda_and_cpu_sample_the_same_distribution(temperature, top_k, top_p):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)) * 2
    params = SamplingParams(temperature=temperature, top_k=top_k if top_k < VOCAB else -1, top_p=top_p)
    expected = _expected(logits, temperature, top_k, top_p)
    torch.manual_seed(1)
    torch.cuda.manual_seed(1)
    cpu = _frequencies("cpu", logits, params)
    cuda = _frequencies("cuda", logits, params)
    # Total-variation distance: with 40k draws over <= 64 tokens the sampling
    # noise is about 0.005; a wrong truncation or temperature moves it far more.
    for name, freq in (("cpu", cpu), ("cuda", cuda)):
        assert 0.5 * (freq - expected).abs().sum() < 0.02, name
        assert freq[expected == 0].sum() == 0, f"{name} sampled a token outside top-k/top-p"
    assert 0.5 * (cpu - cuda).abs().sum() < 0.03


def test_greedy_rows_agree_exactly():
    logits = torch.randn(32, VOCAB, generator=torch.Generator().manual_seed(2))
    rows = [SamplingRow(SamplingParams(temperature=0.0, logprobs=3), [1], []) for _ in range(32)]
    cpu = Sampler()(logits, build_sampling_metadata(rows, VOCAB, "cpu"))
    cuda = Sampler()(logits.cuda(), build_sampling_metadata(rows, VOCAB, "cuda"))
    assert torch.equal(cpu.sampled_token_ids, cuda.sampled_token_ids.cpu())
    torch.testing.assert_close(cpu.logprobs.logprobs, cuda.logprobs.logprobs.cpu(), atol=1e-5, rtol=1e-5)


def test_seeded_rows_repeat_on_cuda():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))

    def draw():
        rows = [
            SamplingRow(SamplingParams(temperature=1.0, seed=s), [1], [], torch.Generator(device="cuda").manual_seed(s))
            for s in range(4)
        ]
        return Sampler()(logits.cuda(), build_sampling_metadata(rows, VOCAB, "cuda")).sampled_token_ids.cpu()

    assert torch.equal(draw(), draw())
