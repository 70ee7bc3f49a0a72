// torch.ops.sfcl.int8_linear (and int8_q8_linear, below): y (M, N) = x (M, K) W^T with W stored as int8 codes times a scale per
// output row, the contract of torch's at::_weight_int8pack_mm (sfcl.model.quant.QuantLinear's int8
// packed path, and decode_layers.cpp's int8 projections), for the few rows of a decode step.
//
// Why our own: a decode step's int8 GEMV is a pass over the weight's bytes (the 49,152 x 576
// lm_head: 28 MB per step), and torch 2.13's CPU kernel read them at ~15 GB/s on the 2-core AVX-512
// EPYC where a plain read runs at ~33 GB/s: right after a 96 MB copy, one row 1.86 ms with torch's
// kernel against 1.42 ms here, two rows 2.46 against 1.90 (scripts/profile_int8_linear.py;
// docs/performance-journal.md, twelfth session; this kernel then ran on one thread, the library
// being built without OpenMP). On an Intel Xeon on two threads (2026-12-05): 1.64 against 1.71 ms,
// on one thread 3.6 ms. Each weight row is read once for all input rows;
// the work is split over torch's intra-op threads by output rows; each 16 (AVX-512) or 8 (AVX2)
// codes are converted to float once for both input rows, and one row runs two FMA chains. From
// kMaxRows + 1 bf16 rows on, torch's kernel is faster and runs instead. Arithmetic: float32
// products and sums (vector accumulators, then a scalar tail), times the row's scale in float32,
// rounded once to x's dtype; torch's kernel computes the same quantities, summed in another order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "sfcl_kernels.h"

namespace sfcl {
namespace {

constexpr int64_t kRowsPerTask = 256;  // output rows per unit of the parallel split (~150 KB of weight at K = 576)
constexpr int kRowBlock = 2;           // input rows that share one conversion of a weight chunk
// Above this many input rows torch's kernel is faster (lm_head, 2-core AVX-512 EPYC, after a 96 MB
// copy: M = 1 1.4 vs 1.9 ms, M = 4 3.4 vs 2.9 ms; scripts/profile_int8_linear.py), and runs instead.
constexpr int64_t kMaxRows = 2;

}  // namespace

// x (M, K) bfloat16 / float16 / float32, w (N, K) int8 contiguous, scale (N,) of any float dtype ->
// (M, N) in x's dtype. Raises (RuntimeError) on other shapes or dtypes.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf ||
                               x.scalar_type() == at::kFloat),
              "int8_linear: x must be a (M, K) bfloat16, float16 or float32 tensor");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() && w.size(1) == x.size(1),
              "int8_linear: w must be a contiguous (N, K) int8 tensor with x's K");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == w.size(0) && at::isFloatingType(scale.scalar_type()),
              "int8_linear: scale must be a (N,) float tensor");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && scale.device().is_cpu(), "int8_linear: CPU tensors only");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor xf = x.to(at::kFloat).contiguous();  // (M, K) float32: converted once, read N times
  at::Tensor sf = scale.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y.to(x.scalar_type());
  const float* X = xf.data_ptr<float>();
  const int8_t* W = w.data_ptr<int8_t>();
  const float* S = sf.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  // torch's kernel is faster from kMaxRows up; it takes bf16 activations and scales (what
  // QuantLinear passes) and only K a multiple of 16 (others crash it)
  if (M > kMaxRows && K % 16 == 0 && x.scalar_type() == at::kBFloat16 && scale.scalar_type() == at::kBFloat16)
    return at::_weight_int8pack_mm(x.contiguous(), w, scale.contiguous());
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
    float acc[kRowBlock];
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* wr = W + n * K;
      for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
        const int64_t r = std::min<int64_t>(kRowBlock, M - m0);
        const float* xb = X + m0 * K;
        if (r == 2)
          dot_i8_rows<2>(wr, xb, K, acc);
        else
          dot_i8_rows<1>(wr, xb, K, acc);
        for (int64_t j = 0; j < r; ++j) Y[(m0 + j) * N + n] = acc[j] * S[n];
      }
    }
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// x (M, K) bfloat16 / float16 / float32 contiguous, w (N, K) int8 contiguous, scale (N,) of any float
// dtype, K a multiple of 32 -> (M, N) in x's dtype: the same product as int8_linear with the
// activations quantised to int8 per block of 32 first (quantise_q8_row, llama.cpp's Q8_0, as
// int4_linear does), so that a block's 32 products are one integer dot product:
//
//   y[m, n] = scale[n] * sum_g d[m, g] * sum_{k in g} w[n, k] x8[m, k]
//
// AVX2: vpmaddubsw of |x8| with w carrying x8's sign (vpsignb; |x8| <= 127 and |w| <= 127 keep each
// int16 pair sum below 32,767; |x8| taken once per call), vpmaddwd to int32, one float FMA per block
// by d: 6 arithmetic instructions per 32 products against 12-16 for int8_linear's conversions to
// float, which made that kernel compute-bound on AVX2 (the 49,152 x 576 lm_head, one row, after a 96 MB copy, AVX2 code paths of
// an Intel Xeon: 1.13 against 1.49 ms; scripts/profile_int8_linear.py). A weight code of -128 counts
// as -127 (sfcl.model.quant.quantize_int8 makes codes in -127..127). The activations' rounding to
// int8 is the approximation (relative error ~5e-3 on Gaussian activations, against ~2e-3 for the
// bf16 activations QuantLinear gives int8_linear). Raises (RuntimeError) on other shapes or dtypes.
at::Tensor int8_q8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf || x.scalar_type() == at::kFloat),
              "int8_q8_linear: x must be a contiguous (M, K) bfloat16, float16 or float32 tensor");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() && w.size(1) == x.size(1),
              "int8_q8_linear: w must be a contiguous (N, K) int8 tensor with x's K");
  TORCH_CHECK(x.size(1) % kQ8Block == 0, "int8_q8_linear: K must be a multiple of ", kQ8Block, ", got ", x.size(1));
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == w.size(0) && at::isFloatingType(scale.scalar_type()),
              "int8_q8_linear: scale must be a (N,) float tensor");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && scale.device().is_cpu(),
              "int8_q8_linear: CPU tensors only");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), G = K / kQ8Block;
  const Q8Rows q8 = quantise_q8_rows(x);  // (M, K) codes, per block d, code sum, float sum
  at::Tensor sf = scale.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y.to(x.scalar_type());
  const int8_t* W = w.data_ptr<int8_t>();
  const int8_t* X8 = q8.x8.data();
  std::vector<int8_t> ax(q8.x8.size());  // |x8|, once per call, not once per weight row
  for (size_t i = 0; i < ax.size(); ++i) ax[i] = static_cast<int8_t>(std::abs(int(q8.x8[i])));  // |x8| <= 127
  const int8_t* AX = ax.data();
  const float* D = q8.d.data();
  const float* S = sf.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* wr = W + n * K;
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* xr = X8 + m * K;
        const int8_t* axr = AX + m * K;
        const float* dm = D + m * G;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256i ones = _mm256_set1_epi16(1), lo = _mm256_set1_epi8(-127);
        __m256 acc = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; ++g) {
          const __m256i wv = _mm256_max_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + g * kQ8Block)), lo);
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + g * kQ8Block));
          const __m256i axv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(axr + g * kQ8Block));
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(axv, _mm256_sign_epi8(wv, xv)), ones);
          acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dm[g]), acc);
        }
        Y[m * N + n] = hsum256(acc) * S[n];
#else
        float a = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          int32_t dot = 0;
          for (int64_t j = 0; j < kQ8Block; ++j)
            dot += std::max<int32_t>(wr[g * kQ8Block + j], -127) * int32_t(xr[g * kQ8Block + j]);
          a += float(dot) * dm[g];
        }
        Y[m * N + n] = a * S[n];
#endif
      }
    }
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace sfcl

TORCH_LIBRARY_FRAGMENT(sfcl, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("int8_q8_linear(Tensor x, Tensor w, Tensor scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(sfcl, CPU, m) {
  m.impl("int8_linear", &sfcl::int8_linear);
  m.impl("int8_q8_linear", &sfcl::int8_q8_linear);
}

// Shapes only, for torch.compile's fake tensors (QuantLinear runs under --compile too; without it
// each call was a graph break): (M, N) in x's dtype, as the CPU kernels return.
TORCH_LIBRARY_IMPL(sfcl, Meta, m) {
  auto shape = [](const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "int8_linear: x (M, K), w (N, K)");
    return at::empty_symint({x.sym_size(0), w.sym_size(0)}, x.options());  // symbolic: no specialised batch
  };
  m.impl("int8_linear", shape);
  m.impl("int8_q8_linear", shape);
}
