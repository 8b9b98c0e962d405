// Matmuls on GGUF-quantized weights (Q8_0, Q4_0, Q4_K, Q6_K) for CPU decode
// (a few activation rows), on weights re-laid once at load for one stream:
// y[m, n] = sum_k x[m, k] * W[n, k].
//
// Decode reads every weight once per token, so its speed is that of the
// weight stream, and with 4-6 bits a weight the stream is fast enough that
// widening each weight to a float (quant_gemm.cpp's path) costs more than
// reading it. Here, as llama.cpp does, the activations are quantized per
// block to int8 (one float scale per 32 values for Q8_0/Q4_0 weights, per 256
// for the K types) and blocks are multiplied in integers with AVX-512 VNNI
// (vpdpbusd: 64 unsigned weight bytes times signed activation bytes, summed
// by fours into 16 int32 lanes); the block's float scales are applied once per
// block. The result is the float product of the dequantized weights with the
// quantized activations, up to float rounding of the scales.
//
// Layout: tiles of 16 output columns (zero past N); a tile holds the whole K
// for its columns, block after block, so a thread streams a contiguous range
// of tiles. Within a tile's block, every group of 32 k is 8 "quads" (4
// consecutive k); a 64-byte line holds one quad for the 16 columns, in the
// order vpdpbusd reads it (lane = column, byte = k % 4). 4-bit values share a
// line by nibbles: the low nibble holds quad r, the high nibble quad r + 4.
// Per tile and block (fp16 scales copied from the file as they are):
//   Q8_0  d[16] fp16 | 8 lines of q + 128 (u8)                           = 544 B
//   Q4_0  d[16] fp16 | 4 nibble lines of q (0..15, value q - 8)          = 288 B
//   Q4_K  d[16], dmin[16] fp16 | scales u8 [8 sub-blocks][16] |
//         mins u8 [4 pairs][16 columns][2] | 8 x 4 nibble lines         = 2368 B
//   Q6_K  d[16] fp16 | scales i8 [16 sub-blocks][16] |
//         8 x (4 nibble lines of the low 4 bits, 2 lines of the high 2
//         bits: line h, bits 2s..2s+1 = quad 4h + s)                     = 3360 B
// Sub-block values: Q4_K w = d * sc * q - dmin * m (sub-blocks of 32),
// Q6_K w = d * sc * (q - 32) (sub-blocks of 16), so the integer sums need the
// activations' sums per sub-block, computed once per call with their quants.
//
// Built only where the compiler sees AVX-512 VNNI and BW (the build is
// -march=native); elsewhere quant_packed_supported() says false and callers
// keep quant_gemm.cpp's path.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "kernels.h"
#include "tiled_gemm.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RAYLM_QUANT_PACKED 1
#endif

namespace {

enum QType : int64_t { Q8_0 = 0, Q4_0 = 1, Q4_K = 2, Q6_K = 3 };  // quant_gemm.cpp's codes

constexpr int64_t kCols = 16;     // output columns per tile (one register of int32 lanes)
constexpr int64_t kMaxRows = 4;   // activation rows per kernel call
constexpr int kLine = 64;         // bytes: one quad of 16 columns

struct Geometry {
  int64_t block;       // weights per file block
  int64_t file_bytes;  // bytes per file block
  int64_t packed;      // bytes per tile per block
  int64_t act_block;   // activations per int8 scale
};

Geometry geometry(int64_t qtype) {
  switch (qtype) {
    case Q8_0: return {32, 34, 32 + 8 * kLine, 32};
    case Q4_0: return {32, 18, 32 + 4 * kLine, 32};
    case Q4_K: return {256, 144, 64 + 128 + 128 + 32 * kLine, 256};
    case Q6_K: return {256, 210, 32 + 256 + 8 * 6 * kLine, 256};
  }
  TORCH_CHECK(false, "quant_pack: unknown quantized type code ", qtype);
}

// ---- packing (once at load) ------------------------------------------------------

// q[c][k] for 16 columns x 32 k (values < 16) -> 4 nibble lines.
void put_nibbles(uint8_t* dst, const uint8_t q[kCols][32]) {
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < kCols; ++c)
      for (int b = 0; b < 4; ++b) dst[r * kLine + c * 4 + b] = q[c][4 * r + b] | (q[c][4 * (r + 4) + b] << 4);
}

// q[c][k] for 16 columns x 32 k -> 8 byte lines.
void put_bytes(uint8_t* dst, const uint8_t q[kCols][32]) {
  for (int i = 0; i < 8; ++i)
    for (int c = 0; c < kCols; ++c)
      for (int b = 0; b < 4; ++b) dst[i * kLine + c * 4 + b] = q[c][4 * i + b];
}

// hi[c][k] for 16 columns x 32 k (values < 4) -> 2 lines of 2-bit fields.
void put_crumbs(uint8_t* dst, const uint8_t hi[kCols][32]) {
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < kCols; ++c)
      for (int b = 0; b < 4; ++b) {
        uint8_t v = 0;
        for (int s = 0; s < 4; ++s) v |= hi[c][4 * (4 * h + s) + b] << (2 * s);
        dst[h * kLine + c * 4 + b] = v;
      }
}

inline void scale_min_k4(int j, const uint8_t* s, uint8_t* sc, uint8_t* mn) {  // ggml's 6-bit packing
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// One tile's block: `blocks[c]` is column c's file block, or null past N.
void pack_block(int64_t qtype, const uint8_t* const blocks[kCols], uint8_t* dst) {
  static const uint8_t zero_block[256] = {};
  const uint8_t* src[kCols];
  for (int c = 0; c < kCols; ++c) src[c] = blocks[c] ? blocks[c] : zero_block;  // all-zero: d = 0
  uint8_t q[kCols][32];
  uint8_t hi[kCols][32];
  switch (qtype) {
    case Q8_0:
      for (int c = 0; c < kCols; ++c) {
        std::memcpy(dst + 2 * c, src[c], 2);
        for (int k = 0; k < 32; ++k) q[c][k] = uint8_t(int(int8_t(src[c][2 + k])) + 128);
      }
      put_bytes(dst + 32, q);
      return;
    case Q4_0:
      for (int c = 0; c < kCols; ++c) {
        std::memcpy(dst + 2 * c, src[c], 2);
        for (int k = 0; k < 16; ++k) {
          q[c][k] = src[c][2 + k] & 0xF;
          q[c][k + 16] = src[c][2 + k] >> 4;
        }
      }
      put_nibbles(dst + 32, q);
      return;
    case Q4_K: {
      uint8_t* scales = dst + 64;
      uint8_t* mins = dst + 192;
      for (int c = 0; c < kCols; ++c) {
        std::memcpy(dst + 2 * c, src[c], 2);
        std::memcpy(dst + 32 + 2 * c, src[c] + 2, 2);
        for (int j = 0; j < 8; ++j) {
          uint8_t sc, mn;
          scale_min_k4(j, src[c] + 4, &sc, &mn);
          scales[j * kCols + c] = sc;
          mins[(j / 2) * 2 * kCols + 2 * c + j % 2] = mn;
        }
      }
      for (int j = 0; j < 8; ++j) {  // sub-block j: chunk j / 2, low nibbles if j is even
        for (int c = 0; c < kCols; ++c) {
          const uint8_t* qs = src[c] + 16 + 32 * (j / 2);
          for (int l = 0; l < 32; ++l) q[c][l] = j % 2 ? qs[l] >> 4 : qs[l] & 0xF;
        }
        put_nibbles(dst + 320 + j * 4 * kLine, q);
      }
      return;
    }
    case Q6_K: {
      int8_t* scales = reinterpret_cast<int8_t*>(dst + 32);
      int q6[kCols][256];
      for (int c = 0; c < kCols; ++c) {
        const uint8_t* b = src[c];
        std::memcpy(dst + 2 * c, b + 208, 2);
        for (int j = 0; j < 16; ++j) scales[j * kCols + c] = int8_t(b[192 + j]);
        for (int half = 0; half < 2; ++half) {
          const uint8_t* ql = b + 64 * half;
          const uint8_t* qh = b + 128 + 32 * half;
          int* y = q6[c] + 128 * half;
          for (int l = 0; l < 32; ++l) {
            y[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
            y[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
            y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
          }
        }
      }
      for (int g = 0; g < 8; ++g) {
        for (int c = 0; c < kCols; ++c)
          for (int l = 0; l < 32; ++l) {
            q[c][l] = q6[c][32 * g + l] & 0xF;
            hi[c][l] = q6[c][32 * g + l] >> 4;
          }
        uint8_t* group = dst + 288 + g * 6 * kLine;
        put_nibbles(group, q);
        put_crumbs(group + 4 * kLine, hi);
      }
      return;
    }
  }
}

// ---- activations, quantized per call ------------------------------------------------

struct Activations {
  std::vector<int8_t> q;        // [rows][K]
  std::vector<float> d;         // [rows][K / act_block]
  std::vector<int32_t> sum16;   // [rows][K / 16]: sums of q over 16 k
  std::vector<int16_t> sum32;   // [rows][K / 32]
};

inline float as_float(float v) { return v; }
inline float as_float(c10::BFloat16 v) { return float(v); }

// Per block of `act_block` values: d = amax / 127, q = round(x * (127 / amax)) to
// nearest even (the default rounding mode), as the tests' reference does.
// Into the calling thread's buffers (kept between calls: no allocation per call).
template <typename T>
const Activations& quantize_rows(const T* x, int64_t rows, int64_t K, int64_t act_block) {
  thread_local Activations a;
  a.q.resize(rows * K);
  a.d.resize(rows * K / act_block);
  a.sum16.resize(rows * K / 16);
  a.sum32.resize(rows * K / 32);
  float xb[256];
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t b = 0; b < K / act_block; ++b) {
      const T* src = x + m * K + b * act_block;
      float amax = 0.f;
      for (int64_t i = 0; i < act_block; ++i) {
        xb[i] = as_float(src[i]);
        amax = std::max(amax, std::fabs(xb[i]));
      }
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      a.d[m * (K / act_block) + b] = amax / 127.f;
      int8_t* qb = a.q.data() + m * K + b * act_block;
      for (int64_t i = 0; i < act_block; ++i) qb[i] = int8_t(std::nearbyint(xb[i] * inv));
    }
  for (int64_t i = 0; i < rows * K / 16; ++i) {
    int32_t s = 0;
    for (int l = 0; l < 16; ++l) s += a.q[16 * i + l];
    a.sum16[i] = s;
  }
  for (int64_t i = 0; i < rows * K / 32; ++i) a.sum32[i] = int16_t(a.sum16[2 * i] + a.sum16[2 * i + 1]);
  return a;
}

#ifdef RAYLM_QUANT_PACKED

struct Call {
  const uint8_t* tile;  // packed data of the tile
  int64_t blocks;       // file blocks along K
  int64_t K;
  const Activations* act;
  int64_t row0;          // first activation row
  void* out[kMaxRows];   // first column of the tile in each row, float or bfloat16
  bool bf16_out;
  int64_t cols;          // valid columns (<= 16)
};

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

inline __m512 fp16x16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512i line(const uint8_t* p) { return _mm512_loadu_si512(p); }

// 4 nibble lines -> the 8 quads of a 32-k group (low nibbles: quads 0..3).
inline void nibbles(const uint8_t* p, __m512i q[8]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int r = 0; r < 4; ++r) {
    const __m512i raw = line(p + r * kLine);
    q[r] = _mm512_and_si512(raw, low4);
    q[r + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
  }
}

// 16 floats rounded to bfloat16 to nearest even, as torch rounds (NaN stays NaN).
inline __m256i to_bf16(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(bits);
}

template <int ROWS>
void store(const Call& c, const __m512 acc[ROWS]) {
  const __mmask16 mask = c.cols >= kCols ? __mmask16(0xFFFF) : __mmask16((1u << c.cols) - 1);
  for (int m = 0; m < ROWS; ++m) {
    if (c.bf16_out)
      _mm256_mask_storeu_epi16(c.out[m], mask, to_bf16(acc[m]));
    else
      _mm512_mask_storeu_ps(static_cast<float*>(c.out[m]), mask, acc[m]);
  }
}

// Q8_0 and Q4_0: per block of 32, acc += d * dx * (sum q_u * x - offset * sum x),
// q_u the stored unsigned value (q + 128 and q: offsets 128 and 8).
template <int ROWS, bool FOUR_BIT>
void tile_32(const Call& c) {
  constexpr int64_t bytes = FOUR_BIT ? 32 + 4 * kLine : 32 + 8 * kLine;
  constexpr int offset = FOUR_BIT ? 8 : 128;
  const Activations& a = *c.act;
  __m512 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < c.blocks; ++b) {
    const uint8_t* p = c.tile + b * bytes;
    _mm_prefetch(reinterpret_cast<const char*>(p + 8 * bytes), _MM_HINT_T0);
    const __m512 d = fp16x16(p);
    __m512i q[8];
    if constexpr (FOUR_BIT) {
      nibbles(p + 32, q);
    } else {
      for (int i = 0; i < 8; ++i) q[i] = line(p + 32 + i * kLine);
    }
    for (int m = 0; m < ROWS; ++m) {
      const int64_t row = c.row0 + m;
      const int8_t* x = a.q.data() + row * c.K + b * 32;
      __m512i dot = _mm512_set1_epi32(-offset * a.sum32[row * (c.K / 32) + b]);
      for (int i = 0; i < 8; ++i) dot = _mm512_dpbusd_epi32(dot, q[i], bcast4(x + 4 * i));
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a.d[row * (c.K / 32) + b]));
      acc[m] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dot), acc[m]);
    }
  }
  store<ROWS>(c, acc);
}

// Q4_K: per block of 256, acc += d * dx * sum_j sc_j * dot_j - dmin * dx * sum_j m_j * xsum_j.
template <int ROWS>
void tile_q4_k(const Call& c) {
  constexpr int64_t bytes = 64 + 128 + 128 + 32 * kLine;
  const Activations& a = *c.act;
  __m512 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < c.blocks; ++b) {
    const uint8_t* p = c.tile + b * bytes;
    _mm_prefetch(reinterpret_cast<const char*>(p + bytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + bytes + 1024), _MM_HINT_T0);
    __m512i isum[ROWS], msum[ROWS];
    for (int m = 0; m < ROWS; ++m) isum[m] = msum[m] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      __m512i q[8];
      nibbles(p + 320 + j * 4 * kLine, q);
      const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 64 + 16 * j)));
      for (int m = 0; m < ROWS; ++m) {
        const int8_t* x = a.q.data() + (c.row0 + m) * c.K + b * 256 + 32 * j;
        __m512i dot = _mm512_setzero_si512();
        for (int i = 0; i < 8; ++i) dot = _mm512_dpbusd_epi32(dot, q[i], bcast4(x + 4 * i));
        isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(dot, sc));
      }
    }
    for (int pair = 0; pair < 4; ++pair) {  // mins as int16 pairs against pairs of sub-block sums
      const __m512i mn = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 192 + 32 * pair)));
      for (int m = 0; m < ROWS; ++m) {
        int32_t sums;
        std::memcpy(&sums, a.sum32.data() + (c.row0 + m) * (c.K / 32) + b * 8 + 2 * pair, 4);
        msum[m] = _mm512_dpwssd_epi32(msum[m], mn, _mm512_set1_epi32(sums));
      }
    }
    const __m512 d = fp16x16(p), dmin = fp16x16(p + 32);
    for (int m = 0; m < ROWS; ++m) {
      const __m512 dx = _mm512_set1_ps(a.d[(c.row0 + m) * (c.K / 256) + b]);
      acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum[m]), acc[m]);
      acc[m] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(msum[m]), acc[m]);
    }
  }
  store<ROWS>(c, acc);
}

// Q6_K: per block of 256, acc += d * dx * sum_j sc_j * (dot_j - 32 * xsum_j), sub-blocks of 16.
template <int ROWS>
void tile_q6_k(const Call& c) {
  constexpr int64_t bytes = 32 + 256 + 8 * 6 * kLine;
  const Activations& a = *c.act;
  const __m512i bits45 = _mm512_set1_epi8(0x30);
  __m512 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < c.blocks; ++b) {
    const uint8_t* p = c.tile + b * bytes;
    _mm_prefetch(reinterpret_cast<const char*>(p + bytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + bytes + 1024), _MM_HINT_T0);
    __m512i isum[ROWS];
    for (int m = 0; m < ROWS; ++m) isum[m] = _mm512_setzero_si512();
    for (int g = 0; g < 8; ++g) {
      const uint8_t* group = p + 288 + g * 6 * kLine;
      __m512i q[8];
      nibbles(group, q);
      const __m512i h0 = line(group + 4 * kLine), h1 = line(group + 5 * kLine);
      // bits 2s..2s+1 of each byte to bits 4..5 (16-bit shifts: the mask drops what crosses bytes)
      q[0] = _mm512_or_si512(q[0], _mm512_and_si512(_mm512_slli_epi16(h0, 4), bits45));
      q[1] = _mm512_or_si512(q[1], _mm512_and_si512(_mm512_slli_epi16(h0, 2), bits45));
      q[2] = _mm512_or_si512(q[2], _mm512_and_si512(h0, bits45));
      q[3] = _mm512_or_si512(q[3], _mm512_and_si512(_mm512_srli_epi16(h0, 2), bits45));
      q[4] = _mm512_or_si512(q[4], _mm512_and_si512(_mm512_slli_epi16(h1, 4), bits45));
      q[5] = _mm512_or_si512(q[5], _mm512_and_si512(_mm512_slli_epi16(h1, 2), bits45));
      q[6] = _mm512_or_si512(q[6], _mm512_and_si512(h1, bits45));
      q[7] = _mm512_or_si512(q[7], _mm512_and_si512(_mm512_srli_epi16(h1, 2), bits45));
      const __m512i sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 32 * g)));
      const __m512i sc1 =
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 32 * g + 16)));
      for (int m = 0; m < ROWS; ++m) {
        const int64_t row = c.row0 + m;
        const int8_t* x = a.q.data() + row * c.K + b * 256 + 32 * g;
        const int32_t* xsum = a.sum16.data() + row * (c.K / 16) + b * 16 + 2 * g;
        __m512i dot0 = _mm512_set1_epi32(-32 * xsum[0]), dot1 = _mm512_set1_epi32(-32 * xsum[1]);
        for (int i = 0; i < 4; ++i) {
          dot0 = _mm512_dpbusd_epi32(dot0, q[i], bcast4(x + 4 * i));
          dot1 = _mm512_dpbusd_epi32(dot1, q[i + 4], bcast4(x + 16 + 4 * i));
        }
        isum[m] = _mm512_add_epi32(isum[m], _mm512_add_epi32(_mm512_mullo_epi32(dot0, sc0),
                                                             _mm512_mullo_epi32(dot1, sc1)));
      }
    }
    const __m512 d = fp16x16(p);
    for (int m = 0; m < ROWS; ++m) {
      const __m512 dx = _mm512_set1_ps(a.d[(c.row0 + m) * (c.K / 256) + b]);
      acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum[m]), acc[m]);
    }
  }
  store<ROWS>(c, acc);
}

using TileFn = void (*)(const Call&);

template <int ROWS>
TileFn tile_fn(int64_t qtype) {
  switch (qtype) {
    case Q8_0: return &tile_32<ROWS, false>;
    case Q4_0: return &tile_32<ROWS, true>;
    case Q4_K: return &tile_q4_k<ROWS>;
    default: return &tile_q6_k<ROWS>;
  }
}

TileFn tile_fn(int64_t qtype, int64_t rows) {
  switch (rows) {
    case 1: return tile_fn<1>(qtype);
    case 2: return tile_fn<2>(qtype);
    case 3: return tile_fn<3>(qtype);
    default: return tile_fn<4>(qtype);
  }
}

#endif  // RAYLM_QUANT_PACKED

}  // namespace

bool quant_packed_supported() {
#ifdef RAYLM_QUANT_PACKED
  return true;
#else
  return false;
#endif
}

// weight [N, K / block * bytes] uint8 as in the file -> [ceil(N / 16), K / block * packed bytes] uint8.
at::Tensor quant_pack(const at::Tensor& weight, int64_t qtype) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.device().is_cpu(),
              "quant_pack: weight is a [rows, bytes] uint8 CPU tensor");
  const Geometry g = geometry(qtype);
  TORCH_CHECK(weight.size(1) % g.file_bytes == 0, "quant_pack: rows of ", weight.size(1),
              " bytes are not whole blocks of ", g.file_bytes);
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), blocks = w.size(1) / g.file_bytes, tiles = (N + kCols - 1) / kCols;
  at::Tensor packed = at::empty({tiles, blocks * g.packed}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* cols[kCols];
        for (int64_t c = 0; c < kCols; ++c) {
          const int64_t n = t * kCols + c;
          cols[c] = n < N ? src + (n * blocks + b) * g.file_bytes : nullptr;
        }
        pack_block(qtype, cols, dst + (t * blocks + b) * g.packed);
      }
  });
  return packed;
}

// x [rows <= 4, K] float32 or bfloat16, packed from quant_pack -> [rows, out_features] in x's dtype.
at::Tensor quant_packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t out_features) {
  TORCH_CHECK(quant_packed_supported(), "quant_packed_linear: this build has no AVX-512 VNNI kernel");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_packed_linear: x is [rows, K] float32 or bfloat16 on CPU");
  const Geometry g = geometry(qtype);
  const int64_t rows = x.size(0), K = x.size(1), tiles = (out_features + kCols - 1) / kCols;
  TORCH_CHECK(K % g.block == 0 && packed.dim() == 2 && packed.is_contiguous() && packed.size(0) == tiles &&
                  packed.size(1) == K / g.block * g.packed,
              "quant_packed_linear: packed weight ", packed.sizes(), " does not hold [", out_features, ", ", K,
              "] in this type");
  // In x's dtype, written by the kernel: no conversion of x or of the result around it.
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return out;
#ifdef RAYLM_QUANT_PACKED
  const at::Tensor xc = x.contiguous();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const Activations& act = bf16 ? quantize_rows(xc.data_ptr<c10::BFloat16>(), rows, K, g.act_block)
                                : quantize_rows(xc.data_ptr<float>(), rows, K, g.act_block);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  char* y = static_cast<char*>(out.data_ptr());
  const int64_t elem = out.element_size();
  const int64_t blocks = K / g.block, tile_stride = blocks * g.packed;
  raylm::for_each_tile_block(rows, tiles, kMaxRows, [](int64_t) { return int64_t(1); },
                             [&](int64_t m0, int64_t block_rows, int64_t t, int64_t) {
                               Call c;
                               c.tile = w + t * tile_stride;
                               c.blocks = blocks;
                               c.K = K;
                               c.act = &act;
                               c.row0 = m0;
                               c.cols = std::min(kCols, out_features - t * kCols);
                               c.bf16_out = bf16;
                               for (int64_t m = 0; m < block_rows; ++m)
                                 c.out[m] = y + ((m0 + m) * out_features + t * kCols) * elem;
                               tile_fn(qtype, block_rows)(c);
                             });
#endif
  return out;
}

// ---- a decode step's layers in one call, with quantized weights -------------------
//
// decode_layers.cpp's loop (same kernels, same order, so the result equals
// the module path to the bit), for layers whose matmuls are stacks of row
// segments (quant_linear.py's QuantizedMatmul: a Q4_K_M file keeps q and k in
// Q4_K and v in Q6_K; rows that are not whole blocks come as bf16). Each
// linear is kLinearSlots tensors: a [segments, 2] int64 spec of (type code, output rows),
// code -1 for a bf16 segment in bf16_linear's layout, then one packed weight
// per segment (empty past the last), then the bias (empty when none).

namespace {

constexpr int64_t kMaxSegments = 3;
constexpr int64_t kLinearSlots = 2 + kMaxSegments;

enum QuantLayerParam : int64_t {
  kQInputNorm = 0,
  kQQkv = 1,
  kQQNorm = kQQkv + kLinearSlots,
  kQKNorm,
  kQO,
  kQPostNorm = kQO + kLinearSlots,
  kQGateUp,
  kQDown = kQGateUp + kLinearSlots,
  kQKvCache = kQDown + kLinearSlots,
  kQParamsPerLayer,
};

at::Tensor segmented_linear(const at::Tensor& x, const at::Tensor* slots) {
  const at::Tensor& spec = slots[0];
  const int64_t segments = spec.size(0);
  const int64_t* s = spec.data_ptr<int64_t>();
  std::vector<at::Tensor> outs;
  for (int64_t i = 0; i < segments; ++i) {
    const int64_t code = s[2 * i], rows = s[2 * i + 1];
    outs.push_back(code < 0 ? bf16_linear(x, slots[1 + i], rows, c10::nullopt)
                            : quant_packed_linear(x, slots[1 + i], code, rows));
  }
  at::Tensor y = segments == 1 ? outs[0] : at::cat(outs, 1);
  const at::Tensor& bias = slots[1 + kMaxSegments];
  return bias.numel() ? y + bias : y;
}

at::Tensor per_head_norm(const at::Tensor& x, const at::Tensor& weight, int64_t head_dim, double eps) {
  const int64_t tokens = x.size(0);
  return rms_norm(x.reshape({-1, head_dim}), weight, eps).view({tokens, -1});
}

}  // namespace

int64_t quant_decode_params_per_layer() { return kQParamsPerLayer; }

std::tuple<at::Tensor, at::Tensor> quant_decode_layers(
    at::Tensor hidden, at::Tensor residual, const at::Tensor& positions, const at::Tensor& slot_mapping,
    const at::Tensor& block_table, const at::Tensor& context_lens, const at::Tensor& cos_cache,
    const at::Tensor& sin_cache, const std::vector<at::Tensor>& params, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t hidden_size, double eps, double scale) {
  TORCH_CHECK(params.size() % kQParamsPerLayer == 0, "quant_decode_layers: ", kQParamsPerLayer,
              " parameters per layer");
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == hidden_size,
              "quant_decode_layers: hidden must be [T, hidden_size]");
  const int64_t tokens = hidden.size(0);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == tokens,
              "quant_decode_layers: one int64 slot per token");
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const int64_t layers = int64_t(params.size()) / kQParamsPerLayer;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* p = params.data() + l * kQParamsPerLayer;
    at::Tensor h;
    if (residual.numel() == 0) {
      residual = hidden;
      h = rms_norm(hidden, p[kQInputNorm], eps);
    } else {
      std::tie(h, residual) = add_rms_norm(hidden, residual, p[kQInputNorm], eps);
    }
    const at::Tensor qkv = segmented_linear(h, p + kQQkv);
    at::Tensor q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size);
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
    if (p[kQQNorm].numel()) {
      q = per_head_norm(q, p[kQQNorm], head_dim, eps);
      k = per_head_norm(k, p[kQKNorm], head_dim, eps);
    }
    std::tie(q, k) = rotary_neox(positions, q, k, cos_cache, sin_cache, head_dim);
    const at::Tensor& kv_cache = p[kQKvCache];
    kv_cache[0].view({-1, num_kv_heads, head_dim}).index_copy_(0, slot_mapping, k.view({tokens, num_kv_heads, head_dim}));
    kv_cache[1].view({-1, num_kv_heads, head_dim}).index_copy_(0, slot_mapping, v.view({tokens, num_kv_heads, head_dim}));
    const at::Tensor attn =
        paged_decode(q.view({tokens, num_heads, head_dim}), kv_cache, block_table, context_lens, scale);
    const at::Tensor o = segmented_linear(attn.view({tokens, q_size}), p + kQO);
    std::tie(h, residual) = add_rms_norm(o, residual, p[kQPostNorm], eps);
    hidden = segmented_linear(silu_and_mul(segmented_linear(h, p + kQGateUp)), p + kQDown);
  }
  return {hidden, residual};
}
