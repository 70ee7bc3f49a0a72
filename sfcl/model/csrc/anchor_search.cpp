// sfcl::anchor_search: the snapshot lookup's IVF pass over a library's anchors in one call, bound as
// the Python function anchor_search of SFCL's kernel module (bindings.cpp; sfcl/library/index.py
// builds its inputs and holds the torch version of the same steps).
//
// Per query row: normalise in float64 (as sfcl.library.index.unit_rows), score the cell centroids
// (int8 codes times a per-centroid scale), keep the nprobe best cells, score their members' int8
// codes (times a per-anchor scale) and keep the R best as candidates, re-score the candidates in
// float32 against the library's stored float16 vectors and return the k best: the returned scores
// are the stored vectors' scores (up to float32 summation order). The inverted file is Jégou et
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

}  // namespace

// queries (B, D) float32; stored (N, D) float16 (the library's vectors); centroids (C, D) int8
// with centroid_scale (C,) float32; offsets (C + 1,) int64: cell c's members are
// members[offsets[c] : offsets[c + 1]] (anchor ids, int32), their codes the same rows of codes
// (N, D) int8 with code_scale (N,) float32. Returns (scores (B, k) float32, ids (B, k) int64),
// best first; -inf / -1 where a row has no anchor (see the header).
std::tuple<at::Tensor, at::Tensor> anchor_search(const at::Tensor& queries, const at::Tensor& stored,
                                                 const at::Tensor& centroids, const at::Tensor& centroid_scale,
                                                 const at::Tensor& offsets, const at::Tensor& members,
                                                 const at::Tensor& codes, const at::Tensor& code_scale,
                                                 int64_t nprobe, int64_t k, int64_t n_candidates) {
  TORCH_CHECK(queries.dim() == 2 && queries.scalar_type() == at::kFloat && queries.is_contiguous(),
              "anchor_search: queries must be a contiguous (B, D) float32 tensor");
  const int64_t B = queries.size(0), D = queries.size(1);
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
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[C] == M, "anchor_search: offsets must run from 0 to the number of members");
  for (int64_t c = 0; c < C; ++c)  // O(C): a decreasing entry would send the scan outside members
    TORCH_CHECK(off[c] <= off[c + 1], "anchor_search: offsets must not decrease (cell ", c, ")");

  const float kNegInf = -std::numeric_limits<float>::infinity();
  auto scores = at::full({B, k}, kNegInf, queries.options());
  auto ids = at::full({B, k}, -1, queries.options().dtype(at::kLong));
  if (B == 0) return {scores, ids};
  const float* Q = queries.data_ptr<float>();
  const uint16_t* V = reinterpret_cast<const uint16_t*>(stored.data_ptr<at::Half>());
  const int8_t* C8 = centroids.data_ptr<int8_t>();
  const float* c_scale = centroid_scale.data_ptr<float>();
  const int32_t* mem = members.data_ptr<int32_t>();
  const int8_t* L8 = codes.data_ptr<int8_t>();
  const float* l_scale = code_scale.data_ptr<float>();
  float* S = scores.data_ptr<float>();
  int64_t* I = ids.data_ptr<int64_t>();
  const int64_t np = std::min(nprobe, C);

  std::vector<float> qn(B * D), cs(B * C), cand_s(n_candidates);
  std::vector<int64_t> cand(n_candidates);
  std::vector<int32_t> order(C);
  std::vector<char> finite(B);
  for (int64_t b = 0; b < B; ++b) {  // unit rows, the norm in float64 (sfcl.library.index.unit_rows)
    const float* q = Q + b * D;
    double ss = 0.0;
    for (int64_t d = 0; d < D; ++d) ss += double(q[d]) * double(q[d]);
    const double norm = std::sqrt(ss);
    finite[b] = std::isfinite(norm);
    const double den = std::max(norm, double(std::numeric_limits<double>::min()));
    for (int64_t d = 0; d < D; ++d) qn[b * D + d] = float(double(q[d]) / den);
  }
  for (int64_t c = 0; c < C; ++c)  // each centroid read once for all rows
    for (int64_t b = 0; b < B; ++b) cs[b * C + c] = c_scale[c] * dot_i8(C8 + c * D, &qn[b * D], D);
  for (int64_t b = 0; b < B; ++b) {
    if (!finite[b]) continue;
    const float* q = &qn[b * D];
    const float* row_cs = &cs[b * C];
    for (int64_t c = 0; c < C; ++c) order[c] = int32_t(c);
    std::partial_sort(order.begin(), order.begin() + np, order.end(),
                      [row_cs](int32_t x, int32_t y) { return row_cs[x] > row_cs[y] || (row_cs[x] == row_cs[y] && x < y); });
    std::fill(cand_s.begin(), cand_s.end(), kNegInf);
    std::fill(cand.begin(), cand.end(), -1);
    int64_t scanned = 0;
    for (int64_t p = 0; p < np; ++p) {
      const int32_t c = order[p];
      for (int64_t j = off[c]; j < off[c + 1]; ++j)
        keep_best(cand_s.data(), cand.data(), n_candidates, l_scale[j] * dot_i8(L8 + j * D, q, D), mem[j]);
      scanned += off[c + 1] - off[c];
    }
    if (scanned < k) continue;  // short: the caller searches this row exactly
    float* s = S + b * k;
    int64_t* id = I + b * k;
    for (int64_t r = 0; r < n_candidates && cand[r] >= 0; ++r) {
      TORCH_CHECK(cand[r] < N, "anchor_search: member id ", cand[r], " out of range for ", N, " anchors");
      keep_best(s, id, k, dot_f16(V + cand[r] * D, q, D), cand[r]);
    }
  }
  return {scores, ids};
}

}  // namespace sfcl
