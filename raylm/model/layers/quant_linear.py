"""The matmul of a linear layer whose weight came quantized.

A layer's weight is a stack of row segments: a merged projection may mix types
(a Q4_K_M file keeps q and k in Q4_K and v in Q6_K; a weight whose rows are
not whole blocks comes as F16). Each segment is multiplied on its own and the
outputs laid side by side. A segment stays quantized when a kernel computes on
its type on this device (quant_kernels.py); otherwise it is dequantized once,
at load, to the model's dtype, and the log says so.
"""

from __future__ import annotations

import logging

import torch

from raylm.model.layers import cpu_gemm, quant_kernels
from raylm.model.quantization import QuantizedWeight

logger = logging.getLogger(__name__)

_told_dequantized: set[tuple[str, str]] = set()


class FloatSegment:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.packed = cpu_gemm.pack_weight(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.linear(x, self.weight, None, self.packed)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


class QuantSegment:
    """Rows of one quantized type, as the kernel's state holds them: the loaded
    weight is not kept (the state may be a re-laid copy of it)."""

    def __init__(self, weight: QuantizedWeight, kernel: quant_kernels.QuantKernel):
        self.qtype, self.shape, self.kernel = weight.qtype, weight.shape, kernel
        self.state = kernel.prepare(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.linear(x, self.state)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors the segment holds."""
        return sum(t.nbytes for t in _tensors(self.state))


def _tensors(state) -> list[torch.Tensor]:
    if isinstance(state, quant_kernels.GGUFState):
        return list(state.tensors)
    tensors, seen = [t for t in state if isinstance(t, torch.Tensor)], set()
    return [t for t in tensors if not (t.data_ptr() in seen or seen.add(t.data_ptr()))]


class QuantizedMatmul:
    def __init__(self, segments: list[FloatSegment | QuantSegment], out_features: int):
        self.segments, self.out_features = segments, out_features

    @classmethod
    def build(cls, float_weight: torch.Tensor, quantized_rows: dict[int, QuantizedWeight]) -> QuantizedMatmul:
        """From the layer's float weight (whose rows not in `quantized_rows` were
        loaded as floats) and its quantized rows by first row."""
        rows, dtype, device = float_weight.shape[0], float_weight.dtype, float_weight.device
        parts: list[tuple[int, torch.Tensor | QuantizedWeight]] = []
        row = 0
        for start in sorted(quantized_rows):
            if start > row:
                parts.append((row, float_weight[row:start]))
            weight = quantized_rows[start]
            parts.append((start, weight))
            row = start + weight.shape[0]
        if row < rows:
            parts.append((row, float_weight[row:]))
        segments: list[FloatSegment | QuantSegment] = []
        for _, part in _merge_same_type(parts):
            if isinstance(part, torch.Tensor):
                segments.append(FloatSegment(part.contiguous()))
                continue
            kernel = quant_kernels.kernel_for(part.qtype.name, device, dtype)
            if kernel is None:
                key = (part.qtype.name, str(device))
                if key not in _told_dequantized:
                    _told_dequantized.add(key)
                    logger.warning(
                        "no %s kernel for %s activations on %s: %s weights are dequantized to %s at load",
                        part.qtype.name,
                        dtype,
                        device,
                        part.qtype.name,
                        dtype,
                    )
                segments.append(FloatSegment(part.dequantize(dtype).to(device)))
            else:
                segments.append(QuantSegment(part, kernel))
        return cls(segments, rows)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if len(self.segments) == 1:
            y = self.segments[0](x)
        else:
            y = torch.cat([segment(x) for segment in self.segments], dim=-1)
        return y + bias if bias is not None else y

    @property
    def nbytes(self) -> int:
        return sum(segment.nbytes for segment in self.segments)

    # Segments one linear may have in csrc/quant_decode.cpp's quant_decode_layers.
    DECODE_MAX_SEGMENTS = 3

    def decode_slots(self) -> list[torch.Tensor] | None:
        """This matmul as quant_decode_layers reads it (without the bias): a
        [segments, 2] int64 spec of (type code, output rows; code -1: bf16 in
        bf16_linear's layout), then each segment's packed weight, padded with
        empty tensors; None when a segment has no decode layout."""
        spec, weights = [], []
        for segment in self.segments:
            if isinstance(segment, QuantSegment):
                state = segment.state
                if not isinstance(state, quant_kernels.GGUFState) or state.packed is None:
                    return None
                spec.append((state.code, state.rows))
                weights.append(state.packed)
            else:
                layout = None if segment.packed is None else segment.packed.decode_layout
                if layout is None:
                    return None
                spec.append((-1, segment.weight.shape[0]))
                weights.append(layout)
        if len(weights) > self.DECODE_MAX_SEGMENTS:
            return None
        empty = torch.empty(0)
        return [torch.tensor(spec, dtype=torch.int64), *weights, *[empty] * (self.DECODE_MAX_SEGMENTS - len(weights))]


def _merge_same_type(parts):
    """Adjacent quantized parts of one type become one (one kernel call, not several)."""
    merged: list[tuple[int, torch.Tensor | QuantizedWeight]] = []
    for start, part in parts:
        if (
            merged
            and isinstance(part, QuantizedWeight)
            and isinstance(merged[-1][1], QuantizedWeight)
            and merged[-1][1].qtype == part.qtype
        ):
            previous = merged[-1][1]
            scales = None if part.scales is None else torch.cat([previous.scales, part.scales])
            joined = QuantizedWeight(
                part.qtype, torch.cat([previous.data, part.data]), part.cols, scales, previous.name
            )
            merged[-1] = (merged[-1][0], joined)
        elif merged and isinstance(part, torch.Tensor) and isinstance(merged[-1][1], torch.Tensor):
            merged[-1] = (merged[-1][0], torch.cat([merged[-1][1], part]))
        else:
            merged.append((start, part))
    return merged
