// Matmuls on GGUF-quantized weights (Q8_0, Q4_0, Q4_K, Q6_K) on CPU, for the
// few-row activations of decode: y[m, n] = sum_k x[m, k] * W[n, k], with W
// read as stored (34, 18, 144 or 210 bytes per block) and each block widened
// to floats in registers (or a small stack buffer), never in a whole-matrix copy.
// Activations stay float (bf16 inputs are widened once per call), so results
// equal a float matmul on the dequantized weights up to summation order.
//
// quant_dequantize widens a whole weight (for prefill, where a float matmul on
// a transient copy is faster than widening each block for every row tile).
//
// Block layouts are ggml's (ggml-common.h), decoded as gguf-py's quants.py
// decodes them. With AVX-512 (the build is -march=native, one build per CPU
// kind: see cpu_kernels.py), every type's blocks are widened straight into
// registers; without it, a block is widened into an L1 buffer by loops that
// -O3 vectorises (AVX2).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <cstring>
#include <vector>

namespace {

enum QType : int64_t { Q8_0 = 0, Q4_0 = 1, Q4_K = 2, Q6_K = 3 };

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction, where c10::Half converts in software
#else
  return float(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// ---- one block -> floats ------------------------------------------------------

inline void dequant_q8_0(const uint8_t* b, float* y) {  // d, qs[32]
  const float d = half_at(b);
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int i = 0; i < 32; ++i) y[i] = d * float(q[i]);
}

inline void dequant_q4_0(const uint8_t* b, float* y) {  // d, qs[16]: low nibbles 0..15, high 16..31
  const float d = half_at(b);
  const uint8_t* q = b + 2;
  for (int i = 0; i < 16; ++i) {
    y[i] = d * float(int(q[i] & 0xF) - 8);
    y[i + 16] = d * float(int(q[i] >> 4) - 8);
  }
}

inline void scale_min_k4(int j, const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

inline void dequant_q4_k(const uint8_t* b, float* y) {  // d, dmin, scales[12], qs[128]
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* s = b + 4;
  const uint8_t* q = b + 16;
  for (int c = 0; c < 4; ++c) {
    uint8_t sc1, m1, sc2, m2;
    scale_min_k4(2 * c, s, &sc1, &m1);
    scale_min_k4(2 * c + 1, s, &sc2, &m2);
    const float d1 = d * sc1, o1 = dmin * m1, d2 = d * sc2, o2 = dmin * m2;
    const uint8_t* qc = q + 32 * c;
    float* yc = y + 64 * c;
    for (int l = 0; l < 32; ++l) {
      yc[l] = d1 * float(qc[l] & 0xF) - o1;
      yc[l + 32] = d2 * float(qc[l] >> 4) - o2;
    }
  }
}

inline void dequant_q6_k(const uint8_t* b, float* y) {  // ql[128], qh[64], scales[16] (int8), d
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* l8 = ql + 64 * half;
    const uint8_t* h8 = qh + 32 * half;
    const int8_t* s = sc + 8 * half;
    float* yh = y + 128 * half;
    for (int is = 0; is < 2; ++is) {  // 16 weights per scale
      const float s1 = d * s[is], s2 = d * s[is + 2], s3 = d * s[is + 4], s4 = d * s[is + 6];
      for (int j = 0; j < 16; ++j) {
        const int l = 16 * is + j;
        yh[l] = s1 * float(int((l8[l] & 0xF) | ((h8[l] & 3) << 4)) - 32);
        yh[l + 32] = s2 * float(int((l8[l + 32] & 0xF) | (((h8[l] >> 2) & 3) << 4)) - 32);
        yh[l + 64] = s3 * float(int((l8[l] >> 4) | (((h8[l] >> 4) & 3) << 4)) - 32);
        yh[l + 96] = s4 * float(int((l8[l + 32] >> 4) | (((h8[l] >> 6) & 3) << 4)) - 32);
      }
    }
  }
}

// Per type: weights and bytes per block, and one block widened to floats.
struct Q8_0T { static constexpr int block = 32, bytes = 34; static void dequant(const uint8_t* b, float* y) { dequant_q8_0(b, y); } };
struct Q4_0T { static constexpr int block = 32, bytes = 18; static void dequant(const uint8_t* b, float* y) { dequant_q4_0(b, y); } };
struct Q4_KT { static constexpr int block = 256, bytes = 144; static void dequant(const uint8_t* b, float* y) { dequant_q4_k(b, y); } };
struct Q6_KT { static constexpr int block = 256, bytes = 210; static void dequant(const uint8_t* b, float* y) { dequant_q6_k(b, y); } };

constexpr int kLanes = 16;   // one AVX-512 register of floats (two AVX2 ones)
constexpr int kRowTile = 4;  // activation rows sharing one widened block

// out[m] = dot(W row, x[m]) for `Rows` activation rows: each block widened once
// (inlined, into an L1 buffer) and used for every row of the tile.
template <typename Q, int Rows>
inline void row_tile(const uint8_t* wrow, int64_t blocks, const float* x, int64_t K, float* out) {
  alignas(64) float w[Q::block];
  alignas(64) float acc[Rows][kLanes] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    Q::dequant(wrow + b * Q::bytes, w);
    const float* xb = x + b * Q::block;
    for (int m = 0; m < Rows; ++m) {
      const float* xm = xb + m * K;
      for (int i = 0; i < Q::block; i += kLanes)
        for (int l = 0; l < kLanes; ++l) acc[m][l] += w[i + l] * xm[i + l];
    }
  }
  for (int m = 0; m < Rows; ++m) {
    float sum = 0.f;
    for (int l = 0; l < kLanes; ++l) sum += acc[m][l];
    out[m] = sum;
  }
}

#if defined(__AVX512F__)
// Q8_0 and Q4_0 blocks (32 weights) widened straight into two AVX-512
// registers: the generic path's buffer round trip costs more than the
// multiply for blocks this small.
template <typename Q, int Rows>
inline void row_tile_avx512(const uint8_t* wrow, int64_t blocks, const float* x, int64_t K, float* out) {
  __m512 acc[Rows];
  for (int m = 0; m < Rows; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = wrow + b * Q::bytes;
    const __m512 d = _mm512_set1_ps(half_at(blk));
    __m512 w0, w1;
    if constexpr (std::is_same_v<Q, Q8_0T>) {
      w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2))));
      w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18))));
    } else {  // Q4_0: low nibbles are weights 0..15, high nibbles 16..31, each minus 8
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
      const __m128i mask = _mm_set1_epi8(0x0F);
      const __m512i eight = _mm512_set1_epi32(8);
      w0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(raw, mask)), eight));
      w1 = _mm512_cvtepi32_ps(
          _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask)), eight));
    }
    const float* xb = x + b * 32;
    for (int m = 0; m < Rows; ++m) {
      const float* xm = xb + m * K;
      const __m512 t = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xm + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xm)));
      acc[m] = _mm512_fmadd_ps(d, t, acc[m]);
    }
  }
  for (int m = 0; m < Rows; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}

// Q4_K: per sub-block of 32, w = d * scale * q - dmin * min, widened in registers.
template <int Rows>
inline void row_tile_q4_k_avx512(const uint8_t* wrow, int64_t blocks, const float* x, int64_t K, float* out) {
  __m512 acc[Rows];
  for (int m = 0; m < Rows; ++m) acc[m] = _mm512_setzero_ps();
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = wrow + b * Q4_KT::bytes;
    const float d = half_at(blk), dmin = half_at(blk + 2);
    const uint8_t* s = blk + 4;
    const uint8_t* q = blk + 16;
    for (int c = 0; c < 4; ++c) {
      uint8_t sc1, m1, sc2, m2;
      scale_min_k4(2 * c, s, &sc1, &m1);
      scale_min_k4(2 * c + 1, s, &sc2, &m2);
      const __m512 d1 = _mm512_set1_ps(d * sc1), o1 = _mm512_set1_ps(dmin * m1);
      const __m512 d2 = _mm512_set1_ps(d * sc2), o2 = _mm512_set1_ps(dmin * m2);
      const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 32 * c));
      const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 32 * c + 16));
      // weights 0..31 of the chunk from the low nibbles, 32..63 from the high ones
      const __m512 w0 = _mm512_fmsub_ps(d1, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(r0, mask))), o1);
      const __m512 w1 = _mm512_fmsub_ps(d1, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(r1, mask))), o1);
      const __m512 w2 = _mm512_fmsub_ps(
          d2, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(r0, 4), mask))), o2);
      const __m512 w3 = _mm512_fmsub_ps(
          d2, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(r1, 4), mask))), o2);
      const float* xc = x + b * 256 + 64 * c;
      for (int m = 0; m < Rows; ++m) {
        const float* xm = xc + m * K;
        __m512 a = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xm), acc[m]);
        a = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xm + 16), a);
        a = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xm + 32), a);
        acc[m] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xm + 48), a);
      }
    }
  }
  for (int m = 0; m < Rows; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}

// Q6_K: each 16 weights of a 128-weight half share a scale; the 6-bit values
// are put together from ql's nibbles and qh's 2-bit fields in registers.
template <int Rows>
inline void row_tile_q6_k_avx512(const uint8_t* wrow, int64_t blocks, const float* x, int64_t K, float* out) {
  __m512 acc[Rows];
  for (int m = 0; m < Rows; ++m) acc[m] = _mm512_setzero_ps();
  const __m128i low4 = _mm_set1_epi8(0x0F), low2 = _mm_set1_epi8(0x03);
  const __m512i bias = _mm512_set1_epi32(32);
  auto widen = [&](__m128i q6) { return _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(q6), bias)); };
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = wrow + b * Q6_KT::bytes;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = half_at(blk + 208);
    for (int half = 0; half < 2; ++half) {
      const uint8_t* l8 = blk + 64 * half;
      const uint8_t* h8 = blk + 128 + 32 * half;
      const int8_t* s = sc + 8 * half;
      for (int is = 0; is < 2; ++is) {
        const int l = 16 * is;
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(l8 + l));
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(l8 + l + 32));
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h8 + l));
        const __m128i q1 = _mm_or_si128(_mm_and_si128(a, low4), _mm_slli_epi16(_mm_and_si128(h, low2), 4));
        const __m128i q2 = _mm_or_si128(_mm_and_si128(c, low4),
                                        _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h, 2), low2), 4));
        const __m128i q3 = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), low4),
                                        _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h, 4), low2), 4));
        const __m128i q4 = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(c, 4), low4),
                                        _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h, 6), low2), 4));
        const __m512 w1 = _mm512_mul_ps(_mm512_set1_ps(d * s[is]), widen(q1));
        const __m512 w2 = _mm512_mul_ps(_mm512_set1_ps(d * s[is + 2]), widen(q2));
        const __m512 w3 = _mm512_mul_ps(_mm512_set1_ps(d * s[is + 4]), widen(q3));
        const __m512 w4 = _mm512_mul_ps(_mm512_set1_ps(d * s[is + 6]), widen(q4));
        const float* xh = x + b * 256 + 128 * half + l;
        for (int m = 0; m < Rows; ++m) {
          const float* xm = xh + m * K;
          __m512 t = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xm), acc[m]);
          t = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xm + 32), t);
          t = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xm + 64), t);
          acc[m] = _mm512_fmadd_ps(w4, _mm512_loadu_ps(xm + 96), t);
        }
      }
    }
  }
  for (int m = 0; m < Rows; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}
#endif

template <typename Q, int Rows>
inline void tile(const uint8_t* wrow, int64_t blocks, const float* x, int64_t K, float* out) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<Q, Q8_0T> || std::is_same_v<Q, Q4_0T>) {
    row_tile_avx512<Q, Rows>(wrow, blocks, x, K, out);
    return;
  }
  if constexpr (std::is_same_v<Q, Q4_KT>) {
    row_tile_q4_k_avx512<Rows>(wrow, blocks, x, K, out);
    return;
  }
  if constexpr (std::is_same_v<Q, Q6_KT>) {
    row_tile_q6_k_avx512<Rows>(wrow, blocks, x, K, out);
    return;
  }
#endif
  row_tile<Q, Rows>(wrow, blocks, x, K, out);
}

template <typename Q>
void gemm_rows(const uint8_t* wp, const float* xp, float* yp, int64_t M, int64_t K, int64_t begin, int64_t end) {
  const int64_t blocks = K / Q::block, row_bytes = blocks * Q::bytes;
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* wrow = wp + n * row_bytes;
    float* out = yp + n * M;
    int64_t m = 0;
    for (; m + kRowTile <= M; m += kRowTile) tile<Q, kRowTile>(wrow, blocks, xp + m * K, K, out + m);
    for (; m < M; ++m) tile<Q, 1>(wrow, blocks, xp + m * K, K, out + m);
  }
}

template <typename Q>
void dequant_rows(const uint8_t* wp, int64_t K, int64_t begin, int64_t end, float* out_f, c10::BFloat16* out_b) {
  const int64_t blocks = K / Q::block;
  alignas(64) float w[Q::block];
  for (int64_t n = begin; n < end; ++n) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = n * K + b * Q::block;
      if (out_f != nullptr) {
        Q::dequant(wp + (n * blocks + b) * Q::bytes, out_f + at);
      } else {
        Q::dequant(wp + (n * blocks + b) * Q::bytes, w);
        for (int i = 0; i < Q::block; ++i) out_b[at + i] = c10::BFloat16(w[i]);
      }
    }
  }
}

// Calls f(Q{}) for the type with this code.
template <typename F>
void with_type(int64_t qtype, F&& f) {
  switch (qtype) {
    case Q8_0: f(Q8_0T{}); return;
    case Q4_0: f(Q4_0T{}); return;
    case Q4_K: f(Q4_KT{}); return;
    case Q6_K: f(Q6_KT{}); return;
  }
  TORCH_CHECK(false, "unknown quantized type code ", qtype);
}

int64_t block_of(int64_t qtype) {
  int64_t block = 0;
  with_type(qtype, [&](auto q) { block = decltype(q)::block; });
  return block;
}

int64_t bytes_of(int64_t qtype) {
  int64_t bytes = 0;
  with_type(qtype, [&](auto q) { bytes = decltype(q)::bytes; });
  return bytes;
}

}  // namespace

// x [M, K] (float32 or bfloat16), weight [N, K / block * bytes] uint8 -> [M, N] in x's dtype.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight, int64_t qtype) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "quant_linear: x [M, K] and weight [N, bytes]");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous(), "quant_linear: weight is contiguous uint8");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "quant_linear: x float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), block = block_of(qtype);
  TORCH_CHECK(K % block == 0 && weight.size(1) == K / block * bytes_of(qtype), "quant_linear: weight rows do not hold ",
              K, " weights");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor yf = at::empty({N, M}, x.options().dtype(at::kFloat));  // by weight row: each task writes its own
  const float* xp = xf.data_ptr<float>();
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* yp = yf.data_ptr<float>();
  with_type(qtype, [&](auto q) {
    using Q = decltype(q);
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) { gemm_rows<Q>(wp, xp, yp, M, K, begin, end); });
  });
  return M == 1 ? yf.view({1, N}).to(x.scalar_type()) : yf.t().contiguous().to(x.scalar_type());
}

// `rows` consecutive rows of file blocks (K weights each) widened into out_f
// (float32) or, when it is null, out_b (bfloat16), [rows, K]: quant_pack.cpp
// widens its tiles through here, so both widenings agree to the bit.
void quant_dequantize_rows(const uint8_t* blocks, int64_t qtype, int64_t K, int64_t rows, float* out_f,
                           c10::BFloat16* out_b) {
  with_type(qtype, [&](auto q) { dequant_rows<decltype(q)>(blocks, K, 0, rows, out_f, out_b); });
}

// The whole weight as floats [N, K] in `dtype` (float32 or bfloat16).
at::Tensor quant_dequantize(const at::Tensor& weight, int64_t qtype, int64_t K, at::ScalarType dtype) {
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() && weight.dim() == 2,
              "quant_dequantize: weight is contiguous uint8 [N, bytes]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "quant_dequantize: dtype float32 or bfloat16");
  const int64_t N = weight.size(0), block = block_of(qtype);
  TORCH_CHECK(K % block == 0 && weight.size(1) == K / block * bytes_of(qtype), "quant_dequantize: rows do not hold ",
              K, " weights");
  at::Tensor out = at::empty({N, K}, weight.options().dtype(dtype));
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* out_f = dtype == at::kFloat ? out.data_ptr<float>() : nullptr;
  c10::BFloat16* out_b = dtype == at::kBFloat16 ? out.data_ptr<c10::BFloat16>() : nullptr;
  with_type(qtype, [&](auto q) {
    using Q = decltype(q);
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) { dequant_rows<Q>(wp, K, begin, end, out_f, out_b); });
  });
  return out;
}
