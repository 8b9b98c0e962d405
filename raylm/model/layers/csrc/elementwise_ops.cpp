// Fused elementwise ops of the Llama block on CPU: SiLU-and-mul, RMSNorm (with
// the residual add fused in) and neox-style rotary embedding.
//
// Each replaces several torch ops that each read and write the whole
// activation (a 2048-token prefill step spent a third of its time in them).
// They keep torch's rounding: wherever the torch path rounds an intermediate
// to the activation dtype (bf16 or fp16), these round it the same way, so
// outputs match the torch path except where a float exp or sum differs in its
// last bit (the exp here is a polynomial; the sums run in another order).
//
// Loops run over contiguous float rows so that -O3 vectorises them; rows are
// split over threads (raylm::parallel_ranges: the work team inside a fused
// decode step, OpenMP elsewhere).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "fast_exp.h"
#include "work_team.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

// ---- loads, stores and rounding, per activation dtype ----------------------

inline float bits_to_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline uint32_t float_to_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// Round to nearest even, as c10::BFloat16 does; NaN stays (a quiet) NaN.
inline uint16_t bf16_bits(float value) {
  const uint32_t u = float_to_bits(value);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t(0x7fc0) : uint16_t(rounded);
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const c10::BFloat16* p, int64_t i) {
  return bits_to_float(uint32_t(reinterpret_cast<const uint16_t*>(p)[i]) << 16);
}
inline float load(const c10::Half* p, int64_t i) { return float(p[i]); }

inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(c10::BFloat16* p, int64_t i, float v) { reinterpret_cast<uint16_t*>(p)[i] = bf16_bits(v); }
inline void store(c10::Half* p, int64_t i, float v) { p[i] = c10::Half(v); }

// v rounded to scalar_t's precision, kept as float: what torch holds after an
// op whose result has that dtype.
template <typename scalar_t>
inline float round_to(float v) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return bits_to_float(uint32_t(bf16_bits(v)) << 16);
  } else if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    return float(c10::Half(v));
  } else {
    return v;
  }
}

// Rows per parallel task: enough work to be worth a thread's wake-up.
inline int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1)); }

void check_cpu_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, ": CPU tensors only");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, what, ": expected [rows, width] with contiguous rows");
}

void check_norm_weight(const at::Tensor& weight, const at::Tensor& x, const char* what) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              what, ": weight must be a contiguous [width] tensor of x's dtype");
}

// ---- SiLU and mul --------------------------------------------------------------

// x[i] = silu(x[i]) = x[i] / (1 + exp(-x[i])), in float, eight at a time.
inline void silu_in_place(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + raylm::kFloats8 <= n; i += raylm::kFloats8) {
    raylm::Floats8 g;
    std::memcpy(&g, x + i, sizeof(g));
    g = g / (1.f + raylm::fast_exp(-g));
    std::memcpy(x + i, &g, sizeof(g));
  }
  for (; i < n; ++i) x[i] = x[i] / (1.f + raylm::fast_exp(-x[i]));
}

template <typename scalar_t>
void silu_and_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), width = out.size(1), in_stride = gate_up.stride(0);
  const scalar_t* in = gate_up.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  raylm::parallel_ranges(rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    // Three passes over a row in L1: the dtype conversions are plain loops the
    // compiler vectorises (it leaves them scalar when fused with the exp).
    std::vector<float> row(width);
    float* h = row.data();
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* gate = in + r * in_stride;
      const scalar_t* up = gate + width;
      scalar_t* dst = o + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) h[i] = load(gate, i);
      silu_in_place(h, width);
      // torch: silu(gate) in the activation dtype, then the product.
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) store(dst, i, round_to<scalar_t>(h[i]) * load(up, i));
    }
  });
}

// ---- RMSNorm -------------------------------------------------------------------

// out = weight * norm(x) per row; with `residual`, x + residual is normed and
// also written to residual_out. All in float, rounded where torch rounds:
// the sum, the normed row (cast back before the weight), the product.
template <typename scalar_t>
void rms_norm_impl(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps,
                   at::Tensor& out, at::Tensor* residual_out) {
  const int64_t rows = x.size(0), width = x.size(1);
  const int64_t x_stride = x.stride(0), r_stride = residual ? residual->stride(0) : 0;
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* rp = residual ? residual->data_ptr<scalar_t>() : nullptr;
  const scalar_t* wp = weight.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  scalar_t* rop = residual_out ? residual_out->data_ptr<scalar_t>() : nullptr;
  const float inv_width = 1.f / float(width);
  raylm::parallel_ranges(rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    std::vector<float> row(width);
    float* h = row.data();
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* src = xp + r * x_stride;
      if (rp != nullptr) {
        const scalar_t* res = rp + r * r_stride;
        scalar_t* res_out = rop + r * width;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) {
          h[i] = round_to<scalar_t>(load(src, i) + load(res, i));
          store(res_out, i, h[i]);
        }
      } else {
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) h[i] = load(src, i);
      }
      float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
      for (int64_t i = 0; i < width; ++i) sum_sq += h[i] * h[i];
      const float inv_rms = 1.f / std::sqrt(sum_sq * inv_width + float(eps));
      scalar_t* dst = op + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) store(dst, i, load(wp, i) * round_to<scalar_t>(h[i] * inv_rms));
    }
  });
}

// ---- rotary embedding (neox: rotate halves) --------------------------------------

// One [rows, heads * head_dim] tensor rotated into `out` (contiguous). cos/sin
// come from float caches, rounded to the activation dtype first as HF does.
template <typename scalar_t>
void rotate_impl(const at::Tensor& x, const int64_t* positions, const float* cos_cache, const float* sin_cache,
                 int64_t head_dim, at::Tensor& out) {
  const int64_t rows = x.size(0), width = x.size(1), half = head_dim / 2, heads = width / head_dim;
  const int64_t x_stride = x.stride(0);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  raylm::parallel_ranges(rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    std::vector<float> cs(2 * half);
    float* c = cs.data();
    float* s = c + half;
    for (int64_t r = begin; r < end; ++r) {
      const float* cos_row = cos_cache + positions[r] * half;
      const float* sin_row = sin_cache + positions[r] * half;
      for (int64_t i = 0; i < half; ++i) {
        c[i] = round_to<scalar_t>(cos_row[i]);
        s[i] = round_to<scalar_t>(sin_row[i]);
      }
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* src = xp + r * x_stride + h * head_dim;
        scalar_t* dst = op + r * width + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = load(src, i), x2 = load(src, i + half);
          // torch: each product, then the sum, rounded to the activation dtype.
          store(dst, i, round_to<scalar_t>(x1 * c[i]) - round_to<scalar_t>(x2 * s[i]));
          store(dst, i + half, round_to<scalar_t>(x2 * c[i]) + round_to<scalar_t>(x1 * s[i]));
        }
      }
    }
  });
}

template <typename F>
void dispatch_dtype(const at::Tensor& t, const char* what, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return f(float{});
    case at::kBFloat16:
      return f(c10::BFloat16{});
    case at::kHalf:
      return f(c10::Half{});
    default:
      TORCH_CHECK(false, what, ": unsupported dtype ", t.scalar_type());
  }
}

}  // namespace

// gate_up [rows, 2 * width] (gate first, then up) -> silu(gate) * up, [rows, width].
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_cpu_rows(gate_up, "silu_and_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: the last dim must be even");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  dispatch_dtype(gate_up, "silu_and_mul", [&](auto tag) { silu_and_mul_impl<decltype(tag)>(gate_up, out); });
  return out;
}

// x [rows, width] -> weight * x / rms(x), [rows, width].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_cpu_rows(x, "rms_norm");
  check_norm_weight(weight, x, "rms_norm");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  dispatch_dtype(x, "rms_norm", [&](auto tag) { rms_norm_impl<decltype(tag)>(x, nullptr, weight, eps, out, nullptr); });
  return out;
}

// (x, residual) -> (norm(x + residual) * weight, x + residual).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_cpu_rows(x, "add_rms_norm");
  check_cpu_rows(residual, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must match x");
  check_norm_weight(weight, x, "add_rms_norm");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  at::Tensor residual_out = at::empty({x.size(0), x.size(1)}, x.options());
  dispatch_dtype(x, "add_rms_norm",
                 [&](auto tag) { rms_norm_impl<decltype(tag)>(x, &residual, weight, eps, out, &residual_out); });
  return {out, residual_out};
}

// positions [rows] int64; q [rows, q_heads * head_dim], k [rows, kv_heads * head_dim];
// cos/sin caches [max_position, head_dim / 2] float32 -> (rotated q, rotated k).
std::tuple<at::Tensor, at::Tensor> rotary_neox(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                                               int64_t head_dim) {
  check_cpu_rows(q, "rotary_neox");
  check_cpu_rows(k, "rotary_neox");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "rotary_neox: q and k dtypes differ");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && q.size(1) % head_dim == 0 && k.size(1) % head_dim == 0,
              "rotary_neox: widths must be multiples of an even head_dim");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.is_contiguous() &&
                  positions.size(0) == q.size(0) && k.size(0) == q.size(0),
              "rotary_neox: positions must be a contiguous [rows] int64 tensor");
  for (const at::Tensor* cache : {&cos_cache, &sin_cache}) {
    TORCH_CHECK(cache->scalar_type() == at::kFloat && cache->dim() == 2 && cache->is_contiguous() &&
                    cache->size(1) == head_dim / 2 && cache->device().is_cpu(),
                "rotary_neox: cos/sin caches must be contiguous [max_position, head_dim / 2] float32");
  }
  TORCH_CHECK(cos_cache.size(0) == sin_cache.size(0), "rotary_neox: cos and sin caches differ in length");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_position = cos_cache.size(0);
  for (int64_t r = 0; r < positions.size(0); ++r) {
    TORCH_CHECK(pos[r] >= 0 && pos[r] < max_position, "rotary_neox: position ", pos[r], " out of range");
  }
  at::Tensor q_out = at::empty({q.size(0), q.size(1)}, q.options());
  at::Tensor k_out = at::empty({k.size(0), k.size(1)}, k.options());
  dispatch_dtype(q, "rotary_neox", [&](auto tag) {
    using scalar_t = decltype(tag);
    rotate_impl<scalar_t>(q, pos, cos_cache.data_ptr<float>(), sin_cache.data_ptr<float>(), head_dim, q_out);
    rotate_impl<scalar_t>(k, pos, cos_cache.data_ptr<float>(), sin_cache.data_ptr<float>(), head_dim, k_out);
  });
  return {q_out, k_out};
}
