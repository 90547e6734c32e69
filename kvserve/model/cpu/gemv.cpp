// Few-row matrix-vector products for CPU decode steps, registered as torch ops (kvserve_cpu::*), so
// a compiled decode graph calls them through the dispatcher (a few microseconds) like aten's own.
//   int8_gemv(x [M, K] float32|bfloat16, w [N, K] int8, scale [N] bfloat16) -> [M, N] in x's dtype:
//     weight-only int8 with one scale per output channel, rounded as torch's CPU kernel
//     (_weight_int8pack_mm) rounds: x and the scale in bfloat16, sums in float32, the result
//     rounded to bfloat16.
//   bf16_gemv(x [M, K] bfloat16, w [N, K] bfloat16) -> [M, N] bfloat16, sums in float32.
//   q8g_tile(codes [N, K] int8, scales [N, K/group] float32 or float16, group 16|32) -> (tiles
//            [ceil(N/16), K/32, 512] uint8, tile scales [ceil(N/16), K/group, 16]): byte codes in tiles.
//   q8g_gemv(x [M, K] float32|bfloat16, tiles, tile scales, mins [K/group, N] of the scales' dtype
//            or None, group, int N) -> [M, N] in x's dtype:
//     y[m, n] = sum over groups g of scales[n, g] * sum_{k in g} x[m, k] codes[n, k]
//               + mins[g, n] * sum_{k in g} x[m, k]
//     (a GGUF block's codes as the format stores them: Q8_0, Q5_0, Q6_K signed, Q5_1 / Q5_K
//     unsigned with mins); q8g_dequantize(tiles, tile scales, mins, group, N, dtype) -> W [N, K].
//   q4g_tile(nibbles [N, K/2] uint8 in GGUF's nibble order, scales [N, K/32] float16) -> (tiles
//            [ceil(N/16), K/32, 256] uint8, tile scales [ceil(N/16), K/32, 16] float16): 4-bit codes
//     re-laid in tiles of 16 output channels (see "Codes in tiles" below).
//   q4g_gemv(x [M, K] float32|bfloat16, tiles, tile scales, mins [K/32, N] float16 or None, int N)
//            -> [M, N] in x's dtype: w = code * scale + min, or without mins (Q4_0's form)
//     w = (code - 8) * scale.
//   q4g_dequantize(tiles, tile scales, mins, N, dtype) -> W [N, K] float32 or bfloat16 (the
//     weight of a many-row step; the dequantizers transpose a tile's block in registers).
//   q5g_tile(codes [N, K] uint8 0..31, scales [N, K/32] float16 or float32) -> (tiles
//            [ceil(N/16), K/32, 320] uint8, tile scales [ceil(N/16), K/32, 16]): 5-bit codes in tiles.
//   q5g_gemv(x, tiles, tile scales, mins [K/32, N] of the scales' dtype or None, int N) -> [M, N]
//     in x's dtype: w = code * scale + min, or without mins (Q5_0's form) w = (code - 16) * scale;
//     q5g_dequantize(tiles, tile scales, mins, N, dtype).
// q8g, q5g and q4g quantize x to int16 per block of 32 and multiply in integers ("Integer products"
// below); their rows never depend on the call's row count or thread count. int8, bfloat16 and
// float16: sixteen output channels at a time: each channel's dot product runs along K with several
// accumulators, the 16 partial vectors are reduced together (a transpose); `invariant`: a lone
// row is summed as a row of a group is, so each row's result is the same whatever the row count.
// Every GEMV fetches its weights 64 KiB ahead into L2 (kFetchAhead).
// Output channel blocks are split over torch's threads (at::parallel_for, torch's OpenMP runtime).
// Vectors are simd.h's `vf`, one register wide (16 floats under AVX-512, 8 under AVX2, 4 else);
// AVX-512 and AVX2 (+F16C) intrinsics appear only under #if beside a portable path (tests build
// the AVX2 path with -mno-avx512f, the portable one with -mno-avx).
// Built at run time by kvserve/model/cpu/__init__.py against torch's headers.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>
#if defined(__SSE__)
#include <immintrin.h>
#endif

#include "simd.h"

namespace {

using namespace kvserve;

// Weights are fetched 64 KiB ahead of the line being read, into L2 (which 64 KiB a thread stays far
// inside): a hardware prefetcher stops at each 4 KiB page, and a GEMV that streams a weight larger
// than the caches (every weight of a decode step, one after another) otherwise waits on each new
// page; one core alone also keeps too few loads in flight to fill the memory bus. A prefetch never
// faults: the int8 / 16-bit kernels' last ones reach past the weight's end and fetch nothing useful.
constexpr int64_t kFetchAhead = 64 * 1024;

inline void prefetch_l2(const void* p) {
#if defined(__SSE__)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

struct Half {  // a float16 value's bits
  uint16_t bits;
};

struct Bf16 {  // a bfloat16 value's bits
  uint16_t bits;
};

inline vf widen(const Bf16* p) { return loadv(&p->bits); }  // kLanes bfloat16 values as floats

inline vf widen(const int8_t* p) {  // kLanes int8 values as floats
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  typedef int8_t vb __attribute__((vector_size(kLanes)));
  vb q;
  std::memcpy(&q, p, sizeof q);
  return __builtin_convertvector(__builtin_convertvector(q, vi), vf);
#endif
}

inline vf widen(const Half* p) {  // kLanes float16 values as floats
#if defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__AVX2__) && defined(__F16C__)
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  typedef _Float16 vh __attribute__((vector_size(kVectorBytes / 2)));
  vh h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, vf);
#endif
}

constexpr int kUnroll = 64 / kLanes;  // vectors per 64 inputs: a one-row pass's accumulators

template <int N>
inline vf sum_of(const vf* a) {  // (a[0] + a[1]) + (a[2] + a[3]) ..., pairwise
  if constexpr (N == 1) return a[0];
  else return sum_of<N / 2>(a) + sum_of<N / 2>(a + N / 2);
}

inline float half_to_float(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}

inline uint16_t float_to_half(float x) {  // round to nearest even
  _Float16 h = static_cast<_Float16>(x);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

// Dot products of row x (float32, K % 16 == 0) with 16 weight rows from w (int8, float16 or
// bfloat16, widened to float32): part[t] holds kLanes partial sums of channel t.
template <typename W>
void widened_block(const float* x, const W* w, int64_t k, vf* part) {
  for (int t = 0; t < 16; ++t) {
    const W* wr = w + t * k;
    vf acc[kUnroll] = {};
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
      prefetch_l2(wr + i + kFetchAhead / sizeof(W));
      if (sizeof(W) > 1) prefetch_l2(wr + i + kFetchAhead / sizeof(W) + 32);
      for (int j = 0; j < kUnroll; ++j) acc[j] += widen(wr + i + j * kLanes) * loadv(x + i + j * kLanes);
    }
    for (; i < k; i += kLanes) acc[0] += widen(wr + i) * loadv(x + i);
    part[t] = sum_of<kUnroll>(acc);
  }
}

// The same for R rows of x at once (row stride k): each widened weight vector serves every row.
// A row's two accumulators take one product each a step: no chain of additions the compiler
// could reassociate, so a row is summed alike whatever R (the `invariant` mode relies on it).
template <int R, typename W>
void widened_rows(const float* x, const W* w, int64_t k, vf (*part)[16]) {
  for (int t = 0; t < 16; ++t) {
    const W* wr = w + t * k;
    vf a[R] = {}, b[R] = {};
    int64_t i = 0;
    for (; i + 2 * kLanes <= k; i += 2 * kLanes) {
      prefetch_l2(wr + i + kFetchAhead / sizeof(W));
      const vf w0 = widen(wr + i), w1 = widen(wr + i + kLanes);
      for (int r = 0; r < R; ++r) {
        a[r] += w0 * loadv(x + r * k + i);
        b[r] += w1 * loadv(x + r * k + i + kLanes);
      }
    }
    for (; i < k; i += kLanes) {
      const vf w0 = widen(wr + i);
      for (int r = 0; r < R; ++r) a[r] += w0 * loadv(x + r * k + i);
    }
    for (int r = 0; r < R; ++r) part[r][t] = a[r] + b[r];
  }
}

// bfloat16 rows of x against bfloat16 weights with AVX512-BF16's dot products (elsewhere x is
// widened to float32 once and the weights as they are read: Widened<Bf16>).
#ifdef __AVX512BF16__
inline vf dot_bf16(vf acc, const Bf16* w, const uint16_t* x) {  // acc plus 32 products, in pairs of lanes
  __m512i wv = _mm512_loadu_si512(w);
  __m512i xv = _mm512_loadu_si512(x);
  return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)wv, (__m512bh)xv);
}

// As widened_block (K % 32 == 0).
void bf16_block(const uint16_t* x, const Bf16* w, int64_t k, vf* part) {
  for (int t = 0; t < 16; ++t) {
    const Bf16* wr = w + t * k;
    vf a = {0}, b = {0}, c = {0}, d = {0};
    int64_t i = 0;
    for (; i + 128 <= k; i += 128) {
      prefetch_l2(wr + i + kFetchAhead / 2);
      prefetch_l2(wr + i + kFetchAhead / 2 + 64);
      a = dot_bf16(a, wr + i, x + i);
      b = dot_bf16(b, wr + i + 32, x + i + 32);
      c = dot_bf16(c, wr + i + 64, x + i + 64);
      d = dot_bf16(d, wr + i + 96, x + i + 96);
    }
    for (; i < k; i += 32) a = dot_bf16(a, wr + i, x + i);
    part[t] = (a + b) + (c + d);
  }
}

// As bf16_block for R rows of x at once.
template <int R>
void bf16_rows(const uint16_t* x, const Bf16* w, int64_t k, vf (*part)[16]) {
  for (int t = 0; t < 16; ++t) {
    const Bf16* wr = w + t * k;
    vf a[R] = {}, b[R] = {};
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
      prefetch_l2(wr + i + kFetchAhead / 2);
      for (int r = 0; r < R; ++r) {
        a[r] = dot_bf16(a[r], wr + i, x + r * k + i);
        b[r] = dot_bf16(b[r], wr + i + 32, x + r * k + i + 32);
      }
    }
    for (; i < k; i += 32) {
      for (int r = 0; r < R; ++r) a[r] = dot_bf16(a[r], wr + i, x + r * k + i);
    }
    for (int r = 0; r < R; ++r) part[r][t] = a[r] + b[r];
  }
}
#endif

// Calls block(r, rows, n0) for every block of 16 output channels starting at n0 (the last block
// overlaps its neighbour when N % 16 != 0) and every group of up to Tile rows from r; blocks are
// split over torch's threads.
template <int Tile = 4, typename Block>
void for_blocks(int64_t m, int64_t n, Block block) {
  const int64_t blocks = (n + 15) / 16;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * 16 <= n - 16 ? blk * 16 : n - 16;
      for (int64_t r = 0; r < m; r += Tile) block(r, std::min<int64_t>(Tile, m - r), n0);
    }
  });
}

// The 16-channel partial sums of `rows` rows (1 to Kernels::kTile) from x, with the kernel for each
// count; args are the kernel's operands. A lone row takes the one-row kernel (more accumulators,
// another summation order) unless `invariant`: then every row is summed as in a group of rows, so a
// row's result does not depend on how many rows share the call (the batch-invariant mode).
template <typename Kernels, int R = 1, typename... Args>
void row_group(int64_t rows, bool invariant, vf (*part)[16], Args... args) {
  if constexpr (R == 1) {
    if (rows == 1 && !invariant) return Kernels::one(args..., part[0]);
  }
  if (rows == R || R == Kernels::kTile) return Kernels::template many<R>(args..., part);
  if constexpr (R < Kernels::kTile) row_group<Kernels, R + 1>(rows, invariant, part, args...);
}

template <typename W>
struct Widened {
  static constexpr int kTile = 4;
  static void one(const float* x, const W* w, int64_t k, vf* part) { widened_block(x, w, k, part); }
  template <int R> static void many(const float* x, const W* w, int64_t k, vf (*part)[16]) { widened_rows<R>(x, w, k, part); }
};
#ifdef __AVX512BF16__
struct Bf16Pairs {
  static constexpr int kTile = 4;
  static void one(const uint16_t* x, const Bf16* w, int64_t k, vf* part) { bf16_block(x, w, k, part); }
  template <int R> static void many(const uint16_t* x, const Bf16* w, int64_t k, vf (*part)[16]) { bf16_rows<R>(x, w, k, part); }
};
#endif


void check_shapes(const at::Tensor& x, const at::Tensor& w, int64_t k_multiple, const char* name) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), name, ": x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), name, ": contiguous x and w expected");
  TORCH_CHECK(x.size(1) % k_multiple == 0, name, ": K must be a multiple of ", k_multiple);
  TORCH_CHECK(w.size(0) >= 16, name, ": at least 16 output channels expected");
  TORCH_CHECK(x.size(0) <= 64, name, ": at most 64 rows expected");
}

// x [M, K] as float32 on a 64-byte boundary (whole-vector loads then never straddle cache lines):
// bfloat16 and float16 widened, float32 rounded to bfloat16 first where round_bf16; aligned
// float32 x that needs no rounding is used as it is.
at::Tensor float_rows(const at::Tensor& x, bool round_bf16) {
  const bool f32 = x.scalar_type() == at::kFloat;
  if (f32 && !round_bf16 && reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 64 == 0) return x;
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const int64_t count = x.numel();
  const float* xf = f32 ? x.const_data_ptr<float>() : nullptr;
  const uint16_t* xh = f32 ? nullptr : static_cast<const uint16_t*>(x.const_data_ptr());
  if (f32 && round_bf16) for (int64_t i = 0; i < count; ++i) o[i] = bf16_to_float(float_to_bf16(xf[i]));
  else if (f32) std::memcpy(o, xf, count * sizeof(float));
  else if (x.scalar_type() == at::kHalf) for (int64_t i = 0; i < count; ++i) o[i] = half_to_float(xh[i]);
  else for (int64_t i = 0; i < count; ++i) o[i] = bf16_to_float(xh[i]);
  return out;
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, bool invariant) {
  check_shapes(x, w, 16, "int8_gemv");
  TORCH_CHECK(w.scalar_type() == at::kChar && scale.scalar_type() == at::kBFloat16 && scale.is_contiguous() &&
                  scale.numel() == w.size(0), "int8_gemv: int8 w and bfloat16 scale [N] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "int8_gemv: float32 or bfloat16 x");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const bool f32 = x.scalar_type() == at::kFloat;
  const at::Tensor xb = float_rows(x, true);  // x rounded to bfloat16, as float32
  at::Tensor y = at::empty({m, n}, x.options());
  const int8_t* wp = w.const_data_ptr<int8_t>();
  const uint16_t* sp = static_cast<const uint16_t*>(scale.const_data_ptr());
  void* yp = y.data_ptr();
  for_blocks(m, n, [&](int64_t r0, int64_t rows, int64_t n0) {
    vf part[4][16];
    row_group<Widened<int8_t>>(rows, invariant, part, xb.const_data_ptr<float>() + r0 * k, wp + n0 * k, k);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t r = r0 + i;
      float sums[16];
      transpose_sum(part[i], sums);
      for (int t = 0; t < 16; ++t) {
        const uint16_t out = float_to_bf16(sums[t] * bf16_to_float(sp[n0 + t]));
        if (f32) static_cast<float*>(yp)[r * n + n0 + t] = bf16_to_float(out);
        else static_cast<uint16_t*>(yp)[r * n + n0 + t] = out;
      }
    }
  });
  return y;
}

at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& w, bool invariant) {
  check_shapes(x, w, 32, "bf16_gemv");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16_gemv: bfloat16 x and w");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
#ifdef __AVX512BF16__
  using Kernels = Bf16Pairs;
  const uint16_t* xp = static_cast<const uint16_t*>(x.const_data_ptr());
#else
  using Kernels = Widened<Bf16>;
  const at::Tensor xf = float_rows(x, false);
  const float* xp = xf.const_data_ptr<float>();
#endif
  const Bf16* wp = static_cast<const Bf16*>(w.const_data_ptr());
  uint16_t* yp = static_cast<uint16_t*>(y.data_ptr());
  for_blocks(m, n, [&](int64_t r0, int64_t rows, int64_t n0) {
    vf part[4][16];
    row_group<Kernels>(rows, invariant, part, xp + r0 * k, wp + n0 * k, k);
    for (int64_t i = 0; i < rows; ++i) {
      float sums[16];
      transpose_sum(part[i], sums);
      for (int t = 0; t < 16; ++t) yp[(r0 + i) * n + n0 + t] = float_to_bf16(sums[t]);
    }
  });
  return y;
}

at::Tensor f16_gemv(const at::Tensor& x, const at::Tensor& w, bool invariant) {
  check_shapes(x, w, 16, "f16_gemv");
  TORCH_CHECK(x.scalar_type() == at::kHalf && w.scalar_type() == at::kHalf, "f16_gemv: float16 x and w");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const at::Tensor xf = float_rows(x, false);
  at::Tensor y = at::empty({m, n}, x.options());
  const Half* wp = static_cast<const Half*>(w.const_data_ptr());
  uint16_t* yp = static_cast<uint16_t*>(y.data_ptr());
  for_blocks(m, n, [&](int64_t r0, int64_t rows, int64_t n0) {
    vf part[4][16];
    row_group<Widened<Half>>(rows, invariant, part, xf.const_data_ptr<float>() + r0 * k, wp + n0 * k, k);
    for (int64_t i = 0; i < rows; ++i) {
      float sums[16];
      transpose_sum(part[i], sums);
      for (int t = 0; t < 16; ++t) yp[(r0 + i) * n + n0 + t] = float_to_half(sums[t]);
    }
  });
  return y;
}

at::Tensor f16_gemv_meta(const at::Tensor& x, const at::Tensor& w, bool invariant) {
  return at::empty_symint({x.sym_size(0), w.sym_size(0)}, x.options());
}


// ---- Integer products of GGUF block codes: q4g (4-bit: Q4_0 / Q4_1 / Q4_K), q5g (5-bit: Q5_0 / Q5_1
// / Q5_K) and q8g (int8 codes as GGUF's Q8_0 / Q6_K store them, signed, or Q5_1 / Q5_K's unsigned
// ones with mins where a fused group widens them), a float16 or float32 scale and min per group of
// 16 or 32, the codes in tiles of 16 output channels (below). w = code * scale + min. The rows of x are quantized to int16 per block of 32 first (d = max|x| /
// 32767, q = round(x / d): llama.cpp's Q8_1 with 16-bit codes, an error of at most 1/65534 of the
// block's largest value, where bfloat16 rounds at 1/512 of each value), so a group's product is an
// integer dot product (exact): y = sum_g scale_g * d * dot(code_g, q_g) + min_g * s_g, s_g = d *
// sum(q_g). Mins are laid out [groups, N]: their term runs for eight channels in a vector's lanes.
// Tiles are split over torch's threads. Every row is computed alone (its float sums run in one order whatever the tile), so a row's result
// does not depend on how many rows share the call.
constexpr int64_t kQBlock = 32;   // inputs per block of x's int16 codes (and of a tile's codes)

inline float scale_value(float s) { return s; }
inline float scale_value(uint16_t bits) {  // a float16 scale or min (F16C's conversion, not a library call)
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return half_to_float(bits);
#endif
}

struct QRows {                // x's rows as int16 per block of 32
  std::vector<int16_t> q;     // [M, K]
  std::vector<float> d, s;    // d [M, K/32]: the block's scale; s [M, K/G]: d * the sum of a group's codes
  std::vector<int32_t> sum;   // [M, K/G]: the sum of a group's codes
};

// A block of 32 inputs as int16 codes (in int32s): returns d = max|x| / 32767, codes round(x / d)
// to nearest even within +-32767 (a NaN input is left out of the maximum and becomes -32767).
inline float block_codes(const float* xb, int32_t* codes) {
#if defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], top = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    top = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), top);   // a NaN lane keeps top's value
  }
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  const float amax = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
  const float d = amax * (1.0f / 32767.0f);
  const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
  const __m256i hi = _mm256_set1_epi32(32767), lo = _mm256_set1_epi32(-32767);
  for (int i = 0; i < 4; ++i) {   // cvtps rounds to nearest even (MXCSR's default), as nearbyint
    const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 8 * i), _mm256_max_epi32(lo, _mm256_min_epi32(hi, c)));
  }
  return d;
#else
  float amax = 0.0f;
  for (int i = 0; i < kQBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
  const float d = amax * (1.0f / 32767.0f);
  const float inv = d > 0.0f ? 1.0f / d : 0.0f;
  for (int i = 0; i < kQBlock; ++i)
    codes[i] = std::min(32767, std::max(-32767, static_cast<int32_t>(std::nearbyint(xb[i] * inv))));
  return d;
#endif
}

// Into `out`, whose buffers a thread reuses from call to call (no allocation a call once they fit).
void quantize_rows(const float* x, int64_t m, int64_t k, int64_t group, QRows& out) {
  const int64_t blocks = k / kQBlock, per = kQBlock / group;
  out.q.resize(m * k);
  out.d.resize(m * blocks);
  out.s.resize(m * k / group);
  out.sum.resize(m * k / group);
  for (int64_t b = 0; b < m * blocks; ++b) {
    const float* xb = x + b * kQBlock;
    int32_t codes[kQBlock];
    const float d = block_codes(xb, codes);
    for (int64_t j = 0; j < per; ++j) {
      int32_t sum = 0;
      for (int64_t i = j * group; i < (j + 1) * group; ++i) {
        out.q[b * kQBlock + i] = static_cast<int16_t>(codes[i]);
        sum += codes[i];
      }
      out.s[b * per + j] = d * static_cast<float>(sum);
      out.sum[b * per + j] = sum;
    }
    out.d[b] = d;
  }
}

template <typename S>
struct MinArgs {         // the mins' term of a GEMV
  const S* mins;         // [K/G, N]
  const QRows* x;
  int64_t k, n, group;
  float* y;              // [M, N]
};

#if defined(__AVX2__)
// Eight float16 or float32 scales as floats.
template <typename S>
inline __m256 eight_scales(const S* p) {
  if constexpr (sizeof(S) == 2) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  else return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
}
#endif

// y[r, n] += sum_g mins[g, n] * s[r, g] for channels n0..n1 of every row: eight channels in a
// vector's lanes, each lane summing its groups in order with one rounding a step (fma), as a lone
// channel does.
template <typename S>
void add_mins(const MinArgs<S>& a, int64_t n0, int64_t n1, int64_t m) {
  const int64_t groups = a.k / a.group, n = a.n;
  for (int64_t r = 0; r < m; ++r) {
    const float* s = a.x->s.data() + r * groups;
    float* y = a.y + r * n;
    int64_t c = n0;
#if defined(__AVX2__) && defined(__F16C__)
    for (; c + 8 <= n1; c += 8) {
      __m256 low = _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        __m256 mins;
        if constexpr (sizeof(S) == 2)
          mins = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.mins + g * n + c)));
        else
          mins = _mm256_loadu_ps(reinterpret_cast<const float*>(a.mins + g * n + c));
        low = _mm256_fmadd_ps(mins, _mm256_set1_ps(s[g]), low);
      }
      _mm256_storeu_ps(y + c, _mm256_add_ps(_mm256_loadu_ps(y + c), low));
    }
#endif
    for (; c < n1; ++c) {
      float low = 0.0f;
      for (int64_t g = 0; g < groups; ++g) low = std::fma(scale_value(a.mins[g * n + c]), s[g], low);
      y[c] += low;
    }
  }
}

// scales [N, groups] and mins [groups, N] (when given), of `dtype`, contiguous.
void check_group_operands(const char* op, const at::Tensor& scales, const at::Tensor* mins, int64_t n,
                          int64_t groups, at::ScalarType dtype) {
  for (const bool is_min : {false, true}) {
    if (is_min && mins == nullptr) continue;
    const at::Tensor& t = is_min ? *mins : scales;
    const int64_t rows = is_min ? groups : n, cols = is_min ? n : groups;
    TORCH_CHECK(t.scalar_type() == dtype && t.dim() == 2 && t.size(0) == rows && t.size(1) == cols && t.is_contiguous(),
                op, ": contiguous ", dtype, is_min ? " mins [K/group, N]" : " scales [N, K/group]", " = [", rows,
                ", ", cols, "] expected, got ", t.scalar_type(), " ", t.sizes(),
                t.is_contiguous() ? "" : " (not contiguous)");
  }
}

// ---- Codes in tiles of 16 output channels (q4g, q5g, q8g): GGUF's 4-bit (Q4_0 / Q4_1 / Q4_K), 5-bit
// (Q5_0 / Q5_1 / Q5_K) and byte (Q8_0, Q6_K, ...) codes re-laid so that one vector holds sixteen channels' codes and each
// integer product instruction takes a pair of inputs for all of them (x's pair broadcast): no
// per-channel reduction, no per-group shuffle. Per tile of 16 output channels (the last one padded
// with zero codes and scales) and block of 32 inputs, the low four bits in 256 bytes: for each quad
// j of inputs (4j .. 4j + 3) 32 bytes, byte 2c + p holding channel c's code of input 4j + p in its
// low nibble and of input 4j + 2 + p in its high one; widened to 16-bit lanes, a quad's bytes are
// channel c's codes of inputs (4j, 4j + 1) in lane pair c (low nibbles) and (4j + 2, 4j + 3) (high
// nibbles). 5-bit tiles add 64 bytes of fifth bits: for quad j a 32-bit word for the low nibbles'
// lanes and one for the high nibbles', bit 2c + p the fifth bit of the code in lane 2c + p. The
// tile's scales [tiles, K/32, 16] sit beside the codes; mins stay [K/32, N].
constexpr int64_t kTile = 16;   // channels a tile

inline int32_t gguf_nibble(const uint8_t* group, int i) {   // GGUF's order: input i in byte i % 16
  return i < 16 ? group[i] & 15 : group[i - 16] >> 4;
}

struct NibbleTile {
  static constexpr int64_t kBytes = 256;   // a tile's codes for a block of 32 inputs
  static int32_t code(const uint8_t* block, int c, int i) {
    const uint8_t byte = block[32 * (i / 4) + 2 * c + (i % 2)];
    return (i % 4) < 2 ? byte & 15 : byte >> 4;
  }
  static void put(uint8_t* block, int c, int i, int32_t code) {   // into a zeroed block
    block[32 * (i / 4) + 2 * c + (i % 2)] |= static_cast<uint8_t>((code & 15) << ((i % 4) < 2 ? 0 : 4));
  }
#if defined(__AVX512F__) && defined(__AVX512BW__)
  static void quad(const uint8_t* block, int j, __m512i& lo, __m512i& hi) {
    const __m512i mask = _mm512_set1_epi16(15);
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * j)));
    lo = _mm512_and_si512(v, mask);
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
  }
#elif defined(__AVX2__)
  static void quad(const uint8_t* block, int j, int h, __m256i& lo, __m256i& hi) {   // channels 8h .. 8h + 7
    const __m256i mask = _mm256_set1_epi16(15);
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 * j + 16 * h)));
    lo = _mm256_and_si256(v, mask);
    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  }
#endif
};

struct FiveBitTile {
  static constexpr int64_t kBytes = 320;
  static uint32_t word(const uint8_t* block, int j, int high) {   // quad j's fifth bits, low or high nibbles' lanes
    uint32_t w;
    std::memcpy(&w, block + NibbleTile::kBytes + 8 * j + 4 * high, 4);
    return w;
  }
  static int32_t code(const uint8_t* block, int c, int i) {
    const uint32_t fifth = (word(block, i / 4, (i % 4) / 2) >> (2 * c + i % 2)) & 1;
    return NibbleTile::code(block, c, i) | static_cast<int32_t>(fifth << 4);
  }
  static void put(uint8_t* block, int c, int i, int32_t code) {
    NibbleTile::put(block, c, i, code);
    const uint32_t w = word(block, i / 4, (i % 4) / 2) | static_cast<uint32_t>((code >> 4) & 1) << (2 * c + i % 2);
    std::memcpy(block + NibbleTile::kBytes + 8 * (i / 4) + 4 * ((i % 4) / 2), &w, 4);
  }
#if defined(__AVX512F__) && defined(__AVX512BW__)
  static void quad(const uint8_t* block, int j, __m512i& lo, __m512i& hi) {   // the fifth bit added where set
    NibbleTile::quad(block, j, lo, hi);
    const __m512i sixteen = _mm512_set1_epi16(16);
    lo = _mm512_mask_add_epi16(lo, static_cast<__mmask32>(word(block, j, 0)), lo, sixteen);
    hi = _mm512_mask_add_epi16(hi, static_cast<__mmask32>(word(block, j, 1)), hi, sixteen);
  }
#elif defined(__AVX2__)
  static __m256i fifth(uint32_t word, int h) {   // 16 where lane L of half h has its bit (16h + L) set
    const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                          static_cast<int16_t>(0x8000));
    const __m256i bits = _mm256_set1_epi16(static_cast<int16_t>(word >> (16 * h)));
    return _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(bits, bit), bit), _mm256_set1_epi16(16));
  }
  static void quad(const uint8_t* block, int j, int h, __m256i& lo, __m256i& hi) {
    NibbleTile::quad(block, j, h, lo, hi);
    lo = _mm256_or_si256(lo, fifth(word(block, j, 0), h));
    hi = _mm256_or_si256(hi, fifth(word(block, j, 1), h));
  }
#endif
};

// int8 codes (Q8_0, Q6_K, ...): per tile and block of 32 inputs 512 bytes, for each pair of inputs
// (2i, 2i + 1) 32 bytes, byte 2c + p holding channel c's code of input 2i + p; a "quad" j is pairs 2j
// and 2j + 1, as the nibble tiles' low and high lanes are.
struct ByteTile {
  static constexpr int64_t kBytes = 512;
  static int32_t code(const uint8_t* block, int c, int i) {
    return static_cast<int8_t>(block[32 * (i / 2) + 2 * c + (i % 2)]);
  }
  static void put(uint8_t* block, int c, int i, int32_t code) {
    block[32 * (i / 2) + 2 * c + (i % 2)] = static_cast<uint8_t>(static_cast<int8_t>(code));
  }
#if defined(__AVX512F__) && defined(__AVX512BW__)
  static void quad(const uint8_t* block, int j, __m512i& lo, __m512i& hi) {
    lo = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * j)));
    hi = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * j + 32)));
  }
#elif defined(__AVX2__)
  static void quad(const uint8_t* block, int j, int h, __m256i& lo, __m256i& hi) {
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 64 * j + 16 * h)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 64 * j + 32 + 16 * h)));
  }
#endif
};

#if defined(__AVX512F__)
inline __m512 sixteen_scales(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 sixteen_scales(const float* p) { return _mm512_loadu_ps(p); }
#endif

// R rows of x (from r0) times one tile's codes, into out[R][16] (without the mins): per group of G
// inputs (32, or 16: two a block), each row's integer products for the 16 channels (exact, int32),
// less Offset * the sum of the row's group codes where the codes are centred (Q4_0: 8, Q5_0: 16),
// times scale * d in float32, the groups alternating between two float accumulators. Every row is
// computed alike whatever R: a row's result is the same alone.
template <typename Tile, int Offset, typename S, int G, int R>
void tile_rows(const uint8_t* tile, const S* scales, const QRows& x, int64_t r0, int64_t k, const uint8_t* fetch_end,
               float (*out)[kTile]) {
  constexpr int kGroups = kQBlock / G;   // groups a block
  const int64_t blocks = k / kQBlock, groups = k / G;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // independent chains of products per row: [group of the block][low / high] for groups of 16, else
  // [quad parity][low / high] for one row, [low / high] for more
  constexpr int kAcc = (G == 16 || R == 1) ? 4 : 2;
  __m512 f[2][R];
  for (int r = 0; r < R; ++r) f[0][r] = f[1][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* w = tile + b * Tile::kBytes;
    for (int64_t line = 0; line < Tile::kBytes; line += 64) prefetch_l2(std::min(w + kFetchAhead + line, fetch_end));
    __m512i acc[R][kAcc];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < kAcc; ++a) acc[r][a] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m512i lo, hi;
      Tile::quad(w, j, lo, hi);
      const int a = G == 16 ? 2 * (j / 4) : kAcc == 4 ? 2 * (j % 2) : 0;
      for (int r = 0; r < R; ++r) {
        const int32_t* q = reinterpret_cast<const int32_t*>(x.q.data() + (r0 + r) * k + b * kQBlock + 4 * j);
        acc[r][a] = _mm512_dpwssd_epi32(acc[r][a], lo, _mm512_set1_epi32(q[0]));
        acc[r][a + 1] = _mm512_dpwssd_epi32(acc[r][a + 1], hi, _mm512_set1_epi32(q[1]));
      }
    }
    for (int gi = 0; gi < kGroups; ++gi) {
      const int64_t g = b * kGroups + gi;
      const __m512 scale = sixteen_scales(scales + g * kTile);
      for (int r = 0; r < R; ++r) {
        __m512i sum = _mm512_add_epi32(acc[r][2 * gi], acc[r][2 * gi + 1]);
        if constexpr (G == 32 && kAcc == 4) sum = _mm512_add_epi32(sum, _mm512_add_epi32(acc[r][2], acc[r][3]));
        if constexpr (Offset != 0) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(Offset * x.sum[(r0 + r) * groups + g]));
        const __m512 d = _mm512_set1_ps(x.d[(r0 + r) * blocks + b]);
        f[g % 2][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale, d), f[g % 2][r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[r], _mm512_add_ps(f[0][r], f[1][r]));
#elif defined(__AVX2__)
  __m256 f[2][R][2];   // [group parity][row][half of the tile]
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) f[0][r][h] = f[1][r][h] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* w = tile + b * Tile::kBytes;
    for (int64_t line = 0; line < Tile::kBytes; line += 64) prefetch_l2(std::min(w + kFetchAhead + line, fetch_end));
    __m256i acc[R][kGroups][2][2];   // [row][group of the block][half][low / high]
    for (int r = 0; r < R; ++r)
      for (int gi = 0; gi < kGroups; ++gi)
        for (int h = 0; h < 2; ++h) acc[r][gi][h][0] = acc[r][gi][h][1] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j)
      for (int h = 0; h < 2; ++h) {
        __m256i lo, hi;
        Tile::quad(w, j, h, lo, hi);
        const int gi = j * kGroups / 8;
        for (int r = 0; r < R; ++r) {
          const int32_t* q = reinterpret_cast<const int32_t*>(x.q.data() + (r0 + r) * k + b * kQBlock + 4 * j);
          acc[r][gi][h][0] = _mm256_add_epi32(acc[r][gi][h][0], _mm256_madd_epi16(lo, _mm256_set1_epi32(q[0])));
          acc[r][gi][h][1] = _mm256_add_epi32(acc[r][gi][h][1], _mm256_madd_epi16(hi, _mm256_set1_epi32(q[1])));
        }
      }
    for (int gi = 0; gi < kGroups; ++gi) {
      const int64_t g = b * kGroups + gi;
      for (int h = 0; h < 2; ++h) {
        const __m256 scale = eight_scales(scales + g * kTile + 8 * h);
        for (int r = 0; r < R; ++r) {
          __m256i sum = _mm256_add_epi32(acc[r][gi][h][0], acc[r][gi][h][1]);
          if constexpr (Offset != 0) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(Offset * x.sum[(r0 + r) * groups + g]));
          const __m256 d = _mm256_set1_ps(x.d[(r0 + r) * blocks + b]);
          f[g % 2][r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(scale, d), f[g % 2][r][h]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out[r] + 8 * h, _mm256_add_ps(f[0][r][h], f[1][r][h]));
#else
  (void)fetch_end;
  (void)blocks;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kTile; ++c) {
      float f[2] = {0.0f, 0.0f};
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t b = g / kGroups, first = (g % kGroups) * G;
        const int16_t* q = x.q.data() + (r0 + r) * k + b * kQBlock;
        int32_t dot = 0;
        for (int i = first; i < first + G; ++i) dot += Tile::code(tile + b * Tile::kBytes, c, i) * q[i];
        dot -= Offset * x.sum[(r0 + r) * groups + g];
        const float d = x.d[(r0 + r) * (k / kQBlock) + b];
        f[g % 2] = std::fma(static_cast<float>(dot), scale_value(scales[g * kTile + c]) * d, f[g % 2]);
      }
      out[r][c] = f[0] + f[1];
    }
#endif
}

// y [M, n] (float32) = x (float32 rows) times the tiles (plus the mins' terms), tiles split over
// torch's threads, rows four at a time (five where four would leave one).
template <typename Tile, int Offset, typename S, int G = kQBlock>
void tile_run(const float* x, const uint8_t* tiles, const S* scales, const S* mins, int64_t k, at::Tensor& y) {
  const int64_t m = y.size(0), n = y.size(1), blocks = k / kQBlock, count = (n + kTile - 1) / kTile;
  const int64_t tile_bytes = blocks * Tile::kBytes;
  thread_local QRows mine;
  quantize_rows(x, m, k, G, mine);
  const QRows& xq = mine;   // this thread's, named outside the threads' lambda (each has its own `mine`)
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, count, 1, [&](int64_t t0, int64_t t1) {
    const uint8_t* fetch_end = tiles + t1 * tile_bytes;
    for (const uint8_t* p = tiles + t0 * tile_bytes; p < std::min(tiles + t0 * tile_bytes + kFetchAhead, fetch_end); p += 64)
      prefetch_l2(p);
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* tile = tiles + t * tile_bytes;
      const S* ts = scales + t * (k / G) * kTile;
      const int64_t width = std::min(kTile, n - t * kTile);
      float out[5][kTile];
      auto emit = [&](int64_t r0, int rows) {
        for (int r = 0; r < rows; ++r) std::memcpy(yp + (r0 + r) * n + t * kTile, out[r], width * sizeof(float));
      };
      int64_t r = 0;
      for (; r + 4 <= m && m - r != 5; r += 4) {
        tile_rows<Tile, Offset, S, G, 4>(tile, ts, xq, r, k, fetch_end, out);
        emit(r, 4);
      }
      switch (m - r) {
        case 5: tile_rows<Tile, Offset, S, G, 5>(tile, ts, xq, r, k, fetch_end, out); emit(r, 5); break;
        case 3: tile_rows<Tile, Offset, S, G, 3>(tile, ts, xq, r, k, fetch_end, out); emit(r, 3); break;
        case 2: tile_rows<Tile, Offset, S, G, 2>(tile, ts, xq, r, k, fetch_end, out); emit(r, 2); break;
        case 1: tile_rows<Tile, Offset, S, G, 1>(tile, ts, xq, r, k, fetch_end, out); emit(r, 1); break;
        default: break;
      }
    }
    if (mins != nullptr) {
      const MinArgs<S> a{mins, &xq, k, n, G, yp};
      add_mins(a, t0 * kTile, std::min(n, t1 * kTile), m);
    }
  });
}

// Tiles [T, K/32, Tile::kBytes] of n channels from code_of(channel, input), and the scales [N, K/G]
// as [T, K/G, 16] (their element type).
template <typename Tile, typename CodeOf>
std::tuple<at::Tensor, at::Tensor> make_tiles(int64_t n, int64_t k, const at::Tensor& scales, CodeOf code_of) {
  const int64_t blocks = k / kQBlock, groups = scales.size(1), tiles = (n + kTile - 1) / kTile;
  at::Tensor out = at::zeros({tiles, blocks, Tile::kBytes}, scales.options().dtype(at::kByte));
  at::Tensor out_scales = at::zeros({tiles, groups, kTile}, scales.options());
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t size = scales.element_size();
  const uint8_t* ssrc = static_cast<const uint8_t*>(scales.const_data_ptr());
  uint8_t* sdst = static_cast<uint8_t*>(out_scales.data_ptr());
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t ch = t0 * kTile; ch < std::min(n, t1 * kTile); ++ch) {
      const int64_t t = ch / kTile;
      const int c = static_cast<int>(ch % kTile);
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* block = dst + (t * blocks + b) * Tile::kBytes;
        for (int i = 0; i < 32; ++i) Tile::put(block, c, i, code_of(ch, b * kQBlock + i));
      }
      for (int64_t g = 0; g < groups; ++g)
        std::memcpy(sdst + ((t * groups + g) * kTile + c) * size, ssrc + (ch * groups + g) * size, size);
    }
  });
  return {out, out_scales};
}

// [N, K/2] GGUF nibbles and [N, K/32] float16 scales -> 4-bit tiles [T, K/32, 256], scales [T, K/32, 16].
std::tuple<at::Tensor, at::Tensor> q4g_tile(const at::Tensor& nibbles, const at::Tensor& scales) {
  TORCH_CHECK(nibbles.dim() == 2 && nibbles.is_contiguous() && nibbles.scalar_type() == at::kByte,
              "q4g_tile: contiguous uint8 nibbles [N, K/2] expected");
  const int64_t n = nibbles.size(0), k = nibbles.size(1) * 2;
  TORCH_CHECK(k % kQBlock == 0, "q4g_tile: K must be a multiple of 32, got ", k);
  check_group_operands("q4g_tile", scales, nullptr, n, k / kQBlock, at::kHalf);
  const uint8_t* src = nibbles.const_data_ptr<uint8_t>();
  return make_tiles<NibbleTile>(n, k, scales, [&](int64_t ch, int64_t i) {
    return gguf_nibble(src + ch * (k / 2) + i / kQBlock * 16, static_cast<int>(i % kQBlock));
  });
}

// codes [N, K] (uint8, 0..31) and [N, K/32] scales (float16 or float32) -> 5-bit tiles [T, K/32, 320],
// scales [T, K/32, 16].
std::tuple<at::Tensor, at::Tensor> q5g_tile(const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kByte,
              "q5g_tile: contiguous uint8 codes [N, K] expected");
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(k % kQBlock == 0, "q5g_tile: K must be a multiple of 32, got ", k);
  check_group_operands("q5g_tile", scales, nullptr, n, k / kQBlock,
                       scales.scalar_type() == at::kHalf ? at::kHalf : at::kFloat);
  const uint8_t* src = codes.const_data_ptr<uint8_t>();
  const int64_t count = codes.numel();
  for (int64_t i = 0; i < count; ++i) TORCH_CHECK(src[i] < 32, "q5g_tile: codes must lie in 0..31, got ", int(src[i]));
  return make_tiles<FiveBitTile>(n, k, scales, [&](int64_t ch, int64_t i) { return src[ch * k + i]; });
}

// Checks tiles [T, K/32, bytes], scales [T, K/G, 16] (float16, or float32 where `wide` allows) and
// mins [K/G, n] of the scales' dtype, for n channels; returns K.
int64_t check_tiles(const char* op, const at::Tensor& tiles, int64_t bytes, const at::Tensor& scales, bool wide,
                    const std::optional<at::Tensor>& mins, int64_t n, int64_t group = kQBlock) {
  TORCH_CHECK(tiles.dim() == 3 && tiles.is_contiguous() && tiles.scalar_type() == at::kByte && tiles.size(2) == bytes,
              op, ": contiguous uint8 tiles [N/16, K/32, ", bytes, "] expected, got ", tiles.sizes());
  TORCH_CHECK(n > (tiles.size(0) - 1) * kTile && n <= tiles.size(0) * kTile, op, ": ", tiles.size(0),
              " tiles hold ", (tiles.size(0) - 1) * kTile + 1, "..", tiles.size(0) * kTile, " channels, not ", n);
  const bool ok_type = scales.scalar_type() == at::kHalf || (wide && scales.scalar_type() == at::kFloat);
  const int64_t k = tiles.size(1) * kQBlock, groups = k / group;
  TORCH_CHECK(ok_type && scales.is_contiguous() && scales.dim() == 3 && scales.size(0) == tiles.size(0) &&
                  scales.size(1) == groups && scales.size(2) == kTile,
              op, ": contiguous ", wide ? "float16 or float32" : "float16", " scales [N/16, K/", group,
              ", 16] expected, got ", scales.scalar_type(), " ", scales.sizes());
  if (mins)
    check_group_operands(op, at::empty({n, groups}, scales.options().device(at::kMeta)), &*mins, n, groups,
                         scales.scalar_type());
  return k;
}

// y for x against the tiles with scales (and mins) of type S; without mins the codes are centred by Offset.
template <typename Tile, int Offset, typename S, int G = kQBlock>
at::Tensor tile_gemv(const char* op, const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                     const std::optional<at::Tensor>& mins, int64_t n, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == k, op, ": contiguous x [M, ", k, "] expected, got ",
              x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": float32 or bfloat16 x expected, got ", x.scalar_type());
  at::Tensor y = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
  if (x.size(0) == 0) return y.to(x.scalar_type());
  const at::Tensor xf = float_rows(x, false);
  const float* xp = xf.const_data_ptr<float>();
  const uint8_t* wp = tiles.const_data_ptr<uint8_t>();
  const S* sp = static_cast<const S*>(scales.const_data_ptr());
  if (mins) tile_run<Tile, 0, S, G>(xp, wp, sp, static_cast<const S*>(mins->const_data_ptr()), k, y);
  else tile_run<Tile, Offset, S, G>(xp, wp, sp, nullptr, k, y);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// Without mins the codes are Q4_0's: w = (code - 8) * scale.
at::Tensor q4g_gemv(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                    const std::optional<at::Tensor>& mins, int64_t n) {
  const int64_t k = check_tiles("q4g_gemv", tiles, NibbleTile::kBytes, scales, false, mins, n);
  return tile_gemv<NibbleTile, 8, uint16_t>("q4g_gemv", x, tiles, scales, mins, n, k);
}

// Without mins the codes are Q5_0's: w = (code - 16) * scale.
at::Tensor q5g_gemv(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                    const std::optional<at::Tensor>& mins, int64_t n) {
  const int64_t k = check_tiles("q5g_gemv", tiles, FiveBitTile::kBytes, scales, true, mins, n);
  if (scales.scalar_type() == at::kHalf) return tile_gemv<FiveBitTile, 16, uint16_t>("q5g_gemv", x, tiles, scales, mins, n, k);
  return tile_gemv<FiveBitTile, 16, float>("q5g_gemv", x, tiles, scales, mins, n, k);
}

at::Tensor tile_gemv_meta(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                          const std::optional<at::Tensor>& mins, int64_t n) {
  return at::empty_symint({x.sym_size(0), c10::SymInt(n)}, x.options());
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 x 16 dwords transposed in registers: dword c of r[m] moves to dword m of r[c].
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

inline void store_wide(float* out, __m512 v) { _mm512_storeu_ps(out, v); }
inline void store_wide(uint16_t* out, __m512 v) {   // bfloat16, rounded to nearest even as float_to_bf16
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(_mm512_srli_epi32(up, 16)));
}
#elif defined(__AVX2__)
// 8 x 8 dwords transposed in registers: dword c of r[m] moves to dword m of r[c].
inline void transpose8(__m256i r[8]) {
  __m256i t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm256_permute2x128_si256(r[i], r[i + 4], 0x20);
    t[i + 4] = _mm256_permute2x128_si256(r[i], r[i + 4], 0x31);
  }
  for (int i = 0; i < 8; ++i) r[i] = t[i];
}

inline void store_wide(float* out, __m256 v) { _mm256_storeu_ps(out, v); }
inline void store_wide(uint16_t* out, __m256 v) {   // bfloat16, rounded to nearest even as float_to_bf16
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),   // each value fits 16 bits: the saturating pack keeps it
                   _mm_packus_epi32(_mm256_castsi256_si128(up), _mm256_extracti128_si256(up, 1)));
}
#endif

// W [n, K] as O (float32, or bfloat16 rounded to nearest even) from the tiles: code * scale + min,
// or (code - Offset) * scale written as code * scale - Offset * scale; groups of G inputs. The
// weight of a step with more rows than the GEMV serves.
template <typename Tile, int Offset, typename S, typename O = float>
void tile_widen_into(const at::Tensor& tiles, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                     int64_t n, int64_t k, int64_t group, O* wp) {
  const int64_t blocks = k / kQBlock, groups = k / group, per = kQBlock / group;
  const uint8_t* tp = tiles.const_data_ptr<uint8_t>();
  const S* sp = static_cast<const S*>(scales.const_data_ptr());
  const S* mp = mins ? static_cast<const S*>(mins->const_data_ptr()) : nullptr;
  // the scale and min of channel ch (tile t, its channel c) for group g
  auto scale_min = [&](int64_t t, int c, int64_t ch, int64_t g, float& scale, float& min) {
    scale = scale_value(sp[(t * groups + g) * kTile + c]);
    min = mp ? scale_value(mp[g * n + ch]) : -static_cast<float>(Offset) * scale;
  };
  at::parallel_for(0, tiles.size(0) * blocks, 16, [&](int64_t tb0, int64_t tb1) {
    for (int64_t tb = tb0; tb < tb1; ++tb) {
      const int64_t t = tb / blocks, b = tb % blocks;
      const uint8_t* block = tp + tb * Tile::kBytes;
      const int channels = static_cast<int>(std::min<int64_t>(kTile, n - t * kTile));
#if defined(__AVX512F__) && defined(__AVX512BW__)
      // the tile's quads as 16 x 16 dwords (register 2j + h: inputs 4j + 2h, +1 of the 16 channels),
      // transposed so that register c holds channel c's 32 codes in input order
      __m512i r[16];
      for (int j = 0; j < 8; ++j) Tile::quad(block, j, r[2 * j], r[2 * j + 1]);
      transpose16(r);
      for (int c = 0; c < channels; ++c) {
        const int64_t ch = t * kTile + c;
        O* out = wp + ch * k + b * kQBlock;
        for (int half = 0; half < 2; ++half) {   // inputs 16 half .. 16 half + 15: one group of 16
          float scale, min;
          scale_min(t, c, ch, b * per + half * per / 2, scale, min);
          const __m256i codes = half ? _mm512_extracti64x4_epi64(r[c], 1) : _mm512_castsi512_si256(r[c]);
          const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(codes));
          store_wide(out + 16 * half, _mm512_fmadd_ps(v, _mm512_set1_ps(scale), _mm512_set1_ps(min)));
        }
      }
#elif defined(__AVX2__)
      // each half of the tile (8 channels) as 16 x 8 dwords, transposed as two 8 x 8 blocks: register
      // c of the first holds channel c's inputs 0..15, of the second its inputs 16..31
      for (int h = 0; h < 2; ++h) {
        __m256i r[16];
        for (int j = 0; j < 8; ++j) Tile::quad(block, j, h, r[2 * j], r[2 * j + 1]);
        transpose8(r);
        transpose8(r + 8);
        for (int c = 8 * h; c < std::min(8 * h + 8, channels); ++c) {
          const int64_t ch = t * kTile + c;
          O* out = wp + ch * k + b * kQBlock;
          for (int half = 0; half < 2; ++half) {   // one group of 16
            float scale, min;
            scale_min(t, c, ch, b * per + half * per / 2, scale, min);
            const __m256i codes = r[8 * half + c - 8 * h];
            for (int q = 0; q < 2; ++q) {
              const __m128i part = q ? _mm256_extracti128_si256(codes, 1) : _mm256_castsi256_si128(codes);
              const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(part));
              store_wide(out + 16 * half + 8 * q, _mm256_fmadd_ps(v, _mm256_set1_ps(scale), _mm256_set1_ps(min)));
            }
          }
        }
      }
#else
      // each channel's 32 codes unpacked once (the input's position in the block a constant), then
      // its outputs written in a row
      for (int c = 0; c < channels; ++c) {
        const int64_t ch = t * kTile + c;
        float codes[kQBlock];
#pragma GCC unroll 32
        for (int i = 0; i < kQBlock; ++i) codes[i] = static_cast<float>(Tile::code(block, c, i));
        for (int64_t j = 0; j < per; ++j) {
          float scale, min;
          scale_min(t, c, ch, b * per + j, scale, min);
          O* out = wp + ch * k + (b * per + j) * group;
          for (int64_t i = 0; i < group; ++i) {
            const float v = codes[j * group + i] * scale + min;
            if constexpr (std::is_same_v<O, float>) out[i] = v;
            else out[i] = kvserve::float_to_bf16(v);
          }
        }
      }
#endif
    }
  });
}

// W [n, K] in float32 or bfloat16 (rounded to nearest even).
template <typename Tile, int Offset, typename S>
at::Tensor tile_widen(const char* op, const at::Tensor& tiles, const at::Tensor& scales,
                      const std::optional<at::Tensor>& mins, int64_t n, int64_t k, int64_t group, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op, ": float32 or bfloat16 out, not ", dtype);
  at::Tensor w = at::empty({n, k}, tiles.options().dtype(dtype));
  if (dtype == at::kFloat) tile_widen_into<Tile, Offset, S>(tiles, scales, mins, n, k, group, w.data_ptr<float>());
  else tile_widen_into<Tile, Offset, S>(tiles, scales, mins, n, k, group, static_cast<uint16_t*>(w.data_ptr()));
  return w;
}

at::Tensor q4g_dequantize(const at::Tensor& tiles, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                          int64_t n, at::ScalarType dtype) {
  const int64_t k = check_tiles("q4g_dequantize", tiles, NibbleTile::kBytes, scales, false, mins, n);
  return tile_widen<NibbleTile, 8, uint16_t>("q4g_dequantize", tiles, scales, mins, n, k, kQBlock, dtype);
}

at::Tensor q5g_dequantize(const at::Tensor& tiles, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                          int64_t n, at::ScalarType dtype) {
  const int64_t k = check_tiles("q5g_dequantize", tiles, FiveBitTile::kBytes, scales, true, mins, n);
  if (scales.scalar_type() == at::kHalf)
    return tile_widen<FiveBitTile, 16, uint16_t>("q5g_dequantize", tiles, scales, mins, n, k, kQBlock, dtype);
  return tile_widen<FiveBitTile, 16, float>("q5g_dequantize", tiles, scales, mins, n, k, kQBlock, dtype);
}

at::Tensor tile_dequantize_meta(const at::Tensor& tiles, const at::Tensor& scales,
                                const std::optional<at::Tensor>& mins, int64_t n, at::ScalarType dtype) {
  return at::empty_symint({c10::SymInt(n), tiles.sym_size(1) * kQBlock}, tiles.options().dtype(dtype));
}

// int8 codes [N, K] and scales [N, K/group] (float16 or float32) -> byte tiles [T, K/32, 512], scales
// [T, K/group, 16].
std::tuple<at::Tensor, at::Tensor> q8g_tile(const at::Tensor& codes, const at::Tensor& scales, int64_t group) {
  TORCH_CHECK(group == 16 || group == 32, "q8g_tile: group must be 16 or 32, got ", group);
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kChar,
              "q8g_tile: contiguous int8 codes [N, K] expected, got ", codes.scalar_type(), " ", codes.sizes());
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(k % kQBlock == 0, "q8g_tile: K must be a multiple of 32, got ", k);
  check_group_operands("q8g_tile", scales, nullptr, n, k / group,
                       scales.scalar_type() == at::kHalf ? at::kHalf : at::kFloat);
  const int8_t* src = codes.const_data_ptr<int8_t>();
  return make_tiles<ByteTile>(n, k, scales, [&](int64_t ch, int64_t i) { return src[ch * k + i]; });
}

at::Tensor q8g_gemv(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                    const std::optional<at::Tensor>& mins, int64_t group, int64_t n) {
  TORCH_CHECK(group == 16 || group == 32, "q8g_gemv: group must be 16 or 32, got ", group);
  const int64_t k = check_tiles("q8g_gemv", tiles, ByteTile::kBytes, scales, true, mins, n, group);
  const bool half = scales.scalar_type() == at::kHalf;   // float16 scales (and mins): 2 bytes a group
  if (group == 32) {
    if (half) return tile_gemv<ByteTile, 0, uint16_t, 32>("q8g_gemv", x, tiles, scales, mins, n, k);
    return tile_gemv<ByteTile, 0, float, 32>("q8g_gemv", x, tiles, scales, mins, n, k);
  }
  if (half) return tile_gemv<ByteTile, 0, uint16_t, 16>("q8g_gemv", x, tiles, scales, mins, n, k);
  return tile_gemv<ByteTile, 0, float, 16>("q8g_gemv", x, tiles, scales, mins, n, k);
}

// W [n, K] in float32 or bfloat16 (rounded to nearest even): w = code * scale (+ min).
at::Tensor q8g_dequantize(const at::Tensor& tiles, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                          int64_t group, int64_t n, at::ScalarType dtype) {
  TORCH_CHECK(group == 16 || group == 32, "q8g_dequantize: group must be 16 or 32, got ", group);
  const int64_t k = check_tiles("q8g_dequantize", tiles, ByteTile::kBytes, scales, true, mins, n, group);
  if (scales.scalar_type() == at::kHalf)   // float16 scales (and mins): 2 bytes a group
    return tile_widen<ByteTile, 0, uint16_t>("q8g_dequantize", tiles, scales, mins, n, k, group, dtype);
  return tile_widen<ByteTile, 0, float>("q8g_dequantize", tiles, scales, mins, n, k, group, dtype);
}

at::Tensor q8g_dequantize_meta(const at::Tensor& tiles, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                               int64_t group, int64_t n, at::ScalarType dtype) {
  return at::empty_symint({c10::SymInt(n), tiles.sym_size(1) * kQBlock}, tiles.options().dtype(dtype));
}

at::Tensor q8g_gemv_meta(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                         const std::optional<at::Tensor>& mins, int64_t group, int64_t n) {
  return at::empty_symint({x.sym_size(0), c10::SymInt(n)}, x.options());
}

at::Tensor int8_gemv_meta(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, bool invariant) {
  return at::empty_symint({x.sym_size(0), w.sym_size(0)}, x.options());
}

at::Tensor bf16_gemv_meta(const at::Tensor& x, const at::Tensor& w, bool invariant) {
  return at::empty_symint({x.sym_size(0), w.sym_size(0)}, x.options());
}

}  // namespace

TORCH_LIBRARY(kvserve_cpu, m) {
  m.def("int8_gemv(Tensor x, Tensor w, Tensor scale, bool invariant=False) -> Tensor");
  m.def("bf16_gemv(Tensor x, Tensor w, bool invariant=False) -> Tensor");
  m.def("f16_gemv(Tensor x, Tensor w, bool invariant=False) -> Tensor");
  m.def("q8g_tile(Tensor codes, Tensor scales, int group) -> (Tensor, Tensor)");
  m.def("q8g_gemv(Tensor x, Tensor tiles, Tensor scales, Tensor? mins, int group, int n) -> Tensor");
  m.def("q8g_dequantize(Tensor tiles, Tensor scales, Tensor? mins, int group, int n, ScalarType dtype) -> Tensor");
  m.def("q4g_tile(Tensor nibbles, Tensor scales) -> (Tensor, Tensor)");
  m.def("q4g_gemv(Tensor x, Tensor tiles, Tensor scales, Tensor? mins, int n) -> Tensor");
  m.def("q4g_dequantize(Tensor tiles, Tensor scales, Tensor? mins, int n, ScalarType dtype) -> Tensor");
  m.def("q5g_tile(Tensor codes, Tensor scales) -> (Tensor, Tensor)");
  m.def("q5g_gemv(Tensor x, Tensor tiles, Tensor scales, Tensor? mins, int n) -> Tensor");
  m.def("q5g_dequantize(Tensor tiles, Tensor scales, Tensor? mins, int n, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("int8_gemv", int8_gemv);
  m.impl("bf16_gemv", bf16_gemv);
  m.impl("f16_gemv", f16_gemv);
  m.impl("q8g_tile", q8g_tile);
  m.impl("q8g_gemv", q8g_gemv);
  m.impl("q8g_dequantize", q8g_dequantize);
  m.impl("q4g_tile", q4g_tile);
  m.impl("q4g_gemv", q4g_gemv);
  m.impl("q4g_dequantize", q4g_dequantize);
  m.impl("q5g_tile", q5g_tile);
  m.impl("q5g_gemv", q5g_gemv);
  m.impl("q5g_dequantize", q5g_dequantize);
}

// Meta kernels keep the row count symbolic (sym_size): size() would make a compiled graph that calls
// them specialize on it, one graph per row count.
TORCH_LIBRARY_IMPL(kvserve_cpu, Meta, m) {
  m.impl("int8_gemv", int8_gemv_meta);
  m.impl("bf16_gemv", bf16_gemv_meta);
  m.impl("f16_gemv", f16_gemv_meta);
  m.impl("q8g_gemv", q8g_gemv_meta);
  m.impl("q8g_dequantize", q8g_dequantize_meta);
  m.impl("q4g_gemv", tile_gemv_meta);
  m.impl("q4g_dequantize", tile_dequantize_meta);
  m.impl("q5g_gemv", tile_gemv_meta);
  m.impl("q5g_dequantize", tile_dequantize_meta);
}
