// Decode attention over paged K/V on the CPU: one query token per row, its K/V read from the pools
// by block id in place (no gathered copy). Work items are (rows, K/V heads) pairs, the rows one row
// or consecutive rows of one sequence; each item scores its rows' query heads of those K/V heads
// against the visible keys (one pass over K), takes the softmax, and sums the values (one pass over
// V). With more than one thread, rows are split into parts at fixed positions, scored apart and
// combined exactly, unless `split` is off (the batch-invariant mode: a row's sums then run in one
// order); either way a row's result does not depend on what else shares the call. Float32
// arithmetic; queries and output float32 over float32 pools
// (dtype 0), bfloat16 over bfloat16 pools (1), or float32 over bfloat16 pools (2: half the bytes
// read). Built at run time by kvserve/attention/cpu/__init__.py and registered as torch ops
// (kvserve_attn::paged_decode_into, kvserve_attn::decode_one, kvserve_attn::decode_batch), so a
// compiled graph calls them through the dispatcher.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include "simd.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace {

using kvserve::exp_nonpositive;
using kvserve::kLanes;
using kvserve::loadv;
using kvserve::transpose_sum;
using kvserve::vf;
using kvserve::vi;

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return kvserve::bf16_to_float(p[i]); }
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x) { p[i] = kvserve::float_to_bf16(x); }

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

// softmax_rows for rows padded to a multiple of 16, kLanes scores at a time; peak[g] gets row g's maximum.
inline void softmax_rows_vec(float* score, int64_t g_n, int64_t len, int64_t stride, float* total, float* peak_out) {
  vi lane;
  for (int i = 0; i < kLanes; ++i) lane[i] = i;
  const vf none = vf{} - INFINITY, zero = vf{};
  for (int64_t g = 0; g < g_n; ++g) {
    float* sg = score + g * stride;
    vf m = none;
    for (int64_t b = 0; b < stride; b += kLanes) {
      const vf x = lane < static_cast<int32_t>(len - b) ? loadv(sg + b) : none;
      m = m > x ? m : x;
    }
    float peak = m[0];
    for (int i = 1; i < kLanes; ++i) peak = std::max(peak, m[i]);
    vf sum = zero;
    for (int64_t b = 0; b < stride; b += kLanes) {
      const vf e = lane < static_cast<int32_t>(len - b) ? exp_nonpositive(loadv(sg + b) - peak) : zero;
      std::memcpy(sg + b, &e, sizeof e);
      sum += e;
    }
    float t = 0.0f;
    for (int i = 0; i < kLanes; ++i) t += sum[i];
    total[g] = t;
    peak_out[g] = peak;
  }
}

struct Shape {
  int64_t width, hq, hkv, d, dv, block_size;
  int64_t q_row, q_head, table_row;  // strides in elements
  float scale;
};

template <typename TQ, typename TK>
void attend_item(const TQ* q, const TK* k_pool, const TK* v_pool, const int64_t* table, int64_t start,
                 int64_t end, int64_t head, const Shape& s, TQ* out, std::vector<float>& buf) {
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
    const TK* k = k_pool + ((block * bs + off) * s.hkv + head) * d;
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
    const TK* v = v_pool + ((block * bs + off) * s.hkv + head) * dv;
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

// Asks for the cache lines of 16 rows of `span` elements each (a tile's K or V) ahead of use.
template <int LOCALITY, typename TK>
inline void prefetch_rows(const TK* pool, const int64_t* rows, int64_t span) {
  const int64_t bytes = span * static_cast<int64_t>(sizeof(TK));
  for (int t = 0; t < 16; ++t) {
    const char* p = reinterpret_cast<const char*>(pool + rows[t]);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, LOCALITY);
  }
}

// A tile's 16 token rows of `span` elements as floats: float32 pools are read where they are
// (rows[t] into the pool), bfloat16 ones widened once into `tile` (exact) for every query head.
template <typename TK>
inline const float* tile_rows(const TK* pool, const int64_t* rows, int64_t span, float* tile, int64_t* at) {
  if constexpr (std::is_same_v<TK, float>) {
    std::memcpy(at, rows, 16 * sizeof(int64_t));
    return pool;
  } else {
    for (int t = 0; t < 16; ++t) {
      for (int64_t i = 0; i < span; i += kLanes) {
        const vf x = loadv(pool + rows[t] + i);
        std::memcpy(tile + t * span + i, &x, sizeof x);
      }
      at[t] = t * span;
    }
    return tile;
  }
}

// ---- head sizes that are a multiple of 16: simd.h's vectors (kLanes floats), tiles of 16 tokens
// whose K/V rows are found once; a tile's 16 dot products are reduced together. An item
// covers `per` adjacent K/V heads of `n_rows` rows of one sequence (consecutive positions over one
// block table: a request's token and its speculated ones, row i seeing positions before
// row_ends[i]), so a tile reads each token's rows of those heads once for every row's query heads
// (one contiguous stretch of the block when per = Hkv). Each query head's scores, softmax and sums
// run as they would for its row alone: positions past a row's end weigh 0. With `part`, the
// item's share of a split row goes there unnormalized instead of to `out`: per query head [DK]
// sums, its peak, its total.
template <typename TQ, typename TK, int DK>
void attend_heads_vec(const TQ* q, const TK* k_pool, const TK* v_pool, const int64_t* table, int64_t start,
                      int64_t end, int64_t h0, int64_t per, const Shape& s, TQ* out, std::vector<float>& buf,
                      float* part, int64_t n_rows, const int64_t* row_ends) {
  constexpr int J = DK / kLanes;
  const int64_t g_n = s.hq / s.hkv, m = per * g_n, n_q = n_rows * m, bs = s.block_size, len = end - start;
  const int64_t padded = (len + 15) / 16 * 16;
  const int64_t span = per * DK;  // elements of a token's rows that the item reads
  buf.resize(n_q * (2 * DK + padded + 2) + 16 * span + 16);
  float* qf = buf.data();              // [rows * per * G, DK]: each row's query heads of K/V heads h0 .. h0 + per
  float* acc = qf + n_q * DK;          // [rows * per * G, DK]
  float* score = acc + n_q * DK;       // [rows * per * G, padded]
  float* total = score + n_q * padded; // [rows * per * G]
  float* peak = total + n_q;           // [rows * per * G]
  float* tile = peak + n_q;            // [16, span]: a tile's K or V rows widened
  for (int64_t a = 0; a < n_q; ++a)
    for (int64_t i = 0; i < DK; ++i)
      qf[a * DK + i] = load(q + (a / m) * s.q_row, (h0 * g_n + a % m) * s.q_head + i) * s.scale;
  std::fill(acc, acc + n_q * DK, 0.0f);
  int64_t rows[16], next[16];
  const auto locate = [&](int64_t base, int64_t* r) {  // element offsets of a tile's 16 rows (last repeated)
    const int64_t n = std::min<int64_t>(16, len - base);
    for (int64_t t = 0; t < 16; ++t) {
      const int64_t p = start + base + std::min(t, n - 1);
      r[t] = ((table[p / bs] * bs + p % bs) * s.hkv + h0) * DK;
    }
  };
  int64_t at[16];
  if (len > 0) locate(0, next);
  for (int64_t base = 0; base < len; base += 16) {  // pass 1: scores, 16 tokens at a time
    std::memcpy(rows, next, sizeof rows);
    if (base + 16 < len) {  // the next tile's keys are fetched while this one is scored
      locate(base + 16, next);
      prefetch_rows<3>(k_pool, next, span);
      prefetch_rows<2>(v_pool, next, span);
    }
    const float* keys = tile_rows(k_pool, rows, span, tile, at);
    for (int64_t a = 0; a < n_q; ++a) {
      const int64_t off = ((a % m) / g_n) * DK;
      vf qv[J], part[16];
      for (int j = 0; j < J; ++j) qv[j] = loadv(qf + a * DK + kLanes * j);
      for (int t = 0; t < 16; ++t) {
        const float* k = keys + at[t] + off;
        vf x = qv[0] * loadv(k);
        for (int j = 1; j < J; ++j) x += qv[j] * loadv(k + kLanes * j);
        part[t] = x;
      }
      transpose_sum(part, score + a * padded + base);
    }
  }
  for (int64_t r = 0; r < n_rows; ++r) {  // each row over its own positions (none: total 0)
    const int64_t seen = row_ends == nullptr ? len : std::max<int64_t>(0, std::min(end, row_ends[r]) - start);
    softmax_rows_vec(score + r * m * padded, m, seen, padded, total + r * m, peak + r * m);
  }
  if (len > 0) locate(0, next);
  for (int64_t base = 0; base < len; base += 16) {  // pass 2: weighted values, 16 tokens at a time
    const int n = static_cast<int>(std::min<int64_t>(16, len - base));
    std::memcpy(rows, next, sizeof rows);
    if (base + 16 < len) {
      locate(base + 16, next);
      prefetch_rows<3>(v_pool, next, span);
    }
    const float* values = tile_rows(v_pool, rows, span, tile, at);
    for (int64_t a = 0; a < n_q; ++a) {
      const int64_t off = ((a % m) / g_n) * DK;
      vf x[J];
      for (int j = 0; j < J; ++j) x[j] = loadv(acc + a * DK + kLanes * j);
      const float* w = score + a * padded + base;
      for (int t = 0; t < n; ++t) {
        const float* v = values + at[t] + off;
        for (int j = 0; j < J; ++j) x[j] += w[t] * loadv(v + kLanes * j);
      }
      for (int j = 0; j < J; ++j) std::memcpy(acc + a * DK + kLanes * j, &x[j], sizeof x[j]);
    }
  }
  if (part != nullptr) {
    for (int64_t a = 0; a < n_q; ++a, part += DK + 2) {
      std::memcpy(part, acc + a * DK, DK * sizeof(float));
      part[DK] = peak[a];
      part[DK + 1] = total[a];
    }
    return;
  }
  for (int64_t a = 0; a < n_q; ++a)
    for (int64_t i = 0; i < DK; ++i)
      store(out + (a / m) * s.hq * DK, (h0 * g_n + a % m) * DK + i, acc[a * DK + i] / total[a]);
}

// True for the head sizes the vector path takes (K and V of one size).
bool vector_heads(const Shape& s) {
  return s.d == s.dv && (s.d == 32 || s.d == 64 || s.d == 80 || s.d == 96 || s.d == 128 || s.d == 256);
}

// The vector path for the usual head sizes (an item of `n_rows` rows of one sequence), the scalar
// path (head by head, one row: n_rows is 1 there) else; `part` (vector path only): the item's
// unnormalized share of a split row (attend_heads_vec).
template <typename TQ, typename TK>
void attend(const TQ* q, const TK* k, const TK* v, const int64_t* table, int64_t start, int64_t end, int64_t h0,
            int64_t per, const Shape& s, TQ* out, std::vector<float>& buf, float* part, int64_t n_rows,
            const int64_t* row_ends) {
  const int64_t d = vector_heads(s) ? s.d : 0;
  switch (d) {
#define KVSERVE_HEADS(DK) \
    case DK: return attend_heads_vec<TQ, TK, DK>(q, k, v, table, start, end, h0, per, s, out, buf, part, n_rows, row_ends);
    KVSERVE_HEADS(32) KVSERVE_HEADS(64) KVSERVE_HEADS(80) KVSERVE_HEADS(96) KVSERVE_HEADS(128) KVSERVE_HEADS(256)
#undef KVSERVE_HEADS
    default:
      for (int64_t h = h0; h < h0 + per; ++h) attend_item<TQ, TK>(q, k, v, table, start, end, h, s, out, buf);
  }
}

// K/V heads per work item: all of a row's when there are rows enough to keep every thread busy
// (each token's K/V of the row is then read in one stretch), else one.
int64_t heads_per_item(int64_t rows, int64_t hkv, int threads) {
  return rows >= 8 * threads ? hkv : 1;
}

// Split rows are cut into parts at fixed positions, [j * kPart, (j + 1) * kPart): a row's parts, and
// so its sums, depend on its own range alone, never on the rows beside it or their lengths.
constexpr int64_t kPart = 512;

// An item's query heads from its parts' [DK] sums, peaks and totals (`stride` floats a part): exact,
// each part's sums rescaled to the largest peak. Query a is head a % m of the item's row a / m,
// rows `row_stride` elements apart in `out`.
template <typename TQ>
void combine(const float* parts, int64_t n_parts, int64_t stride, int64_t n_q, int64_t m, int64_t row_stride,
             int64_t dv, TQ* out) {
  for (int64_t a = 0; a < n_q; ++a) {
    float peak = -INFINITY;
    for (int64_t j = 0; j < n_parts; ++j) peak = std::max(peak, parts[j * stride + a * (dv + 2) + dv]);
    float total = 0.0f;
    std::vector<float> acc(dv, 0.0f);
    for (int64_t j = 0; j < n_parts; ++j) {
      const float* p = parts + j * stride + a * (dv + 2);
      if (p[dv + 1] == 0.0f) continue;   // an empty part
      const float w = std::exp(p[dv] - peak);
      total += w * p[dv + 1];
      for (int64_t i = 0; i < dv; ++i) acc[i] += w * p[i];
    }
    for (int64_t i = 0; i < dv; ++i) store(out + (a / m) * row_stride, (a % m) * dv + i, acc[i] / total);
  }
}

// Row r continues row r - 1's sequence: the same first visible position and block table, one
// position further (a request's token and its speculated tokens, laid out by the model runner).
bool continues(const int64_t* table, int64_t table_row, const int64_t* starts, const int64_t* ends, int64_t r,
               int64_t block_size) {
  if (starts[r] != starts[r - 1] || ends[r] != ends[r - 1] + 1) return false;
  const int64_t blocks = (ends[r] - 1) / block_size + 1;
  return table_row == 0 ||
         std::memcmp(table + r * table_row, table + (r - 1) * table_row, blocks * sizeof(int64_t)) == 0;
}

// The first row of each item's run of rows, then `rows`: on the vector path consecutive rows of one
// sequence (up to kRunRows) share items, each K/V row read once for all of them; else one row each.
constexpr int64_t kRunRows = 16;
std::vector<int64_t> row_runs(const int64_t* table, int64_t table_row, const int64_t* starts, const int64_t* ends,
                              int64_t rows, int64_t block_size, bool vec) {
  std::vector<int64_t> first;
  for (int64_t r = 0; r < rows; ++r)
    if (first.empty() || !vec || r - first.back() >= kRunRows ||
        !continues(table, table_row, starts, ends, r, block_size))
      first.push_back(r);
  first.push_back(rows);
  return first;
}

template <typename TQ, typename TK>
void run(const void* q, const void* k_pool, const void* v_pool, const int64_t* table, const int64_t* starts,
         const int64_t* ends, void* out, int64_t rows, const Shape& s, int threads, bool split) {
  const bool vec = vector_heads(s), parted = split && vec && threads > 1;
  const std::vector<int64_t> first = row_runs(table, s.table_row, starts, ends, rows, s.block_size, vec);
  const int64_t runs = static_cast<int64_t>(first.size()) - 1;
  const int64_t per = heads_per_item(runs, s.hkv, threads), groups = s.hkv / per, items = runs * groups;
  // each item's first unit: one per part of its rows' positions (one when not split)
  std::vector<int64_t> unit0(items + 1, 0);
  int64_t most = 1;
  for (int64_t item = 0; item < items; ++item) {
    const int64_t u = item / groups, lo = starts[first[u]], hi = ends[first[u + 1] - 1];
    unit0[item + 1] = unit0[item] + (parted && hi > lo ? (hi - 1) / kPart - lo / kPart + 1 : 1);
    most = std::max(most, first[u + 1] - first[u]);
  }
  const int64_t units = unit0[items];
  const int64_t m = per * (s.hq / s.hkv), stride = most * m * (s.dv + 2), row_out = s.hq * s.dv;
  std::vector<float> parts(units > items ? units * stride : 0);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
    for (int64_t unit = 0; unit < units; ++unit) {
      const int64_t item = std::upper_bound(unit0.begin(), unit0.end(), unit) - unit0.begin() - 1;
      const int64_t u = item / groups, h0 = (item % groups) * per, r = first[u], n_rows = first[u + 1] - r;
      const int64_t lo = starts[r], hi = ends[r + n_rows - 1], j = unit - unit0[item];
      const bool whole = unit0[item + 1] - unit0[item] == 1;
      const int64_t a = whole ? lo : std::max(lo, (lo / kPart + j) * kPart);
      const int64_t b = whole ? hi : std::min(hi, (lo / kPart + j + 1) * kPart);
      attend<TQ, TK>(static_cast<const TQ*>(q) + r * s.q_row, static_cast<const TK*>(k_pool),
                     static_cast<const TK*>(v_pool), table + r * s.table_row, a, b, h0, per, s,
                     static_cast<TQ*>(out) + r * row_out, buf, whole ? nullptr : parts.data() + unit * stride,
                     n_rows, n_rows > 1 ? ends + r : nullptr);
    }
#pragma omp for
    for (int64_t item = 0; item < items; ++item) {
      const int64_t n_parts = unit0[item + 1] - unit0[item];
      if (n_parts == 1) continue;
      const int64_t u = item / groups, h0 = (item % groups) * per, r = first[u], n_rows = first[u + 1] - r;
      combine(parts.data() + unit0[item] * stride, n_parts, stride, n_rows * m, m, row_out, s.dv,
              static_cast<TQ*>(out) + r * row_out + h0 * (s.hq / s.hkv) * s.dv);
    }
  }
}

int paged_decode(const void* q, const void* k_pool, const void* v_pool, const int64_t* table,
                 const int64_t* starts, const int64_t* ends, void* out, int64_t rows, const Shape& s, int dtype,
                 int threads, bool split) {
  if (dtype == 0) {
    run<float, float>(q, k_pool, v_pool, table, starts, ends, out, rows, s, threads, split);
  } else if (dtype == 1) {
    run<uint16_t, uint16_t>(q, k_pool, v_pool, table, starts, ends, out, rows, s, threads, split);
  } else if (dtype == 2) {
    run<float, uint16_t>(q, k_pool, v_pool, table, starts, ends, out, rows, s, threads, split);
  } else {
    return 1;
  }
  return 0;
}

// The kernel's dtype code for queries q over pools like `pool`: float32 / float32 (0), bfloat16 /
// bfloat16 (1), float32 / bfloat16 (2); -1 for any other pair.
int dtype_code(const at::Tensor& q, const at::Tensor& pool) {
  const auto a = q.scalar_type(), b = pool.scalar_type();
  if (a == at::kFloat && b == at::kFloat) return 0;
  if (a == at::kBFloat16 && b == at::kBFloat16) return 1;
  if (a == at::kFloat && b == at::kBFloat16) return 2;
  return -1;
}

void check_index(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.stride(-1) == 1, "CPU decode attention: ",
              what, " must be a CPU long tensor with unit last stride");
}

// Row i of q [B, Hq, D] over positions [starts[i], ends[i]) of table[i] ([B, W], or [W] for one
// row) in the pools [num_blocks, block_size, Hkv, D], into out [B, Hq, Dv] (contiguous, q's dtype).
void decode_rows(const at::Tensor& q_in, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& table,
                 const int64_t* starts, const int64_t* ends, double scale, const at::Tensor& out, bool split) {
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  check_index(table, "block tables");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && v_pool.scalar_type() == k_pool.scalar_type(),
              "CPU decode attention: K and V pools must be contiguous and of one dtype");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == q.scalar_type(), "CPU decode attention: out must be "
              "contiguous in the queries' dtype");
  const int dtype = dtype_code(q, k_pool);
  TORCH_CHECK(dtype >= 0, "CPU decode attention kernel: unsupported dtypes (queries ", q.scalar_type(), ", pools ",
              k_pool.scalar_type(), ")");
  const int64_t width = table.size(-1);
  const Shape s{width, q.size(1), k_pool.size(2), q.size(2), v_pool.size(3), k_pool.size(1), q.stride(0), q.stride(1),
                table.dim() == 2 ? table.stride(0) : width, static_cast<float>(scale)};
  paged_decode(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), table.data_ptr<int64_t>(), starts, ends,
               out.data_ptr(), q.size(0), s, dtype, at::get_num_threads(), split);
}

void paged_decode_into(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& table,
                       const at::Tensor& starts, const at::Tensor& ends, double scale, at::Tensor out, bool split) {
  check_index(starts, "starts");
  check_index(ends, "ends");
  decode_rows(q, k_pool, v_pool, table, starts.data_ptr<int64_t>(), ends.data_ptr<int64_t>(), scale, out, split);
}

// One token's K or V [1, H, D] (any strides) into row `slot` of a contiguous pool [blocks,
// block_size, H, D]: float32 kept or rounded to bfloat16 to nearest even (as torch's .to()),
// bfloat16 kept; other dtype pairs through copy_.
template <typename TS, typename TP>
void store_rows(const TS* src, int64_t head_stride, int64_t elem_stride, TP* dst, int64_t h, int64_t d) {
  for (int64_t a = 0; a < h; ++a)
    for (int64_t i = 0; i < d; ++i) dst[a * d + i] = static_cast<TP>(src[a * head_stride + i * elem_stride]);
}

// Row i of x [R, H, D] (any strides) into row `slot` of a contiguous pool [blocks, block_size, H, D].
void store_token(const at::Tensor& x, int64_t i, at::Tensor& pool, int64_t slot) {
  const int64_t h = pool.size(2), d = pool.size(3), row = slot * h * d, at_row = i * x.stride(0);
  TORCH_CHECK(slot >= 0 && slot < pool.size(0) * pool.size(1), "decode attention: slot ", slot,
              " is outside the pool");
  TORCH_CHECK(x.size(1) == h && x.size(2) == d, "decode attention: K/V of shape ", x.sizes(), " for a pool of ",
              pool.sizes());
  const auto xs = x.scalar_type(), ps = pool.scalar_type();
  if (xs == at::kFloat && ps == at::kFloat) {
    store_rows(x.data_ptr<float>() + at_row, x.stride(1), x.stride(2), pool.data_ptr<float>() + row, h, d);
  } else if (xs == at::kFloat && ps == at::kBFloat16) {
    store_rows(x.data_ptr<float>() + at_row, x.stride(1), x.stride(2), pool.data_ptr<at::BFloat16>() + row, h, d);
  } else if (xs == at::kBFloat16 && ps == at::kBFloat16) {
    store_rows(x.data_ptr<at::BFloat16>() + at_row, x.stride(1), x.stride(2), pool.data_ptr<at::BFloat16>() + row, h,
               d);
  } else {
    pool.view({-1, h, d}).select(0, slot).copy_(x.select(0, i));
  }
}

// One decode token: its K and V [1, Hkv, D] stored at `slot` [1] of the pools (in the pools'
// dtype, rounded as torch's .to() rounds), then q [1, Hq, D] attends over positions
// [span[0], span[1]) of `blocks` [n] -> [1, Hq, Dv].
at::Tensor decode_one(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_pool,
                      at::Tensor v_pool, const at::Tensor& slot, const at::Tensor& blocks, const at::Tensor& span,
                      double scale) {
  check_index(span, "span");
  const int64_t at_slot = slot.data_ptr<int64_t>()[0];
  store_token(k, 0, k_pool, at_slot);
  store_token(v, 0, v_pool, at_slot);
  at::Tensor out = at::empty({q.size(0), q.size(1), v_pool.size(3)}, q.options());
  const int64_t* ends = span.data_ptr<int64_t>();
  decode_rows(q, k_pool, v_pool, blocks, ends, ends + 1, scale, out, true);
  return out;
}

// R decode rows (a step's decodes, or one request's token and its speculated tokens): row i's K and V
// [R, Hkv, D] stored at slots[i], then q [R, Hq, D] row i attends over positions [ranges[0][i],
// ranges[1][i]) of tables[i] ([R, W]) -> [R, Hq, Dv]. Every row is stored before any attends: rows of
// one request see each other's K/V as far as their ranges reach.
at::Tensor decode_batch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_pool,
                        at::Tensor v_pool, const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& ranges,
                        double scale) {
  check_index(slots, "slots");
  TORCH_CHECK(ranges.is_contiguous() && ranges.dim() == 2 && ranges.size(0) == 2 && ranges.size(1) == q.size(0) &&
              slots.numel() == q.size(0) && k.size(0) == q.size(0) && v.size(0) == q.size(0),
              "decode_batch: ", q.size(0), " rows need ", q.size(0), " slots, K/V rows and [2, rows] ranges");
  check_index(ranges, "ranges");
  const int64_t* at_slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < q.size(0); ++i) {
    store_token(k, i, k_pool, at_slot[i * slots.stride(0)]);
    store_token(v, i, v_pool, at_slot[i * slots.stride(0)]);
  }
  at::Tensor out = at::empty({q.size(0), q.size(1), v_pool.size(3)}, q.options());
  const int64_t* starts = ranges.data_ptr<int64_t>();
  decode_rows(q, k_pool, v_pool, tables, starts, starts + q.size(0), scale, out, true);
  return out;
}

void paged_decode_into_meta(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& table, const at::Tensor& starts, const at::Tensor& ends, double scale,
                            at::Tensor out, bool split) {}

at::Tensor decode_one_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_pool,
                           at::Tensor v_pool, const at::Tensor& slot, const at::Tensor& blocks, const at::Tensor& span,
                           double scale) {
  return at::empty_symint({q.sym_size(0), q.sym_size(1), v_pool.sym_size(3)}, q.options());
}

at::Tensor decode_batch_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_pool,
                             at::Tensor v_pool, const at::Tensor& slots, const at::Tensor& tables,
                             const at::Tensor& ranges, double scale) {
  return at::empty_symint({q.sym_size(0), q.sym_size(1), v_pool.sym_size(3)}, q.options());
}

}  // namespace

TORCH_LIBRARY(kvserve_attn, m) {
  m.def("paged_decode_into(Tensor q, Tensor k_pool, Tensor v_pool, Tensor table, Tensor starts, Tensor ends, "
        "float scale, Tensor(a!) out, bool split=True) -> ()");
  m.def("decode_one(Tensor q, Tensor k, Tensor v, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slot, Tensor blocks, "
        "Tensor span, float scale) -> Tensor");
  m.def("decode_batch(Tensor q, Tensor k, Tensor v, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slots, "
        "Tensor tables, Tensor ranges, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_attn, CPU, m) {
  m.impl("paged_decode_into", paged_decode_into);
  m.impl("decode_one", decode_one);
  m.impl("decode_batch", decode_batch);
}

TORCH_LIBRARY_IMPL(kvserve_attn, Meta, m) {
  m.impl("paged_decode_into", paged_decode_into_meta);
  m.impl("decode_one", decode_one_meta);
  m.impl("decode_batch", decode_batch_meta);
}
