// Paged decode attention on CPU: one query token per request against the
// request's blocks in the paged KV cache; built at first use by cpu_attention_kernel.py.
//
// Work is split over (request, kv head) pairs. Each task loads its group of
// query heads once (as float, pre-scaled), walks only the blocks that hold the
// request's context (no padding), and does a two-pass softmax in float: scores
// for every context token first, then exp/normalise, then the weighted V sum.
// Each K/V row is converted to float once and reused by every query head of the
// group (GQA), which is where most of the saving over a padded gather comes from.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Row loads into float. Plain loops over contiguous memory so that -O3
// vectorises them; bf16 -> float is a 16-bit shift of the bit pattern.
inline void load_row(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

inline void load_row(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t widened[256];
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) widened[i] = static_cast<uint32_t>(bits[i]) << 16;
  std::memcpy(dst, widened, n * sizeof(float));
}

inline void load_row(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

template <typename q_t, typename cache_t>
void paged_decode_impl(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                       const at::Tensor& context_lens, double scale, at::Tensor& out) {
  const int64_t num_reqs = q.size(0);
  const int64_t num_heads = q.size(1);
  const int64_t head_dim = q.size(2);
  const int64_t block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;

  const q_t* q_ptr = q.data_ptr<q_t>();
  const int64_t q_req_stride = q.stride(0), q_head_stride = q.stride(1);
  q_t* out_ptr = out.data_ptr<q_t>();
  const int64_t out_req_stride = out.stride(0), out_head_stride = out.stride(1);

  const cache_t* k_cache = kv_cache.data_ptr<cache_t>();
  const cache_t* v_cache = k_cache + kv_cache.stride(0);
  const int64_t block_stride = kv_cache.stride(1);
  const int64_t token_stride = kv_cache.stride(2);
  const int64_t kv_head_stride = kv_cache.stride(3);

  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t table_stride = block_table.stride(0);
  const int64_t* ctx_lens = context_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);

  // Small batches with short contexts finish faster on one thread than the
  // cost of waking the pool; aim for roughly 64k multiply-adds per chunk.
  int64_t total_ctx = 0;
  for (int64_t b = 0; b < num_reqs; ++b) total_ctx += ctx_lens[b];
  const int64_t num_tasks = num_reqs * num_kv_heads;
  const int64_t work_per_task = std::max<int64_t>(1, total_ctx / std::max<int64_t>(1, num_reqs) * group * head_dim * 2);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / work_per_task);

  at::parallel_for(0, num_tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> q_group(group * head_dim);
    std::vector<float> acc(group * head_dim);
    std::vector<float> row(head_dim);
    std::vector<float> scores;  // [group][ctx]

    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads;
      const int64_t kv_head = task % num_kv_heads;
      const int64_t ctx = ctx_lens[b];
      const int64_t first_head = kv_head * group;

      for (int64_t h = 0; h < group; ++h) {
        float* qh = q_group.data() + h * head_dim;
        load_row(q_ptr + b * q_req_stride + (first_head + h) * q_head_stride, qh, head_dim);
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) qh[d] *= fscale;
      }

      // Pass 1: scores for every context token, walking the block table.
      scores.resize(group * ctx);
      const int64_t* blocks = table + b * table_stride;
      for (int64_t start = 0; start < ctx; start += block_size) {
        const int64_t n = std::min(block_size, ctx - start);
        const cache_t* k_block = k_cache + blocks[start / block_size] * block_stride + kv_head * kv_head_stride;
        for (int64_t t = 0; t < n; ++t) {
          load_row(k_block + t * token_stride, row.data(), head_dim);
          for (int64_t h = 0; h < group; ++h)
            scores[h * ctx + start + t] = dot(q_group.data() + h * head_dim, row.data(), head_dim);
        }
      }

      // Softmax per head, in float, shifted by the max for stability.
      std::vector<float> inv_sum(group);
      for (int64_t h = 0; h < group; ++h) {
        float* s = scores.data() + h * ctx;
        float max_score = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < ctx; ++i) max_score = std::max(max_score, s[i]);
        float sum = 0.f;
        for (int64_t i = 0; i < ctx; ++i) {
          s[i] = std::exp(s[i] - max_score);
          sum += s[i];
        }
        inv_sum[h] = sum > 0.f ? 1.f / sum : 0.f;
      }

      // Pass 2: probability-weighted sum of V rows.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0; start < ctx; start += block_size) {
        const int64_t n = std::min(block_size, ctx - start);
        const cache_t* v_block = v_cache + blocks[start / block_size] * block_stride + kv_head * kv_head_stride;
        for (int64_t t = 0; t < n; ++t) {
          load_row(v_block + t * token_stride, row.data(), head_dim);
          for (int64_t h = 0; h < group; ++h)
            axpy(scores[h * ctx + start + t], row.data(), acc.data() + h * head_dim, head_dim);
        }
      }

      for (int64_t h = 0; h < group; ++h) {
        q_t* dst = out_ptr + b * out_req_stride + (first_head + h) * out_head_stride;
        const float* src = acc.data() + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<q_t>(src[d] * inv_sum[h]);
      }
    }
  });
}

template <typename q_t>
void dispatch_cache(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                    const at::Tensor& context_lens, double scale, at::Tensor& out) {
  switch (kv_cache.scalar_type()) {
    case at::kFloat:
      return paged_decode_impl<q_t, float>(q, kv_cache, block_table, context_lens, scale, out);
    case at::kBFloat16:
      return paged_decode_impl<q_t, c10::BFloat16>(q, kv_cache, block_table, context_lens, scale, out);
    case at::kHalf:
      return paged_decode_impl<q_t, c10::Half>(q, kv_cache, block_table, context_lens, scale, out);
    default:
      TORCH_CHECK(false, "paged_decode: unsupported cache dtype ", kv_cache.scalar_type());
  }
}

}  // namespace

// q [B, H, D] (last dim contiguous); kv_cache [2, num_blocks, block_size, KVH, D];
// block_table [B, max_blocks] int64; context_lens [B] int64 -> out [B, H, D] in q's dtype.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                        const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_decode: q must be [B, H, D] with contiguous D");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "paged_decode: kv_cache must be a contiguous [2, blocks, block_size, KVH, D] tensor");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 && block_table.stride(1) == 1,
              "paged_decode: block_table must be [B, max_blocks] int64 with contiguous rows");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.dim() == 1 && context_lens.is_contiguous(),
              "paged_decode: context_lens must be a contiguous [B] int64 tensor");
  const int64_t num_reqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == head_dim, "paged_decode: head_dim mismatch between q and cache");
  TORCH_CHECK(head_dim % 8 == 0 && head_dim <= 256, "paged_decode: head_dim must be a multiple of 8 up to 256");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "paged_decode: heads not a multiple of kv heads");
  TORCH_CHECK(block_table.size(0) == num_reqs && context_lens.size(0) == num_reqs, "paged_decode: batch mismatch");

  // Validate every block index the kernel will touch, so a bad table is an
  // error here rather than an out-of-bounds read in the parallel loop.
  const int64_t max_blocks = block_table.size(1);
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* ctx_lens = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < num_reqs; ++b) {
    const int64_t ctx = ctx_lens[b];
    TORCH_CHECK(ctx >= 1 && ctx <= max_blocks * block_size, "paged_decode: context length ", ctx,
                " out of range for request ", b);
    const int64_t used = (ctx + block_size - 1) / block_size;
    for (int64_t j = 0; j < used; ++j) {
      const int64_t blk = table[b * block_table.stride(0) + j];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "paged_decode: block id ", blk, " out of range");
    }
  }

  at::Tensor out = at::empty({num_reqs, num_heads, head_dim}, q.options());
  switch (q.scalar_type()) {
    case at::kFloat:
      dispatch_cache<float>(q, kv_cache, block_table, context_lens, scale, out);
      break;
    case at::kBFloat16:
      dispatch_cache<c10::BFloat16>(q, kv_cache, block_table, context_lens, scale, out);
      break;
    case at::kHalf:
      dispatch_cache<c10::Half>(q, kv_cache, block_table, context_lens, scale, out);
      break;
    default:
      TORCH_CHECK(false, "paged_decode: unsupported query dtype ", q.scalar_type());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Paged decode attention over a block table (CPU)",
        pybind11::arg("q"), pybind11::arg("kv_cache"), pybind11::arg("block_table"),
        pybind11::arg("context_lens"), pybind11::arg("scale"));
}
