"""Quality of the decode kernel for GGUF weights (csrc/quant_decode.cpp), which
quantizes the activations per block to int8 as llama.cpp does: the perplexity
of the held-out passage with every quantized matmul sent through it (the
prompt's rows too, so the whole passage is scored on its numerics) stays
within the bounds of issue 24 (1% of bf16 for Q8_0, 3% for a Q4_K_M mix)."""

from __future__ import annotations

import pytest

from raylm.config import DEFAULT_MODEL_DIR
from raylm.model.layers import quant_kernels
from raylm.model.layers.cpu_kernels import get_cpu_kernels
from raylm.testing.gguf_writer import write_gguf
from raylm.testing.held_out import q4_k_m
from tests.model.test_quant_quality import perplexity


@pytest.fixture(scope="module")
def bf16_perplexity() -> float:
    return perplexity(str(DEFAULT_MODEL_DIR))


@pytest.mark.parametrize("variant,bound", [("Q8_0", 0.01), ("Q4_K_M", 0.03)])
def test_perplexity_through_the_decode_kernel_stays_near_bf16(variant, bound, bf16_perplexity, tmp_path, monkeypatch):
    module = get_cpu_kernels()
    if module is None or not quant_kernels.packed_kernel_available(module):
        pytest.skip("no AVX-512 VNNI decode kernel in this build")
    monkeypatch.setenv("RAYLM_GGUF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(quant_kernels, "PACKED_MAX_ROWS", 1 << 30)
    rows_seen = []
    plain_linear = quant_kernels._gguf_linear

    def counting_linear(x, state):
        if state.packed is not None:
            rows_seen.append(x.reshape(-1, state.cols).shape[0])
        return plain_linear(x, state)

    monkeypatch.setattr(quant_kernels, "_gguf_linear", counting_linear)
    path = write_gguf(
        DEFAULT_MODEL_DIR,
        tmp_path / "m.gguf",
        "Q8_0" if variant == "Q8_0" else "Q4_K",
        tensor_type=q4_k_m if variant == "Q4_K_M" else None,
    )
    quantized = perplexity(str(path))
    assert rows_seen and max(rows_seen) > 150  # the passage's rows went through the decode kernel
    print(f"{variant} through the decode kernel: perplexity {quantized:.4f}, bf16 {bf16_perplexity:.4f}")
    assert abs(quantized / bf16_perplexity - 1) < bound, (quantized, bf16_perplexity)
