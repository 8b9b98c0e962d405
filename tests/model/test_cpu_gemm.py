"""The bf16 matmul kernel for decode (csrc/bf16_gemm.cpp) and the packed
weights of the linear layers (cpu_gemm.py), against float64 matmuls.

The kernel accumulates in float and rounds once, so each output is the
exact product rounded to bf16, but for the last bits of a float sum: within
one bf16 unit in the last place (ulp) everywhere, and mostly equal."""

from __future__ import annotations

import re

import pytest
import torch

from raylm.model.layers import cpu_gemm
from raylm.model.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from tests.model.cpu_kernel_utils import needs_compiler

pytestmark = needs_compiler


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |x| (8 significant bits)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-120)))
    return torch.pow(2.0, exponent - 7)


def _assert_rounded_product(y: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor) -> None:
    """y (bf16) is the float64 reference rounded to bf16, give or take one ulp
    and the float accumulation's error (at most ~2^-20 of the sum of the terms'
    magnitudes, `magnitude`, here: it matters where terms cancel)."""
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    err = (y.double() - ref).abs()
    bound = _bf16_ulp(ref) * 1.01 + magnitude * 2.0**-20
    assert torch.all(err <= bound), f"max error {(err - bound).max().item()} above one bf16 ulp"
    exact = (y == ref.to(torch.bfloat16)).double().mean().item()
    assert exact >= 0.95, f"only {exact:.1%} of outputs are the correctly rounded product"


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None):
    """(x @ w^T + bias, the sum of its terms' magnitudes) in float64."""
    ref = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    if bias is not None:
        ref, magnitude = ref + bias.double(), magnitude + bias.double().abs()
    return ref, magnitude


@pytest.mark.parametrize(
    "out_features,in_features",
    [(16, 2), (33, 7), (100, 64), (64, 1024), (200, 30), (1000, 2816)],
)
# 37 and 64 rows: a narrow weight's rows are split over several items (tiled_gemm.h's TileItems).
# From 16 rows the AVX2 build widens each tile once into a panel (6-row blocks:
# 16, 17, 23, 37 end on a partial block; 200 goes through several row chunks).
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16, 17, 23, 37, 64, 200])
def test_kernel_equals_rounded_product(kernels, out_features, in_features, rows):
    g = torch.Generator().manual_seed(out_features * 1000 + in_features + rows)
    w = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=g).to(torch.bfloat16)
    packed = kernels.bf16_pack(w)
    # Odd widths and partial tiles are padded with zeros, which must not count.
    assert packed.shape == ((out_features + 15) // 16, (in_features + 1) // 2, 16, 2)
    _assert_rounded_product(kernels.bf16_linear(x, packed, out_features, None), *_reference(x, w))
    _assert_rounded_product(kernels.bf16_linear(x, packed, out_features, bias), *_reference(x, w, bias))


@pytest.mark.parametrize("out_features,in_features", [(40, 30), (1000, 2816)])
def test_a_row_comes_out_the_same_in_any_batch(kernels, out_features, in_features):
    """Each row's sums run in the same order whatever the batch (one row, a
    block of 4, or the AVX2 panel path from 16 rows): a request's output does
    not depend on which others share its step."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    x = torch.randn(70, in_features, generator=g).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=g).to(torch.bfloat16)
    packed = kernels.bf16_pack(w)
    alone = torch.cat([kernels.bf16_linear(x[i : i + 1], packed, out_features, bias) for i in range(70)])
    for rows in (4, 16, 23, 70):
        assert torch.equal(kernels.bf16_linear(x[:rows], packed, out_features, bias), alone[:rows]), rows


def test_kernel_reads_strided_rows(kernels):
    # Rows of a wider tensor (e.g. q out of a fused qkv output) are read in place or copied.
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=g).to(torch.bfloat16)
    wide = torch.randn(3, 128, generator=g).to(torch.bfloat16)
    for x in (wide[:, :64], wide[:, ::2]):
        y = kernels.bf16_linear(x, kernels.bf16_pack(w), 48, None)
        _assert_rounded_product(y, *_reference(x, w))


def test_kernel_rejects_mismatched_operands(kernels):
    w = torch.randn(32, 64).to(torch.bfloat16)
    packed = kernels.bf16_pack(w)
    with pytest.raises(RuntimeError, match="does not hold"):
        kernels.bf16_linear(torch.randn(1, 62).to(torch.bfloat16), packed, 32, None)
    with pytest.raises(RuntimeError, match="does not hold"):
        kernels.bf16_linear(torch.randn(1, 64).to(torch.bfloat16), packed, 48, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.bf16_linear(torch.randn(1, 64), packed, 32, None)
    with pytest.raises(RuntimeError, match="bf16_pack"):
        kernels.bf16_linear(torch.randn(1, 64).to(torch.bfloat16), w, 32, None)


# (rows, whether the CPU has bf16 arithmetic): with it, raylm's kernel serves up to
# DECODE_MAX_ROWS rows and oneDNN more; without it (AVX2), the kernel serves up to
# EMULATED_BF16_KERNEL_MAX_ROWS and float32's matmul more. Both are forced here, so
# either machine runs both.
_ROW_CASES = [(rows, True) for rows in (1, cpu_gemm.DECODE_MAX_ROWS, cpu_gemm.DECODE_MAX_ROWS + 1, 64)] + [
    (rows, False)
    for rows in (
        1,
        cpu_gemm.DECODE_MAX_ROWS + 1,
        cpu_gemm.EMULATED_BF16_KERNEL_MAX_ROWS,
        cpu_gemm.EMULATED_BF16_KERNEL_MAX_ROWS + 1,
        300,
    )
]


@pytest.mark.parametrize("rows,bf16_arithmetic", _ROW_CASES)
def test_packed_layers_compute_the_plain_matmul(kernels, monkeypatch, rows, bf16_arithmetic):
    """Through the layers: packing frees the plain weight, and every packed
    path gives the plain product."""
    monkeypatch.setattr(cpu_gemm, "cpu_has_bf16_arithmetic", lambda: bf16_arithmetic)
    # Widen 16 output columns at a time, so that a layer takes several slices.
    monkeypatch.setattr(cpu_gemm, "_WIDEN_ELEMENTS", 16 * 96)
    kernel_rows = cpu_gemm.DECODE_MAX_ROWS if bf16_arithmetic else cpu_gemm.EMULATED_BF16_KERNEL_MAX_ROWS
    g = torch.Generator().manual_seed(rows)
    layers = [
        ColumnParallelLinear(96, 80, bias=True),
        MergedColumnParallelLinear(96, [40, 40]),
        RowParallelLinear(80, 96),
    ]
    for layer in layers:
        layer.to(torch.bfloat16)
        for param in layer.parameters():
            param.data.copy_(torch.randn(param.shape, generator=g))
        weight = layer.weight.data.clone()
        bias = None if layer.bias is None else layer.bias.data.clone()
        layer.pack_weights()
        assert layer.packed_weight is not None
        assert layer.weight.numel() == 0, "the plain weight is dropped once packed"
        counting = _Counting(kernels)
        layer.packed_weight._kernels = counting
        x = torch.randn(rows, weight.shape[1], generator=g).to(torch.bfloat16)
        ref, magnitude = _reference(x, weight, bias)
        y = layer(x)
        assert y.dtype == torch.bfloat16
        if rows <= kernel_rows:
            assert counting.calls == [rows], "a few rows go through raylm's kernel"
            _assert_rounded_product(y, ref, magnitude)
        elif bf16_arithmetic:
            assert counting.calls == []
            # oneDNN's bf16 path (its own blocking and rounding): close, not bit-equal.
            assert torch.allclose(y.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
        else:
            # float32's matmul on the widened weight: float accumulation, rounded once.
            assert counting.calls == []
            _assert_rounded_product(y, ref, magnitude)


@pytest.mark.parametrize("rows", [1, 3, cpu_gemm.DECODE_MAX_ROWS + 1, 64, 65])
def test_logits_widen_exactly_on_either_path(kernels, rows):
    """as_float32 (the LM head's logits) widens the kernel's rows on the work
    team, more rows with torch: either way exactly .float(), padding columns
    trimmed by a view and inf and NaN kept."""
    g = torch.Generator().manual_seed(rows)
    padded = torch.randn(rows, 1000, generator=g).mul(30).to(torch.bfloat16)
    padded[0, 5], padded[-1, 7], padded[rows // 2, 11] = float("nan"), float("inf"), float("-inf")
    logits = padded[:, :997]  # a vocabulary split over TP ranks is trimmed so
    widened = cpu_gemm.as_float32(logits)
    assert widened.dtype == torch.float32 and widened.shape == (rows, 997)
    assert torch.equal(widened.nan_to_num(), logits.float().nan_to_num())
    assert torch.equal(widened.isnan(), logits.float().isnan())
    with pytest.raises(RuntimeError, match="widen_rows"):
        kernels.widen_rows(logits[0])
    with pytest.raises(RuntimeError, match="dtype"):
        kernels.widen_rows(logits.half())


def test_bf16_arithmetic_is_read_off_the_cpu(monkeypatch):
    """AVX-512 (any of its bf16 paths) or AMX count as bf16 arithmetic; AVX2 alone does not."""
    cpu_gemm.cpu_has_bf16_arithmetic.cache_clear()
    for flags, expected in (
        ({"_is_avx512_supported"}, True),
        ({"_is_amx_tile_supported"}, True),
        ({"_is_avx2_supported"}, False),
        (set(), False),
    ):
        for probe in (
            "_is_avx512_supported",
            "_is_avx512_bf16_supported",
            "_is_amx_tile_supported",
            "_is_avx2_supported",
        ):
            monkeypatch.setattr(torch.cpu, probe, lambda on=probe in flags: on)
        cpu_gemm.cpu_has_bf16_arithmetic.cache_clear()
        assert cpu_gemm.cpu_has_bf16_arithmetic() is expected, flags
    monkeypatch.undo()
    cpu_gemm.cpu_has_bf16_arithmetic.cache_clear()


class _Counting:
    """The kernel module, counting bf16_linear calls by their number of rows."""

    def __init__(self, kernels):
        self._kernels, self.calls = kernels, []

    def bf16_linear(self, *args):
        self.calls.append(args[0].shape[0])
        return self._kernels.bf16_linear(*args)


def test_float32_layers_stay_plain():
    layer = ColumnParallelLinear(32, 16)
    layer.pack_weights()
    assert layer.packed_weight is None and layer.weight.shape == (16, 32)


@pytest.mark.parametrize("out_features,in_features", [(16, 4), (33, 7), (100, 64), (1000, 2816)])
@pytest.mark.parametrize("rows", [1, 2, 5, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kernel_equals_dequantized_product(kernels, out_features, in_features, rows, dtype):
    """int8 weights, one scale per row: the float matmul on the dequantized weight."""
    g = torch.Generator().manual_seed(out_features + in_features + rows)
    q = torch.randint(-127, 128, (out_features, in_features), generator=g, dtype=torch.int8)
    scales = torch.rand(out_features, generator=g) * 0.01
    bias = torch.randn(out_features, generator=g)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    packed = kernels.int8_pack(q)
    assert packed.shape == ((out_features + 15) // 16, (in_features + 3) // 4, 4, 16)
    dequantized = q.double() * scales.double()[:, None]
    for b in (None, bias):
        y = kernels.int8_linear(x, packed, scales, out_features, b)
        assert y.dtype == dtype and y.shape == (rows, out_features)
        ref, magnitude = _reference(x, dequantized, b)
        if dtype == torch.bfloat16:
            _assert_rounded_product(y, ref, magnitude)
        else:
            assert torch.all((y.double() - ref).abs() <= magnitude * 2.0**-20)


def test_int8_layers_use_the_kernel_for_every_row_count(kernels):
    """Through quant_kernels: every row count goes through int8_linear (layers keep
    only its packed weight) and computes the dequantized matmul."""
    from raylm.model.layers import quant_kernels
    from raylm.model.quantization import QuantizedWeight
    from raylm.model.quantization.qtypes import quant_type

    g = torch.Generator().manual_seed(7)
    q = torch.randint(-127, 128, (48, 64), generator=g, dtype=torch.int8)
    scales = torch.rand(48, generator=g) * 0.01
    weight = QuantizedWeight(quant_type("INT8"), q, 64, scales=scales)
    kernel = quant_kernels.kernel_for("INT8", torch.device("cpu"), torch.float32)
    state = kernel.prepare(weight)
    counting = _CountingInt8(kernels)
    state = (*state[:2], counting, *state[3:])
    dequantized = q.double() * scales.double()[:, None]
    for rows in (1, 4, 7, 67):
        x = torch.randn(rows, 64, generator=g)
        counting.calls.clear()
        y = kernel.linear(x, state)
        ref, magnitude = _reference(x, dequantized)
        assert torch.all((y.double() - ref).abs() <= magnitude * 2.0**-16)
        assert counting.calls == [rows]


class _CountingInt8:
    def __init__(self, kernels):
        self._kernels, self.calls = kernels, []

    def int8_linear(self, *args):
        self.calls.append(args[0].shape[0])
        return self._kernels.int8_linear(*args)


@pytest.mark.slow
@pytest.mark.skipif(
    not getattr(torch.cpu, "_is_avx2_supported", lambda: False)(), reason="runs the AVX2 build, so needs an AVX2 CPU"
)
def test_the_avx2_path_equals_the_rounded_product(tmp_path):
    """CPUs without AVX-512 (most consumer CPUs, AMD before Zen 4) build
    bf16_gemm.cpp's AVX2 path. Built here for such a CPU (-march=haswell: AVX2
    and FMA, no AVX-512) and run, whatever this machine's own build uses.

    The two kernels are registered as torch ops (torch/library.h), not as a
    Python module: torch/extension.h alone takes longer to compile than the
    kernel. The instructions checked are those of the object that runs."""
    import shutil
    import subprocess

    from torch.utils import cpp_extension

    from raylm.model.layers.cpu_kernels import _CSRC

    binding = tmp_path / "bindings.cpp"
    binding.write_text(
        '#include <torch/library.h>\n#include "kernels.h"\n'
        "TORCH_LIBRARY(raylm_bf16_avx2_check, m) {\n"
        '  m.def("bf16_pack", &bf16_pack);\n'
        '  m.def("bf16_linear", &bf16_linear);\n}\n'
    )
    flags = ["-O2", "-march=haswell", "-fopenmp", f"-I{_CSRC}"]
    cpp_extension.load(
        name="raylm_bf16_avx2_check",
        build_directory=str(tmp_path),
        sources=[str(binding), str(_CSRC / "bf16_gemm.cpp"), str(_CSRC / "work_team.cpp")],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )
    ops = torch.ops.raylm_bf16_avx2_check
    objdump = shutil.which("objdump")
    if objdump is not None:
        text = subprocess.run(
            [objdump, "-d", str(tmp_path / "bf16_gemm.o")], check=True, capture_output=True, text=True
        ).stdout
    else:  # no binutils beside the compiler: the compiler's assembly of the same source and flags
        assembly = tmp_path / "bf16_gemm.s"
        subprocess.run(
            [
                cpp_extension.get_cxx_compiler(),
                "-std=c++17",
                *flags,
                "-S",
                *[f"-I{p}" for p in cpp_extension.include_paths()],
                str(_CSRC / "bf16_gemm.cpp"),
                "-o",
                str(assembly),
            ],
            check=True,
            capture_output=True,
        )
        text = assembly.read_text()
    assert "zmm" not in text and re.search(r"vfmadd\d+ps\s+[^\n]*%ymm", text)
    for out_features, in_features in ((33, 7), (100, 64), (1000, 2816)):
        for rows in (1, 2, 3, 4, 5, 9, 16, 23, 64, 130):
            g = torch.Generator().manual_seed(out_features + rows)
            w = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
            x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
            bias = torch.randn(out_features, generator=g).to(torch.bfloat16)
            packed = ops.bf16_pack(w)
            _assert_rounded_product(ops.bf16_linear(x, packed, out_features, None), *_reference(x, w))
            _assert_rounded_product(ops.bf16_linear(x, packed, out_features, bias), *_reference(x, w, bias))
