// Matmuls on GGUF-quantized weights (Q8_0, Q4_0, Q4_K, Q6_K) for CPU decode
// (a few activation rows), on weights re-laid once at load for one stream
// (quant_layout.h, quant_pack.cpp): y[m, n] = sum_k x[m, k] * W[n, k].
//
// Decode reads every weight once per token, so its speed is that of the
// weight stream, and with 4-6 bits a weight the stream is fast enough that
// widening each weight to a float (quant_gemm.cpp's path) costs more than
// reading it. Here, as llama.cpp does, the activations are quantized per
// block to int8 (one float scale per 32 values for Q8_0/Q4_0 weights, per 256
// for the K types) and blocks are multiplied in integers: unsigned weight
// bytes times signed activation bytes, summed by fours into one int32 lane per
// output column; the block's float scales are applied once per block. The
// result is the float product of the dequantized weights with the quantized
// activations, up to float rounding of the scales. The K types' integer sums
// need the activations' sums per sub-block, computed once per call with their
// quants.
//
// The kernels are written once over an instruction set `V` that holds a
// tile's 16 columns as 16 int32 / float lanes:
//   Avx512Vnni  one 512-bit register; vpdpbusd does a 4-byte dot per lane.
//   AvxVnni     two 256-bit registers (columns 0-7, 8-15), 256-bit vpdpbusd.
//   Avx2        the same registers; the 4-byte dot is vpmaddubsw + vpmaddwd.
//               vpmaddubsw saturates pairs at int16, so Q8_0's bytes (q + 128,
//               up to 255) are read signed instead, by the sign trick (|w|
//               times x with w's sign).
// Each exists where the compiler targets it (the build is -march=native, one
// build per CPU kind: cpu_kernels.py), the best one runs by default, and
// quant_packed_use("avx2") picks the AVX2 one on a machine that has more
// (tests; RAYLM_QUANT_KERNEL=avx2 in quant_kernels.py). Without AVX2,
// quant_packed_supported() says false and callers keep quant_gemm.cpp's path.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "decode_layer_loop.h"
#include "kernels.h"
#include "quant_layout.h"
#include "tiled_gemm.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RAYLM_QUANT_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RAYLM_QUANT_AVX2 1
#endif

namespace {

using namespace raylm::quant;

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

constexpr int kMaxRowsAny = 4;  // the most activation rows any kernel call takes

struct Call {
  const uint8_t* tile;  // packed data of the tile
  int64_t blocks;       // file blocks along K
  int64_t K;
  const Activations* act;
  int64_t row0;             // first activation row
  void* out[kMaxRowsAny];   // first column of the tile in each row, float or bfloat16
  bool bf16_out;
  int64_t cols;             // valid columns (<= 16)

  const int8_t* x(int m, int64_t k) const { return act->q.data() + (row0 + m) * K + k; }
  float dx(int m, int64_t block, int64_t act_block) const { return act->d[(row0 + m) * (K / act_block) + block]; }
};

inline int32_t four_bytes(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// A scalar store of 16 lanes for the last tile of a row (fewer columns) or a
// bf16 output (rounded to nearest even as torch rounds).
inline void store_lanes(const float lanes[kCols], void* out, bool bf16, int64_t cols) {
  if (bf16) {
    auto* y = static_cast<c10::BFloat16*>(out);
    for (int64_t c = 0; c < cols; ++c) y[c] = c10::BFloat16(lanes[c]);
  } else {
    std::memcpy(out, lanes, cols * sizeof(float));
  }
}

#ifdef RAYLM_QUANT_AVX512

struct Avx512Vnni {
  static constexpr const char* kName = "avx512_vnni";
  static constexpr int kMaxRows = 4;
  static constexpr int kQ8Offset = 128;  // Q8_0 bytes are read unsigned (q + 128)
  using I = __m512i;
  using F = __m512;

  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I zero() { return _mm512_setzero_si512(); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I bcast4(const int8_t* p) { return _mm512_set1_epi32(four_bytes(p)); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I low_nibbles(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
  static I high_nibbles(I v) { return low_nibbles(_mm512_srli_epi16(v, 4)); }
  // Bits 4 - S .. 5 - S of each byte (a 2-bit field) moved to bits 4..5, OR-ed into q.
  template <int S>
  static I with_crumb(I q, I h) {
    I moved = h;
    if constexpr (S > 0) moved = _mm512_slli_epi16(h, S);
    if constexpr (S < 0) moved = _mm512_srli_epi16(h, -S);
    return _mm512_or_si512(q, _mm512_and_si512(moved, _mm512_set1_epi8(0x30)));
  }
  // acc + per lane the sum over its 4 bytes of u (unsigned) times s (signed).
  static I dot4(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static I q8_weights(I stored) { return stored; }
  static I q8_dot4(I acc, I w, I s) { return dot4(acc, w, s); }
  static I u8_lanes(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I i8_lanes(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  // 32 bytes (2 per lane) as int16 pairs.
  static I u8_pairs(const uint8_t* p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  // acc + per lane the dot of its int16 pair with the pair in `pair`.
  static I dot2(I acc, I pairs, int32_t pair) { return _mm512_dpwssd_epi32(acc, pairs, _mm512_set1_epi32(pair)); }

  static F zero_f() { return _mm512_setzero_ps(); }
  static F fp16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F set1_f(float v) { return _mm512_set1_ps(v); }
  static F to_f(I v) { return _mm512_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  // 16 floats rounded to bfloat16 to nearest even, as torch rounds (NaN stays NaN).
  static __m256i to_bf16(F v) {
    __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(bits);
  }
  static void store(F v, void* out, bool bf16, int64_t cols) {
    const __mmask16 mask = cols >= kCols ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
    if (bf16)
      _mm256_mask_storeu_epi16(out, mask, to_bf16(v));
    else
      _mm512_mask_storeu_ps(out, mask, v);
  }
};

#endif  // RAYLM_QUANT_AVX512

#ifdef RAYLM_QUANT_AVX2

struct Avx2 {
  static constexpr const char* kName = "avx2";
  static constexpr int kMaxRows = 2;      // 16 ymm registers
  static constexpr int kQ8Offset = 0;     // Q8_0 bytes are read signed
  struct I { __m256i lo, hi; };           // columns 0-7, 8-15 (bytes 0-31, 32-63 of a line)
  struct F { __m256 lo, hi; };

  template <typename Op>
  static I each(I a, I b, Op op) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
  static I load(const uint8_t* p) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
  }
  static I zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  static I set1(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
  static I bcast4(const int8_t* p) { return set1(four_bytes(p)); }
  static I add(I a, I b) { return each(a, b, [](__m256i x, __m256i y) { return _mm256_add_epi32(x, y); }); }
  static I mullo(I a, I b) { return each(a, b, [](__m256i x, __m256i y) { return _mm256_mullo_epi32(x, y); }); }
  static I low_nibbles(I v) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    return {_mm256_and_si256(v.lo, m), _mm256_and_si256(v.hi, m)};
  }
  static I high_nibbles(I v) { return low_nibbles({_mm256_srli_epi16(v.lo, 4), _mm256_srli_epi16(v.hi, 4)}); }
  template <int S>
  static I with_crumb(I q, I h) {
    const __m256i m = _mm256_set1_epi8(0x30);
    const auto one = [&](__m256i x, __m256i y) {
      __m256i moved = y;
      if constexpr (S > 0) moved = _mm256_slli_epi16(y, S);
      if constexpr (S < 0) moved = _mm256_srli_epi16(y, -S);
      return _mm256_or_si256(x, _mm256_and_si256(moved, m));
    };
    return each(q, h, one);
  }
  // u * s summed by pairs into int16 (exact while u <= 128: |s| <= 127), then pairs into int32.
  static I dot4(I acc, I u, I s) {
    const __m256i ones = _mm256_set1_epi16(1);
    const auto one = [&](__m256i a, __m256i x, __m256i y) {
      return _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), ones));
    };
    return {one(acc.lo, u.lo, s.lo), one(acc.hi, u.hi, s.hi)};
  }
  // Q8_0's stored q + 128 back to signed q.
  static I q8_weights(I stored) {
    const __m256i flip = _mm256_set1_epi8(char(0x80));
    return {_mm256_xor_si256(stored.lo, flip), _mm256_xor_si256(stored.hi, flip)};
  }
  // Signed w times signed s: |w| (unsigned, <= 128) times s with w's sign.
  static I q8_dot4(I acc, I w, I s) {
    return dot4(acc, {_mm256_sign_epi8(w.lo, w.lo), _mm256_sign_epi8(w.hi, w.hi)},
                {_mm256_sign_epi8(s.lo, w.lo), _mm256_sign_epi8(s.hi, w.hi)});
  }
  static __m128i low8(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
  static I u8_lanes(const uint8_t* p) { return {_mm256_cvtepu8_epi32(low8(p)), _mm256_cvtepu8_epi32(low8(p + 8))}; }
  static I i8_lanes(const uint8_t* p) { return {_mm256_cvtepi8_epi32(low8(p)), _mm256_cvtepi8_epi32(low8(p + 8))}; }
  static I u8_pairs(const uint8_t* p) {
    const auto half = [](const uint8_t* q) { return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))); };
    return {half(p), half(p + 16)};
  }
  static I dot2(I acc, I pairs, int32_t pair) {
    const __m256i b = _mm256_set1_epi32(pair);
    return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(pairs.lo, b)),
            _mm256_add_epi32(acc.hi, _mm256_madd_epi16(pairs.hi, b))};
  }

  static F zero_f() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static F fp16(const uint8_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
  }
  static F set1_f(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
  static F to_f(I v) { return {_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }
  static F mul(F a, F b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  static F fmadd(F a, F b, F c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
  static F fnmadd(F a, F b, F c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
  static void store(F v, void* out, bool bf16, int64_t cols) {
    alignas(32) float lanes[kCols];
    _mm256_store_ps(lanes, v.lo);
    _mm256_store_ps(lanes + 8, v.hi);
    store_lanes(lanes, out, bf16, cols);
  }
};

// AVX2 with 256-bit vpdpbusd (AVX-VNNI, as on Alder Lake and later; the same
// instruction in its AVX-512 VL encoding where the CPU has that instead):
// the 4-byte dot in one instruction, without int16 pairs that could saturate,
// so Q8_0 is read unsigned as on AVX-512.
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define RAYLM_QUANT_AVX_VNNI 1

struct AvxVnni : Avx2 {
  static constexpr const char* kName = "avx_vnni";
  static constexpr int kQ8Offset = 128;
  static __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_dpbusd_epi32(acc, u, s);
#endif
  }
  static I dot4(I acc, I u, I s) { return {dpbusd(acc.lo, u.lo, s.lo), dpbusd(acc.hi, u.hi, s.hi)}; }
  static I q8_weights(I stored) { return stored; }
  static I q8_dot4(I acc, I w, I s) { return dot4(acc, w, s); }
};

#endif  // AVX-VNNI
#endif  // RAYLM_QUANT_AVX2

// ---- the kernels, once for every instruction set -------------------------------------

// 4 nibble lines -> the 8 quads of a 32-k group (low nibbles: quads 0..3).
template <typename V>
inline void nibbles(const uint8_t* p, typename V::I q[8]) {
  for (int r = 0; r < 4; ++r) {
    const typename V::I raw = V::load(p + r * kLine);
    q[r] = V::low_nibbles(raw);
    q[r + 4] = V::high_nibbles(raw);
  }
}

// init + the sum over i < 8 of dot(q[i], the 4 activations x[4i..4i+3]), in
// CHAINS independent chains of dots instead of one: the sums are integers,
// exact in any order, and at one row a chain of 8 dependent vpdpbusd was the
// kernel's limit. More rows are chains of their own already, and more
// accumulators there would spill registers (dot_chains).
template <typename V, int CHAINS, typename Dot>
inline typename V::I chained_dot8(typename V::I init, const typename V::I q[8], const int8_t* x, Dot dot) {
  typename V::I chain[CHAINS];
  chain[0] = init;
  for (int i = 1; i < CHAINS; ++i) chain[i] = V::zero();
  for (int i = 0; i < 8; ++i) chain[i % CHAINS] = dot(chain[i % CHAINS], q[i], V::bcast4(x + 4 * i));
  for (int i = 1; i < CHAINS; ++i) chain[0] = V::add(chain[0], chain[i]);
  return chain[0];
}

constexpr int dot_chains(int rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }

// Runs block(p, b, acc) over the tile's blocks of `bytes` each (p: block b's
// data; acc: the 16 columns of each row, from zero), then stores acc. Ahead
// of each block, every line of the bytes kPrefetchAhead further on is asked
// for, into L2 (an L1 prefetch holds one of the core's few fill buffers
// until the line arrives; the tile's stream is sequential, so L2 can keep
// far more of it in flight).
constexpr int64_t kPrefetchAhead = 4096;

template <typename V, int ROWS, int64_t BYTES, typename Block>
inline void over_blocks(const Call& c, Block block) {
  typename V::F acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = V::zero_f();
  for (int64_t b = 0; b < c.blocks; ++b) {
    const uint8_t* p = c.tile + b * BYTES;
    for (int64_t line = 0; line < BYTES; line += kLine) __builtin_prefetch(p + kPrefetchAhead + line, 0, 2);
    block(p, b, acc);
  }
  for (int m = 0; m < ROWS; ++m) V::store(acc[m], c.out[m], c.bf16_out, c.cols);
}

// Q8_0 and Q4_0: per block of 32, acc += d * dx * (sum q_u * x - offset * sum x),
// q_u the weight as the dot reads it (Q4_0: q + 8, offset 8; Q8_0: V's choice).
template <typename V, int ROWS, bool FOUR_BIT>
void tile_32(const Call& c) {
  using I = typename V::I;
  constexpr int64_t bytes = FOUR_BIT ? 32 + 4 * kLine : 32 + 8 * kLine;
  constexpr int offset = FOUR_BIT ? 8 : V::kQ8Offset;
  over_blocks<V, ROWS, bytes>(c, [&](const uint8_t* p, int64_t b, typename V::F* acc) {
    const typename V::F d = V::fp16(p);
    I q[8];
    if constexpr (FOUR_BIT) {
      nibbles<V>(p + 32, q);
    } else {
      for (int i = 0; i < 8; ++i) q[i] = V::q8_weights(V::load(p + 32 + i * kLine));
    }
    for (int m = 0; m < ROWS; ++m) {
      const int8_t* x = c.x(m, b * 32);
      const I dot = chained_dot8<V, 2>(V::set1(-offset * c.act->sum32[(c.row0 + m) * (c.K / 32) + b]), q, x,
                                       [](I a, I w, I s) { return FOUR_BIT ? V::dot4(a, w, s) : V::q8_dot4(a, w, s); });
      acc[m] = V::fmadd(V::mul(d, V::set1_f(c.dx(m, b, 32))), V::to_f(dot), acc[m]);
    }
  });
}

// Q4_K: per block of 256, acc += d * dx * sum_j sc_j * dot_j - dmin * dx * sum_j m_j * xsum_j.
template <typename V, int ROWS>
void tile_q4_k(const Call& c) {
  using I = typename V::I;
  over_blocks<V, ROWS, kQ4KQuants + 32 * kLine>(c, [&](const uint8_t* p, int64_t b, typename V::F* acc) {
    I isum[ROWS], msum[ROWS];
    for (int m = 0; m < ROWS; ++m) isum[m] = msum[m] = V::zero();
    for (int j = 0; j < 8; ++j) {
      I q[8];
      nibbles<V>(p + kQ4KQuants + j * 4 * kLine, q);
      const I sc = V::u8_lanes(p + kQ4KScales + 16 * j);
      for (int m = 0; m < ROWS; ++m) {
        const int8_t* x = c.x(m, b * 256 + 32 * j);
        const I dot = chained_dot8<V, dot_chains(ROWS)>(V::zero(), q, x, [](I a, I w, I s) { return V::dot4(a, w, s); });
        isum[m] = V::add(isum[m], V::mullo(dot, sc));
      }
    }
    for (int pair = 0; pair < 4; ++pair) {  // mins as int16 pairs against pairs of sub-block sums
      const I mn = V::u8_pairs(p + kQ4KMins + 32 * pair);
      for (int m = 0; m < ROWS; ++m)
        msum[m] = V::dot2(msum[m], mn, four_bytes(c.act->sum32.data() + (c.row0 + m) * (c.K / 32) + b * 8 + 2 * pair));
    }
    const typename V::F d = V::fp16(p), dmin = V::fp16(p + 32);
    for (int m = 0; m < ROWS; ++m) {
      const typename V::F dx = V::set1_f(c.dx(m, b, 256));
      acc[m] = V::fmadd(V::mul(d, dx), V::to_f(isum[m]), acc[m]);
      acc[m] = V::fnmadd(V::mul(dmin, dx), V::to_f(msum[m]), acc[m]);
    }
  });
}

// Q6_K: per block of 256, acc += d * dx * sum_j sc_j * (dot_j - 32 * xsum_j), sub-blocks of 16.
template <typename V, int ROWS>
void tile_q6_k(const Call& c) {
  using I = typename V::I;
  over_blocks<V, ROWS, kQ6KGroups + 8 * kQ6KGroupBytes>(c, [&](const uint8_t* p, int64_t b, typename V::F* acc) {
    I isum[ROWS];
    for (int m = 0; m < ROWS; ++m) isum[m] = V::zero();
    for (int g = 0; g < 8; ++g) {
      const uint8_t* group = p + kQ6KGroups + g * kQ6KGroupBytes;
      I q[8];
      nibbles<V>(group, q);
      // line h, bits 2s..2s+1 -> bits 4..5 of quad 4h + s
      const I h0 = V::load(group + 4 * kLine), h1 = V::load(group + 5 * kLine);
      q[0] = V::template with_crumb<4>(q[0], h0);
      q[1] = V::template with_crumb<2>(q[1], h0);
      q[2] = V::template with_crumb<0>(q[2], h0);
      q[3] = V::template with_crumb<-2>(q[3], h0);
      q[4] = V::template with_crumb<4>(q[4], h1);
      q[5] = V::template with_crumb<2>(q[5], h1);
      q[6] = V::template with_crumb<0>(q[6], h1);
      q[7] = V::template with_crumb<-2>(q[7], h1);
      const I sc0 = V::i8_lanes(p + kQ6KScales + 32 * g), sc1 = V::i8_lanes(p + kQ6KScales + 32 * g + 16);
      for (int m = 0; m < ROWS; ++m) {
        const int8_t* x = c.x(m, b * 256 + 32 * g);
        const int32_t* xsum = c.act->sum16.data() + (c.row0 + m) * (c.K / 16) + b * 16 + 2 * g;
        I dot0 = V::set1(-32 * xsum[0]), dot1 = V::set1(-32 * xsum[1]);
        for (int i = 0; i < 4; ++i) {
          dot0 = V::dot4(dot0, q[i], V::bcast4(x + 4 * i));
          dot1 = V::dot4(dot1, q[i + 4], V::bcast4(x + 16 + 4 * i));
        }
        isum[m] = V::add(isum[m], V::add(V::mullo(dot0, sc0), V::mullo(dot1, sc1)));
      }
    }
    const typename V::F d = V::fp16(p);
    for (int m = 0; m < ROWS; ++m)
      acc[m] = V::fmadd(V::mul(d, V::set1_f(c.dx(m, b, 256))), V::to_f(isum[m]), acc[m]);
  });
}

using TileFn = void (*)(const Call&);

template <typename V, int ROWS>
TileFn tile_fn(int64_t qtype) {
  switch (qtype) {
    case Q8_0: return &tile_32<V, ROWS, false>;
    case Q4_0: return &tile_32<V, ROWS, true>;
    case Q4_K: return &tile_q4_k<V, ROWS>;
    default: return &tile_q6_k<V, ROWS>;
  }
}

template <typename V>
TileFn tile_fn(int64_t qtype, int64_t rows) {
  static_assert(V::kMaxRows == 2 || V::kMaxRows == 4, "row counts below");
  switch (rows) {
    case 1: return tile_fn<V, 1>(qtype);
    case 2: return tile_fn<V, 2>(qtype);
  }
  if constexpr (V::kMaxRows == 4) return rows == 3 ? tile_fn<V, 3>(qtype) : tile_fn<V, 4>(qtype);
  TORCH_CHECK(false, "quant_packed_linear: ", rows, " rows in one call");
  return nullptr;
}

// y [rows, N] (x's dtype) = x @ W^T with V's kernels; x's rows quantized first.
template <typename V>
void packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, at::Tensor& out) {
  const Geometry g = geometry(qtype);
  const int64_t rows = x.size(0), K = x.size(1), N = out.size(1), tiles = packed.size(0);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const Activations& act = bf16 ? quantize_rows(x.data_ptr<c10::BFloat16>(), rows, K, g.act_block)
                                : quantize_rows(x.data_ptr<float>(), rows, K, g.act_block);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  char* y = static_cast<char*>(out.data_ptr());
  const int64_t elem = out.element_size(), tile_stride = packed.size(1);
  raylm::for_each_tile_block(rows, tiles, V::kMaxRows, [](int64_t) { return int64_t(1); },
                             [&](int64_t m0, int64_t block_rows, int64_t t, int64_t) {
                               Call c;
                               c.tile = w + t * tile_stride;
                               c.blocks = K / g.block;
                               c.K = K;
                               c.act = &act;
                               c.row0 = m0;
                               c.cols = std::min(kCols, N - t * kCols);
                               c.bf16_out = bf16;
                               for (int64_t m = 0; m < block_rows; ++m)
                                 c.out[m] = y + ((m0 + m) * N + t * kCols) * elem;
                               tile_fn<V>(qtype, block_rows)(c);
                             });
}

// ---- which instruction set runs ----------------------------------------------------------

enum class Isa : int { kNone, kAvx2, kAvxVnni, kAvx512Vnni };

// Best first.
std::vector<std::pair<std::string, Isa>> built_variants() {
  std::vector<std::pair<std::string, Isa>> v;
#ifdef RAYLM_QUANT_AVX512
  v.emplace_back(Avx512Vnni::kName, Isa::kAvx512Vnni);
#endif
#ifdef RAYLM_QUANT_AVX_VNNI
  v.emplace_back(AvxVnni::kName, Isa::kAvxVnni);
#endif
#ifdef RAYLM_QUANT_AVX2
  v.emplace_back(Avx2::kName, Isa::kAvx2);
#endif
  return v;
}

Isa best_isa() {
  const auto v = built_variants();
  return v.empty() ? Isa::kNone : v.front().second;
}

std::atomic<int> g_isa{int(best_isa())};

Isa current_isa() { return Isa(g_isa.load(std::memory_order_relaxed)); }

}  // namespace

bool quant_packed_supported() { return current_isa() != Isa::kNone; }

std::vector<std::string> quant_packed_variants() {
  std::vector<std::string> names;
  for (const auto& [name, isa] : built_variants()) names.push_back(name);
  return names;
}

std::string quant_packed_variant() {
  for (const auto& [name, isa] : built_variants())
    if (isa == current_isa()) return name;
  return "";
}

void quant_packed_use(const std::string& name) {
  if (name.empty() || name == "auto") {
    g_isa = int(best_isa());
    return;
  }
  for (const auto& [variant, isa] : built_variants())
    if (variant == name) {
      g_isa = int(isa);
      return;
    }
  std::string have;
  for (const auto& variant : quant_packed_variants()) have += " " + variant;
  TORCH_CHECK(false, "quant_packed_use: no '", name, "' decode kernel in this build (it has: auto", have, ")");
}

// x [rows, K] float32 or bfloat16, packed from quant_pack -> [rows, out_features] in x's dtype.
at::Tensor quant_packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t out_features) {
  TORCH_CHECK(quant_packed_supported(), "quant_packed_linear: this build has no AVX2 or AVX-512 VNNI kernel");
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
  const at::Tensor xc = x.contiguous();
  switch (current_isa()) {
#ifdef RAYLM_QUANT_AVX512
    case Isa::kAvx512Vnni: packed_linear<Avx512Vnni>(xc, packed, qtype, out); break;
#endif
#ifdef RAYLM_QUANT_AVX_VNNI
    case Isa::kAvxVnni: packed_linear<AvxVnni>(xc, packed, qtype, out); break;
#endif
#ifdef RAYLM_QUANT_AVX2
    case Isa::kAvx2: packed_linear<Avx2>(xc, packed, qtype, out); break;
#endif
    default: break;
  }
  return out;
}

// ---- a decode step's layers in one call, with quantized weights -------------------
//
// decode_layer_loop.h's loop, for layers whose matmuls are stacks of row
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

}  // namespace

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


int64_t quant_decode_params_per_layer() { return kQParamsPerLayer; }

std::tuple<at::Tensor, at::Tensor> quant_decode_layers(
    at::Tensor hidden, at::Tensor residual, const at::Tensor& positions, const at::Tensor& slot_mapping,
    const at::Tensor& block_table, const at::Tensor& context_lens, const at::Tensor& cos_cache,
    const at::Tensor& sin_cache, const std::vector<at::Tensor>& params, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t hidden_size, double eps, double scale) {
  TORCH_CHECK(params.size() % kQParamsPerLayer == 0, "quant_decode_layers: ", kQParamsPerLayer,
              " parameters per layer");
  const raylm::DecodeStep step{positions, slot_mapping, block_table, context_lens, cos_cache, sin_cache,
                               num_heads,  num_kv_heads, head_dim,   hidden_size,  eps,       scale};
  const auto layer = [&](int64_t l) { return params.data() + l * kQParamsPerLayer; };
  return raylm::decode_layer_loop(
      "quant_decode_layers", std::move(hidden), std::move(residual), step,
      int64_t(params.size()) / kQParamsPerLayer,
      [&](int64_t l) {
        const at::Tensor* p = layer(l);
        return raylm::DecodeLayer{p[kQInputNorm], p[kQQNorm], p[kQKNorm], p[kQPostNorm], p[kQKvCache]};
      },
      [&](int64_t l, raylm::Projection which, const at::Tensor& x) {
        static constexpr int64_t first_slot[] = {kQQkv, kQO, kQGateUp, kQDown};  // by Projection
        return segmented_linear(x, layer(l) + first_slot[int(which)]);
      });
}
