// A vectorised exp for the CPU kernels: both the softmax of paged attention
// and the SiLU of the MLP would otherwise spend most of their time in libm.
//
// It is written on eight-float vectors (GCC and Clang's vector extensions:
// each operation is one AVX2 instruction, two SSE ones without AVX) rather than
// as a scalar function in loops left to the auto-vectoriser. GCC 12 did not
// vectorise those loops: it turned the clamps into branches (after a clamp the
// rest of the function is a constant, so it "threads" the constant through),
// and a loop with branches stays scalar. The SiLU ran ~4x slower than torch's.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

namespace raylm {

using Floats8 = float __attribute__((vector_size(32)));
using Ints8 = int32_t __attribute__((vector_size(32)));
constexpr int kFloats8 = 8;

inline Floats8 splat8(float value) { return Floats8{} + value; }

// exp(x) lane by lane as 2^k * polynomial (Cody-Waite reduction, relative error
// ~2e-7), branch-free. Below -87 the result would be subnormal and is given as
// e^-87 (negligible next to any weight it is summed with); past the float range
// it is infinity, as std::exp gives; NaN stays NaN.
inline Floats8 fast_exp(Floats8 x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kRoundMagic = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const Floats8 overflow = x > 88.7f ? splat8(std::numeric_limits<float>::infinity()) : splat8(1.f);
  x = x < -87.f ? splat8(-87.f) : x;
  x = x > 88.f ? splat8(88.f) : x;
  const Floats8 k = (x * kLog2e + kRoundMagic) - kRoundMagic;
  const Floats8 y = (x - k * kLn2Hi) - k * kLn2Lo;  // |y| <= ln2 / 2
  Floats8 p = splat8(1.f / 720.f);
  p = p * y + 1.f / 120.f;
  p = p * y + 1.f / 24.f;
  p = p * y + 1.f / 6.f;
  p = p * y + 0.5f;
  p = p * y + 1.f;
  p = p * y + 1.f;
  // NaN's lanes compare false above and reach the int conversion as NaN; the
  // product with p (NaN) keeps them NaN whatever the scale's bits are.
  const Ints8 bits = (__builtin_convertvector(k, Ints8) + 127) << 23;
  Floats8 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale * overflow;
}

// The same exp for one value (loop tails): lane 0 of the vector form, so that a
// row's last elements round exactly as its vectorised body does.
inline float fast_exp(float x) { return fast_exp(splat8(x))[0]; }

}  // namespace raylm
