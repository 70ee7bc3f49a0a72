// The element-wise steps of a decoder layer over many rows, for the prompt path and the anchor
// builder's model pass (torch.ops.sfcl.rms_norm, silu_mul, rope_), float32, bf16 or float16 on CPU.
//
// Why: over a prompt chunk or a batch of anchor-build windows (thousands of rows) torch's operators
// take RMSNorm as six passes over the rows (a float32 copy, pow, mean, rsqrt times x, back to the
// model dtype, times the weight), rotary embedding as four and SiLU(gate) * up as three, each
// writing a new tensor: on the Intel Xeon with AMX those steps took ~0.4 s of a 1.4 s batch of four
// 1,024-token windows whose GEMMs ran on AMX (scripts/profile_model_pass.py --profile, 2026-12-05).
// Here each is one loop over the rows (elementwise.h, the same loops as the fused decode layers),
// split over torch's intra-op threads. sfcl.model.llama calls them when this library is loaded and
// torch.compile is not tracing. float32 (the AVX2 default) too since the twenty-seventh session: there
// torch's operators were ~6% of the anchor build's model pass (aten::mul, silu, flip, pow, ...).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "elementwise.h"

#include <cstdint>

namespace sfcl {
namespace {

void check_rows(const at::Tensor& t, const char* op, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", what, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf, op,
              ": ", what, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), op, ": ", what, " must be contiguous");
}

// The model dtypes these loops serve: float32 (rnd<float> is the identity: every step in float32, as
// torch's float32 operators) and the two 16-bit ones.
#define SFCL_DISPATCH_ROWS(TYPE, NAME, ...)                                        \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)          \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

}  // namespace

// x (..., H) float32/bf16/fp16 contiguous, weight (H,) the same dtype -> (..., H): RMSNorm(x) * weight with
// float32 statistics, the normalised row rounded to the dtype before the weight multiplies it
// (sfcl.model.llama.RMSNorm). Raises (RuntimeError) on other dtypes, shapes or layouts.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm", "x");
  check_rows(weight, "rms_norm", "weight");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1) &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be (H,) in x's dtype, with H = x's last dimension");
  const int64_t H = x.size(-1), B = H ? x.numel() / H : 0;
  at::Tensor out = at::empty_like(x);
  if (B == 0) return out;
  SFCL_DISPATCH_ROWS(x.scalar_type(), "rms_norm", [&] {
    ew::rms_norm<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), B, H,
                           static_cast<float>(eps));
  });
  return out;
}

// gate_up (..., 2I) float32/bf16/fp16 contiguous -> (..., I): SiLU(gate_up[..., :I]) * gate_up[..., I:],
// each operation rounded to the dtype (F.silu(gate) * up). Raises (RuntimeError) on other dtypes,
// an odd last dimension or a non-contiguous input.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul", "gate_up");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "silu_mul: gate_up's last dimension must be even");
  const int64_t I = gate_up.size(-1) / 2, B = I ? gate_up.numel() / (2 * I) : 0;
  auto shape = gate_up.sizes().vec();
  shape.back() = I;
  at::Tensor act = at::empty(shape, gate_up.options());
  if (B == 0) return act;
  SFCL_DISPATCH_ROWS(gate_up.scalar_type(), "silu_mul", [&] {
    ew::silu_mul<scalar_t>(gate_up.data_ptr<scalar_t>(), act.data_ptr<scalar_t>(), B, I);
  });
  return act;
}

// In place on x (R, W) float32/bf16/fp16 contiguous (R rows, e.g. a prompt chunk's fused q/k/v projections):
// the first rot_heads heads of head_dim in each row get the rotary embedding of the half-split layout,
// x * cos + (x2, x1) * sin (sfcl.model.llama.apply_rope: cos = cat(cos, cos), sin = cat(-sin, sin)),
// cos / sin (R, head_dim) in x's dtype, one row per row of x. Returns x. Raises (RuntimeError) when
// rot_heads * head_dim exceeds W, head_dim is odd, or the shapes or dtypes differ.
at::Tensor& rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t rot_heads, int64_t head_dim) {
  check_rows(x, "rope_", "x");
  check_rows(cos, "rope_", "cos");
  check_rows(sin, "rope_", "sin");
  TORCH_CHECK(x.dim() == 2, "rope_: x must be (R, W)");
  const int64_t R = x.size(0), W = x.size(1);
  TORCH_CHECK(head_dim >= 2 && head_dim % 2 == 0 && rot_heads >= 0 && rot_heads * head_dim <= W,
              "rope_: need an even head_dim >= 2 and rot_heads * head_dim <= W, got ", rot_heads, " x ", head_dim,
              " for W = ", W);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == R && t->size(1) == head_dim && t->scalar_type() == x.scalar_type(),
                "rope_: cos and sin must be (R, head_dim) in x's dtype");
  if (R == 0 || rot_heads == 0) return x;
  SFCL_DISPATCH_ROWS(x.scalar_type(), "rope_", [&] {
    ew::rope_<scalar_t>(x.data_ptr<scalar_t>(), R, W, rot_heads, head_dim, cos.data_ptr<scalar_t>(),
                        sin.data_ptr<scalar_t>());
  });
  return x;
}

}  // namespace sfcl

TORCH_LIBRARY_FRAGMENT(sfcl, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin, int rot_heads, int head_dim) -> Tensor(a!)");
}
TORCH_LIBRARY_IMPL(sfcl, CPU, m) {
  m.impl("rms_norm", &sfcl::rms_norm);
  m.impl("silu_mul", &sfcl::silu_mul);
  m.impl("rope_", &sfcl::rope_);
}
