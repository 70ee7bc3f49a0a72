// Causal attention of a float32 prompt chunk over its sequence's KV cache, with AVX2 and FMA: the
// prefill of a float32 model (the dtype `--dtype auto` picks on CPUs without native bf16) and its
// anchor build.
//
//   o[b, i, h] = sum_{j <= start + i} p[i, j] v[b, g(h), j],
//   p[i, :] = softmax_j(scale q[b, h, i] . k[b, g(h), j]),   start = S - T,
//
// for the T queries of a chunk at positions [start, S) against the S keys [0, S) of the cache
// (the chunk's own keys last), g(h) = h / (nh / nkv) (grouped-query attention). The flash-attention
// recurrence (Dao et al., 2022: "FlashAttention", Algorithm 1; the online softmax of Milakov and
// Gimelshein, 2018) in float32 throughout: per (sequence, KV head, block of up to kQ query positions)
// the rows of all the KV head's query heads (position-major) run over the keys in blocks of kKeys;
// per block S = Q K^T (6 rows x 16 keys of accumulators), each row's running max and sum updated,
// P = exp(S - max) (sfcl::exp_nonpositive8, ~1 ulp), W = P V (6 rows x 16 columns), O = O alpha + W.
// A group of 6 rows stops at its last row's position, and no row reads a key past its own (so a row's
// result is the same bit for bit whichever rows share its group or chunk, and a non-finite value of a
// later token stays out of it). NaN or +inf scores make their rows NaN, as in torch's SDPA. K is first
// packed per (sequence, KV head) into panels of 16 keys x HD dims
// (kt[(j / 16) * HD * 16 + d * 16 + j % 16]) so the score product reads 16 keys of one dimension in two
// loads; V is read in place (its rows are contiguous in the cache).
//
// Why: torch 2.13's CPU flash attention (scaled_dot_product_attention), with the chunk's bool mask,
// took 51% of a cold 3,600-token prefill in float32 on the AVX2 code paths of a 2-core AMD EPYC
// (4.92 of 9.64 s), ~90 GFLOP/s of useful work against ~176 for a float32 GEMM of the model's shapes;
// this kernel 3.27 of 7.92 s (docs/benchmarks.md, twenty-ninth session).
//
// Compiled where -march enables AVX2 and FMA; elsewhere prefill_attention_ready() is false and the
// operator raises.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "sfcl_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#define SFCL_PREFILL_AVX2 1
#include <immintrin.h>
#endif

namespace sfcl {
namespace {

#ifdef SFCL_PREFILL_AVX2
constexpr int64_t kQ = 32;     // query positions per work item
constexpr int64_t kKeys = 128;  // keys per block of the recurrence
constexpr int64_t kMR = 6;     // rows per register tile (12 accumulators of 8 lanes)

// K of one (sequence, KV head), n keys with row stride ks -> panels of 16 keys x HD dims, keys past
// n zero (so a tile may read up to the next multiple of 16).
template <int HD>
void pack_kt(const float* k, int64_t ks, int64_t n, float* kt) {
  const int64_t np = (n + 15) / 16;
  for (int64_t p = 0; p < np; ++p) {
    float* dst = kt + p * HD * 16;
    for (int64_t jj = 0; jj < 16; ++jj) {
      const int64_t j = p * 16 + jj;
      if (j < n) {
        const float* src = k + j * ks;
        for (int d = 0; d < HD; ++d) dst[d * 16 + jj] = src[d];
      } else {
        for (int d = 0; d < HD; ++d) dst[d * 16 + jj] = 0.0f;
      }
    }
  }
}

// S (MR rows, 16 keys) = Q K^T for one panel: q rows of HD floats (stride HD), kt one packed panel;
// S's row stride ss.
template <int HD, int MR>
inline void scores_tile(const float* q, const float* kt, float* S, int64_t ss) {
  __m256 a0[MR], a1[MR];
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int d = 0; d < HD; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kt + d * 16), k1 = _mm256_loadu_ps(kt + d * 16 + 8);
    for (int r = 0; r < MR; ++r) {
      const __m256 x = _mm256_broadcast_ss(q + r * HD + d);
      a0[r] = _mm256_fmadd_ps(x, k0, a0[r]);
      a1[r] = _mm256_fmadd_ps(x, k1, a1[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(S + r * ss, a0[r]);
    _mm256_storeu_ps(S + r * ss + 8, a1[r]);
  }
}

// W (MR rows of HD, columns c .. c + 15) = P (MR rows, n >= 1 keys; row stride ps) V (n rows, row
// stride vs): one block's product, from zero (the caller merges it into the running output).
template <int HD, int MR>
inline void values_tile(const float* P, int64_t ps, const float* v, int64_t vs, int64_t n, float* W, int c) {
  __m256 a0[MR], a1[MR];
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  // a do-while (n >= 1): with a for loop g++ kept a copy of the accumulators on the stack, stored on
  // every iteration
  const float* vr = v + c;
  const float* pr = P;
  do {
    const __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8);
    for (int r = 0; r < MR; ++r) {
      const __m256 x = _mm256_broadcast_ss(pr + r * ps);
      a0[r] = _mm256_fmadd_ps(x, v0, a0[r]);
      a1[r] = _mm256_fmadd_ps(x, v1, a1[r]);
    }
    vr += vs;
    ++pr;
  } while (--n > 0);
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(W + r * HD + c, a0[r]);
    _mm256_storeu_ps(W + r * HD + c + 8, a1[r]);
  }
}

// One group of mr rows (mr <= kMR) against keys [j0, j0 + n) of a block: scores, each row's online
// softmax update (running max m, sum l), W = P V from zero, O = O alpha + W. lim[r]: keys of row r
// in this block (<= 0: none; the row is left as it was). P V runs over the keys every row of the group
// attends, then each row's own further keys: no row reads a key past its position, so a non-finite V
// of a later key stays out of it (0 x inf is NaN), and a row's sums run over its keys in order
// whichever rows share its group (a chunk's rows come out bit for bit as the whole prompt's). A block's
// product is summed apart and then added to O (as torch's flash attention for CPU does), not chained
// onto O over all S keys: the error of a long chain grew ~10x torch's at S = 8,192 on flat rows.
template <int HD, int MR>
void group_block(const float* q, const float* kt, const float* v, int64_t vs, int64_t n, const int64_t* lim,
                 float* m, float* l, float* O, float* S, float* W) {
  const int64_t width = (n + 15) / 16 * 16;
  for (int64_t p = 0; p < width; p += 16) scores_tile<HD, MR>(q, kt + p * HD, S + p, kKeys);
  int64_t shared = n;  // keys every row of the group attends
  float alpha[kMR];
  for (int r = 0; r < MR; ++r) {
    float* s = S + r * kKeys;
    const int64_t c = std::min<int64_t>(lim[r], n);
    shared = std::min<int64_t>(shared, std::max<int64_t>(c, 0));
    alpha[r] = 1.0f;
    if (c <= 0) continue;
    // the row's max: a NaN score may be skipped here, but its exp below is NaN, and so is the row
    __m256 mv8 = _mm256_set1_ps(s[0]);
    int64_t j = 0;
    for (; j + 8 <= c; j += 8) mv8 = _mm256_max_ps(mv8, _mm256_loadu_ps(s + j));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mv8), _mm256_extractf128_ps(mv8, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float mx = _mm_cvtss_f32(h);
    for (; j < c; ++j) mx = std::max(mx, s[j]);
    const float mnew = std::max(m[r], mx);
    alpha[r] = m[r] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m[r] - mnew);
    // every score so far -inf (a key that overflowed): their weights are exp(-inf) = 0, not exp(-inf - -inf),
    // a NaN that had made the whole row NaN where torch's SDPA is finite (a tester's finding)
    const float mref = mnew == -std::numeric_limits<float>::infinity() ? 0.0f : mnew;
    const __m256 mv = _mm256_set1_ps(mref);
    __m256 sum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= c; j += 8) {
      const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
      _mm256_storeu_ps(s + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    float tail = 0.0f;
    for (; j < c; ++j) {
      s[j] = exp_nonpositive(s[j] - mref);
      tail += s[j];
    }
    l[r] = l[r] * alpha[r] + (hsum256(sum) + tail);
    m[r] = mnew;
  }
  if (shared > 0)
    for (int c = 0; c < HD; c += 16) values_tile<HD, MR>(S, kKeys, v, vs, shared, W, c);
  else
    std::fill(W, W + MR * HD, 0.0f);
  for (int r = 0; r < MR; ++r) {
    const int64_t c = std::min<int64_t>(lim[r], n);
    if (c <= 0) continue;
    float* w = W + r * HD;
    for (int64_t j = shared; j < c; ++j) {  // the keys past `shared` that row r attends (the block's diagonal)
      const __m256 x = _mm256_broadcast_ss(S + r * kKeys + j);
      for (int d = 0; d < HD; d += 8)
        _mm256_storeu_ps(w + d, _mm256_fmadd_ps(x, _mm256_loadu_ps(v + j * vs + d), _mm256_loadu_ps(w + d)));
    }
    const __m256 av = _mm256_set1_ps(alpha[r]);
    float* o = O + r * HD;
    for (int d = 0; d < HD; d += 8)
      _mm256_storeu_ps(o + d, _mm256_fmadd_ps(_mm256_loadu_ps(o + d), av, _mm256_loadu_ps(w + d)));
  }
}

template <int HD>
using GroupFn = void (*)(const float*, const float*, const float*, int64_t, int64_t, const int64_t*, float*, float*,
                         float*, float*, float*);

template <int HD>
GroupFn<HD> group_fn(int64_t mr) {
  switch (mr) {
    case 1: return &group_block<HD, 1>;
    case 2: return &group_block<HD, 2>;
    case 3: return &group_block<HD, 3>;
    case 4: return &group_block<HD, 4>;
    case 5: return &group_block<HD, 5>;
    default: return &group_block<HD, 6>;
  }
}

// Per-thread buffers of one work item: rows of scaled queries, outputs, running max and sum, the
// scores / probabilities and the block's P V of one group.
struct Rows {
  std::vector<float> q, o, m, l, s, w;
  std::vector<int64_t> pos;
  Rows(int64_t rows, int64_t hd) : q(rows * hd), o(rows * hd), m(rows), l(rows), s(kMR * kKeys), w(kMR * hd), pos(rows) {}
};

// Work item: query positions [i0, i0 + nq) of the chunk's T, all `group` heads of KV head g of
// sequence b; writes their rows of out (B, T, nh, HD).
template <int HD>
void attend_item(const at::Tensor& q, const float* kt, const at::Tensor& v, int64_t b, int64_t g, int64_t group,
                 int64_t start, int64_t T, int64_t i0, int64_t nq, float scale, float* out, int64_t nh, Rows& w) {
  const int64_t R = nq * group;
  const float* qd = q.data_ptr<float>() + b * q.stride(0);
  for (int64_t r = 0; r < R; ++r) {  // row r: position start + i0 + r / group, head g * group + r % group
    const int64_t i = i0 + r / group, h = g * group + r % group;
    const float* src = qd + h * q.stride(1) + i * q.stride(2);
    float* dst = w.q.data() + r * HD;
    for (int d = 0; d < HD; ++d) dst[d] = src[d] * scale;
    w.pos[r] = start + i;
  }
  std::fill(w.o.begin(), w.o.begin() + R * HD, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + R, -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.begin() + R, 0.0f);
  const float* vd = v.data_ptr<float>() + b * v.stride(0) + g * v.stride(1);
  const int64_t vs = v.stride(2), kend = start + i0 + nq;
  int64_t lim[kMR];
  for (int64_t j0 = 0; j0 < kend; j0 += kKeys) {
    for (int64_t r0 = 0; r0 < R; r0 += kMR) {
      const int64_t mr = std::min(kMR, R - r0);
      const int64_t n = std::min(kKeys, w.pos[r0 + mr - 1] + 1 - j0);  // keys the group's last row reaches
      if (n <= 0) continue;
      for (int64_t r = 0; r < mr; ++r) lim[r] = w.pos[r0 + r] + 1 - j0;
      group_fn<HD>(mr)(w.q.data() + r0 * HD, kt + j0 * HD, vd + j0 * vs, vs, n, lim, w.m.data() + r0, w.l.data() + r0,
                       w.o.data() + r0 * HD, w.s.data(), w.w.data());
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = i0 + r / group, h = g * group + r % group;
    const __m256 inv = _mm256_set1_ps(1.0f / w.l[r]);
    float* dst = out + ((b * T + i) * nh + h) * HD;
    for (int d = 0; d < HD; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(w.o.data() + r * HD + d), inv));
  }
}

template <int HD>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, float scale, at::Tensor& o) {
  const int64_t B = q.size(0), nh = q.size(1), T = q.size(2), nkv = k.size(1), S = k.size(2);
  const int64_t group = nh / nkv, start = S - T, Sp = (S + 15) / 16 * 16;
  // Query positions per work item: kQ, or fewer where that leaves under 4 items per thread (a short
  // chunk over a long cache: 3 items of 32 rows on 2 threads left one thread idle a third of the call).
  const int64_t want = 4 * at::get_num_threads(), per_pos = B * nkv;
  const int64_t qb = std::clamp<int64_t>(T * per_pos / want, 1, kQ), nb = (T + qb - 1) / qb;
  std::unique_ptr<float[]> kt(new float[B * nkv * Sp * HD]);  // every element written by pack_kt
  const float* kd = k.data_ptr<float>();
  at::parallel_for(0, B * nkv, 1, [&](int64_t a, int64_t e) {
    for (int64_t x = a; x < e; ++x)
      pack_kt<HD>(kd + x / nkv * k.stride(0) + x % nkv * k.stride(1), k.stride(2), S, kt.get() + x * Sp * HD);
  });
  float* od = o.data_ptr<float>();
  // Items in the order of query blocks 0, nb - 1, 1, nb - 2, ...: a causal chunk's late blocks attend to
  // more keys, and at::parallel_for hands each thread a contiguous range of items.
  at::parallel_for(0, nb * B * nkv, 1, [&](int64_t a, int64_t e) {
    Rows w(qb * group, HD);
    for (int64_t x = a; x < e; ++x) {
      const int64_t z = x / (B * nkv), bg = x % (B * nkv);
      const int64_t blk = z % 2 == 0 ? z / 2 : nb - 1 - z / 2;
      const int64_t i0 = blk * qb;
      attend_item<HD>(q, kt.get() + bg * Sp * HD, v, bg / nkv, bg % nkv, group, start, T, i0, std::min(qb, T - i0),
                      scale, od, nh, w);
    }
  });
}
#endif  // SFCL_PREFILL_AVX2

}  // namespace

// Whether prefill_attention runs here: the kernel library was built with AVX2 and FMA.
bool prefill_attention_ready() {
#ifdef SFCL_PREFILL_AVX2
  return true;
#else
  return false;
#endif
}

// q (B, nh, T, hd), k and v (B, nkv, S, hd): float32 CPU tensors whose last dimension is contiguous
// (other strides free: a cache row's views), hd 64 or 128, nh a multiple of nkv, 1 <= T <= S. The T
// queries sit at positions [S - T, S) and each attends causally to keys [0, its position]; softmax of
// scale q . k. Returns o (B, T, nh, hd) float32 contiguous (transpose(1, 2) gives torch's (B, nh, T, hd)
// layout of scaled_dot_product_attention). Raises (RuntimeError) where prefill_attention_ready() is false
// or for arguments that do not fit together.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(prefill_attention_ready(), "prefill_attention: needs a kernel build with -march enabling AVX2 and FMA");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "prefill_attention: CPU tensors");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "prefill_attention: q, k, v must be float32");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(),
              "prefill_attention: q (B, nh, T, hd), k and v (B, nkv, S, hd), got q ", q.sizes(), ", k ", k.sizes(),
              ", v ", v.sizes());
  const int64_t B = q.size(0), nh = q.size(1), T = q.size(2), hd = q.size(3), nkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == hd, "prefill_attention: q ", q.sizes(), " and k ", k.sizes(),
              " differ in batch or head size");
  TORCH_CHECK(hd == 64 || hd == 128, "prefill_attention: the head size must be 64 or 128, got ", hd);
  TORCH_CHECK(nkv >= 1 && nh >= 1 && nh % nkv == 0, "prefill_attention: nh must be a positive multiple of nkv, got nh = ",
              nh, ", nkv = ", nkv);
  TORCH_CHECK(T >= 1 && T <= S, "prefill_attention: 1 <= T <= S, got T = ", T, ", S = ", S);
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "prefill_attention: the head dimension must be contiguous");
  TORCH_CHECK(!at::GradMode::is_enabled() || !(q.requires_grad() || k.requires_grad() || v.requires_grad()),
              "prefill_attention: no autograd; call it under torch.inference_mode() or torch.no_grad()");
  at::Tensor o = at::empty({B, T, nh, hd}, q.options());
#ifdef SFCL_PREFILL_AVX2
  if (hd == 64)
    run<64>(q, k, v, static_cast<float>(scale), o);
  else
    run<128>(q, k, v, static_cast<float>(scale), o);
#endif
  return o;
}

}  // namespace sfcl

TORCH_LIBRARY_FRAGMENT(sfcl, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.def("prefill_attention_ready() -> bool", &sfcl::prefill_attention_ready);  // no tensor: a catch-all kernel
}
TORCH_LIBRARY_IMPL(sfcl, CPU, m) { m.impl("prefill_attention", &sfcl::prefill_attention); }
