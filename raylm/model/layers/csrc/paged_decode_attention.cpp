// Paged decode attention on CPU: one query token per request against the
// request's blocks in the paged KV cache; built at first use by cpu_kernels.py.
//
// Work is split over requests (and runs of kv heads when requests are fewer
// than threads). Each task loads its query heads once (as float, pre-scaled),
// walks only the blocks that hold the request's context (no padding), and does
// a two-pass softmax in float: scores for every context token first, then
// exp/normalise, then the weighted V sum.
// Each K/V block is converted to float once and reused by every query head of
// the group (GQA); no padded copy of the context is ever made.
// Under context parallelism a rank holds only its shard of each request's
// blocks: `paged_decode_partial` attends over that shard (a context may be
// empty there) and also returns each head's log-sum-exp of scores, by which
// the shards' outputs are merged exactly (attention_merge.merge_partials).
// Its output stays float32 whatever q's dtype: rounding each shard's partial
// to bf16 before the merge made CP=2 drift from CP=1; the merge rounds once.
// With a bf16 query and cache on an AVX512-BF16 core a dedicated path scores
// with vdpbf16ps on the raw bf16 values, widens V inside the FMA, and
// prefetches the next block: it then runs at about the core's memory bandwidth.
// With a bf16 cache on an AVX2 core (no bf16 arithmetic) K and V rows are
// widened in registers into the FMAs, and eight dot products reduced at once.

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
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define RAYLM_AVX512_BF16 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RAYLM_AVX2_BF16_CACHE 1
#endif

namespace {

constexpr int kLanes = 8;  // head_dim is a multiple of this: one AVX2 register of floats

// Row loads into float. Plain loops over contiguous memory so that -O3
// vectorises them; bf16 -> float is a 16-bit shift of the bit pattern.
inline void load_row(const float* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}

inline void load_row(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t widened = static_cast<uint32_t>(bits[i]) << 16;
    float value;
    std::memcpy(&value, &widened, sizeof(value));
    dst[i] = value;
  }
}

inline void load_row(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// `n` token rows of `width` floats (a run of kv heads) in one block, as float
// rows `*row_stride` apart: a float cache is read in place, other dtypes are
// converted into `buffer`.
inline const float* block_rows(const float* src, int64_t n, int64_t width, int64_t token_stride, float*,
                               int64_t* row_stride) {
  (void)n;
  (void)width;
  *row_stride = token_stride;
  return src;
}

template <typename cache_t>
inline const float* block_rows(const cache_t* src, int64_t n, int64_t width, int64_t token_stride,
                               float* buffer, int64_t* row_stride) {
  for (int64_t t = 0; t < n; ++t) load_row(src + t * token_stride, buffer + t * width, width);
  *row_stride = width;
  return buffer;
}

// Scores of T consecutive rows against one query. Each row keeps its own
// kLanes-wide partial sums (independent FMA chains), and the partials are
// folded across rows at the end: much cheaper than one horizontal reduction
// per dot product when head_dim is small.
template <int T>
inline void dot_rows(const float* q, const float* rows, int64_t row_stride, int64_t head_dim, float* out) {
  float partial[T][kLanes] = {};
  for (int64_t j = 0; j < head_dim; j += kLanes)
    for (int t = 0; t < T; ++t)
      for (int l = 0; l < kLanes; ++l) partial[t][l] += q[j + l] * rows[t * row_stride + j + l];
  float sums[T] = {};
  for (int l = 0; l < kLanes; ++l)
    for (int t = 0; t < T; ++t) sums[t] += partial[t][l];
  for (int t = 0; t < T; ++t) out[t] = sums[t];
}

inline void score_rows(const float* q, const float* rows, int64_t row_stride, int64_t n, int64_t head_dim,
                       float* out) {
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) dot_rows<8>(q, rows + t * row_stride, row_stride, head_dim, out + t);
  for (; t < n; ++t) dot_rows<1>(q, rows + t * row_stride, row_stride, head_dim, out + t);
}

// acc[0:head_dim] += sum_t probs[t] * rows[t]: each kLanes-wide slice of the
// accumulator stays in a register while the rows stream past.
inline void accumulate_rows(const float* probs, const float* rows, int64_t row_stride, int64_t n,
                            int64_t head_dim, float* acc) {
  for (int64_t j = 0; j < head_dim; j += kLanes) {
    float slice[kLanes];
    for (int l = 0; l < kLanes; ++l) slice[l] = acc[j + l];
    for (int64_t t = 0; t < n; ++t)
      for (int l = 0; l < kLanes; ++l) slice[l] += probs[t] * rows[t * row_stride + j + l];
    for (int l = 0; l < kLanes; ++l) acc[j + l] = slice[l];
  }
}

// In place: s[i] = exp(s[i] - shift) for s[i] <= shift, returning the sum.
inline float exp_shifted_and_sum(float* s, int64_t n, float shift) {
  raylm::Floats8 sums{};
  int64_t i = 0;
  for (; i + raylm::kFloats8 <= n; i += raylm::kFloats8) {
    raylm::Floats8 v;
    std::memcpy(&v, s + i, sizeof(v));
    v = raylm::fast_exp(v - shift);
    std::memcpy(s + i, &v, sizeof(v));
    sums += v;
  }
  float sum = 0.f;
  for (int l = 0; l < raylm::kFloats8; ++l) sum += sums[l];
  for (; i < n; ++i) {
    s[i] = raylm::fast_exp(s[i] - shift);
    sum += s[i];
  }
  return sum;
}

#ifdef RAYLM_AVX512_BF16
// bf16 query and bf16 cache on a core with AVX512-BF16: scores come from
// vdpbf16ps on the raw bf16 bits (products are exact in float, sums are float),
// and V rows are widened in registers (a 16-bit shift) straight into the FMA,
// so no block is ever written out as float. Needs head_dim % 32 == 0.
constexpr int kBf16Pair = 32;  // bf16 elements per vdpbf16ps
constexpr int kTile = 16;      // tokens whose dot products are reduced together

// Lane i of the result is the horizontal sum of v[i]: a transpose-and-add tree,
// about three instructions per vector instead of one full reduction each.
inline __m512 reduce16(const __m512* v) {
  __m512 pairs[8];
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 quads[4];
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Each 128-bit chunk of quads[i] now holds partial sums of inputs 4i..4i+3.
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                  _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                  _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

// out[t] = scale * dot(q, row t) for n <= kTile rows `row_stride` bf16 apart.
inline void score_tile_bf16(const __m512i* q_pairs, int64_t num_pairs, const uint16_t* rows, int64_t row_stride,
                            int64_t n, float scale, float* out) {
  __m512 partial[kTile];
  for (int64_t t = 0; t < n; ++t) {
    const uint16_t* row = rows + t * row_stride;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < num_pairs; ++j)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)q_pairs[j], (__m512bh)_mm512_loadu_si512(row + j * kBf16Pair));
    partial[t] = acc;
  }
  for (int64_t t = n; t < kTile; ++t) partial[t] = _mm512_setzero_ps();
  const __m512 sums = _mm512_mul_ps(reduce16(partial), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1u), sums);
}

// The next block of the table is at an unrelated address, so the hardware
// prefetcher cannot run ahead into it: ask for its rows while this block computes.
// Into L2, not L1: a block's rows are 256 lines, far more than the core's L1
// fill buffers, which an L1 prefetch holds until its line arrives (64 requests
// x 192 tokens of the ~111M model's heads: 0.90-1.19 ms a layer against
// 1.83-2.19 with L1 prefetches; one request of 128 tokens the same).
inline void prefetch_rows(const uint16_t* rows, int64_t n, int64_t row_stride, int64_t width) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t d = 0; d < width; d += 32)  // one 64-byte line holds 32 bf16
      _mm_prefetch(reinterpret_cast<const char*>(rows + t * row_stride + d), _MM_HINT_T1);
}

inline __m512 widen_bf16(const uint16_t* src) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// For GC query heads sharing one kv head: acc[g][0:head_dim] += sum_t probs[g][t] * rows[t].
// Each V slice is widened once and feeds all GC accumulators held in registers.
template <int GC>
inline void accumulate_bf16(const float* const* probs, const uint16_t* rows, int64_t row_stride, int64_t n,
                            int64_t head_dim, float* const* acc) {
  for (int64_t j = 0; j < head_dim; j += 16) {
    __m512 a[GC];
    for (int g = 0; g < GC; ++g) a[g] = _mm512_loadu_ps(acc[g] + j);
    for (int64_t t = 0; t < n; ++t) {
      const __m512 v = widen_bf16(rows + t * row_stride + j);
      for (int g = 0; g < GC; ++g) a[g] = _mm512_fmadd_ps(_mm512_set1_ps(probs[g][t]), v, a[g]);
    }
    for (int g = 0; g < GC; ++g) _mm512_storeu_ps(acc[g] + j, a[g]);
  }
}

inline void accumulate_group_bf16(const float* const* probs, const uint16_t* rows, int64_t row_stride, int64_t n,
                                  int64_t head_dim, float* const* acc, int64_t group) {
  int64_t g = 0;
  for (; g + 4 <= group; g += 4) accumulate_bf16<4>(probs + g, rows, row_stride, n, head_dim, acc + g);
  switch (group - g) {
    case 3: return accumulate_bf16<3>(probs + g, rows, row_stride, n, head_dim, acc + g);
    case 2: return accumulate_bf16<2>(probs + g, rows, row_stride, n, head_dim, acc + g);
    case 1: return accumulate_bf16<1>(probs + g, rows, row_stride, n, head_dim, acc + g);
    default: return;
  }
}
#endif  // RAYLM_AVX512_BF16

#ifdef RAYLM_AVX2_BF16_CACHE
// bf16 query and cache on an AVX2 core (no bf16 arithmetic): K and V rows are
// widened in registers (a 16-bit shift) straight into the FMAs, never written
// out as float, and each widened row serves every query head of its group.
// The query heads are float, pre-scaled, as on the generic path. (The generic
// path widened each block into a buffer and scored one head at a time: on a
// Zen 3, 64 requests x ~200 tokens of the ~7M model's heads, a quarter of a
// decode step.)
constexpr int64_t kRowsAtOnce = 8;  // token rows of a block read before the next kv head's

inline __m256 widen8(const uint16_t* src) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// Lane i of the result is the horizontal sum of v[i].
inline __m256 reduce8(const __m256* v) {
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}

inline float dot_bf16(const float* q, const uint16_t* row, int64_t head_dim) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < head_dim; j += kLanes) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), widen8(row + j), acc);
  float lanes[kLanes];
  _mm256_storeu_ps(lanes, acc);
  float sum = 0.f;
  for (float lane : lanes) sum += lane;
  return sum;
}

// scores[g * ctx + t] = dot(q head g, row t) for the G query heads of one kv
// head (q: G rows of head_dim floats) and n rows `row_stride` bf16 apart.
// 8 / G rows at a time, so that 8 dot products are reduced together.
template <int G>
inline void score_rows_bf16(const float* q, int64_t head_dim, const uint16_t* rows, int64_t row_stride, int64_t n,
                            float* scores, int64_t ctx) {
  constexpr int T = kLanes / G;
  int64_t t0 = 0;
  for (; t0 + T <= n; t0 += T) {
    __m256 acc[kLanes];
    for (int i = 0; i < kLanes; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < head_dim; j += kLanes)
      for (int t = 0; t < T; ++t) {
        const __m256 k = widen8(rows + (t0 + t) * row_stride + j);
        for (int g = 0; g < G; ++g)
          acc[g * T + t] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * head_dim + j), k, acc[g * T + t]);
      }
    float sums[kLanes];
    _mm256_storeu_ps(sums, reduce8(acc));
    for (int g = 0; g < G; ++g)
      for (int t = 0; t < T; ++t) scores[g * ctx + t0 + t] = sums[g * T + t];
  }
  for (; t0 < n; ++t0)
    for (int g = 0; g < G; ++g) scores[g * ctx + t0] = dot_bf16(q + g * head_dim, rows + t0 * row_stride, head_dim);
}

// body(G, g) over a kv head's `group` query heads: G = group at once, from
// head g = 0, where the group is 1, 2, 4 or 8 heads (kLanes / G rows then
// fill a register's eight dot products); else G = 1 for each head g.
template <typename Body>
inline void for_group(int64_t group, const Body& body) {
  switch (group) {
    case 1: return body(std::integral_constant<int, 1>{}, 0);
    case 2: return body(std::integral_constant<int, 2>{}, 0);
    case 4: return body(std::integral_constant<int, 4>{}, 0);
    case 8: return body(std::integral_constant<int, 8>{}, 0);
    default:
      for (int64_t g = 0; g < group; ++g) body(std::integral_constant<int, 1>{}, g);
  }
}

inline void score_group_bf16(const float* q, int64_t group, int64_t head_dim, const uint16_t* rows,
                             int64_t row_stride, int64_t n, float* scores, int64_t ctx) {
  for_group(group, [&](auto heads, int64_t g) {
    score_rows_bf16<decltype(heads)::value>(q + g * head_dim, head_dim, rows, row_stride, n, scores + g * ctx, ctx);
  });
}

// acc[g][s-th slice of 8] += sum_t probs[g * ctx + t] * rows[t][slice] for G
// heads and S slices, G x S accumulators held in registers while the rows
// stream past; each widened slice of V feeds all G heads.
template <int G, int S>
inline void accumulate_slices_bf16(const float* probs, int64_t ctx, const uint16_t* rows, int64_t row_stride,
                                   int64_t n, float* acc, int64_t head_dim) {
  __m256 a[G][S];
  for (int g = 0; g < G; ++g)
    for (int s = 0; s < S; ++s) a[g][s] = _mm256_loadu_ps(acc + g * head_dim + s * kLanes);
  for (int64_t t = 0; t < n; ++t) {
    __m256 p[G];
    for (int g = 0; g < G; ++g) p[g] = _mm256_broadcast_ss(probs + g * ctx + t);
    for (int s = 0; s < S; ++s) {
      const __m256 v = widen8(rows + t * row_stride + s * kLanes);
      for (int g = 0; g < G; ++g) a[g][s] = _mm256_fmadd_ps(p[g], v, a[g][s]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int s = 0; s < S; ++s) _mm256_storeu_ps(acc + g * head_dim + s * kLanes, a[g][s]);
}

template <int G>
inline void accumulate_rows_bf16(const float* probs, int64_t ctx, const uint16_t* rows, int64_t row_stride,
                                 int64_t n, float* acc, int64_t head_dim) {
  constexpr int S = kLanes / G;  // eight accumulators
  int64_t j = 0;
  for (; j + S * kLanes <= head_dim; j += S * kLanes)
    accumulate_slices_bf16<G, S>(probs, ctx, rows + j, row_stride, n, acc + j, head_dim);
  for (; j < head_dim; j += kLanes) accumulate_slices_bf16<G, 1>(probs, ctx, rows + j, row_stride, n, acc + j, head_dim);
}

inline void accumulate_group_rows_bf16(const float* probs, int64_t group, int64_t ctx, const uint16_t* rows,
                                       int64_t row_stride, int64_t n, float* acc, int64_t head_dim) {
  for_group(group, [&](auto heads, int64_t g) {
    accumulate_rows_bf16<decltype(heads)::value>(probs + g * ctx, ctx, rows, row_stride, n, acc + g * head_dim,
                                                 head_dim);
  });
}
#endif  // RAYLM_AVX2_BF16_CACHE

// Sixteen running maxima folded at the end: a single running max is one long
// chain of dependent max instructions, which the compiler leaves scalar.
inline float max_of(const float* s, int64_t n) {
  constexpr int kWays = 16;
  float lanes[kWays];
  for (int l = 0; l < kWays; ++l) lanes[l] = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + kWays <= n; i += kWays)
    for (int l = 0; l < kWays; ++l) lanes[l] = s[i + l] > lanes[l] ? s[i + l] : lanes[l];
  float m = -std::numeric_limits<float>::infinity();
  for (; i < n; ++i) m = std::max(m, s[i]);
  for (int l = 0; l < kWays; ++l) m = std::max(m, lanes[l]);
  return m;
}

// Each of `heads` rows of `ctx` scores becomes exp(score - row max), unnormalised;
// inv_sum[h] is the reciprocal of row h's sum (applied to the output at the end),
// lse[h] (when asked for) the row's log-sum-exp: -inf for an empty row.
inline void softmax_rows(float* scores, int64_t heads, int64_t ctx, float* inv_sum, float* lse) {
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores + h * ctx;
    const float shift = max_of(s, ctx);
    const float sum = exp_shifted_and_sum(s, ctx, shift);
    inv_sum[h] = sum > 0.f ? 1.f / sum : 0.f;
    if (lse != nullptr) lse[h] = sum > 0.f ? shift + std::log(sum) : -std::numeric_limits<float>::infinity();
  }
}

template <typename out_t>
inline void write_rows(const float* acc, const float* inv_sum, int64_t heads, int64_t head_dim, out_t* out,
                       int64_t out_head_stride) {
  for (int64_t h = 0; h < heads; ++h) {
    out_t* dst = out + h * out_head_stride;
    const float* src = acc + h * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<out_t>(src[d] * inv_sum[h]);
  }
}

// Where a task's output rows go: q's dtype for a whole sequence, float32 for a
// CP shard's partial (with its log-sum-exp), which is merged before rounding.
template <typename q_t>
struct OutRows {
  q_t* whole;      // [B, H, D] in q's dtype, or null
  float* partial;  // [B, H, D] float32, or null
  float* lse;      // [B, H] float32 beside `partial`, or null
  int64_t req_stride, head_stride, num_heads;
};

// The task's rows (acc / sum) of request b from head `first_head` on.
template <typename q_t>
inline void write_heads(const OutRows<q_t>& out, int64_t b, int64_t first_head, const float* acc,
                        const float* inv_sum, const float* head_lse, int64_t heads, int64_t head_dim) {
  const int64_t offset = b * out.req_stride + first_head * out.head_stride;
  if (out.partial == nullptr) return write_rows(acc, inv_sum, heads, head_dim, out.whole + offset, out.head_stride);
  write_rows(acc, inv_sum, heads, head_dim, out.partial + offset, out.head_stride);
  std::copy(head_lse, head_lse + heads, out.lse + b * out.num_heads + first_head);
}

template <typename q_t, typename cache_t>
void paged_decode_impl(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                       const at::Tensor& context_lens, double scale, at::Tensor& out, at::Tensor* lse) {
  const int64_t num_reqs = q.size(0);
  const int64_t num_heads = q.size(1);
  const int64_t head_dim = q.size(2);
  const int64_t block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;

  const q_t* q_ptr = q.data_ptr<q_t>();
  const int64_t q_req_stride = q.stride(0), q_head_stride = q.stride(1);
  // With lse (a CP shard) `out` is float32, else q's dtype; either way [B, H, D] contiguous.
  const OutRows<q_t> rows_out{lse != nullptr ? nullptr : out.data_ptr<q_t>(),
                              lse != nullptr ? out.data_ptr<float>() : nullptr,
                              lse != nullptr ? lse->data_ptr<float>() : nullptr, out.stride(0), out.stride(1),
                              num_heads};

  const cache_t* k_cache = kv_cache.data_ptr<cache_t>();
  const cache_t* v_cache = k_cache + kv_cache.stride(0);
  const int64_t block_stride = kv_cache.stride(1);
  const int64_t token_stride = kv_cache.stride(2);
  const int64_t kv_head_stride = kv_cache.stride(3);

  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t table_stride = block_table.stride(0);
  const int64_t* ctx_lens = context_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);

  // A task is one request and a run of its kv heads: reading all heads of a
  // block at once keeps the cache reads contiguous. Requests are split into
  // head runs only when there are fewer requests than threads.
  const int64_t threads = at::get_num_threads();
  const int64_t chunks = std::min(num_kv_heads, std::max<int64_t>(1, (threads + num_reqs - 1) / num_reqs));
  const int64_t heads_per_chunk = (num_kv_heads + chunks - 1) / chunks;
  const int64_t num_chunks = (num_kv_heads + heads_per_chunk - 1) / heads_per_chunk;
  const int64_t num_tasks = num_reqs * num_chunks;

  // Small batches with short contexts finish faster on one thread than the
  // cost of waking the pool; aim for roughly 64k multiply-adds per chunk.
  int64_t total_ctx = 0;
  for (int64_t b = 0; b < num_reqs; ++b) total_ctx += ctx_lens[b];
  const int64_t work_per_task =
      std::max<int64_t>(1, total_ctx / num_reqs * heads_per_chunk * group * head_dim * 2);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / work_per_task);

#ifdef RAYLM_AVX512_BF16
  constexpr bool kBf16Inputs = std::is_same_v<q_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>;
  const bool bf16_dot = kBf16Inputs && head_dim % kBf16Pair == 0;
  const int64_t num_pairs = head_dim / kBf16Pair;
#endif

  raylm::parallel_ranges(num_tasks, grain, [&](int64_t begin, int64_t end) {
    const int64_t max_heads = heads_per_chunk * group;
#ifdef RAYLM_AVX512_BF16
    // The query heads as raw bf16 bits, unscaled so they stay exact; the scale
    // is applied to the float scores instead.
    std::vector<__m512i> q_pairs(bf16_dot ? max_heads * num_pairs : 0);
    std::vector<const float*> group_probs(group);
    std::vector<float*> group_acc(group);
#endif
    std::vector<float> q_heads(max_heads * head_dim);
    std::vector<float> acc(max_heads * head_dim);
    std::vector<float> inv_sum(max_heads);
    std::vector<float> head_lse(max_heads);
    float* const want_lse = rows_out.lse != nullptr ? head_lse.data() : nullptr;
    // One block of K or V for the task's kv heads, as float: [block_size, heads_per_chunk, D].
    std::vector<float> block_buffer(block_size * heads_per_chunk * head_dim);
    std::vector<float> scores;  // [heads][ctx]

    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_chunks;
      const int64_t kv_first = (task % num_chunks) * heads_per_chunk;
      const int64_t kv_count = std::min(heads_per_chunk, num_kv_heads - kv_first);
      const int64_t heads = kv_count * group;
      const int64_t first_head = kv_first * group;
      const int64_t width = kv_count * head_dim;  // contiguous: the cache is [.., KVH, D]
      const int64_t ctx = ctx_lens[b];

#ifdef RAYLM_AVX512_BF16
      if (bf16_dot) {
        for (int64_t h = 0; h < heads; ++h)
          std::memcpy(q_pairs.data() + h * num_pairs, q_ptr + b * q_req_stride + (first_head + h) * q_head_stride,
                      head_dim * sizeof(uint16_t));
        scores.resize(heads * ctx);
        const int64_t* blocks = table + b * table_stride;
        for (int64_t start = 0; start < ctx; start += block_size) {
          const int64_t n = std::min(block_size, ctx - start);
          const uint16_t* k_block = reinterpret_cast<const uint16_t*>(
              k_cache + blocks[start / block_size] * block_stride + kv_first * kv_head_stride);
          // After the last K block comes the first V block of pass 2.
          const bool last = start + block_size >= ctx;
          const uint16_t* next_block = reinterpret_cast<const uint16_t*>(
              (last ? v_cache + blocks[0] * block_stride : k_cache + blocks[start / block_size + 1] * block_stride) +
              kv_first * kv_head_stride);
          const int64_t next_n = last ? std::min(block_size, ctx) : std::min(block_size, ctx - start - block_size);
          for (int64_t h = 0; h < heads; ++h) {
            const uint16_t* rows = k_block + (h / group) * kv_head_stride;
            if (h % group == 0)
              prefetch_rows(next_block + (h / group) * kv_head_stride, next_n, token_stride, head_dim);
            for (int64_t t = 0; t < n; t += kTile)
              score_tile_bf16(q_pairs.data() + h * num_pairs, num_pairs, rows + t * token_stride, token_stride,
                              std::min<int64_t>(kTile, n - t), fscale, scores.data() + h * ctx + start + t);
          }
        }
        softmax_rows(scores.data(), heads, ctx, inv_sum.data(), want_lse);
        std::fill(acc.begin(), acc.begin() + heads * head_dim, 0.f);
        for (int64_t start = 0; start < ctx; start += block_size) {
          const int64_t n = std::min(block_size, ctx - start);
          const uint16_t* v_block = reinterpret_cast<const uint16_t*>(
              v_cache + blocks[start / block_size] * block_stride + kv_first * kv_head_stride);
          // After the last V block comes the first K block of the next task, if any.
          const uint16_t* next_block = nullptr;
          int64_t next_n = 0, next_heads = kv_count;
          if (start + block_size < ctx) {
            next_block = reinterpret_cast<const uint16_t*>(v_cache + blocks[start / block_size + 1] * block_stride +
                                                           kv_first * kv_head_stride);
            next_n = std::min(block_size, ctx - start - block_size);
          } else if (task + 1 < end) {
            const int64_t next_b = (task + 1) / num_chunks;
            const int64_t next_kv_first = ((task + 1) % num_chunks) * heads_per_chunk;
            next_block = reinterpret_cast<const uint16_t*>(k_cache + table[next_b * table_stride] * block_stride +
                                                           next_kv_first * kv_head_stride);
            next_n = std::min(block_size, ctx_lens[next_b]);
            next_heads = std::min(kv_count, num_kv_heads - next_kv_first);
          }
          for (int64_t kh = 0; kh < kv_count; ++kh) {
            if (kh < next_heads && next_n > 0)
              prefetch_rows(next_block + kh * kv_head_stride, next_n, token_stride, head_dim);
            for (int64_t g = 0; g < group; ++g) {
              group_probs[g] = scores.data() + (kh * group + g) * ctx + start;
              group_acc[g] = acc.data() + (kh * group + g) * head_dim;
            }
            accumulate_group_bf16(group_probs.data(), v_block + kh * kv_head_stride, token_stride, n, head_dim,
                                  group_acc.data(), group);
          }
        }
        write_heads(rows_out, b, first_head, acc.data(), inv_sum.data(), head_lse.data(), heads, head_dim);
        continue;
      }
#endif

      for (int64_t h = 0; h < heads; ++h) {
        float* qh = q_heads.data() + h * head_dim;
        load_row(q_ptr + b * q_req_stride + (first_head + h) * q_head_stride, qh, head_dim);
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) qh[d] *= fscale;
      }

      // Pass 1: scores for every context token, walking the block table.
      scores.resize(heads * ctx);
      const int64_t* blocks = table + b * table_stride;
#ifdef RAYLM_AVX2_BF16_CACHE
      if constexpr (std::is_same_v<cache_t, c10::BFloat16>) {
        const auto bits = [&](const cache_t* block) { return reinterpret_cast<const uint16_t*>(block); };
        // A block is read a few whole token rows (all the task's kv heads) at
        // a time, not one kv head's column of rows after another: a walk in
        // address order, which the hardware prefetchers follow (the ~111M
        // model's 8 kv heads of 64, 64 requests x 192 tokens: 2.4-2.9 ms a
        // layer -> 1.7-2.0 on a Zen 3).
        for (int64_t start = 0; start < ctx; start += block_size) {
          const int64_t n = std::min(block_size, ctx - start);
          const cache_t* k_block = k_cache + blocks[start / block_size] * block_stride + kv_first * kv_head_stride;
          for (int64_t t = 0; t < n; t += kRowsAtOnce)
            for (int64_t kh = 0; kh < kv_count; ++kh)
              score_group_bf16(q_heads.data() + kh * group * head_dim, group, head_dim,
                               bits(k_block + t * token_stride + kh * kv_head_stride), token_stride,
                               std::min(kRowsAtOnce, n - t), scores.data() + kh * group * ctx + start + t, ctx);
        }
        softmax_rows(scores.data(), heads, ctx, inv_sum.data(), want_lse);
        std::fill(acc.begin(), acc.begin() + heads * head_dim, 0.f);
        for (int64_t start = 0; start < ctx; start += block_size) {
          const int64_t n = std::min(block_size, ctx - start);
          const cache_t* v_block = v_cache + blocks[start / block_size] * block_stride + kv_first * kv_head_stride;
          for (int64_t t = 0; t < n; t += kRowsAtOnce)
            for (int64_t kh = 0; kh < kv_count; ++kh)
              accumulate_group_rows_bf16(scores.data() + kh * group * ctx + start + t, group, ctx,
                                         bits(v_block + t * token_stride + kh * kv_head_stride), token_stride,
                                         std::min(kRowsAtOnce, n - t), acc.data() + kh * group * head_dim, head_dim);
        }
        write_heads(rows_out, b, first_head, acc.data(), inv_sum.data(), head_lse.data(), heads, head_dim);
        continue;
      }
#endif
      int64_t row_stride = 0;
      for (int64_t start = 0; start < ctx; start += block_size) {
        const int64_t n = std::min(block_size, ctx - start);
        const cache_t* k_block = k_cache + blocks[start / block_size] * block_stride + kv_first * kv_head_stride;
        const float* rows = block_rows(k_block, n, width, token_stride, block_buffer.data(), &row_stride);
        for (int64_t h = 0; h < heads; ++h)
          score_rows(q_heads.data() + h * head_dim, rows + (h / group) * head_dim, row_stride, n, head_dim,
                     scores.data() + h * ctx + start);
      }

      // Softmax per head, in float, shifted by the max for stability.
      softmax_rows(scores.data(), heads, ctx, inv_sum.data(), want_lse);

      // Pass 2: probability-weighted sum of V rows.
      std::fill(acc.begin(), acc.begin() + heads * head_dim, 0.f);
      for (int64_t start = 0; start < ctx; start += block_size) {
        const int64_t n = std::min(block_size, ctx - start);
        const cache_t* v_block = v_cache + blocks[start / block_size] * block_stride + kv_first * kv_head_stride;
        const float* rows = block_rows(v_block, n, width, token_stride, block_buffer.data(), &row_stride);
        for (int64_t h = 0; h < heads; ++h)
          accumulate_rows(scores.data() + h * ctx + start, rows + (h / group) * head_dim, row_stride, n, head_dim,
                          acc.data() + h * head_dim);
      }

      write_heads(rows_out, b, first_head, acc.data(), inv_sum.data(), head_lse.data(), heads, head_dim);
    }
  });
}

template <typename q_t>
void dispatch_cache(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                    const at::Tensor& context_lens, double scale, at::Tensor& out, at::Tensor* lse) {
  switch (kv_cache.scalar_type()) {
    case at::kFloat:
      return paged_decode_impl<q_t, float>(q, kv_cache, block_table, context_lens, scale, out, lse);
    case at::kBFloat16:
      return paged_decode_impl<q_t, c10::BFloat16>(q, kv_cache, block_table, context_lens, scale, out, lse);
    case at::kHalf:
      return paged_decode_impl<q_t, c10::Half>(q, kv_cache, block_table, context_lens, scale, out, lse);
    default:
      TORCH_CHECK(false, "paged_decode: unsupported cache dtype ", kv_cache.scalar_type());
  }
}

// Checks the arguments and every block index the kernel will touch (so a
// bad table is an error here rather than an out-of-bounds read in the
// parallel loop), then runs it: (out, lse), lse undefined unless `with_lse`.
// A context may be empty only with lse (a CP rank's shard): out 0, lse -inf.
std::tuple<at::Tensor, at::Tensor> run_paged_decode(const at::Tensor& q, const at::Tensor& kv_cache,
                                                    const at::Tensor& block_table, const at::Tensor& context_lens,
                                                    double scale, bool with_lse) {
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

  const int64_t min_ctx = with_lse ? 0 : 1;
  const int64_t max_blocks = block_table.size(1);
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* ctx_lens = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < num_reqs; ++b) {
    const int64_t ctx = ctx_lens[b];
    TORCH_CHECK(ctx >= min_ctx && ctx <= max_blocks * block_size, "paged_decode: context length ", ctx,
                " out of range for request ", b);
    const int64_t used = (ctx + block_size - 1) / block_size;
    for (int64_t j = 0; j < used; ++j) {
      const int64_t blk = table[b * block_table.stride(0) + j];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "paged_decode: block id ", blk, " out of range");
    }
  }

  at::Tensor out = at::empty({num_reqs, num_heads, head_dim}, with_lse ? q.options().dtype(at::kFloat) : q.options());
  at::Tensor lse = with_lse ? at::empty({num_reqs, num_heads}, q.options().dtype(at::kFloat)) : at::Tensor();
  at::Tensor* lse_arg = with_lse ? &lse : nullptr;
  switch (q.scalar_type()) {
    case at::kFloat:
      dispatch_cache<float>(q, kv_cache, block_table, context_lens, scale, out, lse_arg);
      break;
    case at::kBFloat16:
      dispatch_cache<c10::BFloat16>(q, kv_cache, block_table, context_lens, scale, out, lse_arg);
      break;
    case at::kHalf:
      dispatch_cache<c10::Half>(q, kv_cache, block_table, context_lens, scale, out, lse_arg);
      break;
    default:
      TORCH_CHECK(false, "paged_decode: unsupported query dtype ", q.scalar_type());
  }
  return {out, lse};
}

}  // namespace

// q [B, H, D] (last dim contiguous); kv_cache [2, num_blocks, block_size, KVH, D];
// block_table [B, max_blocks] int64; context_lens [B] int64 -> out [B, H, D] in q's dtype.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                        const at::Tensor& context_lens, double scale) {
  return std::get<0>(run_paged_decode(q, kv_cache, block_table, context_lens, scale, false));
}

// As paged_decode over one shard of each request's context (context_lens may
// be 0): out [B, H, D] float32 (not q's dtype: it is merged before any rounding)
// and lse [B, H] float32, each head's log-sum-exp of scores.
std::tuple<at::Tensor, at::Tensor> paged_decode_partial(const at::Tensor& q, const at::Tensor& kv_cache,
                                                        const at::Tensor& block_table,
                                                        const at::Tensor& context_lens, double scale) {
  return run_paged_decode(q, kv_cache, block_table, context_lens, scale, true);
}
