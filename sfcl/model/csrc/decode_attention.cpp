// Fused decode attention over the slot-row KV cache (sfcl.model.kv_cache.KVCache), CPU.
//
// One call per layer and step: for each decode row b (cache row row0 + b) it writes the new
// token's K and V at position pos[b], then attends the row's query heads to positions
// [0, pos[b]] of that row: scores q K^T (float32 accumulation), softmax, weights times V.
// Grouped-query attention: the g = nh / nkv query heads of a KV head share one pass over its
// keys and values, so K and V are read once per (row, KV head) straight from the cache's strided
// rows, with no copy to contiguous memory (what oneDNN's batched matmul does first) and no mask
// (each row's own length bounds its loop). Work is split over (row, KV head) with
// at::parallel_for (torch's own intra-op thread pool).
//
// Registered as torch.ops.sfcl.decode_attention; the Python side (sfcl/model/decode_kernel.py)
// builds and loads this file with torch.utils.cpp_extension; decode_attention below checks its inputs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "sfcl_kernels.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using sfcl::exp_nonpositive;

inline void load_row(const c10::BFloat16* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = sfcl::bf16_to_float(src[i]);
}

inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void load_row(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// sc[0, n) <- exp(sc - max(sc)); returns 1 / their sum (the softmax's normaliser).
inline float softmax_unnormalised(float* sc, int64_t n) {
  float m = sc[0];
#pragma omp simd reduction(max : m)
  for (int64_t s = 1; s < n; ++s) m = std::max(m, sc[s]);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t s = 0; s < n; ++s) {
    float e = exp_nonpositive(sc[s] - m);
    sc[s] = e;
    sum += e;
  }
  return 1.0f / sum;
}

// probs_out[0, S) <- the normalised weights of positions [0, n), zeros after (one query head).
inline void write_probs(const float* e, float inv, int64_t n, int64_t S, float* probs_out) {
  for (int64_t s = 0; s < n; ++s) probs_out[s] = e[s] * inv;
  for (int64_t s = n; s < S; ++s) probs_out[s] = 0.0f;
}

// Calls f(std::integral_constant<int, G>{}) for g = G in 1..4 (the specialised paths keep g heads'
// queries and outputs in registers); false for other g.
template <typename F>
inline bool with_group(int64_t g, F&& f) {
  switch (g) {
    case 1: f(std::integral_constant<int, 1>{}); return true;
    case 2: f(std::integral_constant<int, 2>{}); return true;
    case 3: f(std::integral_constant<int, 3>{}); return true;
    case 4: f(std::integral_constant<int, 4>{}); return true;
    default: return false;
  }
}

template <typename T, int HD>
void attend(const T* q, int64_t q_head_stride, const T* kr, const T* vr, int64_t n, int64_t g, float scale,
            float* scores, float* probs_out, int64_t S, T* out) {
  // q: g heads at q + j * q_head_stride; kr, vr: n rows of HD contiguous values; scores: g * n
  float qf[8][HD];
  float buf[HD];
  for (int64_t j = 0; j < g; ++j) {
    load_row(q + j * q_head_stride, qf[j], HD);
    for (int d = 0; d < HD; ++d) qf[j][d] *= scale;
  }
  for (int64_t s = 0; s < n; ++s) {
    load_row(kr + s * HD, buf, HD);
    for (int64_t j = 0; j < g; ++j) {
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int d = 0; d < HD; ++d) acc += qf[j][d] * buf[d];
      scores[j * n + s] = acc;
    }
  }
  float inv[8];
  for (int64_t j = 0; j < g; ++j) {
    inv[j] = softmax_unnormalised(scores + j * n, n);
  }
  float of[8][HD];
  for (int64_t j = 0; j < g; ++j)
    for (int d = 0; d < HD; ++d) of[j][d] = 0.0f;
  for (int64_t s = 0; s < n; ++s) {
    load_row(vr + s * HD, buf, HD);
    for (int64_t j = 0; j < g; ++j) {
      const float w = scores[j * n + s];
#pragma omp simd
      for (int d = 0; d < HD; ++d) of[j][d] += w * buf[d];
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    for (int d = 0; d < HD; ++d) out[j * HD + d] = static_cast<T>(of[j][d] * inv[j]);
    if (probs_out != nullptr) write_probs(scores + j * n, inv[j], n, S, probs_out + j * S);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512DQ__)
// sc[0, n) <- exp(sc - max(sc)); returns 1 / their sum. exp as exp_nonpositive, 16 lanes at a time
// (exp_nonpositive16), the last block masked.
inline float softmax_unnormalised_avx512(float* sc, int64_t n) {
  __m512 mv = _mm512_set1_ps(-INFINITY);
  for (int64_t s = 0; s < n; s += 16) {
    const __mmask16 k = n - s >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - s)) - 1);
    mv = _mm512_mask_max_ps(mv, k, mv, _mm512_maskz_loadu_ps(k, sc + s));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t s = 0; s < n; s += 16) {
    const __mmask16 k = n - s >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - s)) - 1);
    const __m512 e = sfcl::exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + s), m));
    _mm512_mask_storeu_ps(sc + s, k, e);
    sum = _mm512_mask_add_ps(sum, k, sum, e);
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}

// bf16 cache on a CPU with AVX-512 BF16: scores with vdpbf16ps (bf16 pairs multiplied exactly,
// accumulated in float32; q is already bf16, so nothing is rounded that the generic path keeps),
// weights times V with V widened to float32 in registers and the g heads' outputs held in 4 g
// registers.
template <int G>
void attend_bf16_avx512(const c10::BFloat16* q, int64_t q_head_stride, const c10::BFloat16* kr,
                        const c10::BFloat16* vr, int64_t n, float scale, float* scores, float* probs_out,
                        int64_t S, c10::BFloat16* out) {
  __m512bh qv[G][2];
  for (int j = 0; j < G; ++j) {
    qv[j][0] = (__m512bh)_mm512_loadu_si512(q + j * q_head_stride);
    qv[j][1] = (__m512bh)_mm512_loadu_si512(q + j * q_head_stride + 32);
  }
  int64_t s = 0;
  for (; s + 4 <= n; s += 4) {  // four positions: their four horizontal sums share one shuffle tree
    __m512bh k[4][2];
    for (int i = 0; i < 4; ++i) {
      k[i][0] = (__m512bh)_mm512_loadu_si512(kr + (s + i) * 64);
      k[i][1] = (__m512bh)_mm512_loadu_si512(kr + (s + i) * 64 + 32);
    }
    for (int j = 0; j < G; ++j) {
      __m512 a[4];
      for (int i = 0; i < 4; ++i)
        a[i] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), k[i][0], qv[j][0]), k[i][1], qv[j][1]);
      const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
      const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
      // per 128-bit lane: (s, s+1, s+2, s+3) partial sums
      const __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))),
                                     _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))));
      const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
      const __m128 q4 = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      _mm_storeu_ps(scores + j * n + s, _mm_mul_ps(q4, _mm_set1_ps(scale)));
    }
  }
  for (; s < n; ++s) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kr + s * 64);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kr + s * 64 + 32);
    for (int j = 0; j < G; ++j) {
      __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), k0, qv[j][0]);
      acc = _mm512_dpbf16_ps(acc, k1, qv[j][1]);
      scores[j * n + s] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
  float inv[G];
  for (int j = 0; j < G; ++j) {
    inv[j] = softmax_unnormalised_avx512(scores + j * n, n);
  }
  __m512 o[G][4];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < 4; ++c) o[j][c] = _mm512_setzero_ps();
  for (int64_t s = 0; s < n; ++s) {
    const uint16_t* v16 = reinterpret_cast<const uint16_t*>(vr + s * 64);
    __m512 vf[4];
    for (int c = 0; c < 4; ++c) {
      __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v16 + 16 * c)));
      vf[c] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    }
    for (int j = 0; j < G; ++j) {
      const __m512 w = _mm512_set1_ps(scores[j * n + s]);
      for (int c = 0; c < 4; ++c) o[j][c] = _mm512_fmadd_ps(w, vf[c], o[j][c]);
    }
  }
  for (int j = 0; j < G; ++j) {
    const __m512 iv = _mm512_set1_ps(inv[j]);
    for (int c = 0; c < 4; ++c) {
      // float32 -> bf16, round to nearest even (as c10::BFloat16's constructor)
      __m256bh b = _mm512_cvtneps_pbh(_mm512_mul_ps(o[j][c], iv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j * 64 + 16 * c), (__m256i)b);
    }
    if (probs_out != nullptr) write_probs(scores + j * n, inv[j], n, S, probs_out + j * S);
  }
}

inline bool attend_fast(const c10::BFloat16* q, int64_t qs, const c10::BFloat16* kr, const c10::BFloat16* vr,
                        int64_t n, int64_t g, float scale, float* scores, float* probs, int64_t S,
                        c10::BFloat16* out, std::integral_constant<int, 64>) {
  return with_group(g, [&](auto G) { attend_bf16_avx512<G.value>(q, qs, kr, vr, n, scale, scores, probs, S, out); });
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// float32 cache (what --dtype auto picks on an AVX2-only CPU), 8 lanes: scores four positions at a
// time with one hadd tree for their four horizontal sums; weights times V one head at a time with
// its 64 outputs in 8 registers (AVX2 has 16), the V rows of the later heads coming from L2.
template <int G>
void attend_f32_avx2(const float* q, int64_t q_head_stride, const float* kr, const float* vr, int64_t n,
                     float scale, float* scores, float* probs_out, int64_t S, float* out) {
  alignas(32) float qf[G][64];
  for (int j = 0; j < G; ++j)
    for (int d = 0; d < 64; ++d) qf[j][d] = q[j * q_head_stride + d] * scale;
  int64_t s = 0;
  for (; s + 4 <= n; s += 4) {
    const float* k = kr + s * 64;
    for (int j = 0; j < G; ++j) {
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
      for (int c = 0; c < 64; c += 8) {
        const __m256 qc = _mm256_load_ps(qf[j] + c);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(k + c), qc, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(k + 64 + c), qc, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(k + 128 + c), qc, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(k + 192 + c), qc, a3);
      }
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  // per 128-bit half: s..s+3
      _mm_storeu_ps(scores + j * n + s, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
  }
  for (; s < n; ++s)
    for (int j = 0; j < G; ++j) {
      float acc = 0.0f;
      for (int d = 0; d < 64; ++d) acc += qf[j][d] * kr[s * 64 + d];
      scores[j * n + s] = acc;
    }
  for (int j = 0; j < G; ++j) {
    float* sc = scores + j * n;
    const float inv = softmax_unnormalised(sc, n);
    __m256 o[8];
    for (int c = 0; c < 8; ++c) o[c] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const __m256 w = _mm256_set1_ps(sc[t]);
      for (int c = 0; c < 8; ++c) o[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + t * 64 + 8 * c), o[c]);
    }
    const __m256 iv = _mm256_set1_ps(inv);
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(out + j * 64 + 8 * c, _mm256_mul_ps(o[c], iv));
    if (probs_out != nullptr) write_probs(sc, inv, n, S, probs_out + j * S);
  }
}

inline bool attend_fast(const float* q, int64_t qs, const float* kr, const float* vr, int64_t n, int64_t g,
                        float scale, float* scores, float* probs, int64_t S, float* out,
                        std::integral_constant<int, 64>) {
  return with_group(g, [&](auto G) { attend_f32_avx2<G.value>(q, qs, kr, vr, n, scale, scores, probs, S, out); });
}
#endif

// No specialised path for this dtype / head size / CPU: the caller uses the generic one.
template <typename T, int HD>
inline bool attend_fast(const T*, int64_t, const T*, const T*, int64_t, int64_t, float, float*, float*, int64_t, T*,
                        std::integral_constant<int, HD>) {
  return false;
}

template <typename T, int HD>
void run(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& kn, const at::Tensor& vn,
         const int64_t* pos, int64_t row0, int64_t S, double scale, at::Tensor& out, float* probs) {
  const int64_t B = q.size(0), nh = q.size(1), nkv = kc.size(1), L = kc.size(2), g = nh / nkv;
  const T* qp = q.data_ptr<T>();
  T* kp = kc.data_ptr<T>();
  T* vp = vc.data_ptr<T>();
  const T* knp = kn.data_ptr<T>();
  const T* vnp = vn.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t ks0 = kn.stride(0), ks1 = kn.stride(1), vs0 = vn.stride(0), vs1 = vn.stride(1);
  const int64_t row_stride = nkv * L * HD, head_stride = L * HD;
  // at least ~64k multiply-adds per chunk, so a short row is not split across threads
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, S * HD * g));
  at::parallel_for(0, B * nkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(g * S);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / nkv, h = t % nkv, p = pos[b], n = p + 1;
      T* kr = kp + (row0 + b) * row_stride + h * head_stride;
      T* vr = vp + (row0 + b) * row_stride + h * head_stride;
      std::memcpy(kr + p * HD, knp + b * ks0 + h * ks1, HD * sizeof(T));
      std::memcpy(vr + p * HD, vnp + b * vs0 + h * vs1, HD * sizeof(T));
      const T* qh = qp + b * qs0 + h * g * qs1;
      float* ph = probs == nullptr ? nullptr : probs + (b * nh + h * g) * S;
      T* oh = op + (b * nh + h * g) * HD;
      if (!attend_fast(qh, qs1, kr, vr, n, g, static_cast<float>(scale), scores.data(), ph, S, oh,
                       std::integral_constant<int, HD>{}))
        attend<T, HD>(qh, qs1, kr, vr, n, g, static_cast<float>(scale), scores.data(), ph, S, oh);
    }
  });
}

}  // namespace

namespace sfcl {

std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                    const at::Tensor& v_cache, const at::Tensor& k_new,
                                                    const at::Tensor& v_new, const at::Tensor& pos, int64_t row0,
                                                    int64_t S, double scale, bool want_probs) {
  TORCH_CHECK(q.dim() == 3 && k_new.dim() == 3 && v_new.dim() == 3, "q, k_new, v_new: (B, heads, head_dim)");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(), "k_cache, v_cache: contiguous (rows, nkv, max_len, head_dim)");
  const int64_t B = q.size(0), nh = q.size(1), hd = q.size(2), nkv = k_cache.size(1);
  TORCH_CHECK(nkv > 0 && k_cache.size(3) == hd && nh % nkv == 0 && nh / nkv <= 8, "head shapes do not match");
  TORCH_CHECK(q.stride(2) == 1 && k_new.stride(2) == 1 && v_new.stride(2) == 1, "head_dim must be the unit stride");
  TORCH_CHECK(k_new.size(0) == B && k_new.size(1) == nkv && k_new.size(2) == hd && v_new.sizes() == k_new.sizes(),
              "k_new, v_new: (B, nkv, head_dim)");
  TORCH_CHECK(S >= 1 && S <= k_cache.size(2), "S must lie in [1, max_len]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  k_new.scalar_type() == k_cache.scalar_type() && v_new.scalar_type() == k_cache.scalar_type(),
              "q, k_new, v_new and the cache share one dtype");
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.dim() == 1 && pos.size(0) == B && pos.is_contiguous(), "pos: (B,) int64");
  TORCH_CHECK(row0 >= 0 && row0 <= k_cache.size(0) - B, "rows out of range");  // no overflow of row0 + B
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(pp[b] >= 0 && pp[b] < S, "positions must lie in [0, S)");
  at::Tensor out = at::empty({B, nh * hd}, q.options());
  at::Tensor probs = want_probs ? at::empty({B, nh, 1, S}, q.options().dtype(at::kFloat)) : at::empty({0}, q.options().dtype(at::kFloat));
  float* pr = want_probs ? probs.data_ptr<float>() : nullptr;
#define SFCL_RUN(T)                                                                        \
  if (hd == 64) run<T, 64>(q, k_cache, v_cache, k_new, v_new, pp, row0, S, scale, out, pr); \
  else if (hd == 128) run<T, 128>(q, k_cache, v_cache, k_new, v_new, pp, row0, S, scale, out, pr); \
  else TORCH_CHECK(false, "head_dim must be 64 or 128, not ", hd);
  switch (q.scalar_type()) {
    case at::kBFloat16: SFCL_RUN(c10::BFloat16) break;
    case at::kFloat: SFCL_RUN(float) break;
    case at::kHalf: SFCL_RUN(c10::Half) break;
    default: TORCH_CHECK(false, "dtype must be bfloat16, float16 or float32");
  }
#undef SFCL_RUN
  return {out, probs};
}

}  // namespace sfcl

TORCH_LIBRARY(sfcl, m) {
  m.def("decode_attention(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k_new, Tensor v_new, Tensor pos, "
        "int row0, int S, float scale, bool want_probs) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(sfcl, CPU, m) { m.impl("decode_attention", &sfcl::decode_attention); }
