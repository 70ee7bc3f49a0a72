"""The snapshot layer's causal attention weights and entropies in one native pass
(``torch.ops.sfcl.causal_softmax_entropy_``; ``csrc/attention_entropy.cpp``) against torch's
softmax and the serving dispersion rule (``sfcl.snapshot.triggers.attention_dispersion``), its
errors, and the anchor builder's attention (``sfcl.anchors.model_pass._snapshot_attention``) with it against the
same attention with torch's eager softmax."""

import types

import pytest
import torch

from sfcl.anchors import model_pass
from sfcl.model import decode_kernel
from sfcl.snapshot.triggers import attention_dispersion, dispersion_from_entropy


@pytest.fixture(scope="module")
def kernel():
    if not decode_kernel.load():
        pytest.skip(f"SFCL's native kernels could not be built here: {decode_kernel.why_unavailable()}")


def _torch_weights(s, scale):
    """(R, T, T) raw scores -> float32 causal softmax of scale * s (zeros above the diagonal)."""
    T = s.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return (s.float() * scale).masked_fill(~causal, float("-inf")).softmax(-1)


def _entropy(w):
    """(..., T) weights -> (...) entropies in nats, a weight of 0 adding 0."""
    return -(w * w.clamp_min(1e-30).log()).sum(-1)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("shape", [(9, 1024), (3, 1), (2, 37)])
def test_weights_and_entropy_match_torch(kernel, dtype, shape):
    R, T = shape
    g = torch.Generator().manual_seed(R * 1000 + T)
    s = (torch.randn(R, T, T, generator=g) * 20).to(dtype)  # peaked and flat rows alike
    ref = _torch_weights(s, 0.125)  # (R, T, T) fp32
    got = s.clone()
    ent = torch.ops.sfcl.causal_softmax_entropy_(got, 0.125)
    assert ent.shape == (R, T) and ent.dtype == torch.float32 and got.dtype == dtype
    assert bool((got.float().triu(1) == 0).all())  # nothing above the diagonal
    tol = {torch.float32: 1e-6, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
    torch.testing.assert_close(got.float(), ref.to(dtype).float(), atol=tol, rtol=tol * 2)
    ref_ent = _entropy(ref)  # (R, T) nats
    torch.testing.assert_close(ent, ref_ent, atol=2e-5 * max(1.0, float(torch.log(torch.tensor(T)))), rtol=0)
    assert bool((ent[:, 0] == 0).all())  # one attended position: no spread


def test_entropy_of_uniform_rows_is_log_n(kernel):
    T = 64
    s = torch.zeros(2, T, T)
    ent = torch.ops.sfcl.causal_softmax_entropy_(s, 1.0)
    torch.testing.assert_close(ent, torch.arange(1, T + 1).float().log().expand(2, T), atol=1e-5, rtol=0)
    torch.testing.assert_close(s[0, 9, :10], torch.full((10,), 0.1))


def test_nan_scores_give_nan_only_in_their_row(kernel):
    s = torch.randn(1, 8, 8)
    s[0, 5, 2] = float("nan")
    ent = torch.ops.sfcl.causal_softmax_entropy_(s, 1.0)
    assert torch.isnan(ent[0, 5]) and not torch.isnan(ent[0, torch.arange(8) != 5]).any()


def test_a_minus_inf_score_weighs_nothing_in_the_entropy(kernel):
    """A score of -inf (a float16 q . k that overflowed) gets weight 0 and adds 0 to the entropy, as p
    log p -> 0: the row's entropy is torch's (0 x -inf had made it NaN; found by a tester)."""
    s = torch.tensor([[[0.0, 0, 0], [1, 2, 0], [1, -float("inf"), 2]]])
    ref = _torch_weights(s, 1.0)
    ref_ent = _entropy(ref)
    got = s.clone()
    ent = torch.ops.sfcl.causal_softmax_entropy_(got, 1.0)
    assert got[0, 2, 1] == 0
    torch.testing.assert_close(ent, ref_ent, atol=1e-6, rtol=0)


@pytest.mark.parametrize("bad, match", [
    (lambda: torch.zeros(2, 4, 5), r"\(R, T, T\)"),
    (lambda: torch.zeros(4, 4), r"\(R, T, T\)"),
    (lambda: torch.zeros(2, 4, 4, dtype=torch.float64), "float32, bfloat16 or float16"),
    (lambda: torch.zeros(2, 4, 4).transpose(1, 2), "contiguous"),
])
def test_bad_input_is_refused(kernel, bad, match):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.sfcl.causal_softmax_entropy_(bad(), 1.0)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_builders_attention_with_the_kernel_matches_torchs_softmax(kernel, dtype, monkeypatch):
    """_snapshot_attention's output and dispersion with the native weights against its eager path (the serving
    rule, attention_dispersion); GQA 9 query heads over 3 KV heads, SmolLM2-135M's shape."""
    nh, nkv, hd, T = 9, 3, 64, 300
    g = torch.Generator().manual_seed(7)
    q = (torch.randn(1, nh, T, hd, generator=g) * 2).to(dtype)
    k = (torch.randn(1, nkv, T, hd, generator=g) * 2).to(dtype)
    v = torch.randn(1, nkv, T, hd, generator=g).to(dtype)
    attn = types.SimpleNamespace(a=types.SimpleNamespace(n_heads=nh, n_kv_heads=nkv, head_dim=hd), scale=hd ** -0.5)
    with torch.inference_mode():
        assert model_pass.native_softmax(q)
        o, d = model_pass._snapshot_attention(attn, q, k, v)
        monkeypatch.setattr(model_pass, "native_softmax", lambda q: False)
        o_ref, d_ref = model_pass._snapshot_attention(attn, q, k, v)
    assert o.shape == o_ref.shape == (T, nh * hd) and d.shape == d_ref.shape == (T,)
    # eager bf16 rounds scale * s to bf16 before its softmax; the kernel scales in float32
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(o.float(), o_ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(d, d_ref, atol=1e-5 if dtype == torch.float32 else 5e-3, rtol=0)
    assert d[0] == 0 and bool(((d >= 0) & (d <= 1 + 1e-6)).all())


def test_dispersion_from_entropy_is_the_serving_rule():
    g = torch.Generator().manual_seed(3)
    p = torch.rand(5, 4, 16, generator=g)  # (B, nh, S)
    n = torch.tensor([1, 2, 7, 16, 16])
    p = p * (torch.arange(16) < n[:, None, None])
    p = p / p.sum(-1, keepdim=True)
    ent = _entropy(p).mean(-1)
    torch.testing.assert_close(dispersion_from_entropy(ent, n), attention_dispersion(p, n))
    assert dispersion_from_entropy(ent, n)[0] == 0
