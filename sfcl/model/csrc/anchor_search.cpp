// sfcl::anchor_search: the snapshot lookup's IVF pass over a library's anchors in one call, bound as
// the Python function anchor_search of SFCL's kernel module (bindings.cpp; sfcl/library/index.py
// builds its inputs and holds the torch version of the same steps).
//
// Per query row: normalise in float64 (as sfcl.library.index.unit_rows), quantise the unit query to
// int8 codes with one scale (max |q| / 127, as the anchors' codes), score the cell centroids (int8
// codes times a per-centroid scale) by integer dot products, keep the nprobe best cells, score their
// members' int8 codes (times a per-anchor scale) the same way and keep the R best as candidates,
// re-score the candidates in float32 against the library's stored float16 vectors and return the k
// best: the returned scores are the stored vectors' scores (up to float32 summation order), and with
// per-anchor weights and decays the snapshot confidence of each (sfcl.snapshot.triggers.
// anchor_confidence_each). The integer dot products are exact in int32 (|sum| <= D * 127^2 < 2^31
// for D <= 131,072), and for D <= 1,040 (sums below 2^24) sfcl.library.index.ivf_search_torch, which
// takes the same steps in float32, picks the same cells and candidates. They run 64 byte pairs per instruction (AVX512-VNNI vpdpbusd; AVX2
// vpmaddubsw on |q| and the codes with q's sign, as llama.cpp's q8 dot products), and the next
// cell's and the candidates' rows are prefetched: after a decode step the index is out of the
// caches, and the pass is memory-bound. The inverted file is Jégou et
// al., "Product quantization for nearest neighbor search", TPAMI 2011 (section on the inverted
// file), with scalar-quantised codes and an exact re-rank. One thread, no allocation per scanned
// anchor; why one call instead of faiss plus numpy: right after a decode step's forward has
// evicted the caches, each Python-level operation of a lookup costs tens of microseconds
// (docs/performance-journal.md, twelfth session). Why a pybind11 function and not a torch operator:
// torch.ops calls release the GIL, and taking it back from the server's event loop thread cost up
// to the interpreter's 5 ms switch interval (thirteenth session); the pass runs ~0.1 ms with it held.
//
// A row whose query is not finite, or whose cells hold fewer than k anchors, comes back with id
// -1 in every column that has no anchor; the caller searches such rows exactly.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "sfcl_kernels.h"

namespace sfcl {
namespace {

// Insert (v, id) into the descending list s[0..n) / ids[0..n) when it beats the last entry.
inline void keep_best(float* s, int64_t* ids, int64_t n, float v, int64_t id) {
  if (!(v > s[n - 1])) return;
  int64_t t = n - 1;
  while (t > 0 && s[t - 1] < v) {
    s[t] = s[t - 1];
    ids[t] = ids[t - 1];
    --t;
  }
  s[t] = v;
  ids[t] = id;
}

// One unit query as int8 codes: q ~ sign * mag * scale, mag = |round(q / scale)| in [0, 127].
struct QueryCodes {
  std::vector<uint8_t> mag;   // (D,)
  std::vector<int8_t> sign;   // (D,) -1 where the code is negative, else 1
  std::vector<uint64_t> neg;  // (D / 64,) bit i of word w: sign[64 w + i] < 0 (the AVX-512 form)
  float scale = 0.f;
};

// The codes of unit row qn (D,) float32 (scale = max |q| / 127, at least FLT_MIN; round half to even,
// as torch.round in sfcl.library.index.query_codes).
void quantise(const float* qn, int64_t D, QueryCodes& out) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(qn[d]));
  out.scale = std::max(amax / 127.f, std::numeric_limits<float>::min());
  out.mag.assign(D, 0);
  out.sign.assign(D, 1);
  out.neg.assign(D / 64, 0);
  for (int64_t d = 0; d < D; ++d) {
    const float c = std::nearbyint(qn[d] / out.scale);
    out.mag[d] = uint8_t(std::fabs(c));
    if (c < 0) {
      out.sign[d] = -1;
      if (d < int64_t(out.neg.size()) * 64) out.neg[d / 64] |= uint64_t{1} << (d % 64);
    }
  }
}

// sum_d q8[d] * v[d] for the int8 codes v (D,) of an anchor or centroid; exact in int32.
inline int32_t dot_codes(const int8_t* v, const QueryCodes& q, int64_t D) {
  int64_t d = 0;
  int32_t s = 0;
  const uint8_t* mag = q.mag.data();
#if defined(__AVX512BW__)
  __m512i acc = _mm512_setzero_si512();
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t w = 0; d + 64 <= D; d += 64, ++w) {
    const __m512i c = _mm512_mask_sub_epi8(_mm512_loadu_si512(v + d), __mmask64(q.neg[w]), zero,
                                           _mm512_loadu_si512(v + d));  // codes times q's sign
#if defined(__AVX512VNNI__)
    acc = _mm512_dpbusd_epi32(acc, _mm512_loadu_si512(mag + d), c);
#else  // |q| <= 127 and |c| <= 127: a pair sums to at most 32,258, no int16 saturation
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_loadu_si512(mag + d), c),
                                                  _mm512_set1_epi16(1)));
#endif
  }
  s = _mm512_reduce_add_epi32(acc);
#elif defined(__AVX2__)
  __m256i acc = _mm256_setzero_si256();
  const int8_t* sg = q.sign.data();
  for (; d + 32 <= D; d += 32) {
    const __m256i c = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + d)),
                                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg + d)));
    const __m256i p = _mm256_maddubs_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mag + d)), c);
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
  }
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
  s = _mm_cvtsi128_si32(h);
#endif
  for (; d < D; ++d) s += int32_t(mag[d]) * int32_t(q.sign[d]) * int32_t(v[d]);
  return s;
}

// dot_codes of rows v, v + D, v + 2D, v + 3D at once (four independent accumulations, one pass over q).
inline void dot_codes4(const int8_t* v, const QueryCodes& q, int64_t D, int32_t* out) {
#if defined(__AVX512BW__)
  if (D % 64 == 0) {
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t d = 0, w = 0; d < D; d += 64, ++w) {
      const __m512i m = _mm512_loadu_si512(q.mag.data() + d);
      const __mmask64 neg = __mmask64(q.neg[w]);
      for (int r = 0; r < 4; ++r) {
        const __m512i c = _mm512_loadu_si512(v + r * D + d);
        const __m512i cs = _mm512_mask_sub_epi8(c, neg, zero, c);
#if defined(__AVX512VNNI__)
        acc[r] = _mm512_dpbusd_epi32(acc[r], m, cs);
#else
        acc[r] = _mm512_add_epi32(acc[r], _mm512_madd_epi16(_mm512_maddubs_epi16(m, cs), _mm512_set1_epi16(1)));
#endif
      }
    }
    for (int r = 0; r < 4; ++r) out[r] = _mm512_reduce_add_epi32(acc[r]);
    return;
  }
#endif
  for (int r = 0; r < 4; ++r) out[r] = dot_codes(v + r * D, q, D);
}

// Prefetch the bytes [p, p + n) into the caches, a line at a time.
inline void prefetch(const void* p, int64_t n) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < n; i += 64) __builtin_prefetch(c + i, 0, 3);
}

}  // namespace

// queries (B, D) float32; stored (N, D) float16 (the library's vectors); centroids (C, D) int8
// with centroid_scale (C,) float32; offsets (C + 1,) int64: cell c's members are
// members[offsets[c] : offsets[c + 1]] (anchor ids, int32), their codes the same rows of codes
// (N, D) int8 with code_scale (N,) float32; weights, decay: (N,) float32 per anchor, or undefined
// (None). Returns (scores (B, k) float32, ids (B, k) int64, confidences (B, k) float32), best
// first; -inf / -1 / NaN where a row has no anchor (see the header); confidences NaN throughout
// without weights and decay. group_centroids (G, D) int8, group_scale (G,) float32, group_offsets
// (G + 1,) int64, or none of them: cells grouped (group g holds cells group_offsets[g] to
// group_offsets[g + 1]), and a row ranks only the centroids of its group_probe best groups (the
// second level of a hierarchical k-means tree: Muja & Lowe, "Scalable nearest neighbor algorithms
// for high dimensional data", TPAMI 2014). anchor_search_into writes the results to S, I and F
// (B * k each); anchor_search returns them as tensors, and bindings.cpp's anchor_lookup as Python
// lists (no torch operator: right after a decode step, creating three small tensors and reading
// them back cost a lookup ~0.05 ms, scripts/lookup_parts.py).
void anchor_search_into(
    const at::Tensor& queries, const at::Tensor& stored, const at::Tensor& centroids, const at::Tensor& centroid_scale,
    const at::Tensor& offsets, const at::Tensor& members, const at::Tensor& codes, const at::Tensor& code_scale,
    int64_t nprobe, int64_t k, int64_t n_candidates, const c10::optional<at::Tensor>& weights,
    const c10::optional<at::Tensor>& decay, const c10::optional<at::Tensor>& group_centroids,
    const c10::optional<at::Tensor>& group_scale, const c10::optional<at::Tensor>& group_offsets,
    int64_t group_probe, float* S, int64_t* I, float* F) {
  TORCH_CHECK(queries.dim() == 2 && queries.scalar_type() == at::kFloat && queries.is_contiguous(),
              "anchor_search: queries must be a contiguous (B, D) float32 tensor");
  const int64_t B = queries.size(0), D = queries.size(1);
  TORCH_CHECK(D <= 131072, "anchor_search: D must be at most 131072 (int32 sums of int8 products), got ", D);
  TORCH_CHECK(stored.dim() == 2 && stored.size(1) == D && stored.scalar_type() == at::kHalf && stored.is_contiguous(),
              "anchor_search: stored must be a contiguous (N, D) float16 tensor with the queries' D");
  const int64_t N = stored.size(0);
  TORCH_CHECK(centroids.dim() == 2 && centroids.size(1) == D && centroids.scalar_type() == at::kChar &&
                  centroids.is_contiguous() && centroids.size(0) >= 1,
              "anchor_search: centroids must be a contiguous (C >= 1, D) int8 tensor");
  const int64_t C = centroids.size(0);
  TORCH_CHECK(centroid_scale.dim() == 1 && centroid_scale.size(0) == C && centroid_scale.scalar_type() == at::kFloat &&
                  centroid_scale.is_contiguous(),
              "anchor_search: centroid_scale must be a contiguous (C,) float32 tensor");
  TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) == C + 1 && offsets.scalar_type() == at::kLong && offsets.is_contiguous(),
              "anchor_search: offsets must be a contiguous (C + 1,) int64 tensor");
  const int64_t M = members.numel();
  TORCH_CHECK(members.dim() == 1 && members.scalar_type() == at::kInt && members.is_contiguous(),
              "anchor_search: members must be a contiguous 1-D int32 tensor");
  TORCH_CHECK(codes.dim() == 2 && codes.size(0) == M && codes.size(1) == D && codes.scalar_type() == at::kChar &&
                  codes.is_contiguous(),
              "anchor_search: codes must be a contiguous (members, D) int8 tensor");
  TORCH_CHECK(code_scale.dim() == 1 && code_scale.size(0) == M && code_scale.scalar_type() == at::kFloat &&
                  code_scale.is_contiguous(),
              "anchor_search: code_scale must be a contiguous (members,) float32 tensor");
  TORCH_CHECK(nprobe >= 1 && k >= 1 && n_candidates >= k, "anchor_search: need nprobe >= 1 and n_candidates >= k >= 1");
  TORCH_CHECK(weights.has_value() == decay.has_value(), "anchor_search: give both weights and decay, or neither");
  const float* W = nullptr;
  const float* L = nullptr;
  if (weights.has_value()) {
    for (const at::Tensor* t : {&*weights, &*decay})
      TORCH_CHECK(t->dim() == 1 && t->size(0) == N && t->scalar_type() == at::kFloat && t->is_contiguous(),
                  "anchor_search: weights and decay must be contiguous (N,) float32 tensors");
    W = weights->data_ptr<float>();
    L = decay->data_ptr<float>();
  }
  // groups of cells (a second level over the centroids): group g holds cells [goff[g], goff[g + 1])
  const bool grouped = group_centroids.has_value();
  TORCH_CHECK(grouped == group_scale.has_value() && grouped == group_offsets.has_value(),
              "anchor_search: give group_centroids, group_scale and group_offsets together, or none");
  const int8_t* G8 = nullptr;
  const float* g_scale = nullptr;
  const int64_t* goff = nullptr;
  int64_t G = 0, gp = 0;
  if (grouped) {
    G = group_centroids->dim() == 2 ? group_centroids->size(0) : 0;
    TORCH_CHECK(G >= 1 && group_centroids->size(1) == D && group_centroids->scalar_type() == at::kChar &&
                    group_centroids->is_contiguous(),
                "anchor_search: group_centroids must be a contiguous (G >= 1, D) int8 tensor");
    TORCH_CHECK(group_scale->dim() == 1 && group_scale->size(0) == G && group_scale->scalar_type() == at::kFloat &&
                    group_scale->is_contiguous(),
                "anchor_search: group_scale must be a contiguous (G,) float32 tensor");
    TORCH_CHECK(group_offsets->dim() == 1 && group_offsets->size(0) == G + 1 &&
                    group_offsets->scalar_type() == at::kLong && group_offsets->is_contiguous(),
                "anchor_search: group_offsets must be a contiguous (G + 1,) int64 tensor");
    TORCH_CHECK(group_probe >= 1, "anchor_search: group_probe must be >= 1");
    G8 = group_centroids->data_ptr<int8_t>();
    g_scale = group_scale->data_ptr<float>();
    goff = group_offsets->data_ptr<int64_t>();
    TORCH_CHECK(goff[0] == 0 && goff[G] == C, "anchor_search: group_offsets must run from 0 to the number of cells");
    for (int64_t g = 0; g < G; ++g)
      TORCH_CHECK(goff[g] <= goff[g + 1], "anchor_search: group_offsets must not decrease (group ", g, ")");
    gp = std::min(group_probe, G);
  }
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[C] == M, "anchor_search: offsets must run from 0 to the number of members");
  for (int64_t c = 0; c < C; ++c)  // O(C): a decreasing entry would send the scan outside members
    TORCH_CHECK(off[c] <= off[c + 1], "anchor_search: offsets must not decrease (cell ", c, ")");

  const float kNegInf = -std::numeric_limits<float>::infinity();
  std::fill(S, S + B * k, kNegInf);
  std::fill(I, I + B * k, int64_t{-1});
  std::fill(F, F + B * k, std::numeric_limits<float>::quiet_NaN());
  if (B == 0) return;
  const float* Q = queries.data_ptr<float>();
  const uint16_t* V = reinterpret_cast<const uint16_t*>(stored.data_ptr<at::Half>());
  const int8_t* C8 = centroids.data_ptr<int8_t>();
  const float* c_scale = centroid_scale.data_ptr<float>();
  const int32_t* mem = members.data_ptr<int32_t>();
  const int8_t* L8 = codes.data_ptr<int8_t>();
  const float* l_scale = code_scale.data_ptr<float>();
  const int64_t np = std::min(nprobe, C);
  const int64_t ahead = 8;  // centroid rows prefetched ahead of the scan

  std::vector<float> qn(B * D), cs(grouped ? 0 : B * C);
  std::vector<char> finite(B);
  std::vector<QueryCodes> qc(B);
  for (int64_t b = 0; b < B; ++b) {  // unit rows, the norm in float64 (sfcl.library.index.unit_rows)
    const float* q = Q + b * D;
    double ss = 0.0;
    for (int64_t d = 0; d < D; ++d) ss += double(q[d]) * double(q[d]);
    const double norm = std::sqrt(ss);
    finite[b] = std::isfinite(norm);
    const double den = std::max(norm, double(std::numeric_limits<double>::min()));
    for (int64_t d = 0; d < D; ++d) qn[b * D + d] = float(double(q[d]) / den);
    if (finite[b]) quantise(&qn[b * D], D, qc[b]);
  }
  int64_t c0 = grouped ? C : 0;  // grouped: each row scores the centroids of its groups below
  for (; c0 + 4 <= C; c0 += 4) {  // each centroid read once for all rows, four at a time
    if (c0 + ahead + 4 <= C) prefetch(C8 + (c0 + ahead) * D, 4 * D);
    for (int64_t b = 0; b < B; ++b) {
      if (!finite[b]) continue;
      int32_t dots[4];
      dot_codes4(C8 + c0 * D, qc[b], D, dots);
      for (int r = 0; r < 4; ++r) cs[b * C + c0 + r] = float(dots[r]) * (c_scale[c0 + r] * qc[b].scale);
    }
  }
  for (int64_t c = grouped ? C : c0; c < C; ++c)
    for (int64_t b = 0; b < B; ++b)
      if (finite[b]) cs[b * C + c] = float(dot_codes(C8 + c * D, qc[b], D)) * (c_scale[c] * qc[b].scale);
  // rows [b0, b1): cells, candidates and re-score, each row on its own. One thread: rows split over
  // torch's threads (a parallel_for, the engine's OpenMP workers still spinning after the step) did
  // not lower the served lookup's p99 and once waited 1.5 ms for a worker (fifteenth session).
  auto rows = [&](int64_t b0, int64_t b1) {
    std::vector<float> cand_s(n_candidates), probe_s(np), group_s(gp);
    std::vector<int64_t> cand(n_candidates), probe(np), group(gp);
    for (int64_t b = b0; b < b1; ++b) {
      if (!finite[b]) continue;
      const float* q = &qn[b * D];
      std::fill(probe_s.begin(), probe_s.end(), kNegInf);
      std::fill(probe.begin(), probe.end(), -1);
      if (!grouped) {
        const float* row_cs = &cs[b * C];
        for (int64_t c = 0; c < C; ++c) keep_best(probe_s.data(), probe.data(), np, row_cs[c], c);  // ties: lower c
      } else {  // the group_probe best groups, then the nprobe best cells among their centroids
        std::fill(group_s.begin(), group_s.end(), kNegInf);
        std::fill(group.begin(), group.end(), -1);
        for (int64_t g = 0; g < G; ++g)
          keep_best(group_s.data(), group.data(), gp, float(dot_codes(G8 + g * D, qc[b], D)) * (g_scale[g] * qc[b].scale), g);
        std::sort(group.begin(), group.end());  // ascending cells: ties between cells go to the lower one
        for (int64_t i = 0; i < gp && group[i] >= 0; ++i) {
          int64_t c = goff[group[i]];
          const int64_t end = goff[group[i] + 1];
          for (; c + 4 <= end; c += 4) {
            int32_t dots[4];
            dot_codes4(C8 + c * D, qc[b], D, dots);
            for (int r = 0; r < 4; ++r)
              keep_best(probe_s.data(), probe.data(), np, float(dots[r]) * (c_scale[c + r] * qc[b].scale), c + r);
          }
          for (; c < end; ++c)
            keep_best(probe_s.data(), probe.data(), np, float(dot_codes(C8 + c * D, qc[b], D)) * (c_scale[c] * qc[b].scale), c);
        }
      }
      std::fill(cand_s.begin(), cand_s.end(), kNegInf);
      std::fill(cand.begin(), cand.end(), -1);
      int64_t scanned = 0;
      for (int64_t p = 0; p < np && probe[p] >= 0; ++p) {
        const int64_t c = probe[p];
        const int64_t nxt = p + 1 < np && probe[p + 1] >= 0 ? probe[p + 1] : -1;
        const int64_t n_next = nxt >= 0 ? off[nxt + 1] - off[nxt] : 0;
        for (int64_t j = off[c]; j < off[c + 1]; ++j) {
          const int64_t r = j - off[c];
          if (r < n_next) prefetch(L8 + (off[nxt] + r) * D, D);  // the next cell's row r
          keep_best(cand_s.data(), cand.data(), n_candidates,
                    float(dot_codes(L8 + j * D, qc[b], D)) * (l_scale[j] * qc[b].scale), mem[j]);
        }
        for (int64_t r = off[c + 1] - off[c]; r < n_next; ++r) prefetch(L8 + (off[nxt] + r) * D, D);
        scanned += off[c + 1] - off[c];
      }
      if (scanned < k) continue;  // short: the caller searches this row exactly
      int64_t n_cand = 0;
      for (; n_cand < n_candidates && cand[n_cand] >= 0; ++n_cand) {
        TORCH_CHECK(cand[n_cand] < N, "anchor_search: member id ", cand[n_cand], " out of range for ", N, " anchors");
        prefetch(V + cand[n_cand] * D, D * 2);
      }
      float* s = S + b * k;
      int64_t* id = I + b * k;
      for (int64_t r = 0; r < n_cand; ++r) keep_best(s, id, k, dot_f16(V + cand[r] * D, q, D), cand[r]);
      if (W != nullptr)
        for (int64_t j = 0; j < k && id[j] >= 0; ++j) {  // sfcl.snapshot.triggers.anchor_confidence_each
          const float c = W[id[j]] * std::exp(-L[id[j]] * std::max(0.f, 1.f - s[j]));
          F[b * k + j] = c != c ? c : std::min(1.f, std::max(0.f, c));  // NaN stays NaN, as numpy's clip leaves it
        }
    }
  };
  rows(0, B);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> anchor_search(
    const at::Tensor& queries, const at::Tensor& stored, const at::Tensor& centroids, const at::Tensor& centroid_scale,
    const at::Tensor& offsets, const at::Tensor& members, const at::Tensor& codes, const at::Tensor& code_scale,
    int64_t nprobe, int64_t k, int64_t n_candidates, const c10::optional<at::Tensor>& weights,
    const c10::optional<at::Tensor>& decay, const c10::optional<at::Tensor>& group_centroids,
    const c10::optional<at::Tensor>& group_scale, const c10::optional<at::Tensor>& group_offsets,
    int64_t group_probe) {
  TORCH_CHECK(queries.dim() == 2 && k >= 1, "anchor_search: queries must be a (B, D) tensor and k >= 1");
  const int64_t B = queries.size(0);
  auto scores = at::empty({B, k}, at::kFloat);
  auto ids = at::empty({B, k}, at::kLong);
  auto conf = at::empty({B, k}, at::kFloat);
  anchor_search_into(queries, stored, centroids, centroid_scale, offsets, members, codes, code_scale, nprobe, k,
                     n_candidates, weights, decay, group_centroids, group_scale, group_offsets, group_probe,
                     scores.data_ptr<float>(), ids.data_ptr<int64_t>(), conf.data_ptr<float>());
  return {scores, ids, conf};
}

}  // namespace sfcl
