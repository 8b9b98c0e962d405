// The loop over a decode step's decoder layers that decode_layers.cpp (bf16
// weights) and quant_decode.cpp (GGUF-quantized weights) share: the same
// kernels in the same order (RMSNorm, qkv matmul, per-head norm, rotary,
// KV-cache write, paged attention, o matmul, add + RMSNorm, gate_up matmul,
// SiLU-and-mul, down matmul), so each equals its module path to the bit.
// Only the matmuls differ: the caller passes them in.
#pragma once

#include "kernels.h"
#include "work_team.h"

#include <cstring>
#include <tuple>

namespace raylm {

enum class Projection { kQkv, kO, kGateUp, kDown };

// One layer's tensors besides its matmuls; an absent q/k norm is empty.
struct DecodeLayer {
  const at::Tensor &input_norm, &q_norm, &k_norm, &post_norm, &kv_cache;
};

// What every layer of the step reads.
struct DecodeStep {
  const at::Tensor &positions, &slot_mapping, &block_table, &context_lens, &cos_cache, &sin_cache;
  int64_t num_heads, num_kv_heads, head_dim, hidden_size;
  double eps, scale;
};

// Per-head RMSNorm of q or k ([T, heads * D]) as Qwen3 does before rotary.
inline at::Tensor head_norm(const at::Tensor& x, const at::Tensor& weight, int64_t head_dim, double eps) {
  const int64_t tokens = x.size(0);
  return rms_norm(x.reshape({-1, head_dim}), weight, eps).view({tokens, -1});
}

// cache[slot_mapping[t]] = rows[t] for every token t, one layer's K or V
// ([slots, kv_heads, head_dim] by slot). A plain copy of each row, where
// index_copy_ went through the dispatcher and a TensorIterator (~4 us a call,
// two a layer: ~30 us of a ~7M model's 4-layer decode step of ~600 us).
inline void write_cache_rows(const at::Tensor& cache, const at::Tensor& slot_mapping, const at::Tensor& rows,
                             int64_t row_size) {
  TORCH_CHECK(cache.is_contiguous() && slot_mapping.is_contiguous() && cache.scalar_type() == rows.scalar_type() &&
                  rows.dim() == 2 && rows.size(1) == row_size && rows.stride(1) == 1,
              "decode_layer_loop: the KV cache must be contiguous and of the model's dtype, with K/V rows of ",
              row_size, " values");
  const int64_t slots = cache.numel() / row_size, tokens = rows.size(0), elem = rows.element_size();
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  char* dst = static_cast<char*>(cache.data_ptr());
  const char* src = static_cast<const char*>(rows.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "KV cache slot ", slot[t], " out of range [0, ", slots, ")");
    std::memcpy(dst + slot[t] * row_size * elem, src + t * rows.stride(0) * elem, row_size * elem);
  }
}

// hidden [T, H]: the embedded tokens (first layer) or the previous stage's
// hidden state with its residual (`residual`, empty for the first layer).
// layer_at(l) -> DecodeLayer; matmul(l, Projection, x) -> x @ W^T (+ bias).
// Returns (hidden, residual) after the last layer, before the final norm.
template <typename LayerAt, typename Matmul>
std::tuple<at::Tensor, at::Tensor> decode_layer_loop(const char* caller, at::Tensor hidden, at::Tensor residual,
                                                     const DecodeStep& s, int64_t layers, LayerAt layer_at,
                                                     Matmul matmul) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == s.hidden_size, caller, ": hidden must be [T, hidden_size]");
  const int64_t tokens = hidden.size(0);
  TORCH_CHECK(s.slot_mapping.scalar_type() == at::kLong && s.slot_mapping.numel() == tokens, caller,
              ": one int64 slot per token");
  const int64_t q_size = s.num_heads * s.head_dim, kv_size = s.num_kv_heads * s.head_dim;
  const FusedDecodeScope on_the_team;  // attention and elementwise ops beside the team's matmuls
  for (int64_t l = 0; l < layers; ++l) {
    const DecodeLayer p = layer_at(l);
    at::Tensor h;
    if (residual.numel() == 0) {
      residual = hidden;
      h = rms_norm(hidden, p.input_norm, s.eps);
    } else {
      std::tie(h, residual) = add_rms_norm(hidden, residual, p.input_norm, s.eps);
    }

    const at::Tensor qkv = matmul(l, Projection::kQkv, h);
    at::Tensor q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size);
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
    if (p.q_norm.numel()) {
      q = head_norm(q, p.q_norm, s.head_dim, s.eps);
      k = head_norm(k, p.k_norm, s.head_dim, s.eps);
    }
    std::tie(q, k) = rotary_neox(s.positions, q, k, s.cos_cache, s.sin_cache, s.head_dim);

    write_cache_rows(p.kv_cache[0], s.slot_mapping, k, kv_size);
    write_cache_rows(p.kv_cache[1], s.slot_mapping, v, kv_size);
    const at::Tensor attn = paged_decode(q.view({tokens, s.num_heads, s.head_dim}), p.kv_cache, s.block_table,
                                         s.context_lens, s.scale);

    const at::Tensor o = matmul(l, Projection::kO, attn.view({tokens, q_size}));
    std::tie(h, residual) = add_rms_norm(o, residual, p.post_norm, s.eps);
    hidden = matmul(l, Projection::kDown, silu_and_mul(matmul(l, Projection::kGateUp, h)));
  }
  return {hidden, residual};
}

}  // namespace raylm
