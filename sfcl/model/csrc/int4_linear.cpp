// torch.ops.sfcl.int4_linear: y (M, N) = x (M, K) W^T for the int4 weights of
// sfcl.model.quant.QuantLinear (groups of 32 along K, w = (q - 8) * scale + zero, q in 0..15, scale
// and zero bfloat16: torch's _weight_int4pack_mm_for_cpu contract) in SFCL's own layout, with the
// activations quantised to int8 per block of 32 (d = max |x| / 127, llama.cpp's Q8_0 scheme), so
// that a group's products are one integer dot product:
//
//   sum_k w_k x_k ~= scale * d * (sum_k q_k x8_k - 8 * sum_k x8_k) + zero * sum_k x_k
//
// (the zero term uses the block's exact float sum). Layout (sfcl.model.quant.int4_q8_layout): the
// weight's rows in blocks of 8, and per block and group 128 bytes of codes in 4 chunks of 32 bytes;
// in chunk i, bytes 4r..4r+3 hold row r's codes of k-quad 2i (low nibbles) and 2i + 1 (high
// nibbles); then 16 bfloat16: the 8 rows' scales, then their zeros (llama.cpp's 8-row repacking of
// its Q4 weights). One group of 8 rows is then 4 loads, the nibbles split in registers, and per
// k-quad one byte dot product against the quad's 4 activation codes broadcast to every row's lane
// (AVX-512 VNNI vpdpbusd; AVX2 vpmaddubsw, whose int16 pair sums, at most 2 * 15 * 127 = 3,810,
// add up over the 8 quads without overflow, then one vpmaddwd): the 8 rows' sums land in the 8
// lanes of one vector with no horizontal add, and the scales apply to 8 rows at once (a per-group
// scale handled row by row cost more than the dot product: docs/performance-journal.md, thirteenth
// session; a first version of this kernel summed each row's lanes with vphaddd, 30 cycles a group).
//
// Why: on an AVX2-only CPU torch 2.13's int4 kernel reads a decode step's int4 weights at ~9 GB/s
// and was most of a one-row step (7.4 of ~12 ms on AVX2 code paths). Work is split over torch's
// intra-op threads by blocks of rows. Arithmetic: exact int32 dot products, float32 scales and
// sums, rounded once to x's dtype; the activations' rounding to int8 is the approximation (relative
// error ~6e-3 on Gaussian activations against ~2e-3 for torch's bf16 activations).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "sfcl_kernels.h"

namespace sfcl {
namespace {

constexpr int64_t kGroup = kQ8Block;  // sfcl.model.quant.INT4_GROUP: the weight's groups are the activations' blocks
constexpr int64_t kRows = 8;         // weight rows per block of the layout
constexpr int64_t kBlocksPerTask = 16;  // row blocks per unit of the parallel split
// Activation rows per pass over a task's weights: 32 rows of codes (48 KB at K = 1,536) and their
// block sums stay near L1 instead of each row coming from L2 once per group (down_proj at 512 rows:
// 1.2x, 2026-12-07, AVX2 code paths of an AMD EPYC Zen 4)
constexpr int64_t kRowTile = 32;

inline float bf16_bits_to_float(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#if defined(__AVX2__) && defined(__FMA__)
// The 8 rows' integer dot products of one group (q[j]: k-quad j's codes, row r in bytes 4r..4r+3)
// with one block of 32 activation codes x8, lanes = rows 0..7.
inline __m256i group_dots(const __m256i q[8], const int8_t* x8) {
  auto quad = [x8](int j) {  // k-quad j's 4 activation codes in every lane, one broadcast load (copying
    int32_t v;               // the block to the stack first cost a store, a reload and a shuffle each)
    std::memcpy(&v, x8 + 4 * j, 4);
    return _mm256_set1_epi32(v);
  };
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();  // two chains of vpdpbusd
  for (int j = 0; j < 8; j += 2) {
    a = _mm256_dpbusd_epi32(a, q[j], quad(j));
    b = _mm256_dpbusd_epi32(b, q[j + 1], quad(j + 1));
  }
  return _mm256_add_epi32(a, b);
#else
  // the int16 sums as a tree (exact: at most 8 * 3,810 < 32,767), not one chain of 7 dependent adds
  const __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(q[0], quad(0)), _mm256_maddubs_epi16(q[1], quad(1)));
  const __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(q[2], quad(2)), _mm256_maddubs_epi16(q[3], quad(3)));
  const __m256i s45 = _mm256_add_epi16(_mm256_maddubs_epi16(q[4], quad(4)), _mm256_maddubs_epi16(q[5], quad(5)));
  const __m256i s67 = _mm256_add_epi16(_mm256_maddubs_epi16(q[6], quad(6)), _mm256_maddubs_epi16(q[7], quad(7)));
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(s01, s23), _mm256_add_epi16(s45, s67)),
                           _mm256_set1_epi16(1));
#endif
}

#endif

// Rows [b0, b1) of 8 of y (M, N) float32 for M activation rows.
void row_blocks(const uint8_t* codes, const uint16_t* sz, const int8_t* x8, const float* d, const int32_t* xs,
                const float* fs, int64_t M, int64_t G, int64_t N, float* y, int64_t b0, int64_t b1) {
  const int64_t K = G * kGroup;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[kRowTile];
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {  // activation rows in tiles (kRowTile)
    const int64_t m1 = std::min(M, m0 + kRowTile);
    for (int64_t rb = b0; rb < b1; ++rb) {
      for (int64_t m = m0; m < m1; ++m) acc[m - m0] = _mm256_setzero_ps();
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* c = codes + (rb * G + g) * 128;
        const uint16_t* s = sz + (rb * G + g) * 16;
        __m256i q[8];
        for (int i = 0; i < 4; ++i) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * i));
          q[2 * i] = _mm256_and_si256(v, low);
          q[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        const __m256 scale = bf16x8(s), zero = bf16x8(s + 8);
        for (int64_t m = m0; m < m1; ++m) {
          const int64_t mg = m * G + g;
          const __m256i dots = _mm256_sub_epi32(group_dots(q, x8 + m * K + g * kGroup), _mm256_set1_epi32(8 * xs[mg]));
          const __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(scale, _mm256_set1_ps(d[mg])),
                                           acc[m - m0]);
          acc[m - m0] = _mm256_fmadd_ps(zero, _mm256_set1_ps(fs[mg]), a);
        }
      }
      for (int64_t m = m0; m < m1; ++m) _mm256_storeu_ps(y + m * N + rb * kRows, acc[m - m0]);
    }
  }
#else
  for (int64_t rb = b0; rb < b1; ++rb) {
    for (int64_t m = 0; m < M; ++m)
      for (int r = 0; r < kRows; ++r) {
        float a = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          const uint8_t* c = codes + (rb * G + g) * 128;
          const uint16_t* s = sz + (rb * G + g) * 16;
          int32_t dot = 0;
          for (int64_t j = 0; j < kGroup; ++j) {  // k-quad j / 4: chunk j / 8, low nibble for even quads
            const uint8_t byte = c[32 * (j / 8) + 4 * r + j % 4];
            dot += int32_t((j / 4) % 2 ? byte >> 4 : byte & 15) * int32_t(x8[m * K + g * kGroup + j]);
          }
          const int64_t mg = m * G + g;
          a += float(dot - 8 * xs[mg]) * (bf16_bits_to_float(s[r]) * d[mg]) + bf16_bits_to_float(s[8 + r]) * fs[mg];
        }
        y[m * N + rb * kRows + r] = a;
      }
  }
#endif
}

}  // namespace

// x (M, K) float32, bfloat16 or float16, contiguous; codes (N / 8, K / 32, 128) uint8 and sz (N / 8, K / 32,
// 16) bfloat16 in the layout above. Returns y (M, N) in x's dtype. Raises for other shapes or dtypes.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf),
              "int4_linear: x must be a contiguous (M, K) float32, bfloat16 or float16 tensor");
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == 128 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "int4_linear: codes must be a contiguous (N / 8, K / 32, 128) uint8 tensor");
  const int64_t M = x.size(0), K = x.size(1), NB = codes.size(0), G = codes.size(1), N = NB * kRows;
  TORCH_CHECK(K == G * kGroup, "int4_linear: x has K = ", K, " but the weight ", G * kGroup);
  TORCH_CHECK(sz.dim() == 3 && sz.size(0) == NB && sz.size(1) == G && sz.size(2) == 16 &&
                  sz.scalar_type() == at::kBFloat16 && sz.is_contiguous(),
              "int4_linear: sz must be a contiguous (N / 8, K / 32, 16) bfloat16 tensor");
  const Q8Rows q8 = quantise_q8_rows(x);  // (M, K) codes, per block d, code sum, float sum
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const uint8_t* C = codes.data_ptr<uint8_t>();
  const uint16_t* S = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>());
  float* Y = y.data_ptr<float>();
  if (M > 0)
    at::parallel_for(0, NB, kBlocksPerTask, [&](int64_t b0, int64_t b1) {
      row_blocks(C, S, q8.x8.data(), q8.d.data(), q8.xs.data(), q8.fs.data(), M, G, N, Y, b0, b1);
    });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace sfcl

TORCH_LIBRARY_FRAGMENT(sfcl, m) { m.def("int4_linear(Tensor x, Tensor codes, Tensor sz) -> Tensor"); }
TORCH_LIBRARY_IMPL(sfcl, CPU, m) { m.impl("int4_linear", &sfcl::int4_linear); }

// Shapes only, for torch.compile's fake tensors: (M, N) in x's dtype.
TORCH_LIBRARY_IMPL(sfcl, Meta, m) {
  m.impl("int4_linear", [](const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz) {
    TORCH_CHECK(x.dim() == 2 && codes.dim() == 3 && x.sym_size(1) == codes.sym_size(1) * 32,
                "int4_linear: x (M, K), codes (N / 8, K / 32, 128)");
    return at::empty_symint({x.sym_size(0), codes.sym_size(0) * 8}, x.options());
  });
}
