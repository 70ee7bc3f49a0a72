// Declarations shared by SFCL's CPU kernels (one library: decode_attention.cpp, decode_layers.cpp).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace sfcl {

// torch.ops.sfcl.decode_attention; see decode_attention.cpp and sfcl/model/decode_kernel.py.
std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                    const at::Tensor& v_cache, const at::Tensor& k_new,
                                                    const at::Tensor& v_new, const at::Tensor& pos, int64_t row0,
                                                    int64_t S, double scale, bool want_probs);

}  // namespace sfcl
