"""Our Llama-family model against Hugging Face transformers on identical weights:
full-sequence float32 logits (plain causal attention, no engine context)."""

from __future__ import annotations

import pytest
import torch

from raylm.model.loader import load_model
from raylm.testing import load_hf_model, make_tiny_model

SEQ_LEN = 24

CASES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "llama-gqa-kv1": ("llama", {"num_key_value_heads": 1}),
    "llama-rope-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "llama-rope-llama3": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama-untied-bias": ("llama", {"tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
}


def _tokens(vocab_size: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (SEQ_LEN,), generator=generator)


@pytest.mark.parametrize("case", list(CASES))
@torch.inference_mode()
def test_logits_match_transformers(case, tmp_path):
    arch, overrides = CASES[case]
    folder = make_tiny_model(arch, tmp_path / case, seed=3, **overrides)
    ours = load_model(folder, torch.float32, "cpu")
    hf = load_hf_model(folder, torch.float32)
    input_ids = _tokens(hf.config.vocab_size)

    hidden = ours(input_ids, torch.arange(SEQ_LEN))
    logits = ours.compute_logits(hidden)
    expected = hf(input_ids=input_ids[None]).logits[0].float()

    assert logits.dtype == torch.float32
    assert logits.shape == expected.shape == (SEQ_LEN, hf.config.vocab_size)
    # Guard against a vacuous comparison: the tiny model's logits must not be flat.
    assert expected.std() > 0.1
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@torch.inference_mode()
def test_rotary_depends_only_on_each_tokens_position(tmp_path):
    """A token's rotation comes from its own entry in `positions`, not from its row in
    the flat batch (decode tokens arrive one by one at arbitrary positions)."""
    folder = make_tiny_model("qwen3", tmp_path / "m", seed=5)
    ours = load_model(folder, torch.float32, "cpu")
    rotary = ours.model.rotary_emb
    q = torch.randn(4, 4 * 32)
    k = torch.randn(4, 2 * 32)
    positions = torch.tensor([0, 7, 100, 1000])
    q_all, k_all = rotary(positions, q, k)
    for i in range(4):
        q_one, k_one = rotary(positions[i : i + 1], q[i : i + 1], k[i : i + 1])
        torch.testing.assert_close(q_one, q_all[i : i + 1])
        torch.testing.assert_close(k_one, k_all[i : i + 1])
    # Position 0 is the identity rotation.
    torch.testing.assert_close(q_all[0], q[0])
