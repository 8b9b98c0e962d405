// Greedy decode steps of a batch in one call: the steps of a decode burst
// after its first (raylm.core.decode_burst), when every request decodes
// greedily with nothing else shaping its logits. Per step: the embedding of
// the last step's tokens, the decoder layers (decode_layers or
// quant_decode_layers), the final RMSNorm, the LM head and each row's argmax
// -- the kernels a step run from Python calls, in its order, so each step's
// tokens are the same; without its ~0.15 ms of Python per step, which on the
// ~7M model is as long as the layers' arithmetic.

#include "kernels.h"
#include "work_team.h"

#include <cmath>
#include <cstring>

namespace {

inline float logit(const float* row, int64_t i) { return row[i]; }
inline float logit(const uint16_t* row, int64_t i) {  // bf16 bits: widening is exact
  const uint32_t bits = uint32_t(row[i]) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

template <typename T>
int64_t argmax_row(const T* row, int64_t vocab) {
  int64_t best = 0;
  float best_value = logit(row, 0);
  for (int64_t i = 0; i < vocab; ++i) {
    const float value = logit(row, i);
    if (std::isnan(value)) return i;
    if (value > best_value) best = i, best_value = value;
  }
  return best;
}

// The index of each row's first maximum over its first `vocab` logits, a NaN
// counting as the maximum (the first NaN): numpy's argmax over the float
// logits, which the sampler's greedy rows take. bf16 logits are read as they
// are, rows split over the work team: a .to(float) would be an OpenMP region
// between the team's matmuls of two steps (see tiled_gemm.h).
void argmax_rows(const at::Tensor& logits, int64_t vocab, int64_t* out) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && vocab >= 1 &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "greedy_decode_steps: float32 or bfloat16 [rows, vocab] logits with contiguous rows");
  const int64_t stride = logits.stride(0);
  const bool bf16 = logits.scalar_type() == at::kBFloat16;
  const void* data = logits.data_ptr();
  raylm::for_each_range(logits.size(0), 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      out[r] = bf16 ? argmax_row(static_cast<const uint16_t*>(data) + r * stride, vocab)
                    : argmax_row(static_cast<const float*>(data) + r * stride, vocab);
  });
}

}  // namespace

// tokens [B]: the tokens the burst's last step sampled, the input of the
// next; positions and context_lens [B]: that next step's; block_table [B,
// blocks] must hold every position of the `steps` steps. lm_head: a
// segmented_linear's slots (quant_decode.cpp). Returns [steps, B] tokens.
at::Tensor greedy_decode_steps(const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& block_table,
                               const at::Tensor& context_lens, int64_t block_size, int64_t steps,
                               const at::Tensor& embedding, const at::Tensor& final_norm, double final_eps,
                               const std::vector<at::Tensor>& lm_head, int64_t vocab_size, bool quantized,
                               const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                               const std::vector<at::Tensor>& params, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t hidden_size, int64_t intermediate_size, double eps,
                               double scale) {
  const int64_t rows = tokens.numel();
  TORCH_CHECK(steps >= 0 && block_size > 0, "greedy_decode_steps: steps >= 0 and block_size > 0");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                  context_lens.scalar_type() == at::kLong && block_table.scalar_type() == at::kLong &&
                  positions.numel() == rows && context_lens.numel() == rows && block_table.dim() == 2 &&
                  block_table.size(0) == rows && block_table.is_contiguous(),
              "greedy_decode_steps: int64 tokens, positions and context_lens of one entry per row, and a "
              "contiguous [rows, blocks] int64 block table");
  TORCH_CHECK(embedding.dim() == 2 && embedding.size(1) == hidden_size && embedding.is_contiguous() &&
                  embedding.scalar_type() == at::kBFloat16,
              "greedy_decode_steps: the embedding must be a contiguous [vocab, hidden_size] bfloat16 matrix");
  // The final norm and the argmax run on the team too, as the layers' ops do.
  const raylm::FusedDecodeScope on_the_team;
  // Each step's inputs, written here between steps (the callers' stay as they were).
  at::Tensor ids = tokens.contiguous().clone(), pos = positions.contiguous().clone();
  at::Tensor ctx = context_lens.contiguous().clone(), slots = at::empty({rows}, pos.options());
  at::Tensor out = at::empty({steps, rows}, ids.options());
  const int64_t max_blocks = block_table.size(1), table_rows = embedding.size(0);
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t positions_held = cos_cache.size(0);
  const size_t row_bytes = hidden_size * embedding.element_size();
  for (int64_t step = 0; step < steps; ++step) {
    int64_t* id = ids.data_ptr<int64_t>();
    int64_t* p = pos.data_ptr<int64_t>();
    int64_t* slot = slots.data_ptr<int64_t>();
    at::Tensor hidden = at::empty({rows, hidden_size}, embedding.options());
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(id[r] >= 0 && id[r] < table_rows, "greedy_decode_steps: token ", id[r], " outside the vocabulary");
      TORCH_CHECK(p[r] >= 0 && p[r] < positions_held && p[r] / block_size < max_blocks,
                  "greedy_decode_steps: position ", p[r], " outside the block table or the rotary tables");
      slot[r] = table[r * max_blocks + p[r] / block_size] * block_size + p[r] % block_size;
      std::memcpy(static_cast<char*>(hidden.data_ptr()) + r * row_bytes,
                  static_cast<const char*>(embedding.data_ptr()) + id[r] * row_bytes, row_bytes);
    }
    at::Tensor residual = at::empty({0}, hidden.options());  // none before the first layer
    std::tie(hidden, residual) =
        quantized ? quant_decode_layers(hidden, residual, pos, slots, block_table, ctx, cos_cache, sin_cache,
                                        params, num_heads, num_kv_heads, head_dim, hidden_size, eps, scale)
                  : decode_layers(hidden, residual, pos, slots, block_table, ctx, cos_cache, sin_cache, params,
                                  num_heads, num_kv_heads, head_dim, hidden_size, intermediate_size, eps, scale);
    const at::Tensor normed = std::get<0>(add_rms_norm(hidden, residual, final_norm, final_eps));
    const at::Tensor logits = segmented_linear(normed, lm_head.data());
    TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= vocab_size, "greedy_decode_steps: the LM head gives ",
                logits.sizes(), " logits for a vocabulary of ", vocab_size);
    int64_t* next = out[step].data_ptr<int64_t>();
    argmax_rows(logits, vocab_size, next);
    std::memcpy(id, next, rows * sizeof(int64_t));
    int64_t* c = ctx.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
      ++p[r];
      ++c[r];
    }
  }
  return out;
}
