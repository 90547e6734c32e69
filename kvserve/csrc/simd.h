// Vector helpers shared by kvserve's C++ kernels: `vf`, the widest float vector the target keeps in
// one register (GCC vector extensions: 16 lanes under AVX-512, 8 under AVX, 4 else; GCC keeps a
// vector wider than the target's registers in memory, op by op), bfloat16 conversions and loads,
// and the transpose-reduce of 16 such vectors. Intrinsics appear only under #if beside a portable
// form, where that one compiles to slower code.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvserve {

#if defined(__AVX512F__)
constexpr int kVectorBytes = 64;
#elif defined(__AVX__)
constexpr int kVectorBytes = 32;
#else
constexpr int kVectorBytes = 16;
#endif
constexpr int kLanes = kVectorBytes / 4;

typedef float vf __attribute__((vector_size(kVectorBytes)));
typedef int32_t vi __attribute__((vector_size(kVectorBytes)));
typedef uint32_t vu __attribute__((vector_size(kVectorBytes)));

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

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vf loadv(const uint16_t* p) {  // kLanes bfloat16 values widened
#if defined(__AVX512F__)
  return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#elif defined(__AVX2__)
  return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#else
  typedef uint16_t vh __attribute__((vector_size(kVectorBytes / 2)));
  vh h;
  std::memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
#endif
}

// Lanes C apart summed, in each chunk of 2C lanes of a and of b: a's sums fill the low half of the
// result, b's the high half (C = 8 on 16 lanes: a[i] + a[i + 8], then b[i] + b[i + 8]).
template <int C>
__attribute__((always_inline)) inline vf fold(vf a, vf b) {
  vi lo, hi;
  for (int i = 0; i < kLanes; ++i) {  // constants once inlined: the compiler picks the shuffles
    const int j = i % (kLanes / 2);
    lo[i] = (i < kLanes / 2 ? 0 : kLanes) + j / C * 2 * C + j % C;
    hi[i] = lo[i] + C;
  }
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

template <int C, int N>
__attribute__((always_inline)) inline void fold_pairs(vf* p) {  // N vectors to N / 2, and on until C = 1 (16 / kLanes vectors)
  for (int i = 0; i < N / 2; ++i) p[i] = fold<C>(p[2 * i], p[2 * i + 1]);
  if constexpr (C > 1) fold_pairs<C / 2, N / 2>(p);
}

// out[t] = the sum of the lanes of p[t], t < 16 (p is overwritten): each sum a tree, the halves of
// the vector added first, whatever its width.
__attribute__((always_inline)) inline void transpose_sum(vf* p, float* out) {
  fold_pairs<kLanes / 2, 16>(p);
  std::memcpy(out, p, 16 * sizeof(float));
}

// exp(x) for x <= 0 (a value minus its row's maximum), vectorizable: 2^n * p(r), |rel err| < 2e-7.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  float n = std::nearbyint(x * 1.44269504f);
  float r = x - n * 0.693145752f - n * 1.42860677e-6f;
  float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666456f +
            r * (0.00833336543f + r * 0.00138883968f)))));
  int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, 4);
  return p * scale;
}

// exp_nonpositive on kLanes lanes, the same polynomial (x <= 0, so truncating x * log2(e) - 0.5
// rounds to nearest: conversions, unlike the 1.5 * 2^23 trick, survive -fassociative-math).
inline vf exp_nonpositive(vf x) {
  const vf lo = vf{} - 87.0f;
  x = x < lo ? lo : x;
  const vi ni = __builtin_convertvector(x * 1.44269504f - 0.5f, vi);
  const vf n = __builtin_convertvector(ni, vf);
  const vf r = x - n * 0.693145752f - n * 1.42860677e-6f;
  const vf p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666456f +
               r * (0.00833336543f + r * 0.00138883968f)))));
  const vi e = (ni + 127) << 23;
  return p * (vf)e;
}

}  // namespace kvserve
