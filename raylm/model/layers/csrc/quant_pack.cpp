// GGUF-quantized weights re-laid into quant_layout.h's tiles once at load
// (quant_pack), and back: quant_unpack gives the file's blocks again, bit for
// bit, and quant_packed_dequantize widens the tiles to floats for prefill
// (through quant_gemm.cpp's block decoders, so it equals quant_dequantize on
// the file's blocks to the bit). A layer therefore keeps only the packed copy.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "kernels.h"
#include "quant_layout.h"

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
// `dtype` (float32 or bfloat16), as quant_dequantize gives it from the file's
// blocks: each tile goes back to file blocks in a small per-thread buffer.
at::Tensor quant_packed_dequantize(const at::Tensor& packed, int64_t qtype, int64_t N, int64_t K,
                                   at::ScalarType dtype) {
  check_packed("quant_packed_dequantize", packed, qtype, N, K);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "quant_packed_dequantize: dtype float32 or bfloat16");
  const Geometry g = geometry(qtype);
  const int64_t blocks = K / g.block, row_bytes = blocks * g.file_bytes, tiles = packed.size(0);
  at::Tensor out = at::empty({N, K}, packed.options().dtype(dtype));
  const uint8_t* src = packed.data_ptr<uint8_t>();
  float* out_f = dtype == at::kFloat ? out.data_ptr<float>() : nullptr;
  c10::BFloat16* out_b = dtype == at::kBFloat16 ? out.data_ptr<c10::BFloat16>() : nullptr;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> rows(kCols * row_bytes);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t cols = std::min(kCols, N - t * kCols), first = t * kCols * K;
      unpack_tile(qtype, src + t * packed.size(1), blocks, cols, rows.data());
      quant_dequantize_rows(rows.data(), qtype, K, cols, out_f ? out_f + first : nullptr,
                            out_b ? out_b + first : nullptr);
    }
  });
  return out;
}
