"""SFCL's element-wise operators over many float32 / 16-bit rows (``torch.ops.sfcl.rms_norm``, ``silu_mul``,
``rope_``; ``csrc/elementwise.cpp``) against the torch arithmetic of ``sfcl.model.llama`` they stand
in for, their errors, and the model calling them (``native_rows``) only where they apply: a whole
forward with them against the same forward with torch's operators."""

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama

from sfcl.model import decode_kernel, llama
from sfcl.model.llama import RMSNorm, apply_rope, native_rows

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ULP = {torch.float32: 2 ** -23, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}  # relative unit of the last place


@pytest.fixture(scope="module")
def kernel():
    if not decode_kernel.load():
        pytest.skip(f"SFCL's native kernels could not be built here: {decode_kernel.why_unavailable()}")


def _torch_rms_norm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 4096, 576), (7, 960), (3, 5, 64)])
def test_rms_norm_matches_torch_up_to_the_sums_order(kernel, dtype, shape):
    """The statistics are a float32 sum in another order, so a row's scale may differ in its last
    bit and flip the rounding of a few elements by one unit of the dtype; nothing else differs."""
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    got = torch.ops.sfcl.rms_norm(x, w, 1e-5)
    ref = _torch_rms_norm(x, w, 1e-5)
    assert got.shape == x.shape and got.dtype == dtype
    if dtype == torch.float32:  # no rounding to a coarser dtype hides the scale's last bits: a few float32 ulps
        torch.testing.assert_close(got, ref, rtol=8 * ULP[dtype], atol=1e-7)
        torch.testing.assert_close(got, F.rms_norm(x, (shape[-1],), w, 1e-5), rtol=8 * ULP[dtype], atol=1e-7)
        return
    ulp = (ref.float().abs() * ULP[dtype]).clamp_min(1e-6)
    assert bool(((got.float() - ref.float()).abs() <= 2 * ulp).all())
    assert int((got != ref).sum()) <= max(2, x.numel() // 1000)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(kernel, dtype):
    g = torch.Generator().manual_seed(1)
    gu = (torch.randn(2, 300, 2 * 1536, generator=g) * 4).to(dtype)
    gu[0, 0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)  # saturated and zero gates
    got = torch.ops.sfcl.silu_mul(gu)
    ref = F.silu(gu[..., :1536]) * gu[..., 1536:]
    assert got.shape == (2, 300, 1536) and got.dtype == dtype
    torch.testing.assert_close(got, ref, rtol=4 * ULP[dtype], atol=1e-3 if dtype != torch.float32 else 1e-6)  # SFCL's exp
    if dtype != torch.float32:
        assert float((got != ref).float().mean()) < 1e-3
    assert bool(got[0, 0, :4].isfinite().all())  # saturated and zero gates: SiLU's limits, no NaN


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_is_apply_rope_bit_for_bit(kernel, dtype):
    """q and k heads rotated, v heads untouched, the same roundings as apply_rope's four operators."""
    R, nh, nkv, hd = 333, 9, 3, 64
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(R, (nh + 2 * nkv) * hd, generator=g).to(dtype)
    cos = torch.randn(R, hd, generator=g).to(dtype)
    sin = torch.randn(R, hd, generator=g).to(dtype)
    ref = apply_rope(qkv[:, :(nh + nkv) * hd].view(R, nh + nkv, hd), cos[:, None], sin[:, None])
    x = qkv.clone()
    out = torch.ops.sfcl.rope_(x, cos, sin, nh + nkv, hd)
    assert out.data_ptr() == x.data_ptr()
    assert torch.equal(x[:, :(nh + nkv) * hd].view(R, nh + nkv, hd), ref)
    assert torch.equal(x[:, (nh + nkv) * hd:], qkv[:, (nh + nkv) * hd:])


def test_errors_are_clear(kernel):
    x = torch.randn(4, 64).bfloat16()
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        torch.ops.sfcl.rms_norm(x.double(), torch.ones(64).double(), 1e-5)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.sfcl.rms_norm(x, torch.ones(32).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.sfcl.rms_norm(x.t(), torch.ones(4).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="even"):
        torch.ops.sfcl.silu_mul(torch.randn(4, 63).bfloat16())
    with pytest.raises(RuntimeError, match="rot_heads"):
        torch.ops.sfcl.rope_(x, torch.ones(4, 64).bfloat16(), torch.ones(4, 64).bfloat16(), 2, 64)
    with pytest.raises(RuntimeError, match=r"\(R, head_dim\)"):
        torch.ops.sfcl.rope_(x, torch.ones(3, 64).bfloat16(), torch.ones(3, 64).bfloat16(), 1, 64)
    assert torch.ops.sfcl.rms_norm(x[:0], torch.ones(64).bfloat16(), 1e-5).shape == (0, 64)
    assert torch.ops.sfcl.silu_mul(x[:0]).shape == (0, 32)


def test_native_rows_only_where_the_operators_apply(kernel):
    x = torch.randn(8, 64).bfloat16()
    assert native_rows(x) and native_rows(x.half()) and native_rows(x.float())
    assert not native_rows(x.double())
    assert not native_rows(x.t())  # not contiguous
    w = x.clone().requires_grad_()
    assert not native_rows(w)
    with torch.no_grad():
        assert native_rows(w)


def test_rms_norm_module_takes_the_operator_for_16_bit_rows(kernel, monkeypatch):
    n = RMSNorm(64, 1e-6).bfloat16()
    x = torch.randn(5, 64).bfloat16()
    calls = []
    op = torch.ops.sfcl.rms_norm

    def spy(*a):
        calls.append(a[0].shape)
        return op(*a)

    monkeypatch.setattr(torch.ops.sfcl, "rms_norm", spy)
    with torch.no_grad():
        n(x)
        n(x.float().bfloat16().t().contiguous().t())  # a transposed view: torch's operators
    assert calls == [(5, 64)]
    out = n(x)  # grad mode on and a weight that requires grad: the operator has no autograd kernel
    assert calls == [(5, 64)] and out.requires_grad


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_rms_norm_module_keeps_the_weights_gradient(kernel, dtype):
    """x without grad, a trained weight: torch's operators, so backward reaches the weight."""
    n = RMSNorm(16, 1e-5).to(dtype)
    x = torch.randn(3, 16).to(dtype)
    n(x).float().sum().backward()
    ref = RMSNorm(16, 1e-5).to(dtype)
    with torch.no_grad():
        assert torch.equal(n(x), torch.ops.sfcl.rms_norm(x, n.weight, 1e-5))  # the served path: the operator
    torch_norm = F.rms_norm(x, (16,), ref.weight, 1e-5) if dtype == torch.float32 else _torch_rms_norm(x, ref.weight, 1e-5)
    torch_norm.float().sum().backward()
    assert n.weight.grad is not None
    torch.testing.assert_close(n.weight.grad, ref.weight.grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_at_extreme_gates_is_torchs(kernel, dtype):
    """Gates past exp's clamp (-87) give SiLU's limit, -0 (x e^x underflows), not x e^-87, which had
    grown to -4.9 at -3e38; -inf gives NaN and NaN stays NaN, as in torch."""
    big = 3e38 if dtype == torch.float32 else (6e4 if dtype == torch.float16 else 3e38)
    g = torch.tensor([-float("inf"), -big, -big / 30, -1e4, -200.0, -100.0, -88.0, 88.0, 200.0, big,
                      float("inf"), float("nan")]).to(dtype)
    up = torch.ones_like(g)
    got = torch.ops.sfcl.silu_mul(torch.cat([g, up])[None])[0]
    ref = F.silu(g) * up
    assert torch.equal(got.isnan(), ref.isnan())
    ok = ~ref.isnan()
    a, b = got[ok].float(), ref[ok].float()
    assert bool(((a == b) | ((a - b).abs() <= 1e-30 + 2 ** -7 * b.abs())).all()), (got, ref)  # inf == inf


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_prefill_with_the_operators_matches_torch_operators(kernel, monkeypatch, dtype):
    """A bf16 / float32 forward of a 2-layer Llama over a 40-token prompt with SFCL's operators and
    with torch's: the same logits up to the roundings RMSNorm's sum order moves (float32: within 1e-4 of the logits' spread),
    the same greedy tokens, and each operator called in each layer."""
    from sfcl.model.kv_cache import KVCache
    from sfcl.model.llama import AttnBatch

    a, m = tiny_llama()
    m = m.to(dtype)
    ids = torch.randint(0, 200, (1, 40))

    def run():
        kv = KVCache(a, 1, 64, dtype)
        kv.ensure_initialized(1, 64)
        return m(ids, AttnBatch(is_prefill=True, slots=torch.tensor([0]), positions=torch.arange(40), kv_len=40), kv,
                 1, all_positions=True).logits

    calls = []
    for name in ("rms_norm", "silu_mul", "rope_"):
        op = getattr(torch.ops.sfcl, name)
        monkeypatch.setattr(torch.ops.sfcl, name, lambda *x, _op=op, _n=name: calls.append(_n) or _op(*x))
    native = run()
    assert sorted(set(calls)) == ["rms_norm", "rope_", "silu_mul"]
    assert calls.count("rms_norm") == 2 * 2 + 1 and calls.count("silu_mul") == 2 and calls.count("rope_") == 2
    monkeypatch.setattr(llama, "native_rows", lambda *x: False)
    ref = run()
    assert native.shape == ref.shape == (1, 40, 200)
    if dtype == torch.float32:
        torch.testing.assert_close(native, ref, rtol=1e-4, atol=1e-4 * float(ref.std()))
        assert torch.equal(native.argmax(-1), ref.argmax(-1))
        return
    torch.testing.assert_close(native, ref, rtol=0.05, atol=0.05 * float(ref.std()))
    assert float((native.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.95
