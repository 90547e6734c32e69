// Decode attention over paged K/V on the CPU: one query token per row, its K/V read from the pools
// by block id in place (no gathered copy). Work items are (row, K/V head) pairs; each item scores
// its head's G query heads against the visible keys (one pass over K), takes the softmax, and sums
// the values (one pass over V). Float32 arithmetic; pools, queries and output are float32 or
// bfloat16 (dtype 0 / 1). Built at run time by kvserve/attention/cpu/__init__.py.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include "simd.h"

namespace {

using kvserve::i32x16;
using kvserve::loadv;
using kvserve::transpose_sum;
using kvserve::v16;

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return kvserve::bf16_to_float(p[i]); }
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x) { p[i] = kvserve::float_to_bf16(x); }

// exp(x) for x <= 0 (scores minus their maximum), vectorizable: 2^n * p(r), |rel err| < 2e-7.
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

// Softmax numerators of G score rows [G, stride] over their first `len` entries, in place; the
// padding up to `stride` weighs 0; total[g] gets row g's sum.
inline void softmax_rows(float* score, int64_t g_n, int64_t len, int64_t stride, float* total) {
  for (int64_t g = 0; g < g_n; ++g) {
    float* sg = score + g * stride;
    float peak = -INFINITY;
    for (int64_t t = 0; t < len; ++t) peak = std::max(peak, sg[t]);
    float sum = 0.0f;
    for (int64_t t = 0; t < len; ++t) {
      sg[t] = exp_nonpositive(sg[t] - peak);
      sum += sg[t];
    }
    for (int64_t t = len; t < stride; ++t) sg[t] = 0.0f;
    total[g] = sum;
  }
}

struct Shape {
  int64_t width, hq, hkv, d, dv, block_size;
  int64_t q_row, q_head, table_row;  // strides in elements
  float scale;
};

template <typename T>
void attend_item(const T* q, const T* k_pool, const T* v_pool, const int64_t* table, int64_t start,
                 int64_t end, int64_t head, const Shape& s, T* out, std::vector<float>& buf) {
  const int64_t g_n = s.hq / s.hkv, d = s.d, dv = s.dv, bs = s.block_size, len = end - start;
  buf.resize(g_n * (d + dv + len));
  float* qf = buf.data();              // [G, D]
  float* acc = qf + g_n * d;           // [G, Dv]
  float* score = acc + g_n * dv;       // [G, L]
  for (int64_t g = 0; g < g_n; ++g)
    for (int64_t i = 0; i < d; ++i) qf[g * d + i] = load(q, (head * g_n + g) * s.q_head + i) * s.scale;
  const int64_t k_tok = s.hkv * d, v_tok = s.hkv * dv;
  for (int64_t p = start; p < end;) {  // pass 1: scores, block by block
    const int64_t block = table[p / bs], off = p % bs, n = std::min(bs - off, end - p);
    const T* k = k_pool + ((block * bs + off) * s.hkv + head) * d;
    for (int64_t t = 0; t < n; ++t, k += k_tok)
      for (int64_t g = 0; g < g_n; ++g) {
        const float* qg = qf + g * d;
        float dot = 0.0f;
        for (int64_t i = 0; i < d; ++i) dot += qg[i] * load(k, i);
        score[g * len + (p - start) + t] = dot;
      }
    p += n;
  }
  std::vector<float> total(g_n);
  softmax_rows(score, g_n, len, len, total.data());
  std::fill(acc, acc + g_n * dv, 0.0f);
  for (int64_t p = start; p < end;) {  // pass 2: weighted values
    const int64_t block = table[p / bs], off = p % bs, n = std::min(bs - off, end - p);
    const T* v = v_pool + ((block * bs + off) * s.hkv + head) * dv;
    for (int64_t t = 0; t < n; ++t, v += v_tok)
      for (int64_t g = 0; g < g_n; ++g) {
        const float w = score[g * len + (p - start) + t];
        float* ag = acc + g * dv;
        for (int64_t i = 0; i < dv; ++i) ag[i] += w * load(v, i);
      }
    p += n;
  }
  for (int64_t g = 0; g < g_n; ++g)
    for (int64_t i = 0; i < dv; ++i) store(out, (head * g_n + g) * dv + i, acc[g * dv + i] / total[g]);
}

// ---- head sizes that are a multiple of 16: 16-float vectors (GCC vector extensions), tiles of
// 16 tokens whose K/V rows are found once; a tile's 16 dot products are reduced together.
template <typename T, int DK>
void attend_item_vec(const T* q, const T* k_pool, const T* v_pool, const int64_t* table, int64_t start,
                     int64_t end, int64_t head, const Shape& s, T* out, std::vector<float>& buf) {
  constexpr int J = DK / 16;
  const int64_t g_n = s.hq / s.hkv, bs = s.block_size, len = end - start, padded = (len + 15) / 16 * 16;
  buf.resize(g_n * (2 * DK + padded) + 16);
  float* qf = buf.data();              // [G, DK]
  float* acc = qf + g_n * DK;          // [G, DK]
  float* score = acc + g_n * DK;       // [G, padded]
  for (int64_t g = 0; g < g_n; ++g)
    for (int64_t i = 0; i < DK; ++i) qf[g * DK + i] = load(q, (head * g_n + g) * s.q_head + i) * s.scale;
  std::fill(acc, acc + g_n * DK, 0.0f);
  int64_t rows[16];
  for (int64_t base = 0; base < len; base += 16) {  // pass 1: scores, 16 tokens at a time
    const int n = static_cast<int>(std::min<int64_t>(16, len - base));
    for (int t = 0; t < 16; ++t) {
      const int64_t p = start + base + std::min(t, n - 1);
      rows[t] = ((table[p / bs] * bs + p % bs) * s.hkv + head) * DK;
    }
    for (int64_t g = 0; g < g_n; ++g) {
      v16 qv[J], part[16];
      for (int j = 0; j < J; ++j) qv[j] = loadv(qf + g * DK + 16 * j);
      for (int t = 0; t < 16; ++t) {
        const T* k = k_pool + rows[t];
        v16 a = qv[0] * loadv(k);
        for (int j = 1; j < J; ++j) a += qv[j] * loadv(k + 16 * j);
        part[t] = a;
      }
      v16 sums = transpose_sum(part);
      std::memcpy(score + g * padded + base, &sums, 64);
    }
  }
  std::vector<float> total(g_n);
  softmax_rows(score, g_n, len, padded, total.data());
  for (int64_t base = 0; base < len; base += 16) {  // pass 2: weighted values, 16 tokens at a time
    const int n = static_cast<int>(std::min<int64_t>(16, len - base));
    for (int t = 0; t < n; ++t) {
      const int64_t p = start + base + t;
      rows[t] = ((table[p / bs] * bs + p % bs) * s.hkv + head) * DK;
    }
    for (int64_t g = 0; g < g_n; ++g) {
      v16 a[J];
      for (int j = 0; j < J; ++j) a[j] = loadv(acc + g * DK + 16 * j);
      const float* w = score + g * padded + base;
      for (int t = 0; t < n; ++t) {
        const T* v = v_pool + rows[t];
        for (int j = 0; j < J; ++j) a[j] += w[t] * loadv(v + 16 * j);
      }
      for (int j = 0; j < J; ++j) std::memcpy(acc + g * DK + 16 * j, &a[j], 64);
    }
  }
  for (int64_t g = 0; g < g_n; ++g)
    for (int64_t i = 0; i < DK; ++i) store(out, (head * g_n + g) * DK + i, acc[g * DK + i] / total[g]);
}

// The vector path for the usual head sizes (K and V of one size), the scalar path else.
template <typename T>
void attend(const T* q, const T* k, const T* v, const int64_t* table, int64_t start, int64_t end, int64_t head,
            const Shape& s, T* out, std::vector<float>& buf) {
  const int64_t d = s.d == s.dv ? s.d : 0;
  switch (d) {
    case 32: return attend_item_vec<T, 32>(q, k, v, table, start, end, head, s, out, buf);
    case 64: return attend_item_vec<T, 64>(q, k, v, table, start, end, head, s, out, buf);
    case 80: return attend_item_vec<T, 80>(q, k, v, table, start, end, head, s, out, buf);
    case 96: return attend_item_vec<T, 96>(q, k, v, table, start, end, head, s, out, buf);
    case 128: return attend_item_vec<T, 128>(q, k, v, table, start, end, head, s, out, buf);
    case 256: return attend_item_vec<T, 256>(q, k, v, table, start, end, head, s, out, buf);
    default: return attend_item<T>(q, k, v, table, start, end, head, s, out, buf);
  }
}

template <typename T>
void run(const void* q, const void* k_pool, const void* v_pool, const int64_t* table, const int64_t* starts,
         const int64_t* ends, void* out, int64_t rows, const Shape& s, int threads) {
  const int64_t items = rows * s.hkv;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t r = item / s.hkv, head = item % s.hkv;
      attend<T>(static_cast<const T*>(q) + r * s.q_row, static_cast<const T*>(k_pool),
                static_cast<const T*>(v_pool), table + r * s.table_row, starts[r], ends[r], head, s,
                static_cast<T*>(out) + r * s.hq * s.dv, buf);
    }
  }
}

}  // namespace

extern "C" int kvserve_paged_decode(const void* q, const void* k_pool, const void* v_pool, const int64_t* table,
                                    const int64_t* starts, const int64_t* ends, void* out, int64_t rows,
                                    int64_t width, int64_t hq, int64_t hkv, int64_t d, int64_t dv,
                                    int64_t block_size, int64_t q_row, int64_t q_head, int64_t table_row,
                                    float scale, int dtype, int threads) {
  const Shape s{width, hq, hkv, d, dv, block_size, q_row, q_head, table_row, scale};
  if (dtype == 0) {
    run<float>(q, k_pool, v_pool, table, starts, ends, out, rows, s, threads);
  } else if (dtype == 1) {
    run<uint16_t>(q, k_pool, v_pool, table, starts, ends, out, rows, s, threads);
  } else {
    return 1;
  }
  return 0;
}
