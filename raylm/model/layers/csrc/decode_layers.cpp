// The decoder layers of a Llama-family model for a decode step on CPU, in one
// call: the same kernels the layers call one by one from Python (RMSNorm,
// bf16 matmul, rotary, KV-cache write, paged attention, SiLU-and-mul), so the
// result is the same to the bit, without the ~20 Python dispatches per layer
// that cost more than the arithmetic on small models and a share of it on
// larger ones (a decode token of a ~111M model is ~4 ms of weight reads).
//
// Serves a step whose tokens are all decodes (one per request), few enough for
// the bf16 matmul kernel, on one tensor-parallel rank. llama.py decides.

#include "kernels.h"

namespace {

// Per layer, in this order; an absent bias or norm is an empty tensor.
enum LayerParam : int64_t {
  kInputNorm,
  kQkv,
  kQkvBias,
  kQNorm,
  kKNorm,
  kO,
  kOBias,
  kPostNorm,
  kGateUp,
  kGateUpBias,
  kDown,
  kDownBias,
  kKvCache,
  kParamsPerLayer,
};

c10::optional<at::Tensor> maybe(const at::Tensor& t) {
  return t.numel() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

// Per-head RMSNorm of q or k ([T, heads * D]) as Qwen3 does before rotary.
at::Tensor head_norm(const at::Tensor& x, const at::Tensor& weight, int64_t head_dim, double eps) {
  const int64_t tokens = x.size(0);
  return rms_norm(x.reshape({-1, head_dim}), weight, eps).view({tokens, -1});
}

}  // namespace

// hidden [T, H]: the embedded tokens (first layer) or the previous stage's
// hidden state with its residual (`residual`, empty for the first layer).
// Returns (hidden, residual) after the last layer, before the final norm.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    at::Tensor hidden, at::Tensor residual, const at::Tensor& positions, const at::Tensor& slot_mapping,
    const at::Tensor& block_table, const at::Tensor& context_lens, const at::Tensor& cos_cache,
    const at::Tensor& sin_cache, const std::vector<at::Tensor>& params, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t hidden_size, int64_t intermediate_size, double eps, double scale) {
  TORCH_CHECK(params.size() % kParamsPerLayer == 0, "decode_layers: ", kParamsPerLayer, " parameters per layer");
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == hidden_size, "decode_layers: hidden must be [T, hidden_size]");
  const int64_t tokens = hidden.size(0);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == tokens,
              "decode_layers: one int64 slot per token");
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const int64_t layers = int64_t(params.size()) / kParamsPerLayer;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* p = params.data() + l * kParamsPerLayer;
    at::Tensor h;
    if (residual.numel() == 0) {
      residual = hidden;
      h = rms_norm(hidden, p[kInputNorm], eps);
    } else {
      std::tie(h, residual) = add_rms_norm(hidden, residual, p[kInputNorm], eps);
    }

    const at::Tensor qkv = bf16_linear(h, p[kQkv], q_size + 2 * kv_size, maybe(p[kQkvBias]));
    at::Tensor q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size);
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
    if (p[kQNorm].numel()) {
      q = head_norm(q, p[kQNorm], head_dim, eps);
      k = head_norm(k, p[kKNorm], head_dim, eps);
    }
    std::tie(q, k) = rotary_neox(positions, q, k, cos_cache, sin_cache, head_dim);

    const at::Tensor& kv_cache = p[kKvCache];
    kv_cache[0].view({-1, num_kv_heads, head_dim}).index_copy_(0, slot_mapping, k.view({tokens, num_kv_heads, head_dim}));
    kv_cache[1].view({-1, num_kv_heads, head_dim}).index_copy_(0, slot_mapping, v.view({tokens, num_kv_heads, head_dim}));
    const at::Tensor attn =
        paged_decode(q.view({tokens, num_heads, head_dim}), kv_cache, block_table, context_lens, scale);

    const at::Tensor o = bf16_linear(attn.view({tokens, q_size}), p[kO], hidden_size, maybe(p[kOBias]));
    std::tie(h, residual) = add_rms_norm(o, residual, p[kPostNorm], eps);
    const at::Tensor gate_up = bf16_linear(h, p[kGateUp], 2 * intermediate_size, maybe(p[kGateUpBias]));
    hidden = bf16_linear(silu_and_mul(gate_up), p[kDown], hidden_size, maybe(p[kDownBias]));
  }
  return {hidden, residual};
}
