// One pass over each row of a step's float32 logits [R, V] (rows may be strided, values contiguous):
// the row's maximum (NaN where the row holds a NaN), the index of its first maximum, log(sum(exp))
// and the maximum's log-prob (the greedy token's: -log(sum(exp(x - max))), as log_softmax gives it),
// as float64 [R, 4]. The sampler takes them where it took amax, argmax and logsumexp, three passes
// over a vocabulary's logits fresh from the LM head (docs/KERNELS.md). A chunk of the row is read
// once from memory (its maximum), then again from L1 (its exponentials, against the running
// maximum); each row's sums run in one order whatever the rows or threads. Built at run time by
// kvserve/engine/cpu/__init__.py and registered as the torch op kvserve_rows::row_stats.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include "simd.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace {

using kvserve::exp_nonpositive;
using kvserve::kLanes;
using kvserve::loadv;
using kvserve::vf;
using kvserve::vi;

constexpr int64_t kChunk = 2048;   // values a chunk (8 KiB: its second read comes from L1)

struct Peak {
  float value;
  int64_t index;
  bool nan;
};

// The largest value of x[begin, end) and its first index (-inf and `begin` where every value is
// -inf); NaNs are left out and flagged.
Peak chunk_peak(const float* x, int64_t begin, int64_t end) {
  vf best = vf{} - INFINITY;
  vi where = vi{}, index, nan = vi{};
  for (int i = 0; i < kLanes; ++i) index[i] = static_cast<int32_t>(begin + i);
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    const vf v = loadv(x + i);
    const vi above = v > best;
    best = above ? v : best;
    where = above ? index : where;
    nan |= v != v;
    index += kLanes;
  }
  Peak p{-INFINITY, begin, false};
  for (int l = 0; l < kLanes; ++l) {   // lanes hold increasing indices: ties go to the smallest
    p.nan |= nan[l] != 0;
    if (best[l] > p.value || (best[l] == p.value && where[l] < p.index && best[l] > -INFINITY)) {
      p.value = best[l];
      p.index = where[l];
    }
  }
  for (; i < end; ++i) {   // the tail: later indices than every lane's
    p.nan |= x[i] != x[i];
    if (x[i] > p.value) {
      p.value = x[i];
      p.index = i;
    }
  }
  return p;
}

// sum(exp(x - peak)) over x[begin, end), peak >= every value and finite.
float chunk_exp_sum(const float* x, int64_t begin, int64_t end, float peak) {
  vf acc = vf{};
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) acc += exp_nonpositive(loadv(x + i) - peak);
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += acc[l];
  for (; i < end; ++i) sum += exp_nonpositive(x[i] - peak);
  return sum;
}

void one_row(const float* x, int64_t v, double* out) {
  float peak = -INFINITY, total = 0.0f;
  int64_t index = 0;
  bool nan = false;
  for (int64_t begin = 0; begin < v; begin += kChunk) {
    const int64_t end = std::min(v, begin + kChunk);
    const Peak p = chunk_peak(x, begin, end);
    nan |= p.nan;
    if (p.value > peak) {
      if (std::isfinite(p.value)) total *= exp_nonpositive(peak - p.value);   // 0 while peak is -inf
      peak = p.value;
      index = p.index;
    }
    if (std::isfinite(peak)) total += chunk_exp_sum(x, begin, end, peak);
  }
  // a row that is NaN, +inf or all -inf: its log-sum-exp is that value, as torch.logsumexp's
  const float top = nan ? std::numeric_limits<float>::quiet_NaN() : peak;
  const float lse = std::isfinite(top) ? peak + std::log(total) : top;
  out[0] = top;
  out[1] = static_cast<double>(index);
  out[2] = lse;
  out[3] = std::isfinite(top) ? -std::log(total) : top - lse;   // = top - lse, without its cancellation
}

at::Tensor row_stats(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.stride(1) == 1 && logits.size(1) > 0,
              "row_stats: float32 CPU logits [R, V > 0] with contiguous rows expected, got ",
              logits.scalar_type(), " ", logits.sizes(), " strides ", logits.strides());
  const int64_t rows = logits.size(0), v = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({rows, 4}, logits.options().dtype(at::kDouble));
  const float* x = logits.data_ptr<float>();
  double* o = out.data_ptr<double>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) one_row(x + r * stride, v, o + 4 * r);
  });
  return out;
}

at::Tensor row_stats_meta(const at::Tensor& logits) {
  return at::empty_symint({logits.sym_size(0), 4}, logits.options().dtype(at::kDouble));
}

}  // namespace

TORCH_LIBRARY(kvserve_rows, m) {
  m.def("row_stats(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_rows, CPU, m) {
  m.impl("row_stats", row_stats);
}

TORCH_LIBRARY_IMPL(kvserve_rows, Meta, m) {
  m.impl("row_stats", row_stats_meta);
}
