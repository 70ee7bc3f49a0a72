// Declarations shared by SFCL's CPU kernels (one library: decode_attention.cpp, decode_layers.cpp, anchor_search.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <tuple>

namespace sfcl {

// bf16 -> float by a bit shift (exact), written so that loops over it vectorise.
inline float bf16_to_float(c10::BFloat16 v) {
  uint32_t u = uint32_t(v.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// exp(x) for x <= 0 (Cephes expf: range reduction by ln 2 in two parts, degree-6 polynomial;
// ~1 ulp), written so that the compiler vectorizes the loop that calls it. decode_attention.cpp's
// AVX-512 softmax evaluates the same steps 16 lanes at a time from these constants.
constexpr float kExpMin = -87.0f;  // exp(-87) ~ 1.6e-38, still a normal float
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 = kLn2Hi + kLn2Lo
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_nonpositive(float x) {
  x = x < kExpMin ? kExpMin : x;
  float n = __builtin_rintf(x * kLog2e);
  float r = x - n * kLn2Hi - n * kLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  p = p * r * r + r + 1.0f;
  int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &e, 4);
  return p * two_n;
}

// torch.ops.sfcl.decode_attention; see decode_attention.cpp and sfcl/model/decode_kernel.py.
std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                    const at::Tensor& v_cache, const at::Tensor& k_new,
                                                    const at::Tensor& v_new, const at::Tensor& pos, int64_t row0,
                                                    int64_t S, double scale, bool want_probs);

}  // namespace sfcl
