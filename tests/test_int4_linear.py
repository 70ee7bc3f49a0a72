"""SFCL's int4 x int8 GEMV (``torch.ops.sfcl.int4_linear``, ``csrc/int4_linear.cpp``) and its weight
layout (``sfcl.model.quant.int4_q8_layout``): error against float64 with the same weights, the
layout's round trip, both activation dtypes, the contract's errors, and QuantLinear's packed path
running it when ``int4_kernel`` says "sfcl"."""

import pytest
import torch

from sfcl.model import decode_kernel, quant
from sfcl.model.quant import QuantLinear, int4_q8_codes, int4_q8_layout, quantize_int4


@pytest.fixture(scope="module")
def kernel():
    if not decode_kernel.load():
        pytest.skip(f"SFCL's native kernels could not be built here: {decode_kernel.why_unavailable()}")


def _weights(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, scale, zero = quantize_int4(torch.randn(n, k, generator=g) * 0.05)
    sz = torch.stack([scale.t(), zero.t()], -1).to(torch.bfloat16).contiguous()  # torch's (K/32, N, 2)
    return q, sz, quant._int4_kernel_weight(q, sz)  # codes, scales and zeros, (N, K) float32 weights


def test_layout_round_trip_and_shapes():
    q, sz, _ = _weights(24, 96)
    codes, s = int4_q8_layout(q, sz)
    assert codes.shape == (3, 3, 128) and codes.dtype == torch.uint8
    assert s.shape == (3, 3, 16) and s.dtype == torch.bfloat16
    assert torch.equal(int4_q8_codes(codes), q)
    # block 1, group 2: rows 8..15, the scales then the zeros of torch's layout
    assert torch.equal(s[1, 2, :8], sz[2, 8:16, 0]) and torch.equal(s[1, 2, 8:], sz[2, 8:16, 1])
    with pytest.raises(ValueError, match="N % 8"):
        int4_q8_layout(q[:20], sz[:, :20])
    with pytest.raises(ValueError, match="scales_and_zeros"):
        int4_q8_layout(q, sz[:, :16])
    with pytest.raises(ValueError, match="0..15"):
        int4_q8_layout(q + 1, sz)  # q holds 15s: 16 would wrap into the next nibble


@pytest.mark.parametrize("n,k", [(576, 576), (1536, 576), (576, 1536), (8, 32)])
@pytest.mark.parametrize("m", [1, 3, 7, 70])
def test_error_against_float64_is_the_int8_activations(kernel, n, k, m):
    """Relative error of y against x @ W^T in float64 with the kernel's own weights (codes times bf16
    scales): what the int8 activations cost, ~6e-3 on Gaussian rows (torch's kernel, bf16
    activations: ~2.4e-3); a wrong scale, zero term or row order would be O(1)."""
    q, sz, w = _weights(n, k, seed=n + k)
    codes, s = int4_q8_layout(q, sz)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    ref = x.double() @ w.double().T
    for xx in (x, x.bfloat16()):
        y = torch.ops.sfcl.int4_linear(xx, codes, s)
        assert y.shape == (m, n) and y.dtype == xx.dtype
        err = float((y.double() - ref).norm() / ref.norm())
        assert err < 1.2e-2, err
    assert torch.ops.sfcl.int4_linear(x[:0], codes, s).shape == (0, n)
    zero_row = torch.ops.sfcl.int4_linear(torch.zeros(1, k), codes, s)
    assert torch.equal(zero_row, torch.zeros(1, n))  # no activation: no zero-point term either


@pytest.mark.parametrize("n,k", [(576, 1536), (24, 64)])
def test_each_row_as_if_alone_across_row_tiles(kernel, n, k):
    """A prompt chunk's hundreds of rows run in tiles of 32 (``kRowTile``): every row of a 1-97-row
    product equals that row multiplied alone, bit for bit (its activations are quantised per row and
    its sums run in the same order), so a row's result does not depend on its batch or on which tile
    it lands in; a tile bound off by one would leave rows unwritten or mixed."""
    q, sz, _ = _weights(n, k, seed=7)
    codes, s = int4_q8_layout(q, sz)
    x = torch.randn(97, k, generator=torch.Generator().manual_seed(8))
    alone = torch.cat([torch.ops.sfcl.int4_linear(x[i:i + 1], codes, s) for i in range(97)])
    for m in (31, 32, 33, 64, 65, 97):
        assert torch.equal(torch.ops.sfcl.int4_linear(x[:m], codes, s), alone[:m]), m


def test_tiny_huge_and_non_finite_activations(kernel):
    """A block of tiny values (max |x| below 127 / FLT_MAX: 127 / max |x| is infinite) keeps its
    signs, 1e30 scales through, and inf or NaN in x gives a non-finite output, not a wrong finite one
    (break-it pass: tiny blocks all came out -127)."""
    q, sz, w = _weights(16, 64, seed=3)
    codes, s = int4_q8_layout(q, sz)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(4))
    for scale in (1e-37, 1e-30, 1.0, 1e30):
        xs = x * scale
        ref = xs.double() @ w.double().T
        err = float((torch.ops.sfcl.int4_linear(xs, codes, s).double() - ref).norm() / ref.norm())
        # at 1e-37 the codes' scale is floored at FLT_MIN, so fewer levels: 3.7% (was 440%: signs lost)
        assert err < (0.1 if scale < 1e-36 else 2e-2), (scale, err)
    bad = x.clone()
    bad[0, 5] = float("inf")
    assert not torch.isfinite(torch.ops.sfcl.int4_linear(bad, codes, s)).any()
    bad[0, 5] = float("nan")
    assert torch.isnan(torch.ops.sfcl.int4_linear(bad, codes, s)).all()


def test_float16_activations(kernel, monkeypatch):
    """A float16 model (``--dtype float16``) on SFCL's kernel: the same products, returned in float16
    (break-it pass: the kernel refused float16 and such a model failed every decode step)."""
    q, sz, w = _weights(32, 64, seed=5)
    codes, s = int4_q8_layout(q, sz)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(6))
    y = torch.ops.sfcl.int4_linear(x.half(), codes, s)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), torch.ops.sfcl.int4_linear(x.half().float(), codes, s), atol=2e-3, rtol=2e-3)
    monkeypatch.setenv("SFCL_INT4_KERNEL", "sfcl")
    ql = QuantLinear.from_linear(torch.nn.Linear(64, 16).half(), "int4", max_rows=6)
    assert ql.kernel == "sfcl" and ql(torch.randn(1, 64).half()).dtype == torch.float16


def test_rejects_inconsistent_arguments(kernel):
    q, sz, _ = _weights(16, 64)
    codes, s = int4_q8_layout(q, sz)
    x = torch.randn(2, 64)
    for bad in ((x[:, :32].contiguous(), codes, s), (x.double(), codes, s), (x, codes[..., :64], s),
                (x, codes, s.float()), (x, codes, s[:1]), (x.t(), codes, s)):
        with pytest.raises(RuntimeError, match="int4_linear"):
            torch.ops.sfcl.int4_linear(*bad)


def test_quant_linear_runs_it_where_chosen(kernel, monkeypatch):
    """SFCL_INT4_KERNEL=sfcl: the packed path is int4_linear on x as it is, the layout replaces
    torch's packed weight, and the dense path still multiplies by the same weights."""
    monkeypatch.setenv("SFCL_INT4_KERNEL", "sfcl")
    lin = torch.nn.Linear(128, 96)
    ql = QuantLinear.from_linear(lin, "int4", max_rows=2, dense="keep")
    assert ql.kernel == "sfcl" and ql.qweight is None and ql.q4codes.shape == (12, 4, 128)
    x2 = torch.randn(2, 128)
    assert torch.equal(ql(x2), torch.ops.sfcl.int4_linear(x2, ql.q4codes, ql.q4sz) + lin.bias)
    q = quantize_int4(lin.weight.data)[0]  # the weights recovered from the layout are the quantized ones
    assert torch.equal(ql.dequantized_weight(), quant._int4_kernel_weight(q, ql.scales_and_zeros).to(torch.bfloat16))
    x3 = torch.randn(3, 128)
    torch.testing.assert_close(ql(x3), torch.nn.functional.linear(x3, ql.dense_weight, lin.bias))
    monkeypatch.setenv("SFCL_INT4_KERNEL", " Torch ")  # read case-insensitively
    assert QuantLinear.from_linear(lin, "int4", max_rows=2).kernel == "torch"
    monkeypatch.setenv("SFCL_INT4_KERNEL", "fast")
    with pytest.raises(ValueError, match="SFCL_INT4_KERNEL"):
        QuantLinear.from_linear(lin, "int4", max_rows=2)
