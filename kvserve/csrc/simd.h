// Vector helpers shared by kvserve's C++ kernels: 16-float vectors (GCC vector extensions: one
// AVX-512 register, or several narrower ones), bfloat16 conversions, a 16x16 transpose-reduce.
#pragma once

#include <cstdint>
#include <cstring>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace kvserve {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float x) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

inline v16 loadv(const float* p) {
  v16 v;
  std::memcpy(&v, p, 64);
  return v;
}

inline v16 loadv(const uint16_t* p) {  // 16 bfloat16 values widened
#ifdef __AVX512F__
  return (v16)_mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#endif
  u16x16 h;
  std::memcpy(&h, p, 32);
  u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  v16 f;
  std::memcpy(&f, &w, 64);
  return f;
}

inline v16 pair_sum(v16 a, v16 b, i32x16 lo, i32x16 hi) {
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

// Lane t of the result is the sum of the 16 lanes of p[t] (p is overwritten).
inline v16 transpose_sum(v16* p) {
  const i32x16 lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const i32x16 hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const i32x16 lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const i32x16 hi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const i32x16 lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const i32x16 hi3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const i32x16 lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const i32x16 hi4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  for (int i = 0; i < 8; ++i) p[i] = pair_sum(p[2 * i], p[2 * i + 1], lo1, hi1);
  for (int i = 0; i < 4; ++i) p[i] = pair_sum(p[2 * i], p[2 * i + 1], lo2, hi2);
  for (int i = 0; i < 2; ++i) p[i] = pair_sum(p[2 * i], p[2 * i + 1], lo3, hi3);
  return pair_sum(p[0], p[1], lo4, hi4);
}

}  // namespace kvserve
