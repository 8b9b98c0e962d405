// The entry points of raylm's CPU kernels, one extension module (see
// cpu_kernels.py): declared once here for the bindings and for the kernels
// that call each other (decode_layers.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                        const at::Tensor& context_lens, double scale);
std::tuple<at::Tensor, at::Tensor> paged_decode_partial(const at::Tensor& q, const at::Tensor& kv_cache,
                                                        const at::Tensor& block_table,
                                                        const at::Tensor& context_lens, double scale);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> rotary_neox(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                                               int64_t head_dim);
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight, int64_t qtype);
at::Tensor quant_dequantize(const at::Tensor& weight, int64_t qtype, int64_t K, at::ScalarType dtype);
void quant_dequantize_rows(const uint8_t* blocks, int64_t qtype, int64_t K, int64_t rows, float* out_f,
                           c10::BFloat16* out_b);
bool quant_packed_supported();
std::vector<std::string> quant_packed_variants();
std::string quant_packed_variant();
void quant_packed_use(const std::string& name);
at::Tensor quant_pack(const at::Tensor& weight, int64_t qtype);
at::Tensor quant_unpack(const at::Tensor& packed, int64_t qtype, int64_t N, int64_t K);
at::Tensor quant_packed_dequantize(const at::Tensor& packed, int64_t qtype, int64_t N, int64_t K,
                                   at::ScalarType dtype);
at::Tensor quant_packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t out_features);
int64_t quant_decode_params_per_layer();
std::tuple<at::Tensor, at::Tensor> quant_decode_layers(
    at::Tensor hidden, at::Tensor residual, const at::Tensor& positions, const at::Tensor& slot_mapping,
    const at::Tensor& block_table, const at::Tensor& context_lens, const at::Tensor& cos_cache,
    const at::Tensor& sin_cache, const std::vector<at::Tensor>& params, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t hidden_size, double eps, double scale);
// A linear as a stack of row segments (quant_decode.cpp): slots are a [segments, 2]
// int64 spec of (type code, rows; -1: bf16 in bf16_linear's layout), a weight per
// segment padded with empty tensors to 3, then the bias (empty when none).
at::Tensor segmented_linear(const at::Tensor& x, const at::Tensor* slots);
at::Tensor greedy_decode_steps(const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& block_table,
                               const at::Tensor& context_lens, int64_t block_size, int64_t steps,
                               const at::Tensor& embedding, const at::Tensor& final_norm, double final_eps,
                               const std::vector<at::Tensor>& lm_head, int64_t vocab_size, bool quantized,
                               const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                               const std::vector<at::Tensor>& params, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t hidden_size, int64_t intermediate_size, double eps,
                               double scale);
// [rows, cols] float32 or bfloat16 rows (contiguous each) as float32, rows on the work team.
at::Tensor widen_rows(const at::Tensor& x);
at::Tensor bf16_pack(const at::Tensor& weight);
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const c10::optional<at::Tensor>& bias);
at::Tensor int8_pack(const at::Tensor& weight);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       int64_t out_features, const c10::optional<at::Tensor>& bias);
std::tuple<at::Tensor, at::Tensor> decode_layers(
    at::Tensor hidden, at::Tensor residual, const at::Tensor& positions, const at::Tensor& slot_mapping,
    const at::Tensor& block_table, const at::Tensor& context_lens, const at::Tensor& cos_cache,
    const at::Tensor& sin_cache, const std::vector<at::Tensor>& params, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t hidden_size, int64_t intermediate_size, double eps, double scale);
// For tests of work_team.h: how often each of `items` ran over `rounds` calls,
// and how many runs were off the calling thread.
std::tuple<at::Tensor, int64_t> work_team_probe(int64_t items, int64_t rounds);
std::tuple<at::Tensor, int64_t> work_team_range_probe(int64_t n, int64_t grain);
