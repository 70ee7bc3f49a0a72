// sfcl::anchor_search: the snapshot lookup's IVF pass over a library's anchors in one call, bound as
// the Python function anchor_search of SFCL's kernel module (bindings.cpp; sfcl/library/index.py
// builds its inputs and holds the torch version of the same steps).
//
// Per query row: normalise in float64 (as sfcl.library.index.unit_rows); with groups, quantise the
// unit query to int8 codes with one scale (max |q| / 127) and score the groups' int8 centroids
// (times a per-group scale) by integer dot products; score the cell centroids' 4-bit codes
// (sfcl.library.index.sq4_rows: per-dimension steps, two codes per byte) against the int8 codes of
// the query times the centroids' steps (sq4_query; the rows of one call read each chosen group's
// cells once for all the rows that chose it), keep the nprobe best cells, score their
// members as q . c (the cell centroid's float16 vector) plus the query's scale times the integer
// sum of its codes (times the residuals' steps) with the 4-bit codes of the member's residual
// from c (as faiss's IndexIVFScalarQuantizer by_residual), keep the R best as candidates, re-score the candidates in float32 against the library's stored float16
// vectors and return the k best: the returned scores are the stored vectors' scores (up to float32
// summation order), and with per-anchor weights and decays the snapshot confidence of each
// (sfcl.snapshot.triggers.anchor_confidence_each). A centroid's 4-bit score is the integer sum
// itself: q . x = q . lo + sum_d (q_d step_d) code_d and q . lo is the same for every row. The
// integer dot products are exact in int32, and below 2^24 (D <= 1,040 for the int8 groups, Dp <=
// 8,808 for the 4-bit codes) sfcl.library.index.ivf_search_torch, which takes the same steps in
// float32, picks the same cells (ties to the lower cell, as here) and, up to the float32 rounding of
// q . c, the same candidates (ties to the earlier row). They run 64 byte pairs per instruction
// (AVX512-VNNI vpdpbusd; AVX2 vpmaddubsw, as llama.cpp's q4 and q8 dot products), and the next
// cell's and the candidates' rows are prefetched: after a decode step the index is out of the
// caches (the codes are 4-bit since a lookup of several rows cost ~0.045 ms per row with int8
// codes; docs/performance-journal.md, twentieth session). The inverted file is Jégou et al., "Product quantization for nearest neighbor
// search", TPAMI 2011 (section on the inverted file), with scalar-quantised codes (as faiss's
// IndexIVFScalarQuantizer, QT_4bit) and an exact re-rank. One thread, no allocation per scanned
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
#include <memory>
#include <tuple>
#include <vector>

#include "sfcl_kernels.h"

namespace sfcl {

// One unit query as int8 codes: q ~ sign * mag * scale, mag = |round(q / scale)| in [0, 127].
struct QueryCodes {
  std::vector<uint8_t> mag;   // (D,)
  std::vector<int8_t> sign;   // (D,) -1 where the code is negative, else 1
  std::vector<uint64_t> neg;  // (D / 64,) bit i of word w: sign[64 w + i] < 0 (the AVX-512 form)
  float scale = 0.f;
};

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

// Int8 codes out (n,) of x (n,) float32 with one scale, returned: max |x| / 127 (at least FLT_MIN),
// codes round(x / scale) half to even, as sfcl.library.index.int8_rows (torch.round of the same
// quotient). A lookup quantises each query row three times (the groups', centroids' and anchors'
// codes): in scalar code with a division per element that was a third of the pass (perf, twentieth
// session), hence the AVX-512 and AVX2 forms (the AVX2 one since the thirty-first session: until then
// an AVX2-only CPU ran this, the split, the query's norm and the four-row scans in scalar or one-row code).
float quantise_into(const float* x, int64_t n, int8_t* out) {
  int64_t i = 0;
  float amax = 0.f;
#if defined(__AVX512F__)
  __m512 m = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  amax = _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#endif
  for (; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = std::max(amax / 127.f, std::numeric_limits<float>::min());
  i = 0;
#if defined(__AVX512F__)
  const __m512 sc = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 c = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), sc), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(c, lo), hi))));
  }
#elif defined(__AVX2__)  // 32 at a time: the same division and rounding (half to even), packed in order
  const __m256 sc = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo the packs' lane interleave
  for (; i + 32 <= n; i += 32) {
    __m256i v[4];
    for (int j = 0; j < 4; ++j) {
      const __m256 c = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i + 8 * j), sc), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(c, lo), hi));
    }
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_permutevar8x32_epi32(b, order));
  }
#endif
  for (; i < n; ++i) out[i] = int8_t(std::max(-127.f, std::min(127.f, std::nearbyint(x[i] / scale))));
  return scale;
}

// The codes of unit row qn (D,) float32 (quantise_into), split as dot_codes takes them. The split
// runs 64 codes per instruction on AVX-512BW and 32 on AVX2: as a scalar loop it was ~14% of a warm
// lookup (perf, twenty-first session).
void quantise(const float* qn, int64_t D, int8_t* c, QueryCodes& out) {  // c (D,): scratch
  out.scale = quantise_into(qn, D, c);
  out.mag.resize(D);
  out.sign.resize(D);
  out.neg.assign(D / 64, 0);
  int64_t d = 0;
#if defined(__AVX512BW__)
  for (int64_t w = 0; d + 64 <= D; d += 64, ++w) {
    const __m512i v = _mm512_loadu_si512(c + d);
    const __mmask64 m = _mm512_movepi8_mask(v);  // the codes' sign bits
    _mm512_storeu_si512(out.mag.data() + d, _mm512_abs_epi8(v));
    _mm512_storeu_si512(out.sign.data() + d, _mm512_mask_blend_epi8(m, _mm512_set1_epi8(1), _mm512_set1_epi8(-1)));
    out.neg[w] = uint64_t(m);
  }
#elif defined(__AVX2__)
  const __m256i zero = _mm256_setzero_si256(), one = _mm256_set1_epi8(1);
  for (int64_t w = 0; d + 64 <= D; d += 64, ++w) {
    uint64_t bits = 0;
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + d + 32 * h));
      const __m256i neg = _mm256_cmpgt_epi8(zero, v);  // -1 where the code is negative
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.mag.data() + d + 32 * h), _mm256_abs_epi8(v));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.sign.data() + d + 32 * h), _mm256_or_si256(neg, one));
      bits |= uint64_t(uint32_t(_mm256_movemask_epi8(neg))) << (32 * h);
    }
    out.neg[w] = bits;
  }
#endif
  for (; d < D; ++d) {
    out.mag[d] = uint8_t(c[d] < 0 ? -c[d] : c[d]);
    out.sign[d] = c[d] < 0 ? -1 : 1;
    if (c[d] < 0 && d < int64_t(out.neg.size()) * 64) out.neg[d / 64] |= uint64_t{1} << (d % 64);
  }
}

#if defined(__AVX512BW__)
// acc plus the int32 sums of four adjacent products of unsigned bytes u and signed bytes v (64 of
// each): vpdpbusd on AVX512-VNNI, else vpmaddubsw + vpmaddwd, whose int16 pair sums do not saturate
// for the codes here (4-bit codes times int8: at most 3,810; int8 magnitudes times int8: 32,258).
inline __m512i dot_acc(__m512i acc, __m512i u, __m512i v) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, v);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, v), _mm512_set1_epi16(1)));
#endif
}
#endif

#if defined(__AVX2__) && !defined(__AVX512BW__)
// The 64 codes of block w of a packed row p as two vectors of bytes: lo = dimensions 64 w .. 64 w + 31,
// hi = 64 w + 32 .. 64 w + 63 (sq4_rows' layout).
inline void sq4_block_avx2(const uint8_t* p, int64_t w, __m256i& lo, __m256i& hi) {
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + w * 32));
  lo = _mm256_and_si256(v, m4);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
}

// acc plus the int32 sums of four adjacent products of unsigned bytes u and signed bytes v (32 of
// each; vpmaddubsw + vpmaddwd, whose int16 pair sums do not saturate for 4-bit codes times int8).
inline __m256i dot_acc_avx2(__m256i acc, __m256i u, __m256i v) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1)));
}

inline int32_t hsum_epi32(__m256i acc) {
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
  return _mm_cvtsi128_si32(h);
}
#endif

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
    acc = dot_acc(acc, _mm512_loadu_si512(mag + d), c);
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
  s = hsum_epi32(acc);
#endif
  for (; d < D; ++d) s += int32_t(mag[d]) * int32_t(q.sign[d]) * int32_t(v[d]);
  return s;
}

constexpr int64_t kSq4Block = 64;  // dimensions per block of packed 4-bit codes (sfcl.library.index.SQ4_BLOCK)

// Int8 codes q8 (Dp,) of the unit query qn (D,) times step (Dp,) (zero past D), as
// sfcl.library.index.sq4_query; t (Dp,) is scratch. Returns the codes' scale.
float sq4_query(const float* qn, int64_t D, const float* step, int64_t Dp, float* t, int8_t* q8) {
  for (int64_t d = 0; d < D; ++d) t[d] = qn[d] * step[d];
  std::fill(t + D, t + Dp, 0.f);
  return quantise_into(t, Dp, q8);
}

#if defined(__AVX512BW__)
// The 64 codes of block w of a packed row p (dimensions 64 w .. 64 w + 63, in order) as bytes.
inline __m512i sq4_block(const uint8_t* p, int64_t w) {
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + w * 32));
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, m4)), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4), 1);
}
#endif

// sum_d q8[d] * code[d] over the packed 4-bit codes p (Dp / 2,) of one row (sq4_rows' layout: block
// w's byte j holds dimension 64 w + j low and 64 w + 32 + j high); exact in int32.
inline int32_t dot_sq4(const uint8_t* p, const int8_t* q8, int64_t Dp) {
#if defined(__AVX512BW__)
  __m512i acc = _mm512_setzero_si512();
  for (int64_t w = 0; w < Dp / kSq4Block; ++w) acc = dot_acc(acc, sq4_block(p, w), _mm512_loadu_si512(q8 + w * kSq4Block));
  return _mm512_reduce_add_epi32(acc);
#elif defined(__AVX2__)
  __m256i acc = _mm256_setzero_si256();
  for (int64_t w = 0; w < Dp / kSq4Block; ++w) {
    const __m256i* q = reinterpret_cast<const __m256i*>(q8 + w * kSq4Block);
    __m256i lo, hi;
    sq4_block_avx2(p, w, lo, hi);
    acc = dot_acc_avx2(dot_acc_avx2(acc, lo, _mm256_loadu_si256(q)), hi, _mm256_loadu_si256(q + 1));
  }
  return hsum_epi32(acc);
#else
  int32_t s = 0;
  for (int64_t w = 0; w < Dp / kSq4Block; ++w)
    for (int64_t j = 0; j < 32; ++j) {
      const uint8_t b = p[w * 32 + j];
      s += int32_t(b & 15) * q8[w * kSq4Block + j] + int32_t(b >> 4) * q8[w * kSq4Block + 32 + j];
    }
  return s;
#endif
}

// dot_sq4 of rows p, p + Dp / 2, p + Dp, p + 3 Dp / 2 at once: four independent accumulations (one
// row's sum is a chain of dependent multiply-adds, so a row at a time waits on their latency).
inline void dot_sq4_4(const uint8_t* p, const int8_t* q8, int64_t Dp, int32_t* out) {
#if defined(__AVX512BW__)
  __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int64_t w = 0; w < Dp / kSq4Block; ++w) {
    const __m512i q = _mm512_loadu_si512(q8 + w * kSq4Block);
    for (int r = 0; r < 4; ++r) acc[r] = dot_acc(acc[r], sq4_block(p + r * (Dp / 2), w), q);
  }
  for (int r = 0; r < 4; ++r) out[r] = _mm512_reduce_add_epi32(acc[r]);
#elif defined(__AVX2__)
  __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int64_t w = 0; w < Dp / kSq4Block; ++w) {
    const __m256i* q = reinterpret_cast<const __m256i*>(q8 + w * kSq4Block);
    const __m256i q_lo = _mm256_loadu_si256(q), q_hi = _mm256_loadu_si256(q + 1);
    for (int r = 0; r < 4; ++r) {
      __m256i lo, hi;
      sq4_block_avx2(p + r * (Dp / 2), w, lo, hi);
      acc[r] = dot_acc_avx2(dot_acc_avx2(acc[r], lo, q_lo), hi, q_hi);
    }
  }
  for (int r = 0; r < 4; ++r) out[r] = hsum_epi32(acc[r]);
#else
  for (int r = 0; r < 4; ++r) out[r] = dot_sq4(p + r * (Dp / 2), q8, Dp);
#endif
}

// dot_sq4 of the one row p against nq <= 4 query code rows q8[0..nq) at once (out[r] for q8[r]):
// a cell centroid that several of a step's rows rank is read and unpacked once for all of them.
inline void dot_sq4_q(const uint8_t* p, const int8_t* const* q8, int nq, int64_t Dp, int32_t* out) {
#if defined(__AVX512BW__)
  __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int64_t w = 0; w < Dp / kSq4Block; ++w) {
    const __m512i c = sq4_block(p, w);
    for (int r = 0; r < nq && r < 4; ++r) acc[r] = dot_acc(acc[r], c, _mm512_loadu_si512(q8[r] + w * kSq4Block));
  }
  for (int r = 0; r < nq; ++r) out[r] = _mm512_reduce_add_epi32(acc[r]);
#elif defined(__AVX2__)
  __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int64_t w = 0; w < Dp / kSq4Block; ++w) {
    __m256i lo, hi;
    sq4_block_avx2(p, w, lo, hi);
    for (int r = 0; r < nq && r < 4; ++r) {
      const __m256i* q = reinterpret_cast<const __m256i*>(q8[r] + w * kSq4Block);
      acc[r] = dot_acc_avx2(dot_acc_avx2(acc[r], lo, _mm256_loadu_si256(q)), hi, _mm256_loadu_si256(q + 1));
    }
  }
  for (int r = 0; r < nq; ++r) out[r] = hsum_epi32(acc[r]);
#else
  for (int r = 0; r < nq; ++r) out[r] = dot_sq4(p, q8[r], Dp);
#endif
}

// Prefetch the bytes [p, p + n) into the caches, a line at a time.
inline void prefetch(const void* p, int64_t n) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < n; i += 64) __builtin_prefetch(c + i, 0, 3);
}

// Software prefetch over byte ranges read in order (one row's probed cells' codes), kept a fixed
// distance ahead of the reader across the ranges' ends: the hardware's stream prefetcher stops at
// each cell's end (and at 4 KB pages). See kScanAhead. Only the first kMax ranges are prefetched
// (an nprobe above 64 leaves the rest to the hardware); `issued` counts whole lines, so it runs up
// to a line per range ahead of the bytes the reader counts.
struct RangePrefetch {
  static constexpr int kMax = 64;
  const uint8_t* p[kMax];
  int64_t n[kMax];
  int nr = 0, i = 0;
  int64_t off = 0, issued = 0;
  void add(const uint8_t* ptr, int64_t len) {
    if (nr < kMax && len > 0) {
      p[nr] = ptr;
      n[nr++] = len;
    }
  }
  void upto(int64_t target) {  // issue lines until `target` bytes of the ranges, in order, have been issued
    for (; issued < target && i < nr; issued += 64) {
      __builtin_prefetch(p[i] + off, 0, 3);
      if ((off += 64) >= n[i]) off = 0, ++i;
    }
  }
};

// How far ahead of the member scan its codes are prefetched, in bytes. The member scan, cold (after
// a 64 MB copy; scratch timings, default library, twenty-fifth session): of one row 16-18 us with
// only the next cell's same rows prefetched (before), 15-16 us 1 KB ahead; of four rows searched
// together 63-66 us before, 55 us 1 KB ahead.
constexpr int64_t kScanAhead = 1024;

}  // namespace

// The per-call buffers, kept between calls of one AnchorSearch (resized, not reallocated: a
// lookup right after a decode step paid ~20 cold allocations).
struct AnchorScratch {
  std::vector<float> qn, qcode_scale, t, probe_s, group_s, cand_s, cell_q;
  std::vector<char> finite;
  std::vector<QueryCodes> qc;
  std::vector<int8_t> qcent, qcode, c8;
  std::vector<int64_t> probe, n_rows, group_rows, group, cand;
};

AnchorSearch::AnchorSearch(
    const at::Tensor& stored, const at::Tensor& centroids, const at::Tensor& centroid_step,
    const at::Tensor& centroid_vectors, const at::Tensor& offsets, const at::Tensor& members, const at::Tensor& codes,
    const at::Tensor& code_step, int64_t nprobe, int64_t k, int64_t n_candidates, const c10::optional<at::Tensor>& weights,
    const c10::optional<at::Tensor>& decay, const c10::optional<at::Tensor>& group_centroids,
    const c10::optional<at::Tensor>& group_scale, const c10::optional<at::Tensor>& group_offsets, int64_t group_probe)
    : scratch_(std::make_unique<AnchorScratch>()) {
  TORCH_CHECK(stored.dim() == 2 && stored.scalar_type() == at::kHalf && stored.is_contiguous(),
              "anchor_search: stored must be a contiguous (N, D) float16 tensor");
  N_ = stored.size(0);
  D_ = stored.size(1);
  TORCH_CHECK(D_ >= 1 && D_ <= 131072, "anchor_search: D must be 1 to 131072 (int32 sums of int8 products), got ", D_);
  Dp_ = (D_ + kSq4Block - 1) / kSq4Block * kSq4Block;  // the 4-bit codes' padded width
  TORCH_CHECK(centroids.dim() == 2 && centroids.size(1) == Dp_ / 2 && centroids.scalar_type() == at::kByte &&
                  centroids.is_contiguous() && centroids.size(0) >= 1,
              "anchor_search: centroids must be a contiguous (C >= 1, ", Dp_ / 2, ") uint8 tensor of packed 4-bit codes");
  C_ = centroids.size(0);
  TORCH_CHECK(centroid_vectors.dim() == 2 && centroid_vectors.size(0) == C_ && centroid_vectors.size(1) == D_ &&
                  centroid_vectors.scalar_type() == at::kHalf && centroid_vectors.is_contiguous(),
              "anchor_search: centroid_vectors must be a contiguous (C, D) float16 tensor");
  for (const at::Tensor* t : {&centroid_step, &code_step})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == Dp_ && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "anchor_search: centroid_step and code_step must be contiguous (", Dp_, ",) float32 tensors");
  TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) == C_ + 1 && offsets.scalar_type() == at::kLong && offsets.is_contiguous(),
              "anchor_search: offsets must be a contiguous (C + 1,) int64 tensor");
  const int64_t M = members.numel();
  TORCH_CHECK(members.dim() == 1 && members.scalar_type() == at::kInt && members.is_contiguous(),
              "anchor_search: members must be a contiguous 1-D int32 tensor");
  TORCH_CHECK(codes.dim() == 2 && codes.size(0) == M && codes.size(1) == Dp_ / 2 && codes.scalar_type() == at::kByte &&
                  codes.is_contiguous(),
              "anchor_search: codes must be a contiguous (members, ", Dp_ / 2, ") uint8 tensor of packed 4-bit codes");
  TORCH_CHECK(nprobe >= 1 && k >= 1 && n_candidates >= k, "anchor_search: need nprobe >= 1 and n_candidates >= k >= 1");
  TORCH_CHECK(weights.has_value() == decay.has_value(), "anchor_search: give both weights and decay, or neither");
  keep_ = {stored, centroids, centroid_step, centroid_vectors, offsets, members, codes, code_step};
  if (weights.has_value()) {
    for (const at::Tensor* t : {&*weights, &*decay})
      TORCH_CHECK(t->dim() == 1 && t->size(0) == N_ && t->scalar_type() == at::kFloat && t->is_contiguous(),
                  "anchor_search: weights and decay must be contiguous (N,) float32 tensors");
    W_ = weights->data_ptr<float>();
    L_ = decay->data_ptr<float>();
    keep_.push_back(*weights);
    keep_.push_back(*decay);
  }
  // groups of cells (a second level over the centroids): group g holds cells [goff[g], goff[g + 1])
  const bool grouped = group_centroids.has_value();
  TORCH_CHECK(grouped == group_scale.has_value() && grouped == group_offsets.has_value(),
              "anchor_search: give group_centroids, group_scale and group_offsets together, or none");
  if (grouped) {
    G_ = group_centroids->dim() == 2 ? group_centroids->size(0) : 0;
    TORCH_CHECK(G_ >= 1 && group_centroids->size(1) == D_ && group_centroids->scalar_type() == at::kChar &&
                    group_centroids->is_contiguous(),
                "anchor_search: group_centroids must be a contiguous (G >= 1, D) int8 tensor");
    TORCH_CHECK(group_scale->dim() == 1 && group_scale->size(0) == G_ && group_scale->scalar_type() == at::kFloat &&
                    group_scale->is_contiguous(),
                "anchor_search: group_scale must be a contiguous (G,) float32 tensor");
    TORCH_CHECK(group_offsets->dim() == 1 && group_offsets->size(0) == G_ + 1 &&
                    group_offsets->scalar_type() == at::kLong && group_offsets->is_contiguous(),
                "anchor_search: group_offsets must be a contiguous (G + 1,) int64 tensor");
    TORCH_CHECK(group_probe >= 1, "anchor_search: group_probe must be >= 1");
    G8_ = group_centroids->data_ptr<int8_t>();
    g_scale_ = group_scale->data_ptr<float>();
    goff_ = group_offsets->data_ptr<int64_t>();
    TORCH_CHECK(goff_[0] == 0 && goff_[G_] == C_, "anchor_search: group_offsets must run from 0 to the number of cells");
    for (int64_t g = 0; g < G_; ++g)
      TORCH_CHECK(goff_[g] <= goff_[g + 1], "anchor_search: group_offsets must not decrease (group ", g, ")");
    gp_ = std::min(group_probe, G_);
    keep_.push_back(*group_centroids);
    keep_.push_back(*group_scale);
    keep_.push_back(*group_offsets);
  }
  off_ = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off_[0] == 0 && off_[C_] == M, "anchor_search: offsets must run from 0 to the number of members");
  for (int64_t c = 0; c < C_; ++c)  // O(C): a decreasing entry would send the scan outside members
    TORCH_CHECK(off_[c] <= off_[c + 1], "anchor_search: offsets must not decrease (cell ", c, ")");
  const int32_t* mem = members.data_ptr<int32_t>();
  for (int64_t j = 0; j < M; ++j)  // O(M), a few us: an id outside the anchors would read outside stored
    TORCH_CHECK(mem[j] >= 0 && mem[j] < N_, "anchor_search: member id ", mem[j], " out of range for ", N_, " anchors");
  V_ = reinterpret_cast<const uint16_t*>(stored.data_ptr<at::Half>());
  C4_ = centroids.data_ptr<uint8_t>();
  L4_ = codes.data_ptr<uint8_t>();
  CV_ = reinterpret_cast<const uint16_t*>(centroid_vectors.data_ptr<at::Half>());
  mem_ = mem;
  cstep_ = centroid_step.data_ptr<float>();
  lstep_ = code_step.data_ptr<float>();
  np_ = std::min(nprobe, C_);
  k_ = k;
  n_candidates_ = n_candidates;
}

AnchorSearch::~AnchorSearch() = default;

void AnchorSearch::run(const at::Tensor& queries, float* S, int64_t* I, float* F) {
  TORCH_CHECK(queries.dim() == 2 && queries.size(1) == D_ && queries.scalar_type() == at::kFloat && queries.is_contiguous(),
              "anchor_search: queries must be a contiguous (B, ", D_, ") float32 tensor");
  const int64_t B = queries.size(0), D = D_, Dp = Dp_, C = C_, G = G_, gp = gp_, np = np_, k = k_;
  const int64_t n_candidates = n_candidates_;
  const float kNegInf = -std::numeric_limits<float>::infinity();
  std::fill(S, S + B * k, kNegInf);
  std::fill(I, I + B * k, int64_t{-1});
  std::fill(F, F + B * k, std::numeric_limits<float>::quiet_NaN());
  if (B == 0) return;
  const float* Q = queries.data_ptr<float>();
  const uint16_t* V = V_;
  const uint8_t* C4 = C4_;
  const uint8_t* L4 = L4_;
  const uint16_t* CV = CV_;
  const int64_t* off = off_;
  const int32_t* mem = mem_;
  const int8_t* G8 = G8_;
  const float* g_scale = g_scale_;
  const int64_t* goff = goff_;
  const float* W = W_;
  const float* L = L_;
  const bool grouped = G8 != nullptr;
  const int64_t R4 = Dp / 2;  // bytes per row of 4-bit codes
  const int64_t ahead = 8;  // centroid rows prefetched ahead of the scan

  AnchorScratch& z = *scratch_;
  z.qn.resize(B * D);
  z.finite.resize(B);
  if (int64_t(z.qc.size()) < B) z.qc.resize(B);  // int8 codes of the unit query (the groups' centroids)
  z.qcent.resize(B * Dp);  // (B, Dp) against the centroids' 4-bit codes
  z.qcode.resize(B * Dp);  // (B, Dp) against the residuals' 4-bit codes
  z.qcode_scale.resize(B);
  z.t.resize(Dp);
  z.c8.resize(D);
  float* qn = z.qn.data();
  for (int64_t b = 0; b < B; ++b) {  // unit rows, the norm in float64 (sfcl.library.index.unit_rows)
    const float* q = Q + b * D;
    double ss = 0.0;
    int64_t d0 = 0;
#if defined(__AVX512F__)  // eight partial sums (one chain of dependent float64 adds was ~2,300 cycles)
    __m512d acc = _mm512_setzero_pd();
    for (; d0 + 8 <= D; d0 += 8) {
      const __m512d x = _mm512_cvtps_pd(_mm256_loadu_ps(q + d0));
      acc = _mm512_add_pd(acc, _mm512_mul_pd(x, x));
    }
    ss = _mm512_reduce_add_pd(acc);
#elif defined(__AVX2__)
    __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
    for (; d0 + 8 <= D; d0 += 8) {
      const __m256d x0 = _mm256_cvtps_pd(_mm_loadu_ps(q + d0)), x1 = _mm256_cvtps_pd(_mm_loadu_ps(q + d0 + 4));
      acc0 = _mm256_add_pd(acc0, _mm256_mul_pd(x0, x0));
      acc1 = _mm256_add_pd(acc1, _mm256_mul_pd(x1, x1));
    }
    const __m256d a = _mm256_add_pd(acc0, acc1);
    const __m128d h = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    ss = _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
#endif
    for (int64_t d = d0; d < D; ++d) ss += double(q[d]) * double(q[d]);
    const double norm = std::sqrt(ss);
    z.finite[b] = std::isfinite(norm);
    const double den = std::max(norm, double(std::numeric_limits<double>::min()));
    for (int64_t d = 0; d < D; ++d) qn[b * D + d] = float(double(q[d]) / den);
    if (!z.finite[b]) continue;
    if (grouped) quantise(&qn[b * D], D, z.c8.data(), z.qc[b]);
    sq4_query(&qn[b * D], D, cstep_, Dp, z.t.data(), &z.qcent[b * Dp]);
    z.qcode_scale[b] = sq4_query(&qn[b * D], D, lstep_, Dp, z.t.data(), &z.qcode[b * Dp]);
  }
  // The probe lists: per row, the nprobe best cells (scores in probe_s, ids in probe, best first;
  // ties go to the lower cell: every row meets its cells in ascending order).
  z.probe_s.assign(B * np, kNegInf);
  z.probe.assign(B * np, -1);
  float* probe_s = z.probe_s.data();
  int64_t* probe = z.probe.data();
  const int8_t* qcent = z.qcent.data();
  if (!grouped) {  // each centroid read once for all rows
    for (int64_t c = 0; c < C; ++c) {
      if (c + ahead < C) prefetch(C4 + (c + ahead) * R4, R4);
      for (int64_t b = 0; b < B; ++b)
        if (z.finite[b])
          keep_best(&probe_s[b * np], &probe[b * np], np, float(dot_sq4(C4 + c * R4, &qcent[b * Dp], Dp)), c);
    }
  } else {
    // Each row's group_probe best groups; then each group that some row chose, in ascending order,
    // its cells read once for all the rows that chose it (a step's rows share most of their groups:
    // per row, the cells' codes were ~a quarter of the bytes a lookup reads, twenty-first session).
    z.n_rows.assign(G, 0);
    z.group_rows.resize(G * B);  // group g's rows: group_rows[g * B : g * B + n_rows[g]], ascending
    z.group_s.resize(gp);
    z.group.resize(gp);
    int64_t* n_rows = z.n_rows.data();
    int64_t* group_rows = z.group_rows.data();
    for (int64_t b = 0; b < B; ++b) {
      if (!z.finite[b]) continue;
      std::fill(z.group_s.begin(), z.group_s.end(), kNegInf);
      std::fill(z.group.begin(), z.group.end(), -1);
      for (int64_t g = 0; g < G; ++g)
        keep_best(z.group_s.data(), z.group.data(), gp, float(dot_codes(G8 + g * D, z.qc[b], D)) * (g_scale[g] * z.qc[b].scale), g);
      for (int64_t i = 0; i < gp && z.group[i] >= 0; ++i) group_rows[z.group[i] * B + n_rows[z.group[i]]++] = b;
    }
    for (int64_t g = 0; g < G; ++g) {
      const int64_t n = n_rows[g], beg = goff[g], end = goff[g + 1];
      if (n == 0) continue;
      const int64_t* rs = &group_rows[g * B];
      prefetch(C4 + beg * R4, std::min<int64_t>(end - beg, ahead) * R4);
      if (n == 1) {  // one row: four cells at a time (independent sums)
        float* ps = &probe_s[rs[0] * np];
        int64_t* pc = &probe[rs[0] * np];
        const int8_t* q8 = &qcent[rs[0] * Dp];
        int64_t c = beg;
        for (; c + 4 <= end; c += 4) {
          if (c + ahead + 4 <= end) prefetch(C4 + (c + ahead) * R4, 4 * R4);
          int32_t dots[4];
          dot_sq4_4(C4 + c * R4, q8, Dp, dots);
          for (int r = 0; r < 4; ++r) keep_best(ps, pc, np, float(dots[r]), c + r);
        }
        for (; c < end; ++c) keep_best(ps, pc, np, float(dot_sq4(C4 + c * R4, q8, Dp)), c);
        continue;
      }
      for (int64_t c = beg; c < end; ++c) {  // several rows: each cell against up to four rows at a time
        if (c + ahead < end) prefetch(C4 + (c + ahead) * R4, R4);
        for (int64_t i = 0; i < n; i += 4) {
          const int m = int(std::min<int64_t>(4, n - i));
          const int8_t* qs[4];
          int32_t dots[4];
          for (int t = 0; t < m; ++t) qs[t] = &qcent[rs[i + t] * Dp];
          dot_sq4_q(C4 + c * R4, qs, m, Dp, dots);
          for (int t = 0; t < m; ++t) keep_best(&probe_s[rs[i + t] * np], &probe[rs[i + t] * np], np, float(dots[t]), c);
        }
      }
    }
  }
  // Per row: the members of its probed cells, candidates and re-score. One thread: rows split over
  // torch's threads (a parallel_for, the engine's OpenMP workers still spinning after the step) did
  // not lower the served lookup's p99 and once waited 1.5 ms for a worker (fifteenth session).
  z.cand_s.resize(n_candidates);
  z.cand.resize(n_candidates);
  z.cell_q.resize(np);
  float* cand_s = z.cand_s.data();
  int64_t* cand = z.cand.data();
  float* cell_q = z.cell_q.data();
  for (int64_t b = 0; b < B; ++b) {
    if (!z.finite[b]) continue;
    const float* q = &qn[b * D];
    const int64_t* probe_b = &probe[b * np];
    std::fill(cand_s, cand_s + n_candidates, kNegInf);
    std::fill(cand, cand + n_candidates, int64_t{-1});
    RangePrefetch ahead_of_scan;  // the probed cells' codes, in scan order
    for (int64_t p = 0; p < np && probe_b[p] >= 0; ++p)
      ahead_of_scan.add(L4 + off[probe_b[p]] * R4, (off[probe_b[p] + 1] - off[probe_b[p]]) * R4);
    ahead_of_scan.upto(kScanAhead);
    for (int64_t p = 0; p < np && probe_b[p] >= 0; ++p) prefetch(CV + probe_b[p] * D, D * 2);
    for (int64_t p = 0; p < np && probe_b[p] >= 0; ++p) cell_q[p] = dot_f16(CV + probe_b[p] * D, q, D);  // q . c
    const float sq = z.qcode_scale[b];
    const int8_t* q8 = &z.qcode[b * Dp];
    int64_t scanned = 0;
    for (int64_t p = 0; p < np && probe_b[p] >= 0; ++p) {
      const int64_t c = probe_b[p];
      int64_t j = off[c];
      for (; j + 4 <= off[c + 1]; j += 4) {  // four rows at a time
        ahead_of_scan.upto(kScanAhead + (scanned + j + 4 - off[c]) * R4);
        int32_t dots[4];
        dot_sq4_4(L4 + j * R4, q8, Dp, dots);
        for (int t = 0; t < 4; ++t) keep_best(cand_s, cand, n_candidates, cell_q[p] + sq * float(dots[t]), mem[j + t]);
      }
      for (; j < off[c + 1]; ++j) {
        ahead_of_scan.upto(kScanAhead + (scanned + j + 1 - off[c]) * R4);
        keep_best(cand_s, cand, n_candidates, cell_q[p] + sq * float(dot_sq4(L4 + j * R4, q8, Dp)), mem[j]);
      }
      scanned += off[c + 1] - off[c];
    }
    if (scanned < k) continue;  // short: the caller searches this row exactly
    int64_t n_cand = 0;
    for (; n_cand < n_candidates && cand[n_cand] >= 0; ++n_cand) prefetch(V + cand[n_cand] * D, D * 2);
    float* s = S + b * k;
    int64_t* id = I + b * k;
    for (int64_t r = 0; r < n_cand; ++r) keep_best(s, id, k, dot_f16(V + cand[r] * D, q, D), cand[r]);
    if (W != nullptr)
      for (int64_t j = 0; j < k && id[j] >= 0; ++j) {  // sfcl.snapshot.triggers.anchor_confidence_each
        const float c = W[id[j]] * std::exp(-L[id[j]] * std::max(0.f, 1.f - s[j]));
        F[b * k + j] = c != c ? c : std::min(1.f, std::max(0.f, c));  // NaN stays NaN, as numpy's clip leaves it
      }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> anchor_search(
    const at::Tensor& queries, const at::Tensor& stored, const at::Tensor& centroids, const at::Tensor& centroid_step,
    const at::Tensor& centroid_vectors, const at::Tensor& offsets, const at::Tensor& members, const at::Tensor& codes, const at::Tensor& code_step,
    int64_t nprobe, int64_t k, int64_t n_candidates, const c10::optional<at::Tensor>& weights,
    const c10::optional<at::Tensor>& decay, const c10::optional<at::Tensor>& group_centroids,
    const c10::optional<at::Tensor>& group_scale, const c10::optional<at::Tensor>& group_offsets,
    int64_t group_probe) {
  TORCH_CHECK(queries.dim() == 2 && k >= 1, "anchor_search: queries must be a (B, D) tensor and k >= 1");
  AnchorSearch pass(stored, centroids, centroid_step, centroid_vectors, offsets, members, codes, code_step, nprobe, k,
                    n_candidates, weights, decay, group_centroids, group_scale, group_offsets, group_probe);
  const int64_t B = queries.size(0);
  auto scores = at::empty({B, k}, at::kFloat);
  auto ids = at::empty({B, k}, at::kLong);
  auto conf = at::empty({B, k}, at::kFloat);
  pass.run(queries, scores.data_ptr<float>(), ids.data_ptr<int64_t>(), conf.data_ptr<float>());
  return {scores, ids, conf};
}

}  // namespace sfcl
