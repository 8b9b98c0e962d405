"""The quantized block types raylm can hold, and their geometry.

A row of `cols` weights is stored as cols / block_size blocks of type_size
bytes each (GGUF's layout, ggml's block structs); a weight can be split
between columns only on a block boundary. "INT8" is raylm's load-time
weight-only int8: one int8 per weight, one float scale per output row, so it
splits anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType


@dataclass(frozen=True)
class QuantType:
    name: str
    block_size: int  # weights per block
    type_size: int  # bytes per block
    ggml_type: GGMLQuantizationType | None = None  # None: not a GGUF type

    def row_bytes(self, cols: int) -> int:
        return cols // self.block_size * self.type_size


def _ggml(name: str) -> QuantType:
    ggml_type = GGMLQuantizationType[name]
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    return QuantType(name, block_size, type_size, ggml_type)


# The quantized GGUF types raylm loads (a Q4_K_M file mixes Q4_K and Q6_K).
QUANT_TYPES: dict[str, QuantType] = {name: _ggml(name) for name in ("Q8_0", "Q4_0", "Q4_K", "Q6_K")}
QUANT_TYPES["INT8"] = QuantType("INT8", block_size=1, type_size=1)

# GGUF's float types, loaded as plain tensors.
FLOAT_GGUF_TYPES = {
    GGMLQuantizationType.F32: "F32",
    GGMLQuantizationType.F16: "F16",
    GGMLQuantizationType.BF16: "BF16",
}


def quant_type(name: str) -> QuantType:
    try:
        return QUANT_TYPES[name]
    except KeyError:
        raise ValueError(f"unknown quantized type {name!r}; raylm knows {', '.join(QUANT_TYPES)}") from None
