// attnzero's float32 math for code the compiler vectorises: exp, exp2, log, log2, tanh, sigmoid and
// rsqrt as branch-free arithmetic (libm's are one call per element), within 3 float32 ulp of the
// exact value, with the zeros, infinities and NaNs of the exact function. Used by the CPU kernel's
// softcap (attention.cpp) and by the C++ generated from a score_mod (attnzero/cpu_mods.py).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace azm {

constexpr float INF = std::numeric_limits<float>::infinity();

// 2^f for |f| <= 1/2 (and a little beyond): a degree-6 polynomial, relative error below 2e-7.
inline float pow2_reduced(float f) {
  float p = 1.5353362e-4f;
  p = p * f + 1.3398874e-3f;
  p = p * f + 9.6184375e-3f;
  p = p * f + 5.5503324e-2f;
  p = p * f + 2.4022648e-1f;
  p = p * f + 6.9314720e-1f;
  return p * f + 1.f;
}

// 2^(t + lo) for float t and a small correction lo, branch-free: t = n + f (n an integer, |f| <= 1/2),
// 2^(f + lo) by pow2_reduced, 2^n by two exponent-field
// scalings (so that a subnormal result is still rounded once). Overflow gives inf, below 2^-150
// gives 0, NaN stays NaN.
inline float pow2(float t, float lo) {
  const float y = t < -151.f ? -151.f : (t > 129.f ? 129.f : t);
  const float n = std::nearbyint(y), f = (y - n) + lo;
  const float p = pow2_reduced(f);
  const int32_t e = static_cast<int32_t>(n), e1 = e / 2, e2 = e - e1;
  const int32_t b1 = (e1 + 127) << 23, b2 = (e2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, 4);
  std::memcpy(&s2, &b2, 4);
  const float r = p * s1 * s2;
  return t != t ? t : (t >= 128.f ? INF : (t < -150.f ? 0.f : r));
}
inline float exp2(float t) { return pow2(t, 0.f); }
// e^x = 2^(x · log2 e): the product's rounding error (an fma) and log2 e's low part go into lo.
inline float exp(float x) {
  const float t = x * 1.44269502f;
  return pow2(t, std::fma(x, 1.44269502f, -t) + x * 1.925963e-8f);
}
// log x = e·ln 2 + log m, m in [sqrt(1/2), sqrt 2): log m = 2 atanh(z), z = (m − 1) / (m + 1),
// |z| <= 0.1716, by its odd series to z^11 (truncation below 3e-10 relative).
inline float log(float x) {
  const bool sub = x < 1.17549435e-38f;
  const float xs = sub ? x * 8388608.f : x;  // subnormals scaled by 2^23 first
  int32_t bits;
  std::memcpy(&bits, &xs, 4);
  int32_t e = ((bits >> 23) & 0xff) - 127;
  int32_t mb = (bits & 0x7fffff) | 0x3f800000;
  float m;
  std::memcpy(&m, &mb, 4);
  const bool big = m > 1.41421356f;
  m = big ? m * 0.5f : m;
  e = e + (big ? 1 : 0) - (sub ? 23 : 0);
  const float z = (m - 1.f) / (m + 1.f), z2 = z * z;
  float p = 0.18181818f;
  p = p * z2 + 0.22222222f;
  p = p * z2 + 0.28571429f;
  p = p * z2 + 0.4f;
  p = p * z2 + 0.66666667f;
  const float lm = 2.f * z + z * z2 * p;
  const float r = static_cast<float>(e) * 0.693147182f + lm;
  return x != x ? x : (x < 0.f ? std::numeric_limits<float>::quiet_NaN() : (x == 0.f ? -INF : (x == INF ? INF : r)));
}
inline float log2(float x) { return log(x) * 1.44269504f; }
// tanh x: odd Taylor series to x^11 where |x| < 0.3 (error below 1e-9 relative), else
// sign(x) · (1 − e) / (1 + e) with e = exp(−2|x|) = 2^t, t = −2 log2(e) · min(|x|, 9) in [−26, 0]
// (tanh 9 rounds to 1 in float32): 2^t as in pow2, with none of its range checks.
inline float tanh(float x) {
  const float a = std::fabs(x), x2 = x * x;
  float p = -0.0088632355f;  // −1382/155925, 62/2835, −17/315, 2/15, −1/3
  p = p * x2 + 0.021869488f;
  p = p * x2 - 0.053968254f;
  p = p * x2 + 0.13333333f;
  p = p * x2 - 0.33333333f;
  const float small = x + x * x2 * p;
  const float t = -2.88539008f * (a < 9.f ? a : 9.f);
  const float n = std::nearbyint(t), f = t - n;
  const float q = pow2_reduced(f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  const float e = q * scale;
  const float large = std::copysign((1.f - e) / (1.f + e), x);
  return a < 0.3f ? small : (x != x ? x : large);
}
inline float sigmoid(float x) { return 1.f / (1.f + exp(-x)); }
inline float rsqrt(float x) { return 1.f / std::sqrt(x); }
inline double exp(double x) { return std::exp(x); }
inline double exp2(double x) { return std::exp2(x); }
inline double log(double x) { return std::log(x); }
inline double log2(double x) { return std::log2(x); }
inline double tanh(double x) { return std::tanh(x); }
inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }

}  // namespace azm
