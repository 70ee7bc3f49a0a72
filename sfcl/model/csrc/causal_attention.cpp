// Causal self-attention in bf16 on Intel AMX tiles or, on CPUs with AVX-512 BF16 but no AMX (AMD EPYC
// Zen 4), with vdpbf16ps on 512-bit vectors: of prompt windows from their position 0 for the anchor
// builder's model pass (sfcl/anchors/model_pass.py), and of the server's bf16 prompt chunks, whose
// queries follow S - Tq positions already in the KV cache (sfcl/model/llama.py, Attention.prefill_attn).
//
//   o[w, i, h] = sum_{j <= i} p[i, j] v[w, j, g(h)],   p[i, :] = softmax_j(scale q[w, i, h] . k[w, j, g(h)])
//
// for the query positions i in [S - Tq, S), keys j in [0, S),
// with g(h) = h / (nh / nkv) (grouped-query attention). Per (window, head, block of 32 queries):
// the block's scores against keys 0 .. its last row, S = Q K^T (bf16 in, float32 accumulated); each
// row's causal softmax in float32 with AVX-512 (softmax_row: an exp of fused multiply-adds, relative
// error < 5e-5), its exponentials rounded to bf16 and normalised after P V (as torch's flash attention
// for CPU does: its P is rounded to the input dtype before the product with V); O = P V.
// K and V are first packed per (window, KV head) into the pair-interleaved ("VNNI") layout that both
// AMX's tile product and vdpbf16ps read their second operand in: a 64-byte row holds 16 columns x 2
// consecutive reduction elements. A block is 32 rows x at most S keys, so the whole row of scores fits
// a per-thread float32 buffer and no online rescaling is needed (32 x S float32 and bf16 per thread:
// 0.8 MB at S = 4,096, 1.6 MB at 8,192).
//
// A prompt chunk's K and V are packed whole for every call, with AVX-512 (O(S) per chunk and layer
// against the O(Tq S) product); V's non-finite elements are packed as 0 and added after P V to the rows
// that attend them only (a group of rows is multiplied by every key up to its last row, and 0 x NaN
// would reach the earlier rows); a chunk's rows past its end are not computed on vectors.
//
// Why: torch 2.13's CPU flash attention (scaled_dot_product_attention) ran the build's 29 causal
// layers at ~12 ms per 4 windows x 1,024 tokens on 2 threads of an Intel Xeon with AMX, about 6x the
// rate of the GEMM probe the build's floor is counted at; on a 2-core AMD EPYC with AVX-512 BF16 (no
// AMX) it took 32% of the pass, 1.5 s per 4 windows, ~95 GFLOP/s against the probe's ~400
// (docs/performance-journal.md).
//
// The AMX path is compiled where the build's -march enables AMX-TILE, AMX-BF16 and AVX-512 BF16 / BW / VL
// (-march=native on such a CPU) and runs where the OS also grants the tile state (Linux arch_prctl
// ARCH_REQ_XCOMP_PERM, checked once); the vector path is compiled where -march enables AVX-512 BF16 / BW
// / VL, and runs where AMX does not (or when asked for: causal_attention(..., amx=False)). Elsewhere
// causal_attention raises and causal_attention_ready() is false.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "sfcl_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SFCL_BF16_VEC 1
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define SFCL_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace sfcl {
namespace {

constexpr int64_t kHeadDim = 64;  // the only head size the tile layout below serves (2 k-steps of 32)
constexpr int64_t kBlock = 32;    // queries per block and keys per step: two tiles of 16 rows
// Row stride of the per-thread score and numerator buffers: T rounded up to 32, plus kPad elements, so
// that the 16 rows a tile store or load touches do not all fall in one L1 set (a 4 KiB stride does).
constexpr int64_t kPad = 16;

#ifdef SFCL_BF16_VEC
using bf16 = c10::BFloat16;

// K of one (window, KV head) -> tiles of 16 keys x 32 dims, pair-interleaved: kp[(kb * 2 + s) * 512 +
// r * 32 + n * 2 + p] = k[kb * 16 + n][s * 32 + 2 r + p]; keys >= T are zeros. As 32-bit words (one
// dimension pair) a tile is the transpose of its 16 keys' 16 words: row r gathers word r of each key.
void pack_k(const bf16* k, int64_t ks, int64_t T, int64_t Tp, bf16* kp) {
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(static_cast<int32_t>(ks)));  // key n at n ks elements (< 2^31)
  for (int64_t kb = 0; kb < Tp / 16; ++kb) {
    const int64_t live = std::clamp<int64_t>(T - kb * 16, 0, 16);
    const __mmask16 m = static_cast<__mmask16>((1u << live) - 1u);
    for (int64_t s = 0; s < 2; ++s) {
      bf16* t = kp + (kb * 2 + s) * 512;
      const bf16* src = k + kb * 16 * ks + s * 32;
      for (int64_t r = 0; r < 16; ++r)
        _mm512_storeu_si512(t + r * 32, live ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx,
                                                                           src + 2 * r, 2)
                                             : _mm512_setzero_si512());
    }
  }
}

// V of one (window, KV head) -> tiles of 32 keys x 16 dims, pair-interleaved: vp[(kb * 4 + c) * 512 +
// r * 32 + n * 2 + p] = v[kb * 32 + 2 r + p][c * 16 + n]; keys >= T are zeros, and so are V's non-finite
// elements (NaN, +-inf): P V multiplies a whole group of rows (a tile, or 4 rows on vectors) by every
// key up to its last row's position, and 0 x NaN would reach rows before a NaN key (P is 0 there).
// Their keys are listed in bad (ascending), and finish_nonfinite adds them to the rows that attend them.
inline bool finite(bf16 x) { return (x.x & 0x7f80) != 0x7f80; }  // exponent not all ones: not NaN or +-inf

// Lanes of 32 bf16 whose exponent is all ones (NaN or +-inf).
inline __mmask32 nonfinite32(__m512i x) {
  const __m512i e = _mm512_set1_epi16(0x7f80);
  return _mm512_cmpeq_epi16_mask(_mm512_and_si512(x, e), e);
}

void pack_v(const bf16* v, int64_t vs, int64_t T, int64_t Tp, bf16* vp, std::vector<int32_t>& bad) {
  bad.clear();
  for (int64_t kb = 0; kb < Tp / 32; ++kb)
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t j = kb * 32 + 2 * r;  // keys j (p = 0, the low half of each word) and j + 1 (p = 1)
      __mmask32 any = 0;                  // the pair's non-finite lanes: even bits key j, odd bits key j + 1
      for (int64_t c = 0; c < 4; ++c) {
        const __m256i a = j < T ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + j * vs + c * 16))
                                : _mm256_setzero_si256();
        const __m256i b = j + 1 < T ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + (j + 1) * vs + c * 16))
                                    : _mm256_setzero_si256();
        const __m512i w = _mm512_or_si512(_mm512_cvtepu16_epi32(a), _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
        const __mmask32 nf = nonfinite32(w);
        any |= nf;
        _mm512_storeu_si512(vp + (kb * 4 + c) * 512 + r * 32, _mm512_maskz_mov_epi16(~nf, w));
      }
      if (any & 0x55555555u) bad.push_back(static_cast<int32_t>(j));
      if (any & 0xAAAAAAAAu) bad.push_back(static_cast<int32_t>(j + 1));
    }
}

// The non-finite elements of V that pack_v left out: obuf[r][d] += P[r][j] v[j][d] for each listed key j
// at or before row r's position (p0 + r) and each d where v[j][d] is not finite, so a row that attends a
// NaN (or inf) value gets NaN (or inf) there as from an exact P V, and earlier rows stay untouched.
void finish_nonfinite(const std::vector<int32_t>& bad, const bf16* v, int64_t vs, const bf16* P, int64_t ss,
                      int64_t p0, int64_t rows, float* obuf) {
  for (int64_t r = 0; r < rows; ++r)
    for (const int32_t j : bad) {
      if (j > p0 + r) break;
      const float pj = static_cast<float>(P[r * ss + j]);
      for (int64_t d = 0; d < kHeadDim; ++d)
        if (!finite(v[j * vs + d])) obuf[r * kHeadDim + d] += pj * static_cast<float>(v[j * vs + d]);
    }
}

// Causal softmax numerators of query row i of a block: p[j] = bf16(exp(scale s[j] - max)) for
// j <= i, 0 for i < j < width (width a multiple of 16, > i). Returns 1 / the float32 sum of the
// numerators before rounding (as torch's flash attention for CPU normalises). exp by
// sfcl::exp_nonpositive16<true>: 16 lanes, e^r by its degree-4 Taylor polynomial (relative error
// < 5e-5, below the bf16 rounding that follows, 2^-9).
float softmax_row(const float* s, int64_t i, int64_t width, float scale, bf16* p) {
  const int64_t n = i + 1, full = n / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - full)) - 1u);
  const __m512 vs = _mm512_set1_ps(scale);
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < full; j += 16) vmax = _mm512_max_ps(vmax, _mm512_mul_ps(vs, _mm512_loadu_ps(s + j)));
  if (tail) vmax = _mm512_mask_max_ps(vmax, tail, vmax, _mm512_mul_ps(vs, _mm512_maskz_loadu_ps(tail, s + full)));
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  __m512 z = _mm512_setzero_ps();
  auto step = [&](__m512 sv, __mmask16 m) {  // lanes m of exp(scale s - max) rounded to bf16, their sum into z; others 0
    // a NaN score stays NaN through the exp, so it makes its row NaN, as in torch's SDPA. The scaled
    // score is rounded before the max is subtracted, as the max was taken: a fused multiply-subtract
    // left up to half an ulp of the max above 0, and the exp overflowed once that passed ~88 (scaled
    // scores above ~1e9 with a scale that is not a power of two: a NaN row; found by a tester)
    const __m512 e = sfcl::exp_nonpositive16<true>(_mm512_sub_ps(_mm512_mul_ps(sv, vs), mx));
    z = _mm512_mask_add_ps(z, m, z, e);
    return _mm256_maskz_mov_epi16(m, (__m256i)_mm512_cvtneps_pbh(e));
  };
  for (int64_t j = 0; j < full; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), step(_mm512_loadu_ps(s + j), 0xffff));
  int64_t done = full;
  if (tail) {  // the lanes past i are stored as zeros
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + full), step(_mm512_maskz_loadu_ps(tail, s + full), tail));
    done = full + 16;
  }
  std::fill(p + done, p + width, bf16(0.0f));
  return 1.0f / _mm512_reduce_add_ps(z);
}

#ifdef SFCL_AMX
// Tile configuration (palette 1): tiles 0-7 all 16 rows x 64 bytes (16 float32 or 32 bf16).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool tiles_granted() {
  constexpr long kReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
  constexpr long kXtiledata = 18;         // XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
}

inline void load_tile_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// S (32, kend) = Q K^T on AMX tiles: qa (32 rows, stride qstride), kp packed by pack_k; S's row stride ss.
void scores_amx(const bf16* qa, int64_t qstride, const bf16* kp, int64_t kend, float* S, int64_t ss) {
  const int64_t qb = qstride * sizeof(bf16), sb = ss * sizeof(float);
  for (int64_t kb = 0; kb < kend / kBlock; ++kb) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < 2; ++s) {
      _tile_loadd(4, qa + s * 32, qb);
      _tile_loadd(5, qa + 16 * qstride + s * 32, qb);
      _tile_loadd(6, kp + ((2 * kb) * 2 + s) * 512, 64);
      _tile_loadd(7, kp + ((2 * kb + 1) * 2 + s) * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    float* sk = S + kb * kBlock;
    _tile_stored(0, sk, sb);
    _tile_stored(1, sk + 16, sb);
    _tile_stored(2, sk + 16 * ss, sb);
    _tile_stored(3, sk + 16 * ss + 16, sb);
  }
}

// O (32, 64) = P V on AMX tiles, 16 output columns of both row halves at a time: per 32 keys, 2 P tiles
// and 2 V tiles feed 4 products. P (32, kend) bf16 with row stride ss; vp packed by pack_v.
void values_amx(const bf16* P, int64_t ss, const bf16* vp, int64_t kend, float* obuf) {
  const int64_t pb = ss * sizeof(bf16), ob = kHeadDim * sizeof(float);
  for (int64_t c = 0; c < 4; c += 2) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < kend / kBlock; ++kb) {
      const bf16* vt = vp + (kb * 4 + c) * 512;
      _tile_loadd(4, P + kb * kBlock, pb);
      _tile_loadd(5, P + 16 * ss + kb * kBlock, pb);
      _tile_loadd(6, vt, 64);
      _tile_loadd(7, vt + 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, obuf + c * 16, ob);
    _tile_stored(1, obuf + c * 16 + 16, ob);
    _tile_stored(2, obuf + 16 * kHeadDim + c * 16, ob);
    _tile_stored(3, obuf + 16 * kHeadDim + c * 16 + 16, ob);
  }
}
#endif  // SFCL_AMX

// The 32-bit word holding bf16 elements e and e + 1 of a row (e even), broadcast to 16 lanes: the
// first operand of vdpbf16ps against a pair-interleaved row.
inline __m512bh pair16(const bf16* row, int64_t e) {
  int32_t w;
  std::memcpy(&w, row + e, sizeof(w));
  return (__m512bh)_mm512_set1_epi32(w);
}

// S = Q K^T with vdpbf16ps: query rows in groups of 8, each group against 32 keys at a time (16
// accumulators of 16 keys), over the keys up to its last row's position (i0 the block's first, T the
// number of keys; clipped to T - 1: rows past the last query read a finite row, never written out); the
// entries past a row's own position are never read. qa (32 rows,
// stride qstride), kp packed by pack_k (a 64-byte row of a tile: one dimension pair of 16 keys); S's
// row stride ss.
void scores_vec(const bf16* qa, int64_t qstride, const bf16* kp, int64_t i0, int64_t T, int64_t rows, float* S,
                int64_t ss) {
  for (int64_t g = 0; g < (rows + 7) / 8; ++g) {  // groups holding a real row (the block's first rows)
    const int64_t nkb = std::min(i0 + 8 * g + 7, T - 1) / kBlock + 1;  // blocks of 32 keys
    const bf16* qg = qa + 8 * g * qstride;
    float* sg = S + 8 * g * ss;
    for (int64_t kb = 0; kb < nkb; ++kb) {
      __m512 acc[8][2];
      for (auto& a : acc) a[0] = a[1] = _mm512_setzero_ps();
      for (int64_t d = 0; d < kHeadDim / 2; ++d) {  // dimensions 2d, 2d + 1
        const bf16* kt = kp + (4 * kb + d / 16) * 512 + (d % 16) * 32;  // keys 32 kb .. +15; +1024: the next 16
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt), k1 = (__m512bh)_mm512_loadu_si512(kt + 1024);
        for (int64_t r = 0; r < 8; ++r) {
          const __m512bh qv = pair16(qg + r * qstride, 2 * d);
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qv, k0);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qv, k1);
        }
      }
      for (int64_t r = 0; r < 8; ++r) {
        _mm512_storeu_ps(sg + r * ss + kb * kBlock, acc[r][0]);
        _mm512_storeu_ps(sg + r * ss + kb * kBlock + 16, acc[r][1]);
      }
    }
  }
}

// O (32, 64) = P V with vdpbf16ps: query rows in groups of 4 (16 accumulators: 4 rows x 64 columns),
// each over the key pairs up to its last row's position (i0 the block's first, T the number of keys; P
// is zero past a row's position). P bf16 with row stride
// ss; vp packed by pack_v (a 64-byte row of a tile: 16 columns of one key pair).
void values_vec(const bf16* P, int64_t ss, const bf16* vp, int64_t i0, int64_t T, int64_t rows, float* obuf) {
  for (int64_t g = 0; g < (rows + 3) / 4; ++g) {  // groups holding a real row
    const int64_t pairs = std::min(i0 + 4 * g + 3, T - 1) / 2 + 1;  // key pairs covering keys 0 .. the last row
    const bf16* pg = P + 4 * g * ss;
    __m512 acc[4][4];
    for (auto& a : acc) a[0] = a[1] = a[2] = a[3] = _mm512_setzero_ps();
    for (int64_t j = 0; j < pairs; ++j) {  // keys 2j, 2j + 1
      const bf16* vt = vp + (j / 16) * 4 * 512 + (j % 16) * 32;
      __m512bh v[4];
      for (int64_t c = 0; c < 4; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vt + c * 512);
      for (int64_t r = 0; r < 4; ++r) {
        const __m512bh pv = pair16(pg + r * ss, 2 * j);
        for (int64_t c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pv, v[c]);
      }
    }
    for (int64_t r = 0; r < 4; ++r)
      for (int64_t c = 0; c < 4; ++c) _mm512_storeu_ps(obuf + (4 * g + r) * kHeadDim + c * 16, acc[r][c]);
  }
}

// One (window, head, query block): query rows i0 .. i0 + 31 of o, at positions off + i0 .. (off = S - Tq:
// a prompt chunk after off cached positions; 0 for a window), over keys 0 .. S - 1 of kp / vp; on AMX
// tiles where amx, else with vdpbf16ps.
void attend_block(const bf16* q, int64_t qs, const bf16* kp, const bf16* vp, const std::vector<int32_t>& bad,
                  const bf16* v, int64_t vs, int64_t Tq, int64_t S, int64_t i0, float scale, bf16* o, int64_t os,
                  float* Sbuf, bf16* P, bf16* qpad, float* obuf, bool amx) {
  const int64_t Sp = (S + kBlock - 1) / kBlock * kBlock;
  const int64_t p0 = S - Tq + i0;  // the block's first position
  const int64_t kend = std::min((p0 + 2 * kBlock - 1) / kBlock * kBlock, Sp);  // keys its last row can attend, rounded up to 32
  const int64_t rows = std::min(kBlock, Tq - i0);
  const bf16* qa = q + i0 * qs;
  int64_t qstride = qs;
  if (rows < kBlock) {  // the last block: its rows past Tq read as zeros from a padded copy
    std::fill(qpad, qpad + kBlock * kHeadDim, bf16(0.0f));
    for (int64_t r = 0; r < rows; ++r) std::memcpy(qpad + r * kHeadDim, qa + r * qs, kHeadDim * sizeof(bf16));
    qa = qpad;
    qstride = kHeadDim;
  }
  const int64_t ss = Sp + kPad;
#ifdef SFCL_AMX
  if (amx)
    scores_amx(qa, qstride, kp, kend, Sbuf, ss);
  else
#endif
    scores_vec(qa, qstride, kp, p0, S, rows, Sbuf, ss);
  float inv[kBlock];
  for (int64_t r = 0; r < rows; ++r) inv[r] = softmax_row(Sbuf + r * ss, p0 + r, kend, scale, P + r * ss);
  // rows past Tq, never written out: zero numerators where P V reads them (AMX: the whole block; vectors:
  // the rest of the last group of 4). Their scores are not computed on vectors (a 1-token chunk's block
  // would otherwise cost 32 rows over all S keys).
  const int64_t read = amx ? kBlock : (rows + 3) / 4 * 4;
  for (int64_t r = rows; r < read; ++r) std::fill(P + r * ss, P + r * ss + kend, bf16(0.0f));
#ifdef SFCL_AMX
  if (amx)
    values_amx(P, ss, vp, kend, obuf);
  else
#endif
    values_vec(P, ss, vp, p0, S, rows, obuf);
  if (!bad.empty()) finish_nonfinite(bad, v, vs, P, ss, p0, rows, obuf);
  for (int64_t r = 0; r < rows; ++r) {  // o = O / Z, rounded to bf16
    bf16* orow = o + (i0 + r) * os;
    const __m512 f = _mm512_set1_ps(inv[r]);
    for (int64_t d = 0; d < kHeadDim; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + d),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(obuf + r * kHeadDim + d), f)));
  }
}
#endif  // SFCL_BF16_VEC

}  // namespace

// Whether the AMX path runs here: built with AMX and the OS grants the tile state (asked once).
bool causal_attention_amx() {
#ifdef SFCL_AMX
  static const bool ok = tiles_granted();
  return ok;
#else
  return false;
#endif
}

// Whether causal_attention can run here: on AMX tiles (causal_attention_amx()) or, built with
// AVX-512 BF16, with vdpbf16ps.
bool causal_attention_ready() {
#ifdef SFCL_BF16_VEC
  return true;
#else
  return false;
#endif
}

// q (n, Tq, nh, 64), k and v (n, S, nkv, 64): bf16 CPU tensors whose last dimension is contiguous,
// nh a multiple of nkv, 1 <= Tq <= S. Returns o (n, Tq, nh, 64) bf16 contiguous: each window's causal
// attention, softmax of scale q . k, its queries at positions S - Tq .. S - 1 over keys 0 .. S - 1 (Tq
// = S: a window from its position 0, the anchor builder's; Tq < S: a prompt chunk after S - Tq cached
// positions, the server's). amx: on AMX tiles where they run (causal_attention_amx()); false takes the
// AVX-512 BF16 vector path on any CPU that runs the kernel (the tests compare both on an AMX CPU).
// Raises (RuntimeError) where causal_attention_ready() is false or for arguments that do not fit
// together.
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool amx) {
  TORCH_CHECK(causal_attention_ready(), "causal_attention: needs a CPU with AVX-512 BF16 (or AMX-BF16) and a "
              "kernel build with -march enabling it");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "causal_attention: CPU tensors");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "causal_attention: q, k, v must be bfloat16");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(), "causal_attention: q (n, Tq, nh, hd), k and v (n, S, nkv, hd)");
  const int64_t n = q.size(0), Tq = q.size(1), nh = q.size(2), S = k.size(1), nkv = k.size(2);
  TORCH_CHECK(q.size(3) == kHeadDim && k.size(3) == kHeadDim, "causal_attention: the head size must be 64, got ",
              q.size(3), " and ", k.size(3));
  TORCH_CHECK(k.size(0) == n, "causal_attention: q ", q.sizes(), " and k ", k.sizes(), " differ in windows");
  TORCH_CHECK(Tq >= 1 && Tq <= S, "causal_attention: 1 <= Tq <= S query positions, got q ", q.sizes(), " and k ",
              k.sizes());
  TORCH_CHECK(nkv >= 1 && nh >= 1 && nh % nkv == 0, "causal_attention: nh must be a positive multiple of nkv, got nh = ",
              nh, ", nkv = ", nkv);
  TORCH_CHECK(!at::GradMode::is_enabled() || !(q.requires_grad() || k.requires_grad() || v.requires_grad()),
              "causal_attention: no autograd; call it under torch.inference_mode() or torch.no_grad()");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "causal_attention: the head dimension must be contiguous");
  TORCH_CHECK(k.stride(1) >= 0 && k.stride(1) <= std::numeric_limits<int32_t>::max() / 16,
              "causal_attention: k's stride between positions must be in [0, 2^31 / 16) elements, got ", k.stride(1));
  at::Tensor o = at::empty({n, Tq, nh, kHeadDim}, q.options());
#ifdef SFCL_BF16_VEC
  const bool tiles = amx && causal_attention_amx();
  const int64_t Sp = (S + kBlock - 1) / kBlock * kBlock, nb = (Tq + kBlock - 1) / kBlock, group = nh / nkv;
  const int64_t tile_elems = Sp * kHeadDim;  // bf16 per packed K (or V) of one (window, KV head)
  // packs and per-thread buffers left uninitialised: pack_k / pack_v write every element, and a block
  // reads its scores and numerators only where it wrote them (its keys up to kend)
  std::unique_ptr<bf16[]> kp(new bf16[n * nkv * tile_elems]), vp(new bf16[n * nkv * tile_elems]);
  std::vector<std::vector<int32_t>> bad(n * nkv);  // per (window, KV head): keys whose V is not all finite
  const bf16 *qd = q.data_ptr<bf16>(), *kd = k.data_ptr<bf16>(), *vd = v.data_ptr<bf16>();
  at::parallel_for(0, n * nkv, 1, [&](int64_t a, int64_t b) {
    for (int64_t x = a; x < b; ++x) {
      const int64_t w = x / nkv, g = x % nkv;
      pack_k(kd + w * k.stride(0) + g * k.stride(2), k.stride(1), S, Sp, kp.get() + x * tile_elems);
      pack_v(vd + w * v.stride(0) + g * v.stride(2), v.stride(1), S, Sp, vp.get() + x * tile_elems, bad[x]);
    }
  });
  bf16* od = o.data_ptr<bf16>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, n * nh * nb, 1, [&](int64_t a, int64_t b) {
    std::unique_ptr<float[]> Sbuf(new float[kBlock * (Sp + kPad)]);
    std::unique_ptr<bf16[]> P(new bf16[kBlock * (Sp + kPad)]);
    std::vector<float> obuf(kBlock * kHeadDim);
    std::vector<bf16> qpad(kBlock * kHeadDim);
#ifdef SFCL_AMX
    if (tiles) load_tile_config();
#endif
    for (int64_t x = a; x < b; ++x) {
      const int64_t w = x / (nh * nb), h = x / nb % nh, blk = x % nb, g = h / group;
      attend_block(qd + w * q.stride(0) + h * q.stride(2), q.stride(1), kp.get() + (w * nkv + g) * tile_elems,
                   vp.get() + (w * nkv + g) * tile_elems, bad[w * nkv + g], vd + w * v.stride(0) + g * v.stride(2),
                   v.stride(1), Tq, S, blk * kBlock, sc,
                   od + w * Tq * nh * kHeadDim + h * kHeadDim, nh * kHeadDim, Sbuf.get(), P.get(), qpad.data(),
                   obuf.data(), tiles);
    }
#ifdef SFCL_AMX
    if (tiles) _tile_release();
#endif
  });
#endif
  return o;
}

}  // namespace sfcl

TORCH_LIBRARY_FRAGMENT(sfcl, m) {
  m.def("causal_attention(Tensor q, Tensor k, Tensor v, float scale, bool amx=True) -> Tensor");
  m.def("causal_attention_ready() -> bool", &sfcl::causal_attention_ready);  // no tensor: a catch-all kernel
  m.def("causal_attention_amx() -> bool", &sfcl::causal_attention_amx);
}
TORCH_LIBRARY_IMPL(sfcl, CPU, m) { m.impl("causal_attention", &sfcl::causal_attention); }
