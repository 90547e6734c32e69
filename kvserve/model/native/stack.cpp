// A decode step's whole decoder stack in one call: a layer's RMSNorm, Q/K/V projection (and per-head
// q/k norms), rotary embedding, paged decode attention (writing the new K/V), output projection
// (and its norm), residual, MLP norm, gate/up projection, SiLU or tanh-GELU product, down projection
// (and its norm), layer after layer, with no Python and no dispatcher boxing between them: Llama,
// Qwen3 and Gemma 3 layers (a norm's weight is passed as the factor it applies: Gemma's 1 + w). The projections and the attention are kvserve's own kernels
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

template <typename Fn>
c10::TypedOperatorHandle<Fn> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

using Tiled = Tensor(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, int64_t);
using Q8g = Tensor(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, int64_t, int64_t);
using Half = Tensor(const Tensor&, const Tensor&, bool);
using Decode = Tensor(const Tensor&, const Tensor&, const Tensor&, Tensor, Tensor, const Tensor&, const Tensor&,
                      const Tensor&, double);   // as kvserve_attn registers them: the pools by value

// The ops, looked up once (their libraries are loaded before a Stack is built).
struct Ops {
  c10::TypedOperatorHandle<Tiled> q4g = op<Tiled>("kvserve_cpu::q4g_gemv");
  c10::TypedOperatorHandle<Tiled> q5g = op<Tiled>("kvserve_cpu::q5g_gemv");
  c10::TypedOperatorHandle<Q8g> q8g = op<Q8g>("kvserve_cpu::q8g_gemv");
  c10::TypedOperatorHandle<Half> bf16 = op<Half>("kvserve_cpu::bf16_gemv");
  c10::TypedOperatorHandle<Half> f16 = op<Half>("kvserve_cpu::f16_gemv");
  c10::TypedOperatorHandle<Decode> one = op<Decode>("kvserve_attn::decode_one");
  c10::TypedOperatorHandle<Decode> batch = op<Decode>("kvserve_attn::decode_batch");
};

struct Linear;
using Kernel = Tensor (*)(const Ops&, const Linear&, const Tensor&);

// One projection: y [R, N] = x [R, K] W^T (+ bias), W in the tensors of its kind, run by the kernel
// its kind names (picked once, in add_linear).
struct Linear {
  Kernel kernel;
  Tensor a, b;      // q4g / q5g / q8g: tiles, tile scales; 16-bit / float: weight
  OptTensor c;      // q4g / q5g / q8g: mins [K/group, N], or none (q4g / q5g: Q4_0's, Q5_0's centred codes)
  int64_t group;    // q8g's group
  int64_t n;        // output channels (the tiles' last one may be padded)
  OptTensor bias;

  Tensor operator()(const Ops& ops, const Tensor& x) const {
    Tensor y = kernel(ops, *this, x);
    if (bias) y.add_(*bias);
    return y;
  }
};

Tensor q4g(const Ops& ops, const Linear& l, const Tensor& x) { return ops.q4g.call(x, l.a, l.b, l.c, l.n); }
Tensor q5g(const Ops& ops, const Linear& l, const Tensor& x) { return ops.q5g.call(x, l.a, l.b, l.c, l.n); }
Tensor q8g(const Ops& ops, const Linear& l, const Tensor& x) { return ops.q8g.call(x, l.a, l.b, l.c, l.group, l.n); }
Tensor bf16(const Ops& ops, const Linear& l, const Tensor& x) {
  return ops.bf16.call(x.to(at::kBFloat16), l.a, false).to(at::kFloat);
}
Tensor f16(const Ops& ops, const Linear& l, const Tensor& x) {
  return ops.f16.call(x.to(at::kHalf), l.a, false).to(at::kFloat);
}
Tensor float32(const Ops&, const Linear& l, const Tensor& x) { return at::linear(x, l.a); }

// The kernel of each projection kind, by the name the Python side passes.
Kernel kernel_of(const std::string& name) {
  static const struct { const char* name; Kernel kernel; } kinds[] = {
      {"q4g", &q4g}, {"q5g", &q5g}, {"q8g", &q8g}, {"bf16", &bf16}, {"f16", &f16}, {"float", &float32}};
  for (const auto& k : kinds)
    if (name == k.name) return k.kernel;
  TORCH_CHECK(false, "native stack: no projection kind '", name, "'");
}

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
  Tensor in_norm, mlp_norm;         // [H] float32: before attention, before the MLP
  OptTensor attn_out_norm, mlp_out_norm;   // Gemma's sandwich norms: on o_proj's and down's outputs
  OptTensor q_norm, k_norm;         // [head_dim]: per-head norms of Q and K before the rotation
  double eps, scale;
  int64_t k_pool, v_pool, group, rope;   // the layer's pools among the stack's, its KV group, its rotary tables
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

// rms_norm of each row of x [R, n] (row stride any) with weight w -> a new [R, n].
Tensor norm_rows(const Tensor& x, const Tensor& w, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  Tensor y = at::empty({rows, n}, x.options());
  for (int64_t r = 0; r < rows; ++r)
    rms_norm_row(x.data_ptr<float>() + r * x.stride(0), w.data_ptr<float>(), n, eps, y.data_ptr<float>() + r * n);
  return y;
}

// rms_norm of each head of x [R, heads * d] (row stride any) with weight w [d] -> a new [R, heads * d].
Tensor norm_heads(const Tensor& x, int64_t heads, int64_t d, const Tensor& w, double eps) {
  const int64_t rows = x.size(0);
  Tensor y = at::empty({rows, heads * d}, x.options());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h)
      rms_norm_row(x.data_ptr<float>() + r * x.stride(0) + h * d, w.data_ptr<float>(), d, eps,
                   y.data_ptr<float>() + (r * heads + h) * d);
  return y;
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

// The gate's activation: SiLU (Llama) or GELU with the tanh approximation (Gemma).
enum Activation : int64_t { kSilu, kGeluTanh };

inline vf silu(vf x) {
  const vf t = exp_nonpositive(x < 0 ? x : -x);   // exp(-|x|)
  return x * (x < 0 ? t / (1.f + t) : 1.f / (1.f + t));
}

inline vf gelu_tanh(vf x) {   // 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3)
  const vf u = 0.7978845608f * (x + 0.044715f * x * x * x);
  const vf t = exp_nonpositive(u < 0 ? 2.f * u : -2.f * u);   // exp(-2 |u|)
  const vf th = (1.f - t) / (1.f + t);                          // tanh(|u|)
  return 0.5f * x * (1.f + (u < 0 ? -th : th));
}

template <Activation A>
inline vf activate(vf x) {
  if constexpr (A == kSilu) return silu(x);
  else return gelu_tanh(x);
}

template <Activation A>
inline float activate(float x) {
  vf v = vf{} + x;
  return activate<A>(v)[0];
}

// act(gate) * up, gate and up [R, n] (row strides any) -> [R, n].
template <Activation A>
Tensor act_mul(const Tensor& gate, const Tensor& up) {
  const int64_t rows = gate.size(0), n = gate.size(1);
  Tensor out = at::empty({rows, n}, gate.options());
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate.data_ptr<float>() + r * gate.stride(0);
    const float* u = up.data_ptr<float>() + r * up.stride(0);
    float* o = out.data_ptr<float>() + r * n;
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      const vf y = activate<A>(loadv(g + i)) * loadv(u + i);
      std::memcpy(o + i, &y, sizeof y);
    }
    for (; i < n; ++i) o[i] = activate<A>(g[i]) * u[i];
  }
  return out;
}

void check_float(const Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(), "native stack: ", what,
              " must be a contiguous float32 CPU tensor");
}

void check_norm(const OptTensor& w, int64_t n) {
  if (!w) return;
  check_float(*w, "a norm weight");
  TORCH_CHECK(w->numel() == n, "native stack: a norm weight of ", w->numel(), " values where ", n, " are normed");
}

struct Stack : torch::CustomClassHolder {
  int64_t heads, kv_heads, head_dim, hidden, intermediate;
  Tensor (*act_mul_fn)(const Tensor&, const Tensor&);   // the activation's product, chosen once
  std::vector<Layer> layers;
  std::vector<Tensor> pools;
  Ops ops;

  Stack(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t hidden, int64_t intermediate,
        const std::string& activation, std::vector<Tensor> pools)
      : heads(heads), kv_heads(kv_heads), head_dim(head_dim), hidden(hidden), intermediate(intermediate),
        pools(std::move(pools)) {
    TORCH_CHECK(activation == "silu" || activation == "gelu_tanh", "native stack: no activation '", activation,
                "' (silu, gelu_tanh)");
    act_mul_fn = activation == "silu" ? &act_mul<kSilu> : &act_mul<kGeluTanh>;
  }

  // A layer: its norms' weights (as the factors they apply), epsilon, attention scale, K and V pool
  // indices among the stack's, KV group and rotary tables' index.
  void add_layer(Tensor in_norm, Tensor mlp_norm, OptTensor attn_out_norm, OptTensor mlp_out_norm,
                 OptTensor q_norm, OptTensor k_norm, double eps, double scale, int64_t k_pool, int64_t v_pool,
                 int64_t group, int64_t rope) {
    for (const OptTensor& w : {OptTensor(in_norm), OptTensor(mlp_norm), attn_out_norm, mlp_out_norm})
      check_norm(w, hidden);
    check_norm(q_norm, head_dim);
    check_norm(k_norm, head_dim);
    TORCH_CHECK(k_pool >= 0 && k_pool < (int64_t)pools.size() && v_pool >= 0 && v_pool < (int64_t)pools.size(),
                "native stack: a pool index outside the stack's ", pools.size(), " pools");
    layers.push_back(Layer{in_norm, mlp_norm, attn_out_norm, mlp_out_norm, q_norm, k_norm, eps, scale, k_pool,
                           v_pool, group, rope, {}, {}, {}, {}});
  }

  // A linear of the last layer's projection `which` (qkv, o, gate_up, down), in order.
  void add_linear(const std::string& which, const std::string& kind, Tensor a, Tensor b, OptTensor c,
                  int64_t group, int64_t n, OptTensor bias) {
    TORCH_CHECK(!layers.empty(), "native stack: add_layer comes before add_linear");
    Layer& l = layers.back();
    Projection* p = which == "qkv" ? &l.qkv : which == "o" ? &l.o : which == "gate_up" ? &l.gate_up
                    : which == "down" ? &l.down : nullptr;
    TORCH_CHECK(p != nullptr, "native stack: no projection '", which, "'");
    p->parts.push_back(Linear{kernel_of(kind), a, b, c, group, n, bias});
  }

  // x [R, H] float32 (R decode rows) through every layer -> [R, H]; the rotary tables (cos[i], sin[i]
  // [positions, head_dim] the layers' `rope` index); per KV group the rows' slots, and what they
  // read: one row its visible blocks [n] and span [2], more rows their tables [R, W] and ranges
  // [2, R] (kvserve_attn's decode_one / decode_batch).
  Tensor run(Tensor x, Tensor positions, std::vector<Tensor> cos, std::vector<Tensor> sin, std::vector<Tensor> slots,
             std::vector<Tensor> blocks, std::vector<Tensor> spans) {
    check_float(x, "x");
    TORCH_CHECK(cos.size() == sin.size(), "native stack: as many cos as sin tables");
    for (size_t i = 0; i < cos.size(); ++i) {
      check_float(cos[i], "cos");
      check_float(sin[i], "sin");
    }
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
      TORCH_CHECK(l.rope >= 0 && l.rope < (int64_t)cos.size(), "native stack: no rotary tables ", l.rope);
      std::vector<Tensor> qkv = l.qkv(ops, xn, qkv_sizes);
      const Tensor qs = l.q_norm ? norm_heads(qkv[0], heads, head_dim, *l.q_norm, l.eps) : qkv[0];
      const Tensor ks = l.k_norm ? norm_heads(qkv[1], kv_heads, head_dim, *l.k_norm, l.eps) : qkv[1];
      Tensor q = rope(qs, heads, head_dim, positions, cos[l.rope], sin[l.rope]);
      Tensor k = rope(ks, kv_heads, head_dim, positions, cos[l.rope], sin[l.rope]);
      Tensor v = qkv[2].view({rows, kv_heads, head_dim});
      Tensor o = decode.call(q, k, v, pools[l.k_pool], pools[l.v_pool], slots[l.group], blocks[l.group],
                             spans[l.group], l.scale);
      Tensor attn = l.o(ops, o.view({rows, heads * head_dim}), {hidden})[0];
      if (l.attn_out_norm) attn = norm_rows(attn, *l.attn_out_norm, l.eps);
      xn = add_norm(h, &attn, l.mlp_norm, l.eps);
      std::vector<Tensor> gu = l.gate_up(ops, xn, mlp_sizes);
      Tensor down = l.down(ops, act_mul_fn(gu[0], gu[1]), {hidden})[0];
      if (l.mlp_out_norm) down = norm_rows(down, *l.mlp_out_norm, l.eps);
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
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, std::string, std::vector<Tensor>>())
      .def("add_layer", &Stack::add_layer)
      .def("add_linear", &Stack::add_linear)
      .def("run", &Stack::run);
}
