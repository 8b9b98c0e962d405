// The Python module of raylm's CPU kernels: one extension built from every
// source in this folder by cpu_kernels.py. The only source that includes
// torch/extension.h (pybind11 and torch's Python bindings): it takes ~30 s to
// compile where the kernels' ATen/ATen.h takes ~9.

#include <torch/extension.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("paged_decode", &paged_decode, "Paged decode attention over a block table", py::arg("q"),
        py::arg("kv_cache"), py::arg("block_table"), py::arg("context_lens"), py::arg("scale"));
  m.def("paged_decode_partial", &paged_decode_partial,
        "(out, lse): paged decode attention over one CP rank's shard of each context, and each head's log-sum-exp",
        py::arg("q"), py::arg("kv_cache"), py::arg("block_table"), py::arg("context_lens"), py::arg("scale"));
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a merged [rows, 2 * width] gate_up", py::arg("gate_up"));
  m.def("rms_norm", &rms_norm, "RMSNorm of [rows, width] rows times weight", py::arg("x"), py::arg("weight"),
        py::arg("eps"));
  m.def("add_rms_norm", &add_rms_norm, "(RMSNorm(x + residual) * weight, x + residual)", py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("rotary_neox", &rotary_neox, "Neox-style rotary embedding of q and k by position", py::arg("positions"),
        py::arg("q"), py::arg("k"), py::arg("cos_cache"), py::arg("sin_cache"), py::arg("head_dim"));
  m.def("quant_linear", &quant_linear, "x @ W^T for a GGUF-quantized W (Q8_0, Q4_0, Q4_K, Q6_K) kept in blocks",
        py::arg("x"), py::arg("weight"), py::arg("qtype"));
  m.def("quant_dequantize", &quant_dequantize, "a GGUF-quantized weight widened to float32 or bfloat16",
        py::arg("weight"), py::arg("qtype"), py::arg("cols"), py::arg("dtype"));
  m.def("quant_packed_supported", &quant_packed_supported,
        "whether a decode kernel on packed GGUF weights runs here (AVX-512 VNNI or AVX2)");
  m.def("quant_packed_variants", &quant_packed_variants,
        "the instruction sets of this build's packed decode kernel, best first");
  m.def("quant_packed_variant", &quant_packed_variant, "the packed decode kernel's instruction set in use");
  m.def("quant_packed_use", &quant_packed_use,
        "run the packed decode kernel on this instruction set ('auto' or '': the best)", py::arg("name"));
  m.def("quant_pack", &quant_pack, "a GGUF-quantized [rows, bytes] weight in quant_packed_linear's tile layout",
        py::arg("weight"), py::arg("qtype"));
  m.def("quant_unpack", &quant_unpack, "the file's blocks [rows, bytes] of a weight packed by quant_pack",
        py::arg("packed"), py::arg("qtype"), py::arg("rows"), py::arg("cols"));
  m.def("quant_packed_dequantize", &quant_packed_dequantize,
        "a weight packed by quant_pack widened to float32 or bfloat16 [rows, cols]", py::arg("packed"),
        py::arg("qtype"), py::arg("rows"), py::arg("cols"), py::arg("dtype"));
  m.def("quant_packed_linear", &quant_packed_linear,
        "x @ W^T for few rows of x (quantized per block to int8), W packed by quant_pack", py::arg("x"),
        py::arg("packed"), py::arg("qtype"), py::arg("out_features"));
  m.def("quant_decode_params_per_layer", &quant_decode_params_per_layer,
        "tensors per layer that quant_decode_layers reads");
  m.def("quant_decode_layers", &quant_decode_layers,
        "the decoder layers of a Llama-family model for a decode step, GGUF-quantized weights", py::arg("hidden"),
        py::arg("residual"), py::arg("positions"), py::arg("slot_mapping"), py::arg("block_table"),
        py::arg("context_lens"), py::arg("cos_cache"), py::arg("sin_cache"), py::arg("params"),
        py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("hidden_size"),
        py::arg("eps"), py::arg("scale"));
  m.def("bf16_pack", &bf16_pack, "a [out, in] bfloat16 weight in bf16_linear's tile layout", py::arg("weight"));
  m.def("bf16_linear", &bf16_linear, "x @ W^T (+ bias) for few rows of x, W packed by bf16_pack", py::arg("x"),
        py::arg("packed"), py::arg("out_features"), py::arg("bias") = py::none());
  m.def("int8_pack", &int8_pack, "a [out, in] int8 weight in int8_linear's tile layout", py::arg("weight"));
  m.def("int8_linear", &int8_linear, "x @ (scales * Q)^T (+ bias) for few rows of x, Q packed by int8_pack",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("out_features"), py::arg("bias") = py::none());
  m.def("decode_layers", &decode_layers, "the decoder layers of a Llama-family model for a decode step",
        py::arg("hidden"), py::arg("residual"), py::arg("positions"), py::arg("slot_mapping"),
        py::arg("block_table"), py::arg("context_lens"), py::arg("cos_cache"), py::arg("sin_cache"),
        py::arg("params"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
        py::arg("hidden_size"), py::arg("intermediate_size"), py::arg("eps"), py::arg("scale"));
  m.def("greedy_decode_steps", &greedy_decode_steps,
        "[steps, rows] tokens of greedy decode steps in one call: embedding, decoder layers, final norm, LM head "
        "and argmax per step, each step's tokens the next one's input",
        py::arg("tokens"), py::arg("positions"), py::arg("block_table"), py::arg("context_lens"),
        py::arg("block_size"), py::arg("steps"), py::arg("embedding"), py::arg("final_norm"), py::arg("final_eps"),
        py::arg("lm_head"), py::arg("vocab_size"), py::arg("quantized"), py::arg("cos_cache"), py::arg("sin_cache"),
        py::arg("params"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
        py::arg("hidden_size"), py::arg("intermediate_size"), py::arg("eps"), py::arg("scale"));
  m.def("widen_rows", &widen_rows, "[rows, cols] float32 or bfloat16 rows as float32, rows on the work team",
        py::arg("x"));
  m.def("work_team_probe", &work_team_probe,
        "(runs per item, runs off the caller) over `rounds` calls of the decode matmuls' work team",
        py::arg("items"), py::arg("rounds"));
  m.def("work_team_range_probe", &work_team_range_probe,
        "(runs per index, ranges) of one for_each_range over [0, n) in ranges of at least `grain`", py::arg("n"),
        py::arg("grain"));
}
