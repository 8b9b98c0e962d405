"""Which kernel multiplies activations by a quantized weight, per type and device.

A kernel computes on the stored blocks (they are never expanded to the model
dtype in memory): `prepare(weight)` once at load, then `linear(x, state)` ->
x @ W^T in x's dtype. `kernel_for` returns None where no kernel runs the type
(the caller dequantizes at load instead).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from raylm.model.layers import cpu_gemm
from raylm.model.layers.cpu_kernels import get_cpu_kernels
from raylm.model.quantization import QuantizedWeight

# The type codes of csrc/quant_gemm.cpp.
GGUF_TYPE_CODES = {"Q8_0": 0, "Q4_0": 1, "Q4_K": 2, "Q6_K": 3}
# From this many activation rows on (prefill), the weight is widened once into a
# transient float copy for a float matmul, instead of each block per row tile.
WIDEN_FROM_ROWS = 16
# Up to PACKED_MAX_ROWS rows (decode steps, small batches of them), in bfloat16
# models where the build has AVX-512 VNNI or AVX2, the weight is read in the tile
# layout packed once at load (csrc/quant_decode.cpp) and the activations are
# quantized per block to int8, as llama.cpp does: the stream of 4-6-bit
# weights is then as fast as memory reads it, where widening each weight to a
# float costs more than reading it. Measured on the 111M model's matmuls
# (loaded machine): 1.8-3.2x the row-tiled path at 1-4 rows, 2.3-4.2x at
# 8-15; against widening the weight for oneDNN, 0.25-0.6x its time at 16 rows,
# 0.5-1.05x at 64, 1.1-1.2x at 128 and 2x at 512 (so prefill keeps widening).
# Past PACKED_MAX_ROWS the packed tiles are widened (the file's blocks are not
# kept beside them). float32 models keep float activations (the paths above):
# they asked for float precision.
PACKED_MAX_ROWS = 64
PACKED_DTYPES = (torch.bfloat16,)


@dataclass(frozen=True)
class QuantKernel:
    name: str
    prepare: Callable[[QuantizedWeight], Any]
    linear: Callable[[torch.Tensor, Any], torch.Tensor]


# Where the build has it, raylm's packed int8 kernel (csrc/int8_gemm.cpp) runs
# every row count: ~2x aten's weight-only int8 kernel at one row (one stream
# through the weight), and 1.3-3.6x at 5-512 rows (111M model's gate_up, one
# thread, loaded machine). A layer then keeps the packed weight only, not the
# row-major int8 matrix beside it (one copy, as GGUF layers keep). Without
# the build, aten's kernel on the row-major matrix.


def _int8_prepare(weight: QuantizedWeight, dtype: torch.dtype):
    """(row-major int8 weight or None, scales in `dtype`, module, packed weight or
    None, float32 scales): the packed weight where the build has the kernel,
    else the int8 rows."""
    data = weight.data.contiguous()
    module = get_cpu_kernels()
    packed = None if module is None else module.int8_pack(data)
    return (
        None if packed is not None else data,
        weight.scales.to(dtype).contiguous(),
        module,
        packed,
        weight.scales.float().contiguous(),
    )


def _int8_linear(x: torch.Tensor, state) -> torch.Tensor:
    data, scales, module, packed, scales_f32 = state
    rows = scales.shape[0]
    flat = x.reshape(-1, x.shape[-1])
    if packed is not None:
        y = module.int8_linear(flat, packed, scales_f32, rows)
    else:
        # aten's weight-only int8 matmul: int8 weights widened in registers.
        y = torch.ops.aten._weight_int8pack_mm(flat.contiguous(), data, scales)
    return y.reshape(*x.shape[:-1], rows)


@dataclass(frozen=True)
class GGUFState:
    """One GGUF weight as a layer keeps it: the packed tiles where the decode
    kernel runs (the file's blocks are dropped: prefill widens the tiles), else
    the file's blocks."""

    module: Any
    code: int
    rows: int  # output features
    cols: int  # input features
    data: torch.Tensor | None  # the file's blocks, [rows, bytes], only without `packed`
    packed: torch.Tensor | None  # quant_decode.cpp's layout, where the build has it

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.data, self.packed) if t is not None)


def _gguf_prepare(weight: QuantizedWeight, module, dtype: torch.dtype) -> GGUFState:
    data, code = weight.data.contiguous(), GGUF_TYPE_CODES[weight.qtype.name]
    rows, cols = weight.shape
    if dtype in PACKED_DTYPES and packed_kernel_available(module):
        return GGUFState(module, code, rows, cols, None, module.quant_pack(data, code))
    return GGUFState(module, code, rows, cols, data, None)


# Names the packed decode kernel's instruction set ("avx512_vnni", "avx2";
# "auto", the default: the best this build and CPU run). For tests and
# benchmarks of the AVX2 kernel on a CPU that has AVX-512 too; read once.
KERNEL_ENV = "RAYLM_QUANT_KERNEL"
_chosen_variant: str | None = None


def packed_kernel_available(module) -> bool:
    if not hasattr(module, "quant_packed_supported"):
        return False
    _apply_kernel_choice(module)
    return module.quant_packed_supported()


def _apply_kernel_choice(module) -> None:
    global _chosen_variant
    if _chosen_variant is not None or not hasattr(module, "quant_packed_use"):
        return
    choice = os.environ.get(KERNEL_ENV, "").strip().lower() or "auto"
    if choice != "auto" and choice not in module.quant_packed_variants():
        raise ValueError(
            f"{KERNEL_ENV}={choice!r}: this build's packed decode kernel runs "
            f"{', '.join(['auto', *module.quant_packed_variants()])}"
        )
    module.quant_packed_use(choice)
    _chosen_variant = choice


def _widened_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a quantized weight is widened to for a float matmul: the
    activations', except bfloat16 on a CPU without bf16 arithmetic, whose
    bf16 matmul is emulated (~5x slower than float32's; cpu_gemm)."""
    if dtype == torch.bfloat16 and not cpu_gemm.cpu_has_bf16_arithmetic():
        return torch.float32
    return dtype


def _gguf_linear(x: torch.Tensor, state: GGUFState) -> torch.Tensor:
    module, code, cols = state.module, state.code, state.cols
    flat = x.reshape(-1, cols)
    wide = _widened_dtype(x.dtype)
    if state.packed is not None:
        if flat.shape[0] <= PACKED_MAX_ROWS:
            y = module.quant_packed_linear(flat, state.packed, code, state.rows)
        else:  # prefill: the tiles widened for oneDNN, one layer's weight at a time
            y = F.linear(flat.to(wide), module.quant_packed_dequantize(state.packed, code, state.rows, cols, wide))
    elif flat.shape[0] >= WIDEN_FROM_ROWS:
        y = F.linear(flat.to(wide), module.quant_dequantize(state.data, code, cols, wide))
    else:
        y = module.quant_linear(flat.contiguous(), state.data, code)
    return y.to(x.dtype).reshape(*x.shape[:-1], state.rows)


def kernel_for(qtype: str, device: torch.device, dtype: torch.dtype) -> QuantKernel | None:
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    if qtype == "INT8" and hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return QuantKernel("raylm int8_gemm", lambda w: _int8_prepare(w, dtype), _int8_linear)
    if qtype in GGUF_TYPE_CODES:
        module = get_cpu_kernels()
        if module is not None and hasattr(module, "quant_linear"):
            return QuantKernel("raylm quant_gemm", lambda w: _gguf_prepare(w, module, dtype), _gguf_linear)
    return None
