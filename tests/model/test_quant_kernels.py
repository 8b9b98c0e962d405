"""The CPU kernels that multiply by GGUF-quantized weights (csrc/quant_gemm.cpp)
against `gguf.quants.dequantize`, the format's own decoder: decode-sized row
counts (the register-tiled path, with and without a remainder row), prefill
sizes (the weight widened once for a float matmul), float32 and bfloat16
activations; and the model keeps such weights quantized when they run there."""

from __future__ import annotations

import shutil
import sysconfig

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from raylm.model.layers import quant_kernels
from raylm.model.layers.cpu_kernels import get_cpu_kernels
from raylm.model.layers.quant_linear import QuantSegment
from raylm.model.quantization import QuantizedWeight, quant_type
from raylm.testing.kquants import quantize_q4_k, quantize_q6_k

_HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++", sysconfig.get_config_var("CXX") or "c++"))
pytestmark = pytest.mark.skipif(not _HAS_COMPILER, reason="no C++ compiler to build the CPU kernels")

ENCODERS = {
    "Q8_0": lambda w: quants.quantize(w, T.Q8_0),
    "Q4_0": lambda w: quants.quantize(w, T.Q4_0),
    "Q4_K": quantize_q4_k,
    "Q6_K": quantize_q6_k,
}


@pytest.fixture(scope="module")
def kernels():
    module = get_cpu_kernels()
    assert module is not None, "a C++ compiler is present, so the kernels must build"
    return module


def _weight(qtype: str, rows: int = 40, cols: int = 512) -> tuple[QuantizedWeight, torch.Tensor]:
    w = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
    data = ENCODERS[qtype](w)
    reference = torch.from_numpy(quants.dequantize(data, T[qtype]))
    return QuantizedWeight(quant_type(qtype), torch.from_numpy(data), cols), reference


@pytest.mark.parametrize("qtype", list(ENCODERS))
def test_dequantize_equals_the_gguf_decoder(qtype, kernels):
    weight, reference = _weight(qtype)
    code = quant_kernels.GGUF_TYPE_CODES[qtype]
    assert torch.equal(kernels.quant_dequantize(weight.data, code, weight.cols, torch.float32), reference)
    assert torch.equal(kernels.quant_dequantize(weight.data, code, weight.cols, torch.bfloat16),
                       reference.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 9, quant_kernels.WIDEN_FROM_ROWS + 1])
@pytest.mark.parametrize("qtype", list(ENCODERS))
def test_matmul_equals_a_float_matmul_on_the_decoded_weight(qtype, rows, dtype, kernels):
    weight, reference = _weight(qtype)
    kernel = quant_kernels.kernel_for(qtype, torch.device("cpu"), dtype)
    assert kernel is not None
    x = torch.randn(rows, weight.cols, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = kernel.linear(x, kernel.prepare(weight))
    assert got.dtype == dtype and got.shape == (rows, weight.shape[0])
    expected = x.float() @ reference.t()
    # float32: summation order only; bfloat16: the output's rounding (and, past
    # WIDEN_FROM_ROWS, the weight's rounding to bf16 for the float matmul).
    tolerance = dict(atol=1e-3, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.3, rtol=2e-2)
    torch.testing.assert_close(got.float(), expected, **tolerance)


def test_model_layers_keep_gguf_weights_quantized(tmp_path, tiny_model_dir, kernels):
    from raylm.model.loader import load_model
    from raylm.testing.gguf_writer import write_gguf

    folder = tiny_model_dir("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=2)
    path = write_gguf(folder, tmp_path / "m.gguf", tensor_type=lambda name, shape: "Q6_K" if "attn_v" in name
                      else "Q4_K")
    model = load_model(str(path), torch.bfloat16, "cpu")
    qkv = model.model.layers[0].self_attn.qkv_proj
    # q and k merged into one Q4_K segment, v its own Q6_K one: no float copy.
    assert [type(s) for s in qkv.quant_matmul.segments] == [QuantSegment, QuantSegment]
    assert [s.weight.qtype.name for s in qkv.quant_matmul.segments] == ["Q4_K", "Q6_K"]
    assert qkv.weight.numel() == 0
