// Element-wise steps of a Llama decoder layer over rows of a 16-bit (or float32) activation, as
// single loops: RMSNorm, the residual add, rotary embedding, SiLU(gate) * up. Shared by the decode
// step's fused layers (decode_layers.cpp) and the prompt / anchor-build path's operators
// (elementwise.cpp: torch.ops.sfcl.rms_norm, silu_mul, rope_). Each operation rounds to the model
// dtype exactly where the torch operators of sfcl.model.llama do (the library is built with
// -ffp-contract=off, so no product is fused into an add); what differs from torch is the order of
// RMSNorm's float32 sum and the exp in SiLU (sfcl::exp_nonpositive).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "sfcl_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace sfcl {
namespace ew {

// Element conversions written so that loops over them vectorise (bf16 <-> float by bit shifts,
// round to nearest even as c10::BFloat16 does, NaN kept as NaN).
inline float to_f(c10::BFloat16 v) { return sfcl::bf16_to_float(v); }
inline float to_f(float v) { return v; }
inline float to_f(c10::Half v) { return static_cast<float>(v); }

template <typename T>
inline T from_f(float f);
template <>
inline float from_f<float>(float f) { return f; }
template <>
inline c10::Half from_f<c10::Half>(float f) { return c10::Half(f); }
template <>
inline c10::BFloat16 from_f<c10::BFloat16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t r = f != f ? uint16_t(0x7fc0) : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return c10::BFloat16(r, c10::BFloat16::from_bits());
}
// The value a torch operator producing dtype T would store: float32 passes through.
template <typename T>
inline float rnd(float f) { return to_f(from_f<T>(f)); }

// silu(x) = x / (1 + exp(-x)), from exp of -|x| only (no overflow either side).
// One division per element: x * sigmoid(x), sigmoid from exp(-|x|) as 1 / (1 + e) or e / (1 + e).
// Below kExpMin exp_nonpositive returns 0: SiLU of a gate under -87 is -0 (torch: 0 or a denormal;
// -inf gives NaN, as in torch), not x * e^-87, which grew to -4.9 at -3e38.
inline float silu(float x) {
  const float a = x < 0.0f ? x : -x;  // -|x|; NaN stays NaN
  const float e = sfcl::exp_nonpositive(a);
  return x * ((x >= 0.0f ? 1.0f : e) / (1.0f + e));
}

// Rows [0, B) of f(b), split over torch's intra-op threads once the step has enough elements.
template <typename F>
inline void for_rows(int64_t B, int64_t row_elems, F&& f) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems));
  at::parallel_for(0, B, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) f(b);
  });
}

// out = RMSNorm(x) * w, per row of H (sfcl.model.llama.RMSNorm: float32 statistics; a 16-bit model
// rounds the normalised row before the weight multiplies it, float32 is F.rms_norm).
template <typename T>
void rms_norm(const T* x, const T* w, T* out, int64_t B, int64_t H, float eps) {
  for_rows(B, H, [&](int64_t b) {
    const T* xr = x + b * H;
    T* o = out + b * H;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < H; ++i) ss += to_f(xr[i]) * to_f(xr[i]);
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) o[i] = from_f<T>(to_f(w[i]) * rnd<T>(to_f(xr[i]) * r));
  });
}

// h += a, per element, rounded to T (the residual add).
template <typename T>
void add_(T* h, const T* a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) h[i] = from_f<T>(to_f(h[i]) + to_f(a[i]));
}

// Rotary embedding in place on the first nrot heads of each row of qkv (B, W), half-split layout:
// x * cos + swapped * sin with swapped = (x2, x1) and sin = (-sin, sin) (sfcl.model.llama.apply_rope).
template <typename T>
void rope_(T* qkv, int64_t B, int64_t W, int64_t nrot, int64_t hd, const T* cos, const T* sin) {
  const int64_t half = hd / 2;
  for_rows(B, nrot * hd, [&](int64_t b) {
    const T* c = cos + b * hd;
    const T* s = sin + b * hd;
    for (int64_t h = 0; h < nrot; ++h) {
      T* x = qkv + b * W + h * hd;
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        const float x1 = to_f(x[j]), x2 = to_f(x[j + half]);
        const float o1 = rnd<T>(x1 * to_f(c[j])) + rnd<T>(x2 * to_f(s[j]));
        const float o2 = rnd<T>(x2 * to_f(c[j + half])) + rnd<T>(x1 * to_f(s[j + half]));
        x[j] = from_f<T>(o1);
        x[j + half] = from_f<T>(o2);
      }
    }
  });
}

// act (B, I) = silu(gu[:, :I]) * gu[:, I:], each operation rounded to T (F.silu(gate) * up).
template <typename T>
void silu_mul(const T* gu, T* act, int64_t B, int64_t I) {
  for_rows(B, 2 * I, [&](int64_t b) {
    const T* g = gu + b * 2 * I;
    const T* u = g + I;
    T* o = act + b * I;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) o[i] = from_f<T>(rnd<T>(silu(to_f(g[i]))) * to_f(u[i]));
  });
}

}  // namespace ew
}  // namespace sfcl
