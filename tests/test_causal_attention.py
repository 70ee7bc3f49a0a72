"""SFCL's bf16 causal attention (``torch.ops.sfcl.causal_attention``; ``csrc/causal_attention.cpp``), on
AMX tiles and on AVX-512 BF16 vectors, against torch's causal SDPA: of windows from position 0 (the anchor
builder's) and of prompt chunks after cached positions (the server's), its errors, the builder's pass
(``sfcl.anchors.model_pass.run_windows``) and a chunked bf16 prefill of the model with it against the
same on torch's SDPA. The kernel runs where the CPU has AVX-512 BF16 and SFCL's kernels were built for
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


def _sdpa_chunk(q, k, v, dtype):
    """torch's SDPA of queries at positions [S - Tq, S) over keys [0, S), in ``dtype``, in the kernel's
    layout: q (n, Tq, nh, 64), k and v (n, S, nkv, 64) -> (n, Tq, nh, 64)."""
    Tq, S = q.shape[1], k.shape[1]
    mask = torch.ones(Tq, S, dtype=torch.bool).tril(S - Tq)
    o = F.scaled_dot_product_attention(*(x.to(dtype).transpose(1, 2) for x in (q, k, v)), attn_mask=mask,
                                       enable_gqa=True)
    return o.transpose(1, 2)


@pytest.mark.parametrize("start, Tq, nh, nkv", [(1, 1, 9, 3), (31, 1, 9, 3), (32, 7, 9, 3), (100, 33, 9, 3),
                                                (1536, 512, 9, 3), (3000, 96, 4, 2), (17, 64, 2, 1)])
@pytest.mark.parametrize("spread", (1.0, 4.0))
def test_a_chunk_after_cached_positions_matches_torchs_sdpa(amx, start, Tq, nh, nkv, spread):
    """Tq queries after ``start`` cached positions (the server's prompt chunks): within the error of
    torch's own bf16 SDPA (with the chunk's causal mask) against float32."""
    q, _, _ = _qkv(1, Tq, nh, nkv, seed=start + Tq, spread=spread)
    _, k, v = _qkv(1, start + Tq, nh, nkv, seed=start + 7, spread=spread)
    got = torch.ops.sfcl.causal_attention(q, k, v, 0.125, amx)
    assert got.shape == (1, Tq, nh, 64) and got.dtype == torch.bfloat16 and got.is_contiguous()
    ref = _sdpa_chunk(q, k, v, torch.float32)
    err = (got.float() - ref).abs().max().item()
    torch_err = (_sdpa_chunk(q, k, v, torch.bfloat16).float() - ref).abs().max().item()
    assert err <= 1.5 * torch_err + 2e-3, (err, torch_err)


@pytest.mark.parametrize("cuts", [(0, 130, 300), (0, 1, 2, 33, 64, 65, 300), (0, 299, 300)])
def test_chunks_equal_the_same_rows_of_the_whole_window(amx, cuts):
    """A prompt computed in chunks (each over the keys before it and its own) gives the rows of the whole
    window bit for bit: a row's scores, softmax and P V do not depend on where its chunk starts, so a
    prompt's attention does not depend on how the server chunked it."""
    q, k, v = _qkv(1, 300, 9, 3, seed=11, spread=2.0)
    whole = torch.ops.sfcl.causal_attention(q, k, v, 0.125, amx)
    for a, b in zip(cuts, cuts[1:]):
        part = torch.ops.sfcl.causal_attention(q[:, a:b], k[:, :b], v[:, :b], 0.125, amx)
        assert torch.equal(part, whole[:, a:b]), (a, b)


def test_a_chunk_reads_keys_through_the_caches_strides(amx):
    """k and v as the server passes them: (1, S, nkv, 64) transposed views of a (rows, nkv, max_len, 64)
    cache row, not contiguous; the same result as from contiguous copies."""
    g = torch.Generator().manual_seed(4)
    cache = torch.randn(2, 2, 512, 64, generator=g).to(torch.bfloat16)  # (rows, nkv, max_len, hd)
    q = torch.randn(1, 6, 40, 64, generator=g).to(torch.bfloat16).transpose(1, 2)  # (1, Tq, nh, hd) view
    k, v = cache[1:2, :, :200].transpose(1, 2), cache[0:1, :, :200].transpose(1, 2)  # (1, S, nkv, hd) views
    got = torch.ops.sfcl.causal_attention(q, k, v, 0.125, amx)
    assert torch.equal(got, torch.ops.sfcl.causal_attention(q.contiguous(), k.contiguous(), v.contiguous(), 0.125, amx))


def test_a_chunked_bf16_prefill_with_it_matches_sdpa(native, monkeypatch):
    """A 2-layer bf16 Llama over a 300-token prompt in two chunks (0-129, 130-299) with the kernel and with
    torch's SDPA (the path bf16 chunks took before), each against the same model in float32: the kernel's
    logits no further from float32's than SDPA's (bf16's own error), the kernel called once per layer and
    chunk."""
    from conftest import tiny_llama

    from sfcl.model import llama
    from sfcl.model.kv_cache import KVCache
    from sfcl.model.llama import AttnBatch

    a, m32 = tiny_llama(n_heads=6, max_positions=1024)
    ids = torch.randint(0, 200, (1, 300), generator=torch.Generator().manual_seed(1))

    def run(m, dtype):
        kv = KVCache(a, 1, 512, dtype)
        kv.ensure_initialized(1, 512)
        out = []
        with torch.inference_mode():
            for s, e in ((0, 130), (130, 300)):
                batch = AttnBatch(is_prefill=True, slots=torch.tensor([0]), positions=torch.arange(s, e), kv_len=e)
                out.append(m(ids[:, s:e], batch, kv, 1, all_positions=True, want_probs=False).logits.float())
        return torch.cat(out, 1)

    exact = run(m32, torch.float32)
    m = m32.to(torch.bfloat16)
    calls = []
    op = torch.ops.sfcl.causal_attention
    monkeypatch.setattr(torch.ops.sfcl, "causal_attention", lambda *x: calls.append((x[0].shape, x[1].shape)) or op(*x))
    got = run(m, torch.bfloat16)
    assert calls == [((1, 130, 6, 64), (1, 130, 2, 64))] * 2 + [((1, 170, 6, 64), (1, 300, 2, 64))] * 2
    monkeypatch.setattr(llama, "native_prefill_attention", lambda *x: False)
    ref = run(m, torch.bfloat16)
    assert len(calls) == 4
    err, torch_err = ((x - exact).abs().mean().item() for x in (got, ref))
    assert err <= 1.25 * torch_err, (err, torch_err)
    agree, torch_agree = ((x.argmax(-1) == exact.argmax(-1)).float().mean().item() for x in (got, ref))
    assert agree >= torch_agree - 0.02, (agree, torch_agree)


@pytest.mark.parametrize("bad, match", [
    (lambda q, k, v: (q.float(), k.float(), v.float()), "bfloat16"),
    (lambda q, k, v: (q[..., :32], k[..., :32], v[..., :32]), "head size must be 64"),
    (lambda q, k, v: (q[:, :, :8], k[:, :, :3], v[:, :, :3]), "multiple of nkv"),
    (lambda q, k, v: (q[:, :, :0], k, v), "positive multiple of nkv"),
    (lambda q, k, v: (q, k[:, :5], v[:, :5]), "1 <= Tq <= S"),
    (lambda q, k, v: (q, torch.cat([k, k]), torch.cat([v, v])), "differ in windows"),
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


@pytest.mark.parametrize("bad", (float("nan"), float("inf"), float("-inf")))
def test_a_non_finite_value_reaches_only_the_rows_that_attend_it(amx, bad):
    """v[key 10, KV head 1, dim 5] not finite: rows before key 10 are as if it were 0, bit for bit (P V
    multiplies groups of rows by every key up to the group's last row, and 0 x NaN had made rows 8-9 NaN;
    found by a tester), rows from 10 on of heads 3-5 get NaN / the inf in that dimension and nothing
    else changes; a chunk still equals the same rows of the whole window."""
    q, k, v = (x.clone() for x in _qkv(1, 70, 9, 3, seed=8))
    clean = torch.ops.sfcl.causal_attention(q, k, v, 0.125, amx)
    v[0, 10, 1, 5] = bad
    got = torch.ops.sfcl.causal_attention(q, k, v, 0.125, amx)
    hit = torch.zeros_like(got, dtype=torch.bool)
    hit[0, 10:, 3:6, 5] = True
    assert torch.equal(got[~hit], clean[~hit])
    if bad != bad:
        assert got[hit].isnan().all()
    else:
        assert (got[hit].float() == bad).all()
    for a, b in ((8, 12), (0, 10), (10, 11), (33, 70)):
        part = torch.ops.sfcl.causal_attention(q[:, a:b], k[:, :b], v[:, :b], 0.125, amx)
        torch.testing.assert_close(part, got[:, a:b], rtol=0, atol=0, equal_nan=True)


def test_a_key_far_below_the_rows_max_weighs_nothing(amx):
    """A key whose scaled score is ~800 below the others' gets weight 0, as from torch's softmax: the
    rows equal those with its value set to 0, bit for bit (the exp's clamp at -87 once gave it
    ~1.6e-38, which 1e37 in its value made visible; found by a tester)."""
    q, k, v = (x.clone() for x in _qkv(1, 40, 9, 3, seed=12))
    q[:, :, 3:6] = 1.0  # heads 3-5 read KV head 1
    k[0, 10, 1] = -100.0  # their score of key 10: 0.125 * 64 * -100 = -800
    v[0, 10, 1] = 0.0
    zero = torch.ops.sfcl.causal_attention(q, k, v, 0.125, amx)
    v[0, 10, 1] = 1e37
    got = torch.ops.sfcl.causal_attention(q, k, v, 0.125, amx)
    assert torch.equal(got, zero)


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
