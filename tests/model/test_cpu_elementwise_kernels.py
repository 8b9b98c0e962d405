"""The fused CPU kernels of the Llama block (SiLU-and-mul, RMSNorm with the
residual add, neox rotary) against the torch ops they replace, through the
layers that use them: bf16 and fp16 round where torch rounds, so they agree
to the bit except where a float exp or sum differs in its last bit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from raylm.model.arch_config import RopeScaling
from raylm.model.layers import activation, layernorm, rotary
from raylm.model.layers.activation import SiluAndMul
from raylm.model.layers.cpu_kernels import DISABLE_ENV
from raylm.model.layers.layernorm import RMSNorm
from raylm.model.layers.rotary import RotaryEmbedding
from tests.model.cpu_kernel_utils import needs_compiler

pytestmark = needs_compiler

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def counted(kernels, monkeypatch):
    """Counts the kernel calls each layer makes (by op name)."""
    calls: dict[str, int] = {}

    def counting(name):
        def call(*args):
            calls[name] = calls.get(name, 0) + 1
            return getattr(kernels, name)(*args)

        return call

    wrapper = SimpleNamespace(**{n: counting(n) for n in ("silu_and_mul", "rms_norm", "add_rms_norm", "rotary_neox")})
    for module in (activation, layernorm, rotary):
        real = module.elementwise_kernels_for
        monkeypatch.setattr(module, "elementwise_kernels_for", lambda x, real=real: wrapper if real(x) else None)
    return calls


def _torch_path(fn, monkeypatch):
    with monkeypatch.context() as m:
        m.setenv(DISABLE_ENV, "1")
        return fn()


def _assert_matches(out, ref, dtype, exact_share: float = 1.0):
    """fp32: within float rounding. bf16/fp16: at least `exact_share` of the
    elements equal to the bit, the rest within one unit of the last place."""
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        return
    assert (out == ref).float().mean().item() >= exact_share
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-3, rtol=ulp)


@pytest.mark.parametrize("width", [344, 341])  # a multiple of the kernel's 8 lanes, and one with a tail
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype, width, counted, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(67, 2 * width, generator=gen) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated exp, both signs; zeros
    special = torch.tensor([float("inf"), float("-inf"), float("nan")])
    gate_up[1, :3] = special  # in the vectorised body
    gate_up[2, width - 3 : width] = special  # in the tail, where there is one
    act = SiluAndMul()
    out = act(gate_up)
    assert counted == {"silu_and_mul": 1}
    ref = _torch_path(lambda: act(gate_up), monkeypatch)
    assert torch.equal(out.isnan(), ref.isnan())  # silu(-inf) and silu(nan) are NaN in both
    _assert_matches(out.nan_to_num(0.0), ref.nan_to_num(0.0), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_residual(dtype, counted, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    with torch.device("cpu"):
        norm = RMSNorm(256, eps=1e-5)
    norm.weight.data = torch.randn(256, generator=gen).to(dtype)
    # Rows of a wider tensor (strided), as the norm of a slice would get them.
    x = torch.randn(53, 300, generator=gen).to(dtype)[:, :256]
    residual = torch.randn(53, 256, generator=gen).to(dtype)

    out = norm(x)
    ref = _torch_path(lambda: norm(x), monkeypatch)
    _assert_matches(out, ref, dtype, exact_share=0.99)

    out, summed = norm(x, residual)
    ref, ref_summed = _torch_path(lambda: norm(x, residual), monkeypatch)
    _assert_matches(summed, ref_summed, dtype)
    _assert_matches(out, ref, dtype, exact_share=0.99)
    assert counted == {"rms_norm": 1, "add_rms_norm": 1}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "head_dim,scaling",
    [
        (32, RopeScaling()),
        (128, RopeScaling(rope_type="llama3", factor=8.0, original_max_position_embeddings=1024)),
    ],
)
def test_rotary(dtype, head_dim, scaling, counted, monkeypatch):
    gen = torch.Generator().manual_seed(2)
    rope = RotaryEmbedding(head_dim, max_position=4096, theta=500000.0, scaling=scaling)
    num_tokens, q_heads, kv_heads = 37, 4, 2
    # q and k as the split views of one qkv projection, as the attention layer has them.
    qkv = torch.randn(num_tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, _ = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    out_q, out_k = rope(positions, q, k)
    assert counted == {"rotary_neox": 1}
    ref_q, ref_k = _torch_path(lambda: rope(positions, q, k), monkeypatch)
    _assert_matches(out_q, ref_q, dtype)
    _assert_matches(out_k, ref_k, dtype)


def test_layers_keep_torch_ops_where_kernels_do_not_apply(counted, monkeypatch):
    """A 3-d input to the norm (Qwen3's per-head q/k norm), a weight of
    another dtype and bf16 rotary caches take the torch path, still correct."""
    norm = RMSNorm(32)
    x = torch.randn(5, 4, 32)
    torch.testing.assert_close(norm(x), _torch_path(lambda: norm(x), monkeypatch))
    norm.weight.data = norm.weight.data.bfloat16()
    x2 = torch.randn(5, 32)
    torch.testing.assert_close(norm(x2), _torch_path(lambda: norm(x2), monkeypatch))
    # Rotary caches cast away from float32 (a whole-module .to(dtype)).
    rope = RotaryEmbedding(32, max_position=64, theta=10000.0, scaling=RopeScaling()).to(torch.bfloat16)
    q, k = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(3, 32, dtype=torch.bfloat16)
    positions = torch.arange(3)
    out_q, out_k = rope(positions, q, k)
    ref_q, ref_k = _torch_path(lambda: rope(positions, q, k), monkeypatch)
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    assert counted == {}


def test_kernels_reject_bad_operands(kernels):
    rope = RotaryEmbedding(32, max_position=64, theta=10000.0, scaling=RopeScaling())
    q, k = torch.randn(3, 64), torch.randn(3, 32)
    with pytest.raises(RuntimeError, match="position 64 out of range"):
        kernels.rotary_neox(torch.tensor([0, 1, 64]), q, k, rope.cos_cache, rope.sin_cache, 32)
    with pytest.raises(RuntimeError, match="must be even"):
        kernels.silu_and_mul(torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.rms_norm(torch.randn(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="residual must match"):
        kernels.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6)
