"""The anchor builder's causal attention (``torch.ops.sfcl.causal_attention``;
``csrc/causal_attention.cpp``), on AMX tiles and on AVX-512 BF16 vectors, against torch's causal SDPA,
its errors, and the builder's pass (``sfcl.anchors.model_pass.run_windows``) with it against the same
pass on torch's SDPA. The kernel runs where the CPU has AVX-512 BF16 and SFCL's kernels were built for
it (its AMX path where the CPU also has AMX-BF16; the vector path is tested there too, with
``amx=False``); elsewhere these tests check that it says so and that the builder keeps torch's SDPA."""

import pytest
import torch
import torch.nn.functional as F
from conftest import contractnli_docs

from sfcl.anchors import model_pass
from sfcl.model import decode_kernel


@pytest.fixture(scope="module")
def kernel():
    if not decode_kernel.load():
        pytest.skip(f"SFCL's native kernels could not be built here: {decode_kernel.why_unavailable()}")


@pytest.fixture(scope="module")
def native(kernel):
    if not torch.ops.sfcl.causal_attention_ready():
        pytest.skip("no AVX-512 BF16 here (or SFCL's kernels were built without it: $SFCL_KERNEL_MARCH)")


@pytest.fixture(params=("amx", "vectors"))
def amx(native, request):
    """Which path: AMX tiles (where they run) or AVX-512 BF16 vectors (wherever the kernel runs)."""
    if request.param == "amx" and not torch.ops.sfcl.causal_attention_amx():
        pytest.skip("no AMX here (or SFCL's kernels were built without it: $SFCL_KERNEL_MARCH)")
    return request.param == "amx"


def _qkv(n, T, nh, nkv, seed, spread=1.0):
    """q (n, T, nh, 64), k and v (n, T, nkv, 64) bf16 as the builder passes them: views of one
    (1, n T, heads, 64) projection, so a token's heads are not contiguous with the next token's."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, n * T, nh, 64, generator=g) * spread).to(torch.bfloat16)
    k = (torch.randn(1, n * T, nkv, 64, generator=g) * spread).to(torch.bfloat16)
    v = torch.randn(1, n * T, nkv, 64, generator=g).to(torch.bfloat16)
    return tuple(x[0].view(n, T, x.shape[2], 64) for x in (q, k, v))


def _sdpa(q, k, v, dtype):
    """torch's causal SDPA in ``dtype``, back in the kernel's (n, T, nh, 64) layout."""
    o = F.scaled_dot_product_attention(*(x.to(dtype).transpose(1, 2) for x in (q, k, v)), is_causal=True,
                                       enable_gqa=True)
    return o.transpose(1, 2)


@pytest.mark.parametrize("n, T, nh, nkv", [(4, 1024, 9, 3), (1, 37, 9, 3), (2, 700, 9, 3), (3, 64, 4, 4),
                                           (1, 1, 9, 3), (1, 33, 2, 1), (1, 4100, 9, 3)])
@pytest.mark.parametrize("spread", (1.0, 4.0))  # flat and peaked rows (scores ~16x larger)
def test_matches_torchs_sdpa(amx, n, T, nh, nkv, spread):
    """Within the error of torch's own bf16 SDPA against float32 (both round P to bf16 before P V)."""
    q, k, v = _qkv(n, T, nh, nkv, seed=n * 10_000 + T, spread=spread)
    got = torch.ops.sfcl.causal_attention(q, k, v, 0.125, amx)
    assert got.shape == (n, T, nh, 64) and got.dtype == torch.bfloat16 and got.is_contiguous()
    ref = _sdpa(q, k, v, torch.float32)
    err = (got.float() - ref).abs().max().item()
    torch_err = (_sdpa(q, k, v, torch.bfloat16).float() - ref).abs().max().item()
    assert err <= 1.5 * torch_err + 2e-3, (err, torch_err)
    if T == 1:  # one attended position: the output is v itself
        torch.testing.assert_close(got.float(), v.float().repeat_interleave(nh // nkv, 2), atol=0, rtol=0)


def test_each_window_attends_from_its_own_start(amx):
    """A batch of windows equals each window alone: no key of one window is seen by another."""
    q, k, v = _qkv(3, 96, 9, 3, seed=5)
    together = torch.ops.sfcl.causal_attention(q, k, v, 0.125, amx)
    for w in range(3):
        alone = torch.ops.sfcl.causal_attention(q[w : w + 1], k[w : w + 1], v[w : w + 1], 0.125, amx)
        assert torch.equal(together[w : w + 1], alone)


@pytest.mark.parametrize("bad, match", [
    (lambda q, k, v: (q.float(), k.float(), v.float()), "bfloat16"),
    (lambda q, k, v: (q[..., :32], k[..., :32], v[..., :32]), "head size must be 64"),
    (lambda q, k, v: (q[:, :, :8], k[:, :, :3], v[:, :, :3]), "multiple of nkv"),
    (lambda q, k, v: (q[:, :, :0], k, v), "positive multiple of nkv"),
    (lambda q, k, v: (q, k[:, :5], v[:, :5]), "differ in windows or tokens"),
    (lambda q, k, v: (q.transpose(2, 3), k, v), "head size must be 64"),
    (lambda q, k, v: (q.requires_grad_(), k, v), "no autograd"),
])
def test_bad_input_is_refused(native, bad, match):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.sfcl.causal_attention(*bad(*_qkv(1, 8, 9, 3, seed=1)), 0.125)


@pytest.mark.parametrize("where", ("q", "k", "scale"))
def test_nan_scores_make_their_rows_nan(amx, where):
    """A NaN in q (one token), in k (one key) or as the scale: the rows whose scores hold it come out NaN,
    as from torch's SDPA, and the others are untouched."""
    q, k, v = (x.clone() for x in _qkv(1, 40, 9, 3, seed=3))
    scale = float("nan") if where == "scale" else 0.125
    if where == "q":
        q[0, 7, 2] = float("nan")  # token 7, head 2
    if where == "k":
        k[0, 5, 1] = float("nan")  # key 5 of KV head 1: heads 3-5 of tokens >= 5
    got = torch.ops.sfcl.causal_attention(q, k, v, scale, amx).isnan().any(-1)[0]  # (T, nh) rows with a NaN
    want = torch.zeros(40, 9, dtype=torch.bool)
    if where == "q":
        want[7, 2] = True
    if where == "k":
        want[5:, 3:6] = True
    if where == "scale":
        want[:] = True
    assert torch.equal(got, want)


def test_the_amx_path_runs_only_where_the_kernel_does(kernel):
    assert not torch.ops.sfcl.causal_attention_amx() or torch.ops.sfcl.causal_attention_ready()


@pytest.mark.parametrize("scale", (1 / 3, 0.1))
def test_huge_scores_with_a_scale_that_rounds(amx, scale):
    """Scaled scores of ~3e8-1e9 with a scale that is not a power of two: the product is rounded
    before the row's max is subtracted, so the exp's argument stays <= 0 (a fused multiply-subtract
    had left half an ulp of the max above 0, and the exp overflowed: NaN rows)."""
    q = torch.full((1, 3, 2, 64), 30000.0 if scale > 0.2 else 100000.0).to(torch.bfloat16)
    v = torch.randn(1, 3, 1, 64).to(torch.bfloat16)
    got = torch.ops.sfcl.causal_attention(q, q[:, :, :1], v, scale, amx)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), _sdpa(q, q[:, :, :1], v, torch.float32).float(), atol=2e-2, rtol=2e-2)


def test_without_avx512_bf16_it_says_so_and_the_builder_keeps_sdpa(kernel):
    if torch.ops.sfcl.causal_attention_ready():
        pytest.skip("AVX-512 BF16 runs here")
    with pytest.raises(RuntimeError, match="AVX-512 BF16"):
        torch.ops.sfcl.causal_attention(*_qkv(1, 8, 9, 3, seed=1), 0.125)
    with torch.inference_mode():
        assert not model_pass.native_attention(torch.empty(1, 64, dtype=torch.bfloat16))


def test_builder_uses_it_only_for_bf16_head_size_64(kernel):
    with torch.inference_mode():
        # float32: the float32 prefill kernel where it runs (tests/test_prefill_attention.py), else SDPA
        assert model_pass.native_attention(torch.empty(1, 64)) == torch.ops.sfcl.prefill_attention_ready()
        assert not model_pass.native_attention(torch.empty(1, 128, dtype=torch.bfloat16))
        assert model_pass.native_attention(torch.empty(1, 64, dtype=torch.bfloat16)) == \
            torch.ops.sfcl.causal_attention_ready()


@pytest.mark.slow
def test_builders_pass_with_it_matches_the_pass_on_sdpa(native, lm, monkeypatch):
    """run_windows over real NDA windows in bf16 (two of one length, one shorter): the tap hidden
    states, surprisals and next-token choices with the kernel against the same pass on torch's SDPA.
    bf16 rounds differently in the two attentions, so the states agree to bf16 rounding carried
    through the layers, not bit for bit."""
    if next(lm.model.parameters()).dtype != torch.bfloat16:
        pytest.skip("the bundled model runs in float32 here (--dtype auto)")
    ids = lm.tokenizer(contractnli_docs(1)[0].text, add_special_tokens=False)["input_ids"]
    wins = [ids[:256], ids[256:512], ids[512:613]]
    got = model_pass.run_windows(lm.model, wins, 22, 8)
    monkeypatch.setattr(model_pass, "native_attention", lambda q: False)
    ref = model_pass.run_windows(lm.model, wins, 22, 8)
    for g, r in zip(got, ref):
        cos = F.cosine_similarity(g.hidden, r.hidden, dim=-1)  # (T-1,)
        assert cos.min().item() > 0.99, cos.min().item()
        assert (g.top_ids[:, 0] == r.top_ids[:, 0]).float().mean().item() > 0.95
        assert (g.surprisal - r.surprisal).abs().median().item() < 0.05
        torch.testing.assert_close(g.dispersion, r.dispersion, atol=0.05, rtol=0)
