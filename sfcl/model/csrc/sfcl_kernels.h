// Declarations and helpers shared by SFCL's CPU kernels (one library: decode_attention.cpp, decode_layers.cpp, anchor_search.cpp, int8_linear.cpp, int4_linear.cpp, logit_stats.cpp, elementwise.cpp, attention_entropy.cpp).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

namespace sfcl {

// bf16 -> float by a bit shift (exact), written so that loops over it vectorise.
inline float bf16_to_float(c10::BFloat16 v) {
  uint32_t u = uint32_t(v.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// exp(x) for x <= 0 (Cephes expf: range reduction by ln 2 in two parts, degree-6 polynomial;
// ~1 ulp), written so that the compiler vectorizes the loop that calls it. exp_nonpositive16 (below)
// evaluates the same steps 16 lanes at a time with AVX-512.
// Below kExpMin every form returns 0 (the true exp is below ~1.6e-38, a denormal or 0): until the
// thirty-first session it returned exp(-87), so a key whose weight is 0 (a score of -inf) weighed
// ~1.6e-38, visible against values near 1e37 (a tester's finding, thirtieth session).
constexpr float kExpMin = -87.0f;  // exp(-87) ~ 1.6e-38, still a normal float
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 = kLn2Hi + kLn2Lo
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_nonpositive(float x) {
  const bool under = x < kExpMin;  // exp below ~1.6e-38 (and exp(-inf)): 0, as a masked key's weight must be
  x = under ? kExpMin : x;
  float n = __builtin_rintf(x * kLog2e);
  float r = x - n * kLn2Hi - n * kLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  p = p * r * r + r + 1.0f;
  int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &e, 4);
  return under ? 0.0f : p * two_n;
}

#if defined(__AVX512F__)
// exp(x) of 16 lanes for x <= 0: exp_nonpositive's steps (x clamped at kExpMin, n = round(x log2 e),
// r = x - n ln 2 with ln 2 in two parts, e^r by the degree-6 polynomial) with fused multiply-adds and
// 2^n applied by vscalefps. A NaN lane stays NaN, as in exp_nonpositive (vmaxps returns its second
// operand when either is NaN). Degree4: e^r by its degree-4 Taylor polynomial on |r| <= ln 2 / 2, ln 2
// in one part (relative error < 5e-5), for values rounded to bf16 right after (2^-9; the anchor
// build's causal softmax, causal_attention.cpp). decode_attention.cpp's softmax uses the full form.
template <bool Degree4 = false>
inline __m512 exp_nonpositive16(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpMin), _CMP_NLT_UQ);  // not below: kept (NaN too)
  x = _mm512_max_ps(_mm512_set1_ps(kExpMin), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 p;
  if constexpr (Degree4) {
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x), one = _mm512_set1_ps(1.0f);
    p = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 24), r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, one);
    p = _mm512_fmadd_ps(p, r, one);
  } else {
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
    p = _mm512_set1_ps(kExpPoly[0]);
    for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  }
  return _mm512_maskz_scalef_ps(keep, p, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp(x) of 8 lanes for x <= 0: exp_nonpositive's steps with fused multiply-adds (x clamped at
// kExpMin, n = round(x log2 e), r = x - n ln 2 with ln 2 in two parts, e^r by the degree-6
// polynomial, 2^n built in the exponent bits; ~1 ulp). The float32 prefill attention's softmax
// (prefill_attention.cpp). A NaN lane stays NaN, as in exp_nonpositive (vmaxps returns its second
// operand when either is NaN).
inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(kExpMin), _CMP_NLT_UQ);  // not below: kept (NaN too)
  x = _mm256_max_ps(_mm256_set1_ps(kExpMin), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

#if defined(__AVX2__)
// 8 bf16 values (bit patterns) -> 8 floats, exactly (a shift into the high half).
inline __m256 bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
#endif

#if defined(__AVX__)
// Sum of the 8 lanes of a.
inline float hsum256(__m256 a) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_hadd_ps(h, h);
  h = _mm_hadd_ps(h, h);
  return _mm_cvtss_f32(h);
}
#endif

// sum_d float(v[d]) * q[d] for float16 v (bit patterns) and float32 q.
inline float dot_f16(const uint16_t* v, const float* q, int64_t D) {
  int64_t d = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (; d + 32 <= D; d += 32) {
    a0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + d))),
                         _mm512_loadu_ps(q + d), a0);
    a1 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + d + 16))),
                         _mm512_loadu_ps(q + d + 16), a1);
  }
  for (; d + 16 <= D; d += 16)
    a0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + d))),
                         _mm512_loadu_ps(q + d), a0);
  s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#elif defined(__F16C__) && defined(__FMA__)
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; d + 16 <= D; d += 16) {
    a0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + d))),
                         _mm256_loadu_ps(q + d), a0);
    a1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + d + 8))),
                         _mm256_loadu_ps(q + d + 8), a1);
  }
  s = hsum256(_mm256_add_ps(a0, a1));
#endif
  for (; d < D; ++d) s += c10::detail::fp16_ieee_to_fp32_value(v[d]) * q[d];
  return s;
}

// out[r] = sum_k float(w[k]) * x[r * K + k] for R input rows x (R, K) float32 and one int8 weight row
// w (K,): each chunk of w is converted to float once and multiplied into all R rows.
template <int R>
inline void dot_i8_rows(const int8_t* w, const float* x, int64_t K, float* out) {
  int64_t k = 0;
  float s[R];
  for (int r = 0; r < R; ++r) s[r] = 0.f;
#if defined(__AVX512F__)
  __m512 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  if (R == 1) {  // one row: a second accumulator, so that two FMA chains overlap
    __m512 b = _mm512_setzero_ps();
    for (; k + 32 <= K; k += 32) {
      a[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k)))),
                             _mm512_loadu_ps(x + k), a[0]);
      b = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k + 16)))),
                          _mm512_loadu_ps(x + k + 16), b);
    }
    a[0] = _mm512_add_ps(a[0], b);
  }
  for (; k + 16 <= K; k += 16) {
    const __m512 wf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k))));
    for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(wf, _mm512_loadu_ps(x + r * K + k), a[r]);
  }
  for (int r = 0; r < R; ++r) s[r] = _mm512_reduce_add_ps(a[r]);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm256_setzero_ps();
  if (R == 1) {
    __m256 b = _mm256_setzero_ps();
    for (; k + 16 <= K; k += 16) {
      a[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k)))),
                             _mm256_loadu_ps(x + k), a[0]);
      b = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k + 8)))),
                          _mm256_loadu_ps(x + k + 8), b);
    }
    a[0] = _mm256_add_ps(a[0], b);
  }
  for (; k + 8 <= K; k += 8) {
    const __m256 wf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k))));
    for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(wf, _mm256_loadu_ps(x + r * K + k), a[r]);
  }
  for (int r = 0; r < R; ++r) s[r] = hsum256(a[r]);
#endif
  for (; k < K; ++k)
    for (int r = 0; r < R; ++r) s[r] += float(w[k]) * x[r * K + k];
  for (int r = 0; r < R; ++r) out[r] = s[r];
}

// sum_d float(v[d]) * q[d] for int8 codes v and float32 q (one row of dot_i8_rows).
inline float dot_i8(const int8_t* v, const float* q, int64_t D) {
  float s;
  dot_i8_rows<1>(v, q, D, &s);
  return s;
}

// Activation row x (K,) -> int8 codes x8 (K,) per block of 32 (llama.cpp's Q8_0: d = max |x| / 127,
// x8 = round(x / d)), and per block: d, the int sum of the codes, the float sum of x. A block holding
// inf or NaN gets no codes and d = NaN, so every product it enters is NaN. K must be a multiple of 32.
// Used by int4_linear.cpp and int8_linear.cpp's int8_q8_linear (one rule for both).
constexpr int64_t kQ8Block = 32;
template <typename T>
void quantise_q8_row(const T* x, int64_t K, int8_t* x8, float* d, int32_t* xs, float* fs) {
  for (int64_t g = 0; g < K / kQ8Block; ++g) {
    float v[kQ8Block], amax = 0.f, sum = 0.f;
    for (int64_t j = 0; j < kQ8Block; ++j) {
      v[j] = static_cast<float>(x[g * kQ8Block + j]);
      amax = std::max(amax, std::fabs(v[j]));
      sum += v[j];
    }
    if (!std::isfinite(amax)) {  // inf or NaN in the block: no codes, and a non-finite result (d NaN)
      for (int64_t j = 0; j < kQ8Block; ++j) x8[g * kQ8Block + j] = 0;
      d[g] = std::numeric_limits<float>::quiet_NaN();
      xs[g] = 0;
      fs[g] = sum;
      continue;
    }
    // the scale floored at FLT_MIN: a block of tiny values (max |x| < 127 / FLT_MAX) would make
    // 127 / max |x| infinite, and the cast of an infinite code to int is undefined (it gave -127)
    const float scale = std::max(amax / 127.f, std::numeric_limits<float>::min());
    int32_t s = 0;
    for (int64_t j = 0; j < kQ8Block; ++j) {
      const float c = std::nearbyint(v[j] / scale);  // |c| <= 127
      x8[g * kQ8Block + j] = static_cast<int8_t>(std::clamp(c, -127.f, 127.f));
      s += x8[g * kQ8Block + j];
    }
    d[g] = scale;
    xs[g] = s;
    fs[g] = sum;
  }
}

// Every row of x (M, K) float32 / bfloat16 / float16, contiguous, K a multiple of 32, through
// quantise_q8_row: x8 (M * K), and per row and block (M * K / 32) d, xs (code sums), fs (float sums).
struct Q8Rows {
  std::vector<int8_t> x8;
  std::vector<float> d, fs;
  std::vector<int32_t> xs;
};
inline Q8Rows quantise_q8_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), G = K / kQ8Block;
  Q8Rows q{std::vector<int8_t>(M * K), std::vector<float>(M * G), std::vector<float>(M * G), std::vector<int32_t>(M * G)};
  for (int64_t m = 0; m < M; ++m) {
    int8_t* x8 = q.x8.data() + m * K;
    float *d = q.d.data() + m * G, *fs = q.fs.data() + m * G;
    int32_t* xs = q.xs.data() + m * G;
    if (x.scalar_type() == at::kFloat)
      quantise_q8_row(x.data_ptr<float>() + m * K, K, x8, d, xs, fs);
    else if (x.scalar_type() == at::kBFloat16)
      quantise_q8_row(x.data_ptr<at::BFloat16>() + m * K, K, x8, d, xs, fs);
    else
      quantise_q8_row(x.data_ptr<at::Half>() + m * K, K, x8, d, xs, fs);
  }
  return q;
}

// torch.ops.sfcl.int8_linear and torch.ops.sfcl.int8_q8_linear; see int8_linear.cpp.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale);
at::Tensor int8_q8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale);

// The snapshot lookup's IVF pass (anchor_search.cpp) over one index: the index's tensors (the
// arguments of anchor_search after queries) checked once and held, and run() searching queries
// (B, D) float32 into S, I, F (B * k each). Not safe to run from two threads at once (its buffers
// are reused); bindings.cpp binds it as the module's AnchorLookup, called with the GIL held.
// Raises c10::Error (RuntimeError in Python) for arguments that do not fit together.
struct AnchorScratch;
class AnchorSearch {
 public:
  AnchorSearch(const at::Tensor& stored, const at::Tensor& centroids, const at::Tensor& centroid_step,
               const at::Tensor& centroid_vectors, const at::Tensor& offsets, const at::Tensor& members,
               const at::Tensor& codes, const at::Tensor& code_step, int64_t nprobe, int64_t k, int64_t n_candidates,
               const c10::optional<at::Tensor>& weights, const c10::optional<at::Tensor>& decay,
               const c10::optional<at::Tensor>& group_centroids, const c10::optional<at::Tensor>& group_scale,
               const c10::optional<at::Tensor>& group_offsets, int64_t group_probe);
  ~AnchorSearch();
  AnchorSearch(const AnchorSearch&) = delete;
  AnchorSearch& operator=(const AnchorSearch&) = delete;
  int64_t k() const { return k_; }
  void run(const at::Tensor& queries, float* S, int64_t* I, float* F);

 private:
  std::vector<at::Tensor> keep_;  // the index's tensors, alive as long as this
  std::unique_ptr<AnchorScratch> scratch_;
  int64_t N_ = 0, D_ = 0, Dp_ = 0, C_ = 0, G_ = 0, gp_ = 0, np_ = 0, k_ = 0, n_candidates_ = 0;
  const uint16_t* V_ = nullptr;
  const uint16_t* CV_ = nullptr;
  const uint8_t* C4_ = nullptr;
  const uint8_t* L4_ = nullptr;
  const int64_t* off_ = nullptr;
  const int64_t* goff_ = nullptr;
  const int32_t* mem_ = nullptr;
  const int8_t* G8_ = nullptr;
  const float* g_scale_ = nullptr;
  const float* cstep_ = nullptr;
  const float* lstep_ = nullptr;
  const float* W_ = nullptr;
  const float* L_ = nullptr;
};
// anchor_search: one AnchorSearch built and run, the results as tensors.
std::tuple<at::Tensor, at::Tensor, at::Tensor> anchor_search(
    const at::Tensor& queries, const at::Tensor& stored, const at::Tensor& centroids, const at::Tensor& centroid_step,
    const at::Tensor& centroid_vectors, const at::Tensor& offsets, const at::Tensor& members, const at::Tensor& codes, const at::Tensor& code_step,
    int64_t nprobe, int64_t k, int64_t n_candidates, const c10::optional<at::Tensor>& weights,
    const c10::optional<at::Tensor>& decay, const c10::optional<at::Tensor>& group_centroids,
    const c10::optional<at::Tensor>& group_scale, const c10::optional<at::Tensor>& group_offsets,
    int64_t group_probe);

// torch.ops.sfcl.int4_linear; see int4_linear.cpp.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz);

// torch.ops.sfcl.logit_stats; see logit_stats.cpp.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> logit_stats(const at::Tensor& logits,
                                                                      const at::Tensor& next, int64_t k);

// torch.ops.sfcl.decode_attention; see decode_attention.cpp and sfcl/model/decode_kernel.py.
std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                    const at::Tensor& v_cache, const at::Tensor& k_new,
                                                    const at::Tensor& v_new, const at::Tensor& pos, int64_t row0,
                                                    int64_t S, double scale, bool want_probs);

}  // namespace sfcl
