// Few-row matrix-vector products for CPU decode steps, registered as torch ops (kvserve_cpu::*), so
// a compiled decode graph calls them through the dispatcher (a few microseconds) like aten's own.
//   int8_gemv(x [M, K] float32|bfloat16, w [N, K] int8, scale [N] bfloat16) -> [M, N] in x's dtype:
//     weight-only int8 with one scale per output channel, rounded as torch's CPU kernel
//     (_weight_int8pack_mm) rounds: x and the scale in bfloat16, sums in float32, the result
//     rounded to bfloat16.
//   bf16_gemv(x [M, K] bfloat16, w [N, K] bfloat16) -> [M, N] bfloat16, sums in float32.
//   q8g_gemv(x [M, K] float32|bfloat16, codes [N, K] int8, scales [N, K/group] float32,
//            mins [N, K/group] float32 or None, group 16|32) -> [M, N] in x's dtype:
//     y[m, n] = sum over groups g of scales[n, g] * sum_{k in g} x[m, k] codes[n, k]
//               + mins[n, g] * sum_{k in g} x[m, k]
//     (a GGUF block's codes as the format stores them: Q8_0, Q5_0, Q6_K signed, Q5_1 / Q5_K
//     unsigned with mins), x as given, float32 sums, a bfloat16 result rounded once.
// Sixteen output channels at a time: each channel's dot product runs along K with several
// accumulators, the 16 partial vectors are reduced together (a transpose), weights are prefetched
// a few KiB ahead (one core alone does not keep enough loads in flight to fill the memory bus).
// `invariant` (int8, bfloat16, float16, q8g): a lone row is summed as a row of a group is, so each
// row's result is the same whatever the call's row count (int4's rows are so already).
// Output channel blocks are split over torch's threads (at::parallel_for, torch's OpenMP runtime).
// Vectors are simd.h's `vf`, one register wide (16 floats under AVX-512, 8 under AVX2, 4 else);
// AVX-512 and AVX2 (+F16C) intrinsics appear only under #if beside a portable path (tests build
// the AVX2 path with -mno-avx512f, the portable one with -mno-avx).
// Built at run time by kvserve/model/cpu/__init__.py against torch's headers.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>
#if defined(__SSE__)
#include <immintrin.h>
#endif

#include "simd.h"

namespace {

using namespace kvserve;

constexpr int64_t kPrefetch = 4096;  // bytes ahead in the weight stream

inline void prefetch(const void* p) {
#if defined(__SSE__)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
#else
  __builtin_prefetch(p);
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
      prefetch(wr + i + kPrefetch / sizeof(W));
      if (sizeof(W) > 1) prefetch(wr + i + kPrefetch / sizeof(W) + 32);
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
      prefetch(wr + i + kPrefetch / sizeof(W));
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
      prefetch(wr + i + kPrefetch / 2);
      prefetch(wr + i + kPrefetch / 2 + 64);
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
      prefetch(wr + i + kPrefetch / 2);
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

// ---- int4: torch's CPU int4 layout (_convert_weight_to_int4pack_for_cpu): per block of B output
// channels (B = 4 x torch's float vector width: 64 under AVX512, 32 under AVX2 and elsewhere), per
// input channel, B/2 bytes: channel c's code in byte c's low nibble, channel B/2 + c's in its high
// nibble; w = (code - 8) * scale + zero, one (scale, zero) pair per channel and group of 32 input
// channels ([K/32, N, 2] bfloat16). Per group, sum(w x) = scale * (sum(code x) - 8 sum(x)) +
// zero * sum(x): the codes' dot products run over plain integers widened to float.
constexpr int64_t kInt4Group = 32;

template <int B>  // B/2 bytes -> the B channels' codes as floats, kLanes per vector
inline void int4_codes(const uint8_t* p, vf* w) {
  constexpr int H = B / 2 / kLanes;  // byte chunk j: channels kLanes j.. (low nibbles), B/2 + kLanes j.. (high)
#if defined(__AVX512F__)
  const __m512i mask = _mm512_set1_epi32(15);
  for (int j = 0; j < H; ++j) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * j)));
    w[j] = (vf)_mm512_cvtepi32_ps(_mm512_and_si512(bytes, mask));
    w[H + j] = (vf)_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
  }
#elif defined(__AVX2__)
  const __m256i mask = _mm256_set1_epi32(15);
  for (int j = 0; j < H; ++j) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * j)));
    w[j] = (vf)_mm256_cvtepi32_ps(_mm256_and_si256(bytes, mask));
    w[H + j] = (vf)_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
  }
#else
  for (int j = 0; j < H; ++j)
    for (int c = 0; c < kLanes; ++c) {
      w[j][c] = static_cast<float>(p[kLanes * j + c] & 15);
      w[H + j][c] = static_cast<float>(p[kLanes * j + c] >> 4);
    }
#endif
}

constexpr int kInt4Vectors = 64 / kLanes;  // vectors of a block of channels, at most

// out[r][j] (kLanes channels each) for R rows of x over one block of B channels: w is the block's
// [K, B/2] bytes, sz its first (scale, zero) pair in group 0, xsum the rows' per-group sums of x.
template <int B, int R>
void int4_rows(const float* x, const float* xsum, const uint8_t* w, const uint32_t* sz, int64_t k, int64_t n,
               vf (*out)[kInt4Vectors]) {
  constexpr int J = B / kLanes, Bytes = B / 2;
  const int64_t groups = k / kInt4Group;
  vf res[R][J] = {};
  for (int64_t g = 0; g < groups; ++g) {
    vf acc[R][J] = {};
    const uint8_t* wg = w + g * kInt4Group * Bytes;
    for (int64_t kk = 0; kk < kInt4Group; ++kk) {
      if (kk % (64 / Bytes) == 0) prefetch(wg + kk * Bytes + kPrefetch);
      vf codes[J];
      int4_codes<B>(wg + kk * Bytes, codes);
      for (int r = 0; r < R; ++r) {
        const float xv = x[r * k + g * kInt4Group + kk];
        for (int j = 0; j < J; ++j) acc[r][j] += codes[j] * xv;
      }
    }
    for (int j = 0; j < J; ++j) {
      vu pair;
      std::memcpy(&pair, sz + g * n + kLanes * j, sizeof pair);
      const vf scale = (vf)(pair << 16), zero = (vf)(pair & 0xFFFF0000u);
      for (int r = 0; r < R; ++r) {
        const float sum = xsum[r * groups + g];
        res[r][j] += scale * (acc[r][j] - 8.0f * sum) + zero * sum;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) out[r][j] = res[r][j];
}

// ---- q8g: int8 codes [N, K] with a float32 scale, and optionally a min, per output channel and
// group of G (16 or 32) inputs: w = code * scale + min. A channel's scales (and mins) are its
// `groups` consecutive floats, read along with its codes. One row: each group's dot product with
// the codes is scaled once, and the mins meet the row's group sums of x; several rows: each kLanes
// codes are dequantized once (code * scale + min, as floats) and serve every row.
#ifdef __AVX512F__
constexpr int kQ8gTile = 8;  // rows per pass over a block: 2 x 8 accumulators in 32 registers
#else
constexpr int kQ8gTile = 4;  // 2 x 4 accumulators and a step's weights in 16 registers
#endif

struct Q8gBlock {     // one block of 16 output channels and the rows of x it meets
  const float* x;     // the rows, stride k
  const float* xsum;  // their sums per group (stride k / G), where there are mins
  const int8_t* w;    // the block's codes [16, k]
  const float* s;     // its scales [16, k / G]
  const float* mn;    // its mins [16, k / G], or null
  int64_t k;
};

template <int G>
inline vf group_dot(const int8_t* w, const float* x) {  // G codes times G inputs, kLanes partial sums
  vf a = widen(w) * loadv(x);
  for (int c = kLanes; c < G; c += kLanes) a += widen(w + c) * loadv(x + c);
  return a;
}

inline vf mins_dot(const float* mn, const float* xsum, int64_t groups) {  // sum of mn * xsum, in lanes
  vf a = {0};
  int64_t g = 0;
  for (; g + kLanes <= groups; g += kLanes) a += loadv(mn + g) * loadv(xsum + g);
  float tail = 0.0f;
  for (; g < groups; ++g) tail += mn[g] * xsum[g];
  a[0] += tail;
  return a;
}

// As widened_block for one row of q8g codes: part[t] holds kLanes partial sums of channel t.
template <int G, bool Mins>
void q8g_block(const Q8gBlock& b, vf* part) {
  const int64_t k = b.k, groups = k / G;
  for (int t = 0; t < 16; ++t) {
    const int8_t* wr = b.w + t * k;
    const float* sr = b.s + t * groups;
    vf acc[4] = {};
    int64_t g = 0;
    for (; g + 4 <= groups; g += 4) {
      for (int p = 0; p < 4 * G; p += 64) prefetch(wr + g * G + p + kPrefetch);
      for (int j = 0; j < 4; ++j) acc[j] += group_dot<G>(wr + (g + j) * G, b.x + (g + j) * G) * sr[g + j];
    }
    for (; g < groups; ++g) acc[0] += group_dot<G>(wr + g * G, b.x + g * G) * sr[g];
    part[t] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    if (Mins) part[t] += mins_dot(b.mn + t * groups, b.xsum, groups);
  }
}

// kLanes codes dequantized. The empty asm keeps them a value of their own: with one row the
// compiler would otherwise fold the scale into the row's products (reassociation), and a lone
// row's sums would differ from the same row's in a group.
template <int G, bool Mins>
inline vf q8g_weights(const int8_t* w, const float* s, const float* mn, int64_t i) {
  const vf c = widen(w + i);
  vf out = Mins ? c * s[i / G] + mn[i / G] : c * s[i / G];
#if defined(__SSE__)
  asm("" : "+v"(out));   // one vector register
#else
  asm("" : "+m"(out));
#endif
  return out;
}

// The same for R rows of x at once (two accumulators a row, as widened_rows).
template <int R, int G, bool Mins>
void q8g_rows(const Q8gBlock& b, vf (*part)[16]) {
  const int64_t k = b.k, groups = k / G;
  for (int t = 0; t < 16; ++t) {
    const int8_t* wr = b.w + t * k;
    const float* sr = b.s + t * groups;
    const float* mr = Mins ? b.mn + t * groups : nullptr;
    vf a[R] = {}, c[R] = {};
    int64_t i = 0;
    for (; i + 2 * kLanes <= k; i += 2 * kLanes) {
      prefetch(wr + i + kPrefetch);
      const vf w0 = q8g_weights<G, Mins>(wr, sr, mr, i), w1 = q8g_weights<G, Mins>(wr, sr, mr, i + kLanes);
      for (int r = 0; r < R; ++r) {
        a[r] += w0 * loadv(b.x + r * k + i);
        c[r] += w1 * loadv(b.x + r * k + i + kLanes);
      }
    }
    for (; i < k; i += kLanes) {
      const vf w0 = q8g_weights<G, Mins>(wr, sr, mr, i);
      for (int r = 0; r < R; ++r) a[r] += w0 * loadv(b.x + r * k + i);
    }
    for (int r = 0; r < R; ++r) part[r][t] = a[r] + c[r];
  }
}

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

template <int G, bool Mins>
struct Q8g {
  static constexpr int kTile = kQ8gTile;
  static void one(const Q8gBlock& b, vf* part) { q8g_block<G, Mins>(b, part); }
  template <int R> static void many(const Q8gBlock& b, vf (*part)[16]) { q8g_rows<R, G, Mins>(b, part); }
};

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

template <int B>
void int4_blocks(const float* xb, const float* xsum, const uint8_t* wp, const uint32_t* sz, int64_t m, int64_t k,
                 int64_t n, bool f32, void* yp) {
  constexpr int J = B / kLanes;
  const int64_t groups = k / kInt4Group;
  at::parallel_for(0, n / B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * B;
      for (int64_t r0 = 0; r0 < m;) {  // tiles of up to 4 rows: each tile unpacks the codes once
        const int64_t rows = std::min<int64_t>(4, m - r0);
        const float* x0 = xb + r0 * k;
        const float* s0 = xsum + r0 * groups;
        const uint8_t* w0 = wp + n0 * k / 2;
        vf out[4][kInt4Vectors];
        if (rows == 4) int4_rows<B, 4>(x0, s0, w0, sz + n0, k, n, out);
        else if (rows == 3) int4_rows<B, 3>(x0, s0, w0, sz + n0, k, n, out);
        else if (rows == 2) int4_rows<B, 2>(x0, s0, w0, sz + n0, k, n, out);
        else int4_rows<B, 1>(x0, s0, w0, sz + n0, k, n, out);
        for (int64_t i = 0; i < rows; ++i)
          for (int j = 0; j < J; ++j)
            for (int t = 0; t < kLanes; ++t) {
              const int64_t at = (r0 + i) * n + n0 + kLanes * j + t;
              const uint16_t v = float_to_bf16(out[i][j][t]);
              if (f32) static_cast<float*>(yp)[at] = bf16_to_float(v);
              else static_cast<uint16_t*>(yp)[at] = v;
            }
        r0 += rows;
      }
    }
  });
}

// `block`: the packed layout's block of output channels (the B above: 32 or 64).
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros, int64_t block) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && packed.dim() == 2 && packed.is_contiguous() &&
                  scales_zeros.is_contiguous(), "int4_gemv: contiguous x [M, K] and packed [N, K/2] expected");
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0);
  TORCH_CHECK(block == 32 || block == 64, "int4_gemv: a block of 32 or 64 output channels expected");
  TORCH_CHECK(packed.size(1) * 2 == k && packed.scalar_type() == at::kByte, "int4_gemv: packed uint8 [N, K/2] expected");
  TORCH_CHECK(k % kInt4Group == 0 && n % block == 0, "int4_gemv: K must be a multiple of 32 and N of the block");
  TORCH_CHECK(scales_zeros.scalar_type() == at::kBFloat16 && scales_zeros.numel() == k / kInt4Group * n * 2,
              "int4_gemv: bfloat16 scales_zeros [K/32, N, 2] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "int4_gemv: float32 or bfloat16 x");
  TORCH_CHECK(m <= 64, "int4_gemv: at most 64 rows expected");
  const bool f32 = x.scalar_type() == at::kFloat;
  const int64_t groups = k / kInt4Group;
  std::vector<float> xb(m * k), xsum(m * groups, 0.0f);  // x rounded to bfloat16; its group sums
  for (int64_t i = 0; i < m * k; ++i) {
    xb[i] = f32 ? bf16_to_float(float_to_bf16(x.const_data_ptr<float>()[i]))
                : bf16_to_float(static_cast<const uint16_t*>(x.const_data_ptr())[i]);
    xsum[i / kInt4Group] += xb[i];
  }
  at::Tensor y = at::empty({m, n}, x.options());
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  const uint32_t* sz = static_cast<const uint32_t*>(scales_zeros.const_data_ptr());
  if (block == 64) int4_blocks<64>(xb.data(), xsum.data(), wp, sz, m, k, n, f32, y.data_ptr());
  else int4_blocks<32>(xb.data(), xsum.data(), wp, sz, m, k, n, f32, y.data_ptr());
  return y;
}

// y [M, N] = the q8g product of x [M, K] (float32) with the codes w, scales s and mins mn (or null),
// the rows' group sums of x first where there are mins.
template <int G, bool Mins>
void q8g_run(const float* x, const int8_t* w, const float* s, const float* mn, int64_t k, bool invariant,
             at::Tensor& y) {
  const int64_t m = y.size(0), n = y.size(1), groups = k / G;
  std::vector<float> xsum(Mins ? m * groups : 0, 0.0f);
  for (int64_t i = 0; i < static_cast<int64_t>(xsum.size()) * G; ++i) xsum[i / G] += x[i];
  const bool f32 = y.scalar_type() == at::kFloat;
  void* yp = y.data_ptr();
  for_blocks<Q8g<G, Mins>::kTile>(m, n, [&](int64_t r0, int64_t rows, int64_t n0) {
    const Q8gBlock b{x + r0 * k, xsum.data() + r0 * groups, w + n0 * k, s + n0 * groups,
                     Mins ? mn + n0 * groups : nullptr, k};
    vf part[Q8g<G, Mins>::kTile][16];
    row_group<Q8g<G, Mins>>(rows, invariant, part, b);
    for (int64_t i = 0; i < rows; ++i) {
      float sums[16];
      transpose_sum(part[i], sums);
      const int64_t at = (r0 + i) * n + n0;
      if (f32) std::memcpy(static_cast<float*>(yp) + at, &sums, 64);
      else
        for (int t = 0; t < 16; ++t) static_cast<uint16_t*>(yp)[at + t] = float_to_bf16(sums[t]);
    }
  });
}

void check_q8g_operand(const at::Tensor& t, const char* name, int64_t n, int64_t groups) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) == n && t.size(1) == groups &&
                  t.is_contiguous(),
              "q8g_gemv: contiguous float32 ", name, " [N, K/group] = [", n, ", ", groups, "] expected, got ",
              t.scalar_type(), " ", t.sizes(), t.is_contiguous() ? "" : " (not contiguous)");
}

at::Tensor q8g_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                    const std::optional<at::Tensor>& mins, int64_t group, bool invariant) {
  TORCH_CHECK(group == 16 || group == 32, "q8g_gemv: group must be 16 or 32, got ", group);
  check_shapes(x, codes, group, "q8g_gemv");
  TORCH_CHECK(codes.scalar_type() == at::kChar, "q8g_gemv: int8 codes expected, got ", codes.scalar_type());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "q8g_gemv: float32 or bfloat16 x expected, got ", x.scalar_type());
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0);
  check_q8g_operand(scales, "scales", n, k / group);
  if (mins) check_q8g_operand(*mins, "mins", n, k / group);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const at::Tensor xf = float_rows(x, false);
  const float* xp = xf.const_data_ptr<float>();
  const int8_t* wp = codes.const_data_ptr<int8_t>();
  const float* sp = scales.const_data_ptr<float>();
  const float* mp = mins ? mins->const_data_ptr<float>() : nullptr;
  using Run = void (*)(const float*, const int8_t*, const float*, const float*, int64_t, bool, at::Tensor&);
  const Run runs[2][2] = {{q8g_run<16, false>, q8g_run<16, true>}, {q8g_run<32, false>, q8g_run<32, true>}};
  runs[group == 32][mins.has_value()](xp, wp, sp, mp, k, invariant, y);
  return y;
}

at::Tensor q8g_gemv_meta(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                         const std::optional<at::Tensor>& mins, int64_t group, bool invariant) {
  return at::empty_symint({x.sym_size(0), codes.sym_size(0)}, x.options());
}

at::Tensor int4_gemv_meta(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros, int64_t block) {
  return at::empty_symint({x.sym_size(0), packed.sym_size(0)}, x.options());
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
  m.def("int4_gemv(Tensor x, Tensor packed, Tensor scales_zeros, int block) -> Tensor");
  m.def("q8g_gemv(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int group, bool invariant=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("int8_gemv", int8_gemv);
  m.impl("bf16_gemv", bf16_gemv);
  m.impl("f16_gemv", f16_gemv);
  m.impl("int4_gemv", int4_gemv);
  m.impl("q8g_gemv", q8g_gemv);
}

// Meta kernels keep the row count symbolic (sym_size): size() would make a compiled graph that calls
// them specialize on it, one graph per row count.
TORCH_LIBRARY_IMPL(kvserve_cpu, Meta, m) {
  m.impl("int8_gemv", int8_gemv_meta);
  m.impl("bf16_gemv", bf16_gemv_meta);
  m.impl("f16_gemv", f16_gemv_meta);
  m.impl("int4_gemv", int4_gemv_meta);
  m.impl("q8g_gemv", q8g_gemv_meta);
}
