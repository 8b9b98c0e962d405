"""Quantized weights: the block types raylm computes on (GGUF's Q8_0, Q4_0,
Q4_K, Q6_K and raylm's own per-channel int8), and QuantizedWeight, the
loader's view of one such weight that tensor-parallel layers slice."""

from raylm.model.quantization.qtypes import FLOAT_GGUF_TYPES, QUANT_TYPES, QuantType, quant_type
from raylm.model.quantization.qweight import QuantizedWeight, is_quantized

__all__ = ["FLOAT_GGUF_TYPES", "QUANT_TYPES", "QuantType", "QuantizedWeight", "is_quantized", "quant_type"]
