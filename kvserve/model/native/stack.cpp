// A decode step's whole decoder stack in one call: a Llama-family layer's RMSNorm, Q/K/V projection,
// rotary embedding, paged decode attention (writing the new K/V), output projection, residual, MLP
// norm, gate/up projection, SiLU product and down projection, layer after layer, with no Python and
// no dispatcher boxing between them. The projections and the attention are kvserve's own kernels
// (kvserve_cpu's GEMVs, kvserve_attn's decode ops), called through typed dispatcher handles; the
// element-wise work between them runs here on one thread (a few thousand values a row). Float32
// activations. Built at run time by kvserve/model/native/__init__.py and registered as the torch
// class kvserve_stack.Stack; the Python side describes each layer to it once, at construction.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>
#include "simd.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

namespace {

using kvserve::exp_nonpositive;
using kvserve::kLanes;
using kvserve::loadv;
using kvserve::vf;

using Tensor = at::Tensor;
using OptTensor = std::optional<Tensor>;

// The kinds of projection a layer may hold; names as the Python side passes them.
enum Kind : int64_t { kQ4g, kQ5g, kQ8g, kBf16, kF16, kFloat };

Kind kind_of(const std::string& name) {
  static const std::pair<const char*, Kind> kinds[] = {{"q4g", kQ4g}, {"q5g", kQ5g}, {"q8g", kQ8g},
                                                       {"bf16", kBf16}, {"f16", kF16}, {"float", kFloat}};
  for (const auto& [n, k] : kinds)
    if (name == n) return k;
  TORCH_CHECK(false, "native stack: no projection kind '", name, "'");
}

template <typename Fn>
c10::TypedOperatorHandle<Fn> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

using FourTensors = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&);
using Q8g = Tensor(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, int64_t);
using Half = Tensor(const Tensor&, const Tensor&, bool);
using Decode = Tensor(const Tensor&, const Tensor&, const Tensor&, Tensor, Tensor, const Tensor&, const Tensor&,
                      const Tensor&, double);   // as kvserve_attn registers them: the pools by value

// The ops, looked up once (their libraries are loaded before a Stack is built).
struct Ops {
  c10::TypedOperatorHandle<FourTensors> q4g = op<FourTensors>("kvserve_cpu::q4g_gemv");
  c10::TypedOperatorHandle<FourTensors> q5g = op<FourTensors>("kvserve_cpu::q5g_gemv");
  c10::TypedOperatorHandle<Q8g> q8g = op<Q8g>("kvserve_cpu::q8g_gemv");
  c10::TypedOperatorHandle<Half> bf16 = op<Half>("kvserve_cpu::bf16_gemv");
  c10::TypedOperatorHandle<Half> f16 = op<Half>("kvserve_cpu::f16_gemv");
  c10::TypedOperatorHandle<Decode> one = op<Decode>("kvserve_attn::decode_one");
  c10::TypedOperatorHandle<Decode> batch = op<Decode>("kvserve_attn::decode_batch");
};

// One projection: y [R, N] = x [R, K] W^T (+ bias), W in the tensors of its kind.
struct Linear {
  Kind kind;
  Tensor a, b;      // q4g: nibbles, scales; q5g: packed, scales; q8g: codes, scales; 16-bit / float: weight
  OptTensor c;      // q4g / q5g: mins [K/32, N]; q8g: mins_t or none
  int64_t group;    // q8g's group
  OptTensor bias;

  Tensor operator()(const Ops& ops, const Tensor& x) const {
    Tensor y;
    switch (kind) {
      case kQ4g: y = ops.q4g.call(x, a, b, *c); break;
      case kQ5g: y = ops.q5g.call(x, a, b, *c); break;
      case kQ8g: y = ops.q8g.call(x, a, b, c, group); break;
      case kBf16: y = ops.bf16.call(x.to(at::kBFloat16), a, false).to(at::kFloat); break;
      case kF16: y = ops.f16.call(x.to(at::kHalf), a, false).to(at::kFloat); break;
      case kFloat: y = at::linear(x, a); break;
    }
    if (bias) y.add_(*bias);
    return y;
  }
};

// A fused group's output pieces: one linear split by column sizes, or one linear a piece.
struct Projection {
  std::vector<Linear> parts;

  std::vector<Tensor> operator()(const Ops& ops, const Tensor& x, const std::vector<int64_t>& sizes) const {
    std::vector<Tensor> out;
    if (parts.size() == 1) {
      Tensor y = parts[0](ops, x);
      int64_t at = 0;
      for (int64_t n : sizes) {
        out.push_back(y.narrow(1, at, n));
        at += n;
      }
    } else {
      for (const Linear& l : parts) out.push_back(l(ops, x));
    }
    return out;
  }
};

struct Layer {
  Tensor in_norm, post_norm;      // [H] float32
  double eps, scale;
  int64_t k_pool, v_pool, group;  // the layer's pools among the stack's, its KV group
  Projection qkv, o, gate_up, down;
};

// y = x / sqrt(mean(x^2) + eps) * w, one row of n values.
void rms_norm_row(const float* x, const float* w, int64_t n, double eps, float* y) {
  vf acc = vf{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vf v = loadv(x + i);
    acc += v * v;
  }
  float sum = 0.f;
  for (int l = 0; l < kLanes; ++l) sum += acc[l];
  for (; i < n; ++i) sum += x[i] * x[i];
  const float r = 1.f / std::sqrt(sum / static_cast<float>(n) + static_cast<float>(eps));
  for (i = 0; i < n; ++i) y[i] = w[i] * (x[i] * r);
}

// h += a (when given), then y = rms_norm(h) with weight w; h, a, y [R, H], a possibly strided by row.
Tensor add_norm(Tensor& h, const Tensor* a, const Tensor& w, double eps) {
  const int64_t rows = h.size(0), n = h.size(1);
  Tensor y = at::empty_like(h);
  float* hp = h.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float* hr = hp + r * n;
    if (a != nullptr) {
      const float* ar = a->data_ptr<float>() + r * a->stride(0);
      for (int64_t i = 0; i < n; ++i) hr[i] += ar[i];
    }
    rms_norm_row(hr, w.data_ptr<float>(), n, eps, y.data_ptr<float>() + r * n);
  }
  return y;
}

// x [R, heads * d] (row stride any) rotated at positions [R] into a new [R, heads, d]: the half-split
// rotary embedding, out = x * cos[p] + rotate_half(x) * sin[p].
Tensor rope(const Tensor& x, int64_t heads, int64_t d, const Tensor& positions, const Tensor& cos,
            const Tensor& sin) {
  const int64_t rows = x.size(0), half = d / 2;
  Tensor out = at::empty({rows, heads, d}, x.options());
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t p = pos[r];
    TORCH_CHECK(p >= 0 && p < cos.size(0), "native stack: position ", p, " is beyond the rotary tables (",
                cos.size(0), ")");
    const float* c = cos.data_ptr<float>() + p * d;
    const float* s = sin.data_ptr<float>() + p * d;
    const float* xr = x.data_ptr<float>() + r * x.stride(0);
    float* o = out.data_ptr<float>() + r * heads * d;
    for (int64_t h = 0; h < heads; ++h) {
      const float* xh = xr + h * d;
      float* oh = o + h * d;
      for (int64_t i = 0; i < half; ++i) {
        oh[i] = xh[i] * c[i] - xh[i + half] * s[i];
        oh[i + half] = xh[i + half] * c[i + half] + xh[i] * s[i + half];
      }
    }
  }
  return out;
}

// silu(gate) * up, gate and up [R, n] (row strides any) -> [R, n].
Tensor silu_mul(const Tensor& gate, const Tensor& up) {
  const int64_t rows = gate.size(0), n = gate.size(1);
  Tensor out = at::empty({rows, n}, gate.options());
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate.data_ptr<float>() + r * gate.stride(0);
    const float* u = up.data_ptr<float>() + r * up.stride(0);
    float* o = out.data_ptr<float>() + r * n;
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      const vf x = loadv(g + i);
      const vf t = exp_nonpositive(x < 0 ? x : -x);   // exp(-|x|)
      const vf sig = x < 0 ? t / (1.f + t) : 1.f / (1.f + t);
      const vf y = x * sig * loadv(u + i);
      std::memcpy(o + i, &y, sizeof y);
    }
    for (; i < n; ++i) {
      const float t = exp_nonpositive(-std::fabs(g[i]));
      o[i] = g[i] * (g[i] < 0 ? t / (1.f + t) : 1.f / (1.f + t)) * u[i];
    }
  }
  return out;
}

void check_float(const Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(), "native stack: ", what,
              " must be a contiguous float32 CPU tensor");
}

struct Stack : torch::CustomClassHolder {
  int64_t heads, kv_heads, head_dim, hidden, intermediate;
  std::vector<Layer> layers;
  std::vector<Tensor> pools;
  Ops ops;

  Stack(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t hidden, int64_t intermediate,
        std::vector<Tensor> pools)
      : heads(heads), kv_heads(kv_heads), head_dim(head_dim), hidden(hidden), intermediate(intermediate),
        pools(std::move(pools)) {}

  void add_layer(Tensor in_norm, Tensor post_norm, double eps, double scale, int64_t k_pool, int64_t v_pool,
                 int64_t group) {
    check_float(in_norm, "a norm weight");
    check_float(post_norm, "a norm weight");
    TORCH_CHECK(in_norm.numel() == hidden && post_norm.numel() == hidden, "native stack: norm weights of ",
                in_norm.numel(), " values for a hidden size of ", hidden);
    TORCH_CHECK(k_pool >= 0 && k_pool < (int64_t)pools.size() && v_pool >= 0 && v_pool < (int64_t)pools.size(),
                "native stack: a pool index outside the stack's ", pools.size(), " pools");
    layers.push_back(Layer{in_norm, post_norm, eps, scale, k_pool, v_pool, group, {}, {}, {}, {}});
  }

  // A linear of the last layer's projection `which` (qkv, o, gate_up, down), in order.
  void add_linear(const std::string& which, const std::string& kind, Tensor a, Tensor b, OptTensor c,
                  int64_t group, OptTensor bias) {
    TORCH_CHECK(!layers.empty(), "native stack: add_layer comes before add_linear");
    Layer& l = layers.back();
    Projection* p = which == "qkv" ? &l.qkv : which == "o" ? &l.o : which == "gate_up" ? &l.gate_up
                    : which == "down" ? &l.down : nullptr;
    TORCH_CHECK(p != nullptr, "native stack: no projection '", which, "'");
    const Kind k = kind_of(kind);
    TORCH_CHECK((k != kQ4g && k != kQ5g) || c.has_value(), "native stack: a ", kind, " linear needs its mins");
    p->parts.push_back(Linear{k, a, b, c, group, bias});
  }

  // x [R, H] float32 (R decode rows) through every layer -> [R, H]; per KV group the rows' slots, and
  // what they read: one row its visible blocks [n] and span [2], more rows their tables [R, W] and
  // ranges [2, R] (kvserve_attn's decode_one / decode_batch).
  Tensor run(Tensor x, Tensor positions, Tensor cos, Tensor sin, std::vector<Tensor> slots,
             std::vector<Tensor> blocks, std::vector<Tensor> spans) {
    check_float(x, "x");
    check_float(cos, "cos");
    check_float(sin, "sin");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden, "native stack: x of shape ", x.sizes(), ", hidden size ",
                hidden);
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == x.size(0),
                "native stack: one int64 position a row");
    TORCH_CHECK(!layers.empty(), "native stack: no layers");
    const int64_t rows = x.size(0);
    const auto& decode = rows == 1 ? ops.one : ops.batch;
    const std::vector<int64_t> qkv_sizes{heads * head_dim, kv_heads * head_dim, kv_heads * head_dim};
    const std::vector<int64_t> mlp_sizes{intermediate, intermediate};
    Tensor h = x.clone();
    Tensor xn = add_norm(h, nullptr, layers[0].in_norm, layers[0].eps);
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& l = layers[i];
      TORCH_CHECK(l.group >= 0 && l.group < (int64_t)slots.size() && slots.size() == blocks.size() &&
                  slots.size() == spans.size(), "native stack: no slots, blocks and spans for KV group ", l.group);
      std::vector<Tensor> qkv = l.qkv(ops, xn, qkv_sizes);
      Tensor q = rope(qkv[0], heads, head_dim, positions, cos, sin);
      Tensor k = rope(qkv[1], kv_heads, head_dim, positions, cos, sin);
      Tensor v = qkv[2].view({rows, kv_heads, head_dim});
      Tensor o = decode.call(q, k, v, pools[l.k_pool], pools[l.v_pool], slots[l.group], blocks[l.group],
                             spans[l.group], l.scale);
      Tensor attn = l.o(ops, o.view({rows, heads * head_dim}), {hidden})[0];
      xn = add_norm(h, &attn, l.post_norm, l.eps);
      std::vector<Tensor> gu = l.gate_up(ops, xn, mlp_sizes);
      Tensor down = l.down(ops, silu_mul(gu[0], gu[1]), {hidden})[0];
      if (i + 1 < layers.size()) {
        xn = add_norm(h, &down, layers[i + 1].in_norm, layers[i + 1].eps);
      } else {
        h.add_(down);
      }
    }
    return h;
  }
};

}  // namespace

TORCH_LIBRARY(kvserve_stack, m) {
  m.class_<Stack>("Stack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, std::vector<Tensor>>())
      .def("add_layer", &Stack::add_layer)
      .def("add_linear", &Stack::add_linear)
      .def("run", &Stack::run);
}
