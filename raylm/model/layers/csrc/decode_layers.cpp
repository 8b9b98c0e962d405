// The decoder layers of a Llama-family model for a decode step on CPU, in one
// call: the same kernels the layers call one by one from Python (RMSNorm,
// bf16 matmul, rotary, KV-cache write, paged attention, SiLU-and-mul), so the
// result is the same to the bit, without the ~20 Python dispatches per layer
// that cost more than the arithmetic on small models and a share of it on
// larger ones (a decode token of a ~111M model is ~4 ms of weight reads).
//
// Serves a step whose tokens are all decodes (one per request), few enough for
// the bf16 matmul kernel, on one tensor-parallel rank. llama.py decides.

#include "decode_layer_loop.h"
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
  const raylm::DecodeStep step{positions, slot_mapping, block_table, context_lens, cos_cache, sin_cache,
                               num_heads,  num_kv_heads, head_dim,   hidden_size,  eps,       scale};
  const auto layer = [&](int64_t l) { return params.data() + l * kParamsPerLayer; };
  const int64_t qkv_size = (num_heads + 2 * num_kv_heads) * head_dim;
  return raylm::decode_layer_loop(
      "decode_layers", std::move(hidden), std::move(residual), step, int64_t(params.size()) / kParamsPerLayer,
      [&](int64_t l) {
        const at::Tensor* p = layer(l);
        return raylm::DecodeLayer{p[kInputNorm], p[kQNorm], p[kKNorm], p[kPostNorm], p[kKvCache]};
      },
      [&](int64_t l, raylm::Projection which, const at::Tensor& x) {
        const at::Tensor* p = layer(l);
        switch (which) {
          case raylm::Projection::kQkv: return bf16_linear(x, p[kQkv], qkv_size, maybe(p[kQkvBias]));
          case raylm::Projection::kO: return bf16_linear(x, p[kO], hidden_size, maybe(p[kOBias]));
          case raylm::Projection::kGateUp:
            return bf16_linear(x, p[kGateUp], 2 * intermediate_size, maybe(p[kGateUpBias]));
          default: return bf16_linear(x, p[kDown], hidden_size, maybe(p[kDownBias]));
        }
      });
}
