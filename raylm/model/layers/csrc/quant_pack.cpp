// GGUF-quantized weights re-laid into quant_layout.h's tiles once at load
// (quant_pack), and back: quant_unpack gives the file's blocks again, bit for
// bit, and quant_packed_dequantize widens the tiles to floats for prefill
// (equal to quant_dequantize on the file's blocks to the bit). A layer
// therefore keeps only the packed copy.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "huge_pages.h"
#include "kernels.h"
#include "quant_layout.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace raylm::quant;

// ---- 32 k x 16 columns <-> lines (see quant_layout.h) -----------------------------

// q[c][k] (values < 16) -> 4 nibble lines.
void put_nibbles(uint8_t* dst, const uint8_t q[kCols][32]) {
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < kCols; ++c)
      for (int b = 0; b < 4; ++b) dst[r * kLine + c * 4 + b] = q[c][4 * r + b] | (q[c][4 * (r + 4) + b] << 4);
}

// Column c's 32 values back from 4 nibble lines.
void get_nibbles(const uint8_t* src, int c, uint8_t q[32]) {
  for (int r = 0; r < 4; ++r)
    for (int b = 0; b < 4; ++b) {
      const uint8_t v = src[r * kLine + c * 4 + b];
      q[4 * r + b] = v & 0xF;
      q[4 * (r + 4) + b] = v >> 4;
    }
}

// q[c][k] -> 8 byte lines.
void put_bytes(uint8_t* dst, const uint8_t q[kCols][32]) {
  for (int i = 0; i < 8; ++i)
    for (int c = 0; c < kCols; ++c)
      for (int b = 0; b < 4; ++b) dst[i * kLine + c * 4 + b] = q[c][4 * i + b];
}

void get_bytes(const uint8_t* src, int c, uint8_t q[32]) {
  for (int i = 0; i < 8; ++i)
    for (int b = 0; b < 4; ++b) q[4 * i + b] = src[i * kLine + c * 4 + b];
}

// hi[c][k] (values < 4) -> 2 lines of 2-bit fields.
void put_crumbs(uint8_t* dst, const uint8_t hi[kCols][32]) {
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < kCols; ++c)
      for (int b = 0; b < 4; ++b) {
        uint8_t v = 0;
        for (int s = 0; s < 4; ++s) v |= hi[c][4 * (4 * h + s) + b] << (2 * s);
        dst[h * kLine + c * 4 + b] = v;
      }
}

void get_crumbs(const uint8_t* src, int c, uint8_t hi[32]) {
  for (int h = 0; h < 2; ++h)
    for (int b = 0; b < 4; ++b) {
      const uint8_t v = src[h * kLine + c * 4 + b];
      for (int s = 0; s < 4; ++s) hi[4 * (4 * h + s) + b] = (v >> (2 * s)) & 3;
    }
}

// ---- Q4_K's 6-bit scales and mins (ggml's packing of 8 + 8 values in 12 bytes) ----

void get_scale_min_k4(int j, const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void put_scales_mins_k4(const uint8_t sc[8], const uint8_t mn[8], uint8_t* s) {
  for (int j = 0; j < 4; ++j) {
    s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
    s[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
    s[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
  }
}

// ---- Q6_K's 6-bit quants: ql (low 4 bits) and qh (high 2 bits) in ggml's order ----

void get_q6(const uint8_t* b, uint8_t q6[256]) {
  for (int half = 0; half < 2; ++half) {
    const uint8_t* ql = b + 64 * half;
    const uint8_t* qh = b + 128 + 32 * half;
    uint8_t* y = q6 + 128 * half;
    for (int l = 0; l < 32; ++l) {
      y[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
      y[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
      y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
      y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
    }
  }
}

void put_q6(const uint8_t q6[256], uint8_t* b) {
  for (int half = 0; half < 2; ++half) {
    uint8_t* ql = b + 64 * half;
    uint8_t* qh = b + 128 + 32 * half;
    const uint8_t* y = q6 + 128 * half;
    for (int l = 0; l < 32; ++l) {
      ql[l] = (y[l] & 0xF) | ((y[l + 64] & 0xF) << 4);
      ql[l + 32] = (y[l + 32] & 0xF) | ((y[l + 96] & 0xF) << 4);
      qh[l] = (y[l] >> 4) | ((y[l + 32] >> 4) << 2) | ((y[l + 64] >> 4) << 4) | ((y[l + 96] >> 4) << 6);
    }
  }
}

// ---- one tile's block <-> the 16 file blocks of its columns --------------------------

// `blocks[c]` is column c's file block, or null past N.
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
        for (int k = 0; k < 32; ++k) q[c][k] = uint8_t(src[c][2 + k] ^ 0x80);  // q + 128
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
      uint8_t* scales = dst + kQ4KScales;
      uint8_t* mins = dst + kQ4KMins;
      for (int c = 0; c < kCols; ++c) {
        std::memcpy(dst + 2 * c, src[c], 2);
        std::memcpy(dst + 32 + 2 * c, src[c] + 2, 2);
        for (int j = 0; j < 8; ++j) {
          uint8_t sc, mn;
          get_scale_min_k4(j, src[c] + 4, &sc, &mn);
          scales[j * kCols + c] = sc;
          mins[(j / 2) * 2 * kCols + 2 * c + j % 2] = mn;
        }
      }
      for (int j = 0; j < 8; ++j) {  // sub-block j: chunk j / 2, low nibbles if j is even
        for (int c = 0; c < kCols; ++c) {
          const uint8_t* qs = src[c] + 16 + 32 * (j / 2);
          for (int l = 0; l < 32; ++l) q[c][l] = j % 2 ? qs[l] >> 4 : qs[l] & 0xF;
        }
        put_nibbles(dst + kQ4KQuants + j * 4 * kLine, q);
      }
      return;
    }
    case Q6_K: {
      int8_t* scales = reinterpret_cast<int8_t*>(dst + kQ6KScales);
      uint8_t q6[kCols][256];
      for (int c = 0; c < kCols; ++c) {
        std::memcpy(dst + 2 * c, src[c] + 208, 2);
        for (int j = 0; j < 16; ++j) scales[j * kCols + c] = int8_t(src[c][192 + j]);
        get_q6(src[c], q6[c]);
      }
      for (int g = 0; g < 8; ++g) {
        for (int c = 0; c < kCols; ++c)
          for (int l = 0; l < 32; ++l) {
            q[c][l] = q6[c][32 * g + l] & 0xF;
            hi[c][l] = q6[c][32 * g + l] >> 4;
          }
        uint8_t* group = dst + kQ6KGroups + g * kQ6KGroupBytes;
        put_nibbles(group, q);
        put_crumbs(group + 4 * kLine, hi);
      }
      return;
    }
  }
}

// Column c's file block back from a tile's block (pack_block's inverse).
void unpack_block(int64_t qtype, const uint8_t* src, int c, uint8_t* dst) {
  uint8_t q[32];
  switch (qtype) {
    case Q8_0:
      std::memcpy(dst, src + 2 * c, 2);
      get_bytes(src + 32, c, q);
      for (int k = 0; k < 32; ++k) dst[2 + k] = q[k] ^ 0x80;
      return;
    case Q4_0:
      std::memcpy(dst, src + 2 * c, 2);
      get_nibbles(src + 32, c, q);
      for (int k = 0; k < 16; ++k) dst[2 + k] = q[k] | (q[k + 16] << 4);
      return;
    case Q4_K: {
      std::memcpy(dst, src + 2 * c, 2);
      std::memcpy(dst + 2, src + 32 + 2 * c, 2);
      uint8_t sc[8], mn[8];
      for (int j = 0; j < 8; ++j) {
        sc[j] = src[kQ4KScales + j * kCols + c];
        mn[j] = src[kQ4KMins + (j / 2) * 2 * kCols + 2 * c + j % 2];
      }
      put_scales_mins_k4(sc, mn, dst + 4);
      for (int j = 0; j < 8; j += 2) {  // sub-blocks j (low nibbles) and j + 1 (high) share chunk j / 2
        uint8_t high[32];
        get_nibbles(src + kQ4KQuants + j * 4 * kLine, c, q);
        get_nibbles(src + kQ4KQuants + (j + 1) * 4 * kLine, c, high);
        for (int l = 0; l < 32; ++l) dst[16 + 16 * j + l] = q[l] | (high[l] << 4);
      }
      return;
    }
    case Q6_K: {
      std::memcpy(dst + 208, src + 2 * c, 2);
      for (int j = 0; j < 16; ++j) dst[192 + j] = src[kQ6KScales + j * kCols + c];
      uint8_t q6[256], hi[32];
      for (int g = 0; g < 8; ++g) {
        const uint8_t* group = src + kQ6KGroups + g * kQ6KGroupBytes;
        get_nibbles(group, c, q);
        get_crumbs(group + 4 * kLine, c, hi);
        for (int l = 0; l < 32; ++l) q6[32 * g + l] = q[l] | (hi[l] << 4);
      }
      put_q6(q6, dst);
      return;
    }
  }
}

// The valid columns of tile t as file rows, into `rows` (cols x row_bytes).
void unpack_tile(int64_t qtype, const uint8_t* tile, int64_t blocks, int64_t cols, uint8_t* rows) {
  const Geometry g = geometry(qtype);
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t c = 0; c < cols; ++c)
      unpack_block(qtype, tile + b * g.packed, int(c), rows + (c * blocks + b) * g.file_bytes);
}

#if defined(__AVX2__) && defined(__F16C__)
// ---- tiles -> floats, vectorised (prefill's widening) -------------------------------
//
// A tile's block is first put back in column order in an L1 buffer: each 32 k
// of its lines become 8 "byte lines" (lane c of line i = column c's k
// 4i..4i+3, one byte each), a transpose of their 32-bit lanes makes them
// column c's 32 values in k order, stored as int8 with the type's bias taken
// off. Then each column's values are scaled per 16 k, w = scale * q - offset,
// as quant_gemm.cpp's block decoders compute them (the same float products
// for scale and offset; scale * q is exact in a float, an fp16 times a small
// integer, so contracting the subtraction into an FMA changes no bit), and
// rounded to bf16 the way c10::BFloat16 rounds. Equal to the bit to widening
// the file's blocks, about as fast (benchmarks/README.md, "Quantized").

// One tile's block in column order: q[c][k] = the value before scaling,
// scale/offset per 16 k.
struct ColumnBlock {
  alignas(64) int8_t q[kCols][256];
  float scale[kCols][16];
  float offset[kCols][16];
};

// A register of a line: the whole line with AVX-512, half of it (8 columns) with AVX2.
#if defined(__AVX512BW__)
using Part = __m512i;
constexpr int kParts = 1;
inline Part load_part(const uint8_t* line, int) { return _mm512_loadu_si512(line); }
inline Part splat(int8_t v) { return _mm512_set1_epi8(v); }
inline Part and_(Part a, Part b) { return _mm512_and_si512(a, b); }
inline Part or_(Part a, Part b) { return _mm512_or_si512(a, b); }
inline Part shift_right(Part a, unsigned n) { return _mm512_srli_epi16(a, n); }  // within 16-bit lanes:
inline Part shift_left(Part a, unsigned n) { return _mm512_slli_epi16(a, n); }   // mask before/after
inline Part sub_bytes(Part a, Part b) { return _mm512_sub_epi8(a, b); }
inline Part unpack_lo32(Part a, Part b) { return _mm512_unpacklo_epi32(a, b); }
inline Part unpack_hi32(Part a, Part b) { return _mm512_unpackhi_epi32(a, b); }
inline Part unpack_lo64(Part a, Part b) { return _mm512_unpacklo_epi64(a, b); }
inline Part unpack_hi64(Part a, Part b) { return _mm512_unpackhi_epi64(a, b); }
#else
using Part = __m256i;
constexpr int kParts = 2;
inline Part load_part(const uint8_t* line, int part) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32 * part));
}
inline Part splat(int8_t v) { return _mm256_set1_epi8(v); }
inline Part and_(Part a, Part b) { return _mm256_and_si256(a, b); }
inline Part or_(Part a, Part b) { return _mm256_or_si256(a, b); }
inline Part shift_right(Part a, unsigned n) { return _mm256_srli_epi16(a, n); }
inline Part shift_left(Part a, unsigned n) { return _mm256_slli_epi16(a, n); }
inline Part sub_bytes(Part a, Part b) { return _mm256_sub_epi8(a, b); }
inline Part unpack_lo32(Part a, Part b) { return _mm256_unpacklo_epi32(a, b); }
inline Part unpack_hi32(Part a, Part b) { return _mm256_unpackhi_epi32(a, b); }
inline Part unpack_lo64(Part a, Part b) { return _mm256_unpacklo_epi64(a, b); }
inline Part unpack_hi64(Part a, Part b) { return _mm256_unpackhi_epi64(a, b); }
#endif
constexpr int kPartCols = kCols / kParts;

// lines[i], i < 8: byte lines of 32 k (one part: columns kPartCols * part..) ->
// q[column][k0..k0+31], minus `bias` per byte. Per 128-bit lane (4 columns),
// two rounds of unpacks give u[j] = column j's quads 0-3 (lines 0-3) and
// u[j + 4] its quads 4-7; the last step joins the two halves of each column.
inline void transpose_to_columns(const Part lines[8], Part bias, int part, int8_t (*q)[256], int k0) {
  Part t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = unpack_lo32(lines[2 * i], lines[2 * i + 1]);
    t[2 * i + 1] = unpack_hi32(lines[2 * i], lines[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = unpack_lo64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = unpack_hi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = unpack_lo64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = unpack_hi64(t[4 * i + 1], t[4 * i + 3]);
  }
  const auto store = [&](int column, __m256i v) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(q[column] + k0), v);
  };
  for (int j = 0; j < 4; ++j) {
#if defined(__AVX512BW__)  // lanes 0-1 of u[j], u[j + 4]: columns j, j + 4; lanes 2-3: j + 8, j + 12
    const __m512i low = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), high = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    const __m512i a = sub_bytes(_mm512_permutex2var_epi64(u[j], low, u[j + 4]), bias);
    const __m512i b = sub_bytes(_mm512_permutex2var_epi64(u[j], high, u[j + 4]), bias);
    store(j, _mm512_castsi512_si256(a));
    store(j + 4, _mm512_extracti64x4_epi64(a, 1));
    store(j + 8, _mm512_castsi512_si256(b));
    store(j + 12, _mm512_extracti64x4_epi64(b, 1));
#else  // lane 0 of u[j], u[j + 4]: column j of the part; lane 1: j + 4
    const int first = kPartCols * part;
    store(first + j, sub_bytes(_mm256_permute2x128_si256(u[j], u[j + 4], 0x20), bias));
    store(first + j + 4, sub_bytes(_mm256_permute2x128_si256(u[j], u[j + 4], 0x31), bias));
#endif
  }
}

// 8 byte lines of one quad each from 8 lines of bytes (Q8_0).
inline void byte_lines(const uint8_t* src, int part, Part lines[8]) {
  for (int i = 0; i < 8; ++i) lines[i] = load_part(src + i * kLine, part);
}

// From 4 nibble lines: the low nibbles are quads 0..3, the high ones 4..7.
inline void nibble_lines(const uint8_t* src, int part, Part lines[8]) {
  const Part low4 = splat(0x0F);
  for (int r = 0; r < 4; ++r) {
    const Part v = load_part(src + r * kLine, part);
    lines[r] = and_(v, low4);
    lines[r + 4] = and_(shift_right(v, 4), low4);
  }
}

// Q6_K's group: nibble lines for the low 4 bits, 2 lines of 2-bit fields for the high 2.
inline void six_bit_lines(const uint8_t* group, int part, Part lines[8]) {
  nibble_lines(group, part, lines);
  const Part low2 = splat(0x03);
  for (int l = 0; l < 2; ++l) {
    const Part v = load_part(group + (4 + l) * kLine, part);
    for (int s = 0; s < 4; ++s)
      lines[4 * l + s] = or_(lines[4 * l + s], shift_left(and_(shift_right(v, 2 * s), low2), 4));
  }
}

// 16 fp16 values (one per column) as floats.
inline void fp16_columns(const uint8_t* p, float out[kCols]) {
  _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
}

// A tile's block (`blk`) into `cb`: quants in column order, scales per 16 k.
void to_columns(int64_t qtype, const uint8_t* blk, ColumnBlock& cb) {
  Part lines[8];
  float d[kCols];
  fp16_columns(blk, d);
  switch (qtype) {
    case Q8_0:
    case Q4_0: {
      const Part bias = splat(qtype == Q8_0 ? int8_t(-128) : 8);
      for (int part = 0; part < kParts; ++part) {
        if (qtype == Q8_0) byte_lines(blk + 32, part, lines);
        else nibble_lines(blk + 32, part, lines);
        transpose_to_columns(lines, bias, part, cb.q, 0);
      }
      for (int c = 0; c < kCols; ++c) cb.scale[c][0] = cb.scale[c][1] = d[c];
      return;
    }
    case Q4_K: {
      float dmin[kCols];
      fp16_columns(blk + 32, dmin);
      for (int j = 0; j < 8; ++j) {
        for (int part = 0; part < kParts; ++part) {
          nibble_lines(blk + kQ4KQuants + j * 4 * kLine, part, lines);
          transpose_to_columns(lines, splat(0), part, cb.q, 32 * j);
        }
        for (int c = 0; c < kCols; ++c) {
          const float scale = d[c] * blk[kQ4KScales + j * kCols + c];
          const float offset = dmin[c] * blk[kQ4KMins + (j / 2) * 2 * kCols + 2 * c + j % 2];
          cb.scale[c][2 * j] = cb.scale[c][2 * j + 1] = scale;
          cb.offset[c][2 * j] = cb.offset[c][2 * j + 1] = offset;
        }
      }
      return;
    }
    case Q6_K: {
      const int8_t* scales = reinterpret_cast<const int8_t*>(blk + kQ6KScales);
      for (int g = 0; g < 8; ++g)
        for (int part = 0; part < kParts; ++part) {
          six_bit_lines(blk + kQ6KGroups + g * kQ6KGroupBytes, part, lines);
          transpose_to_columns(lines, splat(32), part, cb.q, 32 * g);
        }
      for (int j = 0; j < 16; ++j)
        for (int c = 0; c < kCols; ++c) cb.scale[c][j] = d[c] * scales[j * kCols + c];
      return;
    }
  }
}

#if defined(__AVX512F__)
// c10::BFloat16's rounding (to nearest even; NaN -> 0x7FC0) of 16 floats.
inline __m256i bf16_bits(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7FC0)));
}

// 16 values scale * q - offset.
template <bool Offset>
inline __m512 widen16(const int8_t* q, float scale, float offset) {
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q))));
  const __m512 scaled = _mm512_mul_ps(_mm512_set1_ps(scale), v);
  return Offset ? _mm512_sub_ps(scaled, _mm512_set1_ps(offset)) : scaled;
}

// Column c's `block` values of cb (scale * q - offset) into out_f or out_b, 32 at a time.
template <bool Offset>
void widen_column(const ColumnBlock& cb, int c, int64_t block, float* out_f, uint16_t* out_b) {
  for (int64_t s = 0; s < block / 16; s += 2) {
    const __m512 lo = widen16<Offset>(cb.q[c] + 16 * s, cb.scale[c][s], cb.offset[c][s]);
    const __m512 hi = widen16<Offset>(cb.q[c] + 16 * s + 16, cb.scale[c][s + 1], cb.offset[c][s + 1]);
    if (out_f != nullptr) {
      _mm512_storeu_ps(out_f + 16 * s, lo);
      _mm512_storeu_ps(out_f + 16 * s + 16, hi);
    } else {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
      // The instruction rounds to nearest even as c10 does (no value here is a
      // denormal, which it would flush); only its NaN differs from c10's.
      const __m512i rounded = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
      const __mmask32 nan = _mm512_kunpackw(_mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q), _mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q));
      _mm512_storeu_si512(out_b + 16 * s, _mm512_mask_blend_epi16(nan, rounded, _mm512_set1_epi16(0x7FC0)));
#else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_b + 16 * s), bf16_bits(lo));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_b + 16 * s + 16), bf16_bits(hi));
#endif
    }
  }
}
#else
// 8 values scale * q - offset.
template <bool Offset>
inline __m256 widen8(const int8_t* q, __m256 scale, __m256 offset) {
  const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
  return Offset ? _mm256_sub_ps(_mm256_mul_ps(scale, v), offset) : _mm256_mul_ps(scale, v);
}

// c10::BFloat16's rounding (to nearest even; NaN -> 0x7FC0) into the low half of each lane.
inline __m256i bf16_bits(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}

// Column c's `block` values of cb (scale * q - offset) into out_f or out_b, 8 at a time.
template <bool Offset>
void widen_column(const ColumnBlock& cb, int c, int64_t block, float* out_f, uint16_t* out_b) {
  for (int64_t s = 0; s < block / 16; ++s) {
    const __m256 scale = _mm256_set1_ps(cb.scale[c][s]), offset = _mm256_set1_ps(Offset ? cb.offset[c][s] : 0.f);
    const __m256 lo = widen8<Offset>(cb.q[c] + 16 * s, scale, offset);
    const __m256 hi = widen8<Offset>(cb.q[c] + 16 * s + 8, scale, offset);
    if (out_f != nullptr) {
      _mm256_storeu_ps(out_f + 16 * s, lo);
      _mm256_storeu_ps(out_f + 16 * s + 8, hi);
    } else {  // packus interleaves 128-bit lanes: put them back in order
      const __m256i both = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits(lo), bf16_bits(hi)), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_b + 16 * s), both);
    }
  }
}
#endif

// The `cols` valid columns of tile `tile` as rows of K floats (out_f) or bf16 bits (out_b).
void widen_tile(int64_t qtype, const uint8_t* tile, int64_t blocks, int64_t cols, int64_t K, ColumnBlock& cb,
                float* out_f, uint16_t* out_b) {
  const Geometry g = geometry(qtype);
  for (int64_t b = 0; b < blocks; ++b) {
    to_columns(qtype, tile + b * g.packed, cb);
    for (int c = 0; c < cols; ++c) {
      const int64_t at = c * K + b * g.block;
      if (qtype == Q4_K) widen_column<true>(cb, c, g.block, out_f ? out_f + at : nullptr, out_b ? out_b + at : nullptr);
      else widen_column<false>(cb, c, g.block, out_f ? out_f + at : nullptr, out_b ? out_b + at : nullptr);
    }
  }
}
#endif

void check_packed(const char* caller, const at::Tensor& packed, int64_t qtype, int64_t N, int64_t K) {
  const Geometry g = geometry(qtype);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.device().is_cpu() && K % g.block == 0 && packed.size(0) == (N + kCols - 1) / kCols &&
                  packed.size(1) == K / g.block * g.packed,
              caller, ": packed weight ", packed.sizes(), " does not hold [", N, ", ", K, "] in this type");
}

}  // namespace

// weight [N, K / block * bytes] uint8 as in the file -> [ceil(N / 16), K / block * packed bytes] uint8.
at::Tensor quant_pack(const at::Tensor& weight, int64_t qtype) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.device().is_cpu(),
              "quant_pack: weight is a [rows, bytes] uint8 CPU tensor");
  const Geometry g = geometry(qtype);
  TORCH_CHECK(weight.size(1) % g.file_bytes == 0, "quant_pack: rows of ", weight.size(1),
              " bytes are not whole blocks of ", g.file_bytes);
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), blocks = w.size(1) / g.file_bytes, tiles = (N + kCols - 1) / kCols;
  at::Tensor packed = raylm::zeros_on_huge_pages({tiles, blocks * g.packed}, w.options());
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

// packed from quant_pack of N rows of K weights -> the file's blocks [N, K / block * bytes] uint8.
at::Tensor quant_unpack(const at::Tensor& packed, int64_t qtype, int64_t N, int64_t K) {
  check_packed("quant_unpack", packed, qtype, N, K);
  const Geometry g = geometry(qtype);
  const int64_t blocks = K / g.block, row_bytes = blocks * g.file_bytes, tiles = packed.size(0);
  at::Tensor out = at::empty({N, row_bytes}, packed.options());
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      unpack_tile(qtype, src + t * packed.size(1), blocks, std::min(kCols, N - t * kCols), dst + t * kCols * row_bytes);
  });
  return out;
}

// packed from quant_pack of N rows of K weights -> the float weight [N, K] in
// `dtype` (float32 or bfloat16), equal to the bit to quant_dequantize on the
// file's blocks: with AVX2, straight from the tiles (widen_tile); otherwise
// each tile goes back to file blocks in a small per-thread buffer first.
at::Tensor quant_packed_dequantize(const at::Tensor& packed, int64_t qtype, int64_t N, int64_t K,
                                   at::ScalarType dtype) {
  check_packed("quant_packed_dequantize", packed, qtype, N, K);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "quant_packed_dequantize: dtype float32 or bfloat16");
  const Geometry g = geometry(qtype);
  const int64_t blocks = K / g.block, tiles = packed.size(0);
  at::Tensor out = at::empty({N, K}, packed.options().dtype(dtype));
  const uint8_t* src = packed.data_ptr<uint8_t>();
  float* out_f = dtype == at::kFloat ? out.data_ptr<float>() : nullptr;
  c10::BFloat16* out_b = dtype == at::kBFloat16 ? out.data_ptr<c10::BFloat16>() : nullptr;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
#if defined(__AVX2__) && defined(__F16C__)
    ColumnBlock buffer;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t cols = std::min(kCols, N - t * kCols), first = t * kCols * K;
      widen_tile(qtype, src + t * packed.size(1), blocks, cols, K, buffer, out_f ? out_f + first : nullptr,
                 out_b ? reinterpret_cast<uint16_t*>(out_b + first) : nullptr);
    }
#else
    std::vector<uint8_t> rows(kCols * blocks * g.file_bytes);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t cols = std::min(kCols, N - t * kCols), first = t * kCols * K;
      unpack_tile(qtype, src + t * packed.size(1), blocks, cols, rows.data());
      quant_dequantize_rows(rows.data(), qtype, K, cols, out_f ? out_f + first : nullptr,
                            out_b ? out_b + first : nullptr);
    }
#endif
  });
  return out;
}
