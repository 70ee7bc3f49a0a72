// torch.ops.sfcl.causal_softmax_entropy_: the snapshot layer's attention weights and their entropy
// over a whole window, for the anchor builder's model pass (sfcl.anchors.model_pass._snapshot_attention).
//
//   s (R, T, T): raw scores q . k of R heads' T queries against the same T positions (query i sits
//   at position i, a window from position 0). In place, row i of each head becomes
//       p[i, j] = exp(scale s[i, j] - m_i) / Z_i   for j <= i,   0 for j > i   (causal softmax)
//   rounded to s's dtype (the weights the values are then multiplied by), and the operator returns
//       ent (R, T) float32 = -sum_j p[i, j] log p[i, j] = log Z_i - sum_j p[i, j] (scale s[i, j] - m_i)
//   in nats, from the float32 weights before rounding; sfcl.snapshot.triggers.dispersion_from_entropy
//   turns their head mean into the dispersion (the rule attention_dispersion serves with).
//
// Why: the pass needs the snapshot layer's attention weights for the dispersion trigger's statistics,
// so that layer cannot use fused scaled-dot-product attention. In torch the weights took a float32
// copy of the (heads, T, T) scores, a causal mask, softmax, a rounded copy, then clamp, log, multiply
// and sum for the entropy: 27 ms per 1,024-token window against 4.5 ms with this operator (bf16, 2
// threads of the Intel Xeon with AMX, python scripts/profile_model_pass.py --ops, 2026-12-05), ~16% of
// a whole pass in a profile over 12 NDAs, for one layer of 30. Here each row is read once and written
// once while it sits in L1, the exponentials kept in a float32 row buffer per thread.
//
// Arithmetic: float32; exp is sfcl::exp_nonpositive (~1 ulp) of scale s - max; sums in vector lanes.
// torch's softmax sums in another order, so weights and entropies agree to float32 rounding. A row
// with NaN gives NaN weights and entropy; an all -inf row (impossible from finite q, k) likewise. A
// weight of 0 (a score of -inf, or more than 87 below the row's max: sfcl::kExpMin) adds 0 to the
// entropy, as p log p -> 0.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "elementwise.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace sfcl {
namespace {

// Row i (i + 1 attended positions) of one head's (T, T) scores, in place; returns its entropy (nats).
template <typename T>
float causal_row(T* row, int64_t n, int64_t width, float scale, float* buf) {
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, scale * ew::to_f(row[j]));
  float z = 0.0f, a = 0.0f;
#pragma omp simd reduction(+ : z, a)
  for (int64_t j = 0; j < n; ++j) {
    const float x = scale * ew::to_f(row[j]) - mx;  // <= 0
    const float e = sfcl::exp_nonpositive(x);
    buf[j] = e;
    z += e;
    a += e == 0.0f ? 0.0f : e * x;  // p log p -> 0 as p -> 0: a -inf score adds nothing (0 x -inf was NaN)
  }
  const float inv = 1.0f / z;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) row[j] = ew::from_f<T>(buf[j] * inv);
  std::fill(row + n, row + width, ew::from_f<T>(0.0f));
  return std::log(z) - a * inv;
}

}  // namespace

// s (R, T, T) float32 / bf16 / fp16, contiguous, CPU: in place, the causal softmax of scale * s per
// row (zeros above the diagonal), rounded to s's dtype. Returns (R, T) float32 entropies in nats.
// Raises (RuntimeError) on another dtype, device, layout or a non-square last two dimensions.
at::Tensor causal_softmax_entropy_(at::Tensor& s, double scale) {
  TORCH_CHECK(s.device().is_cpu(), "causal_softmax_entropy_: s must be a CPU tensor");
  TORCH_CHECK(s.scalar_type() == at::kFloat || s.scalar_type() == at::kBFloat16 || s.scalar_type() == at::kHalf,
              "causal_softmax_entropy_: s must be float32, bfloat16 or float16, got ", s.scalar_type());
  TORCH_CHECK(s.dim() == 3 && s.size(1) == s.size(2), "causal_softmax_entropy_: s must be (R, T, T), got ",
              s.sizes());
  TORCH_CHECK(s.is_contiguous(), "causal_softmax_entropy_: s must be contiguous");
  const int64_t R = s.size(0), T = s.size(1);
  at::Tensor ent = at::empty({R, T}, s.options().dtype(at::kFloat));
  if (R == 0 || T == 0) return ent;
  const float sc = static_cast<float>(scale);
  float* e = ent.data_ptr<float>();
  auto run = [&](auto* base) {
    using scalar_t = std::remove_pointer_t<decltype(base)>;
    // rows (head, query) in contiguous shares: every head costs the same, so the shares do too
    const int64_t grain = std::max<int64_t>(1, 65536 / T);
    at::parallel_for(0, R * T, grain, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(T);
      for (int64_t r = r0; r < r1; ++r) e[r] = causal_row<scalar_t>(base + r * T, r % T + 1, T, sc, buf.data());
    });
  };
  if (s.scalar_type() == at::kFloat) run(s.data_ptr<float>());
  else if (s.scalar_type() == at::kBFloat16) run(s.data_ptr<c10::BFloat16>());
  else run(s.data_ptr<c10::Half>());
  return ent;
}

}  // namespace sfcl

TORCH_LIBRARY_FRAGMENT(sfcl, m) { m.def("causal_softmax_entropy_(Tensor(a!) s, float scale) -> Tensor"); }
TORCH_LIBRARY_IMPL(sfcl, CPU, m) { m.impl("causal_softmax_entropy_", &sfcl::causal_softmax_entropy_); }
