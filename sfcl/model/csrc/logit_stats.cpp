// torch.ops.sfcl.logit_stats: what the anchor builder's model pass keeps of each row of logits, in
// one pass over the row (sfcl.anchors.model_pass.run_windows):
//
//   lse[r]       = log sum_v exp(logits[r, v])                       (float32)
//   top_i[r, :]  = the k largest logits' ids, largest first (ties: the lower id first)
//   top_p[r, :]  = exp(logits[r, top_i] - lse[r])                    (their probabilities)
//   surprisal[r] = lse[r] - logits[r, next[r]]                       (nats)
//
// Why: in torch these are a float32 copy of the (R, V) logits, amax, a subtraction, exp, sum, log
// (logsumexp), topk, gather: 7-8 passes over 49,152 floats per row. On the 2-core Intel Xeon with AMX
// they were ~0.4 of the 1.8 s a batch of 4 windows of 1,024 tokens took (the GEMMs ~0.6 s;
// `python scripts/profile_model_pass.py --profile`, docs/performance-journal.md). Here a row, bf16
// or float32 as the lm_head returns it, is read three times while it sits in L2 (the max; the sum
// of exponentials; the top-k, whose candidates are found 8 at a time by one comparison against the
// current k-th value). Rows are split over torch's intra-op threads.
//
// Arithmetic: float32; exp is sfcl::exp_nonpositive (~1 ulp) of x - max, summed in vector lanes
// per block of 512 and the blocks in double; torch's logsumexp sums in another order, so lse agrees to float32 rounding (~1e-6
// relative). A row holding NaN or +inf, or only -inf, gives NaN lse, top_p and surprisal (its top
// ids are then the k largest of its other values; torch would give inf or -inf in some of these).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "sfcl_kernels.h"

namespace sfcl {
namespace {

inline float load1(const float* p, int64_t i) { return p[i]; }
inline float load1(const c10::BFloat16* p, int64_t i) { return bf16_to_float(p[i]); }

// keep (vals, ids) of length k sorted descending (ties: lower id first); insert (v, id) if it belongs.
inline void insert_top(float* vals, int64_t* ids, int64_t k, float v, int64_t id) {
  if (!(v > vals[k - 1])) return;  // equal values keep the earlier (lower) id; NaN never enters
  int64_t j = k - 1;
  while (j > 0 && v > vals[j - 1]) {
    vals[j] = vals[j - 1];
    ids[j] = ids[j - 1];
    --j;
  }
  vals[j] = v;
  ids[j] = id;
}

template <typename T>
void row_stats(const T* x, int64_t V, int64_t k, int64_t nxt, float* top_p, int64_t* top_i, float* lse_out,
               float* sur_out) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  // 1. max (a NaN is skipped here and poisons the sum below)
  float mx = kNegInf;
#pragma omp simd reduction(max : mx)
  for (int64_t v = 0; v < V; ++v) mx = std::max(mx, load1(x, v));
  // 2. sum of exp(x - max): blocks of 512 summed in vector lanes, the blocks' sums in double (one
  // float32 sum over 49,152 positive terms drifted by ~6e-6 relative with 8 lanes)
  double total = 0.0;
  if (std::isfinite(mx)) {
    for (int64_t v0 = 0; v0 < V; v0 += 512) {
      const int64_t v1 = std::min<int64_t>(V, v0 + 512);
      float b = 0.f;
#pragma omp simd reduction(+ : b)
      for (int64_t v = v0; v < v1; ++v) b += exp_nonpositive(load1(x, v) - mx);
      total += b;
    }
  }
  const float lse = std::isfinite(mx) && std::isfinite(total) ? mx + static_cast<float>(std::log(total))
                                                              : std::numeric_limits<float>::quiet_NaN();
  // 3. top-k: candidates are the values above the current k-th
  std::vector<float> vals(k, kNegInf);
  std::vector<int64_t> ids(k, -1);
  int64_t v = 0;
#if defined(__AVX2__)
  for (; v + 8 <= V; v += 8) {
    __m256 xv;
    if constexpr (std::is_same_v<T, float>)
      xv = _mm256_loadu_ps(x + v);
    else
      xv = bf16x8(reinterpret_cast<const uint16_t*>(x + v));
    int m = _mm256_movemask_ps(_mm256_cmp_ps(xv, _mm256_set1_ps(vals[k - 1]), _CMP_GT_OQ));
    while (m) {
      const int j = __builtin_ctz(m);
      insert_top(vals.data(), ids.data(), k, load1(x, v + j), v + j);
      m &= m - 1;
    }
  }
#endif
  for (; v < V; ++v) insert_top(vals.data(), ids.data(), k, load1(x, v), v);
  for (int64_t j = 0; j < k; ++j) {
    top_i[j] = ids[j];
    top_p[j] = ids[j] < 0 ? 0.f : std::exp(vals[j] - lse);
  }
  *lse_out = lse;
  *sur_out = lse - load1(x, nxt);
}

}  // namespace

// logits (R, V) float32 or bfloat16, contiguous; next (R,) int64 ids in [0, V); 1 <= k <= V.
// Returns (top_p (R, k) float32, top_i (R, k) int64, surprisal (R,) float32, lse (R,) float32).
// Raises (RuntimeError) on other shapes, dtypes or an id out of range.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> logit_stats(const at::Tensor& logits,
                                                                      const at::Tensor& next, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "logit_stats: logits must be a contiguous (R, V) float32 or bfloat16 tensor");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(next.dim() == 1 && next.size(0) == R && next.scalar_type() == at::kLong,
              "logit_stats: next must be a (R,) int64 tensor");
  TORCH_CHECK(k >= 1 && k <= V, "logit_stats: k must lie in [1, V], got ", k, " for V = ", V);
  TORCH_CHECK(logits.device().is_cpu() && next.device().is_cpu(), "logit_stats: CPU tensors only");
  at::Tensor nx = next.contiguous();
  const int64_t* N = nx.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(N[r] >= 0 && N[r] < V, "logit_stats: next id ", N[r], " of row ", r, " is out of [0, ", V, ")");
  at::Tensor top_p = at::empty({R, k}, logits.options().dtype(at::kFloat));
  at::Tensor top_i = at::empty({R, k}, logits.options().dtype(at::kLong));
  at::Tensor sur = at::empty({R}, logits.options().dtype(at::kFloat));
  at::Tensor lse = at::empty({R}, logits.options().dtype(at::kFloat));
  float* P = top_p.data_ptr<float>();
  int64_t* I = top_i.data_ptr<int64_t>();
  float* S = sur.data_ptr<float>();
  float* L = lse.data_ptr<float>();
  const bool bf16 = logits.scalar_type() == at::kBFloat16;
  const void* X = logits.data_ptr();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (bf16)
        row_stats(static_cast<const c10::BFloat16*>(X) + r * V, V, k, N[r], P + r * k, I + r * k, L + r, S + r);
      else
        row_stats(static_cast<const float*>(X) + r * V, V, k, N[r], P + r * k, I + r * k, L + r, S + r);
    }
  });
  return {top_p, top_i, sur, lse};
}

}  // namespace sfcl

TORCH_LIBRARY_FRAGMENT(sfcl, m) {
  m.def("logit_stats(Tensor logits, Tensor next, int k) -> (Tensor top_p, Tensor top_i, Tensor surprisal, Tensor lse)");
}
TORCH_LIBRARY_IMPL(sfcl, CPU, m) { m.impl("logit_stats", &sfcl::logit_stats); }
