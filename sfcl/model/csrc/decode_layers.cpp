// The decoder layers of one decode-only engine step in one call (torch.ops.sfcl.decode_layers), CPU.
//
// What sfcl.model.llama.LlamaModel.forward_step computes for B decode rows between the embedding
// and the final norm, layer by layer: RMSNorm, the fused q/k/v projection, rotary embedding,
// decode attention over the KV cache (sfcl::decode_attention, which also writes the new K/V),
// the output projection and residual, RMSNorm, the fused gate/up projection, SiLU(gate) * up,
// the down projection and residual. The projections are torch's own kernels called from C++
// (the packed int4 / int8 GEMVs of sfcl.model.quant.QuantLinear, or at::linear for a dense
// weight); the element-wise steps between them are single loops here, rounding to the model
// dtype after each operation exactly where the torch operators do (bf16: x * cos, swapped * sin
// and their sum are each rounded; the library is built with -ffp-contract=off, so no product is
// fused into an add). The Python forward runs the same loops (elementwise.h, through
// torch.ops.sfcl.rms_norm / silu_mul / rope_ wherever sfcl.model.llama.native_rows allows), so the
// two agree bit for bit, also where the packed kernels round activations to bf16 and a last-bit
// difference would otherwise flip a rounding and grow through the layers; against torch's own
// operators (the Python forward without SFCL's kernels, or under torch.compile) a step differs by
// the order of RMSNorm's float32 sum and the exp in SiLU. Until the twenty-seventh session a
// float32 model took RMSNorm and SiLU * up from torch's operators here, as its Python forward did.
//
// Why: at one stream a step of SmolLM2-135M is ~2,000 small torch operators called from Python
// (~68 per layer), which cost about as much as the weights' GEMVs themselves
// (docs/performance-journal.md); here a layer is five kernel calls and a few loops.
//
// Scope (checked by sfcl/model/decode_stack.py before calling): Llama-family blocks without
// per-head q/k norms, head_dim 64 or 128, a KV cache decode_attention takes, rows in consecutive
// cache rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "elementwise.h"
#include "sfcl_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

using namespace sfcl::ew;  // rms_norm, add_, rope_, silu_mul (elementwise.h)

// Weight layouts of one projection (sfcl.model.decode_stack.KIND_*).
constexpr int64_t kDense = 0, kInt8 = 1, kInt4 = 2, kInt4Q8 = 3, kInt8Q8 = 4;
constexpr int64_t kInt4Group = 32;  // sfcl.model.quant.INT4_GROUP

// y (B, N) = x (B, K) W^T (+ bias), as sfcl.model.quant.QuantLinear.forward computes it for the path
// given by kind: the packed kernels take bf16 activations (cast in and out), dense is at::linear;
// int8 is SFCL's int8_linear (int8_linear.cpp), which QuantLinear runs too once this library is loaded;
// int4 x int8 (kInt4Q8) is SFCL's int4_linear (int4_linear.cpp), on x as it is (QuantLinear.kernel "sfcl"),
// int8 x int8 (kInt8Q8) SFCL's int8_q8_linear (int8_linear.cpp), on x as it is (QuantLinear.kernel "q8").
// A dense weight packed by oneDNN (sfcl.model.quant.pack_dense_weights: an mkldnn tensor) is multiplied
// by torch's mkldnn::_linear_pointwise, as QuantLinear.forward does, through the dispatcher (a boxed
// call: the operator is registered by torch's oneDNN bindings, with no C++ header of its own).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack;
  stack.emplace_back(x.is_contiguous() ? x : x.contiguous());
  stack.emplace_back(w);
  stack.emplace_back(bias.has_value() && bias->defined() ? c10::IValue(*bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<c10::optional<at::Scalar>>());
  stack.emplace_back(c10::IValue());  // algorithm: none
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

at::Tensor project(const at::Tensor& x, int64_t kind, const at::Tensor& w, const at::Tensor& s,
                   const c10::optional<at::Tensor>& bias) {
  if (kind == kDense) return w.is_mkldnn() ? packed_linear(x, w, bias) : at::linear(x, w, bias);
  at::Tensor y;
  if (kind == kInt4Q8) {
    y = sfcl::int4_linear(x.is_contiguous() ? x : x.contiguous(), w, s);
  } else if (kind == kInt8Q8) {
    y = sfcl::int8_q8_linear(x.is_contiguous() ? x : x.contiguous(), w, s);
  } else {
    at::Tensor xk = x.scalar_type() == at::kBFloat16 ? x : x.to(at::kBFloat16);
    y = kind == kInt8 ? sfcl::int8_linear(xk, w, s) : at::_weight_int4pack_mm_for_cpu(xk, w, kInt4Group, s);
  }
  if (y.scalar_type() != x.scalar_type()) y = y.to(x.scalar_type());
  if (bias.has_value() && bias->defined()) y = y + *bias;
  return y;
}

// RMSNorm(h) * w (B, H) written into xn, as sfcl.model.llama.RMSNorm computes it for T (see the header).
template <typename T>
at::Tensor normed(const at::Tensor& h, const at::Tensor& w, at::Tensor& xn, float eps) {
  rms_norm<T>(h.data_ptr<T>(), w.data_ptr<T>(), xn.data_ptr<T>(), h.size(0), h.size(1), eps);
  return xn;
}

// act (B, I) <- SiLU(gu[:, :I]) * gu[:, I:] (F.silu(gate) * up, rounded to T after each operation).
template <typename T>
at::Tensor silu_times_up(const at::Tensor& gu, int64_t I) {
  at::Tensor act = at::empty({gu.size(0), I}, gu.options());
  silu_mul<T>(gu.data_ptr<T>(), act.data_ptr<T>(), gu.size(0), I);
  return act;
}

// Checks that a projection's output is (B, N) before a loop reads B * N of it.
inline void check_width(const at::Tensor& y, int64_t B, int64_t N, int64_t layer, const char* what) {
  TORCH_CHECK(y.dim() == 2 && y.size(0) == B && y.size(1) == N, "layer ", layer, ": ", what, " gives ", y.sizes(),
              ", not (", B, ", ", N, ")");
}

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> run_layers(
    const at::Tensor& h_in, const at::Tensor& cos, const at::Tensor& sin, at::TensorList norms,
    at::TensorList weights, at::TensorList scales, const c10::List<c10::optional<at::Tensor>>& biases,
    at::IntArrayRef kinds, at::TensorList k_cache, at::TensorList v_cache, const at::Tensor& pos, int64_t row0,
    int64_t S, double scale, double eps, int64_t n_heads, int64_t tap_layer, bool want_probs) {
  const int64_t L = static_cast<int64_t>(k_cache.size());
  const int64_t B = h_in.size(0), H = h_in.size(1);
  const int64_t nkv = k_cache[0].size(1), hd = k_cache[0].size(3);
  const int64_t W = (n_heads + 2 * nkv) * hd;
  at::Tensor h = h_in.clone();  // (B, H) residual stream, updated in place
  at::Tensor xn = at::empty_like(h);
  at::Tensor tap_hidden = at::empty({0}, h.options()), tap_probs = at::empty({0}, h.options().dtype(at::kFloat));
  T* hp = h.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const float e = static_cast<float>(eps);
  for (int64_t l = 0; l < L; ++l) {
    const int64_t p = 4 * l;
    // attention
    at::Tensor x = normed<T>(h, norms[2 * l], xn, e);
    at::Tensor qkv = project(x, kinds[p], weights[p], scales[p], biases.get(p)).contiguous();  // (B, W)
    check_width(qkv, B, W, l, "the q/k/v projection");
    rope_<T>(qkv.data_ptr<T>(), B, W, n_heads + nkv, hd, cp, sp);
    at::Tensor q = qkv.narrow(1, 0, n_heads * hd).view({B, n_heads, hd});
    at::Tensor kn = qkv.narrow(1, n_heads * hd, nkv * hd).view({B, nkv, hd});
    at::Tensor vn = qkv.narrow(1, (n_heads + nkv) * hd, nkv * hd).view({B, nkv, hd});
    const bool probs_here = want_probs && l == tap_layer;
    auto [o, pr] = sfcl::decode_attention(q, k_cache[l], v_cache[l], kn, vn, pos, row0, S, scale, probs_here);
    at::Tensor a = project(o, kinds[p + 1], weights[p + 1], scales[p + 1], biases.get(p + 1)).contiguous();  // (B, H)
    check_width(a, B, H, l, "the output projection");
    add_<T>(hp, a.data_ptr<T>(), B * H);
    // MLP
    x = normed<T>(h, norms[2 * l + 1], xn, e);
    at::Tensor gu = project(x, kinds[p + 2], weights[p + 2], scales[p + 2], biases.get(p + 2)).contiguous();  // (B, 2 I)
    TORCH_CHECK(gu.dim() == 2 && gu.size(0) == B && gu.size(1) % 2 == 0 && gu.size(1) > 0, "layer ", l,
                ": the gate/up projection gives ", gu.sizes(), ", not (", B, ", 2 x intermediate)");
    const int64_t I = gu.size(1) / 2;
    at::Tensor act = silu_times_up<T>(gu, I);  // (B, I)
    at::Tensor d = project(act, kinds[p + 3], weights[p + 3], scales[p + 3], biases.get(p + 3)).contiguous();  // (B, H)
    check_width(d, B, H, l, "the down projection");
    add_<T>(hp, d.data_ptr<T>(), B * H);
    if (l == tap_layer) {
      tap_hidden = h.clone();
      if (probs_here) tap_probs = pr;
    }
  }
  return {h, tap_hidden, tap_probs};
}

}  // namespace

namespace sfcl {

std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, at::TensorList norms, at::TensorList weights,
    at::TensorList scales, const c10::List<c10::optional<at::Tensor>>& biases, at::IntArrayRef kinds,
    at::TensorList k_cache, at::TensorList v_cache, const at::Tensor& pos, int64_t row0, int64_t S, double scale,
    double eps, int64_t n_heads, int64_t tap_layer, bool want_probs) {
  const int64_t L = static_cast<int64_t>(k_cache.size());
  TORCH_CHECK(L > 0 && v_cache.size() == k_cache.size(), "k_cache, v_cache: one tensor per layer, as many of each");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * L, "norms: 2 per layer (input, post-attention)");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 4 * L && static_cast<int64_t>(scales.size()) == 4 * L &&
                  static_cast<int64_t>(biases.size()) == 4 * L && static_cast<int64_t>(kinds.size()) == 4 * L,
              "weights, scales, biases, kinds: 4 per layer (qkv, o, gate_up, down)");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "h: contiguous (B, hidden)");
  for (int64_t l = 0; l < L; ++l)
    TORCH_CHECK(k_cache[l].dim() == 4 && v_cache[l].dim() == 4 && k_cache[l].sizes() == k_cache[0].sizes() &&
                    v_cache[l].sizes() == k_cache[0].sizes() && k_cache[l].is_contiguous() && v_cache[l].is_contiguous() &&
                    k_cache[l].scalar_type() == h.scalar_type() && v_cache[l].scalar_type() == h.scalar_type(),
                "k_cache, v_cache: one contiguous (rows, nkv, max_len, head_dim) tensor per layer, all of one shape, in h's dtype");
  const int64_t B = h.size(0), H = h.size(1), hd = k_cache[0].size(3);
  TORCH_CHECK(B > 0, "no rows");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == B && cos.size(1) == hd && cos.is_contiguous() && sin.sizes() == cos.sizes() &&
                  sin.is_contiguous() && cos.scalar_type() == h.scalar_type() && sin.scalar_type() == h.scalar_type(),
              "cos, sin: contiguous (B, head_dim) in h's dtype");
  TORCH_CHECK(hd % 2 == 0, "head_dim must be even");
  for (int64_t i = 0; i < 2 * L; ++i)
    TORCH_CHECK(norms[i].dim() == 1 && norms[i].size(0) == H && norms[i].is_contiguous() &&
                    norms[i].scalar_type() == h.scalar_type(), "norm weights: contiguous (hidden,) in h's dtype");
  for (int64_t i = 0; i < 4 * L; ++i)
    TORCH_CHECK(kinds[i] == kDense || kinds[i] == kInt8 || kinds[i] == kInt4 || kinds[i] == kInt4Q8 || kinds[i] == kInt8Q8,
                "kinds: 0 dense, 1 int8, 2 int4, 3 int4 x int8, 4 int8 x int8");
  TORCH_CHECK(tap_layer >= 0 && tap_layer < L, "tap_layer must lie in [0, layers)");
  TORCH_CHECK(eps > 0.0 && std::isfinite(eps), "eps must be a positive finite number");
  TORCH_CHECK(n_heads > 0 && k_cache[0].size(1) > 0 && n_heads % k_cache[0].size(1) == 0,
              "n_heads must be a positive multiple of the cache's KV heads");
  switch (h.scalar_type()) {
    case at::kBFloat16:
      return run_layers<c10::BFloat16>(h, cos, sin, norms, weights, scales, biases, kinds, k_cache, v_cache, pos, row0, S,
                                       scale, eps, n_heads, tap_layer, want_probs);
    case at::kFloat:
      return run_layers<float>(h, cos, sin, norms, weights, scales, biases, kinds, k_cache, v_cache, pos, row0, S, scale,
                               eps, n_heads, tap_layer, want_probs);
    case at::kHalf:
      return run_layers<c10::Half>(h, cos, sin, norms, weights, scales, biases, kinds, k_cache, v_cache, pos, row0, S,
                                   scale, eps, n_heads, tap_layer, want_probs);
    default:
      TORCH_CHECK(false, "dtype must be bfloat16, float16 or float32");
  }
}

}  // namespace sfcl

TORCH_LIBRARY_FRAGMENT(sfcl, m) {
  m.def("decode_layers(Tensor h, Tensor cos, Tensor sin, Tensor[] norms, Tensor[] weights, Tensor[] scales, "
        "Tensor?[] biases, int[] kinds, Tensor(a!)[] k_cache, Tensor(b!)[] v_cache, Tensor pos, int row0, int S, "
        "float scale, float eps, int n_heads, int tap_layer, bool want_probs) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(sfcl, CPU, m) { m.impl("decode_layers", &sfcl::decode_layers); }
// weights packed by oneDNN (sfcl.model.quant.pack_dense_weights) are MkldnnCPU tensors, which route the
// call to that dispatch key
TORCH_LIBRARY_IMPL(sfcl, MkldnnCPU, m) { m.impl("decode_layers", &sfcl::decode_layers); }
