"""The float32 prefill attention (``torch.ops.sfcl.prefill_attention``; ``csrc/prefill_attention.cpp``)
against torch's SDPA in float64, chunks of a prompt against the whole prompt, its errors, and the
model taking it (``sfcl.model.llama.native_prefill_attention``) for float32 prompt chunks and the
anchor builder's float32 windows. The kernel runs where SFCL's kernels were built with AVX2 and FMA;
elsewhere these tests check that it says so."""

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama

from sfcl.anchors import model_pass
from sfcl.model import decode_kernel, llama
from sfcl.model.llama import native_prefill_attention


@pytest.fixture(scope="module")
def kernel():
    if not decode_kernel.load():
        pytest.skip(f"SFCL's native kernels could not be built here: {decode_kernel.why_unavailable()}")


@pytest.fixture(scope="module")
def avx2(kernel):
    if not torch.ops.sfcl.prefill_attention_ready():
        pytest.skip("SFCL's kernels were built without AVX2 and FMA here ($SFCL_KERNEL_MARCH)")


def _qkv(B, nh, nkv, T, S, hd=64, seed=0, spread=1.0):
    """q (B, nh, T, hd) as a view of a (B, T, nh + 2 nkv, hd) projection, k and v (B, nkv, S, hd) as
    views of a cache of 4,096 positions: the strides the model passes."""
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(B, T, nh + 2 * nkv, hd, generator=g) * spread
    q = proj[:, :, :nh].transpose(1, 2)
    cache_k = torch.randn(B, nkv, 4096, hd, generator=g) * spread
    cache_v = torch.randn(B, nkv, 4096, hd, generator=g)
    return q, cache_k[:, :, :S], cache_v[:, :, :S]


def _sdpa(q, k, v, scale, dtype=torch.float64):
    """torch's SDPA in ``dtype`` with the chunk's causal mask, in the kernel's (B, T, nh, hd) layout."""
    T, S = q.shape[2], k.shape[2]
    mask = torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)
    o = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask, enable_gqa=True,
                                       scale=scale)
    return o.transpose(1, 2)


@pytest.mark.parametrize("B, nh, nkv, T, S, hd", [
    (1, 9, 3, 512, 512, 64), (1, 9, 3, 512, 3584, 64), (1, 9, 3, 1, 100, 64), (2, 4, 2, 37, 90, 128),
    (1, 9, 3, 33, 33, 64), (1, 8, 1, 100, 1000, 64), (1, 3, 3, 7, 7, 64), (3, 9, 3, 129, 129, 64),
    (1, 2, 1, 1, 1, 64), (1, 16, 2, 65, 300, 128)])
@pytest.mark.parametrize("spread", (1.0, 4.0))  # flat and peaked rows (scores ~16x larger)
def test_matches_sdpa_in_float64(avx2, B, nh, nkv, T, S, hd, spread):
    """Within twice the error of torch's own float32 SDPA (plus 1e-6) against float64."""
    q, k, v = _qkv(B, nh, nkv, T, S, hd, seed=B * 10_000 + T + S, spread=spread)
    got = torch.ops.sfcl.prefill_attention(q, k, v, hd ** -0.5)
    assert got.shape == (B, T, nh, hd) and got.dtype == torch.float32 and got.is_contiguous()
    ref = _sdpa(q, k, v, hd ** -0.5)
    err = (got.double() - ref).abs().max().item()
    torch_err = (_sdpa(q, k, v, hd ** -0.5, torch.float32).double() - ref).abs().max().item()
    assert err <= 2 * torch_err + 1e-6, (err, torch_err)


def test_a_chunk_equals_the_same_rows_of_the_whole_prompt(avx2):
    """Chunks at any boundaries, each over the keys up to its end, give the whole prompt's rows bit
    for bit: no row's sums depend on which rows share its group or call."""
    q, k, v = _qkv(1, 9, 3, 700, 700, seed=3)
    whole = torch.ops.sfcl.prefill_attention(q, k, v, 0.125)
    for a, b in ((0, 37), (37, 300), (300, 301), (301, 700)):
        part = torch.ops.sfcl.prefill_attention(q[:, :, a:b], k[:, :, :b], v[:, :, :b], 0.125)
        assert torch.equal(part, whole[:, a:b]), (a, b)


def test_each_sequence_of_a_batch_equals_it_alone(avx2):
    q, k, v = _qkv(3, 9, 3, 96, 200, seed=5)
    together = torch.ops.sfcl.prefill_attention(q, k, v, 0.125)
    for b in range(3):
        alone = torch.ops.sfcl.prefill_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], 0.125)
        assert torch.equal(together[b:b + 1], alone)


def test_a_query_with_one_key_returns_its_value(avx2):
    q, k, v = _qkv(1, 9, 3, 1, 1, seed=7)
    got = torch.ops.sfcl.prefill_attention(q, k, v, 0.125)
    torch.testing.assert_close(got[0, 0], v[0, :, 0].repeat_interleave(3, 0), atol=0, rtol=0)


@pytest.mark.parametrize("bad", (float("nan"), float("inf")))
def test_a_non_finite_value_reaches_only_the_rows_that_attend_it(avx2, bad):
    """v of key 10 (KV head 1) non-finite: the earlier rows are bit for bit what they were, the later
    rows of heads 3-5 are not finite, the other heads untouched."""
    q, k, v = (x.clone() for x in _qkv(1, 9, 3, 40, 40, seed=11))
    clean = torch.ops.sfcl.prefill_attention(q, k, v, 0.125)
    v[0, 1, 10, 5] = bad
    got = torch.ops.sfcl.prefill_attention(q, k, v, 0.125)
    assert torch.equal(got[:, :10], clean[:, :10])
    assert not got[0, 10:, 3:6].isfinite().all(-1).any()
    assert torch.equal(got[:, 10:, :3], clean[:, 10:, :3]) and torch.equal(got[:, 10:, 6:], clean[:, 10:, 6:])


@pytest.mark.parametrize("S", (8, 9, 16, 17, 300))  # NaN keys in the vector lanes and in the scalar tail
def test_a_nan_key_makes_the_rows_that_attend_it_nan(avx2, S):
    """As from torch's SDPA, whichever lane of 8 keys the NaN falls in (a clamp in the exp had turned
    it into a weight of ~1e-38 there; found by a tester)."""
    for key in range(0, S, max(1, S // 9)):
        q, k, v = (x.clone() for x in _qkv(1, 9, 3, S, S, seed=S + key))
        k[0, 0, key, 3] = float("nan")  # KV head 0: query heads 0-2
        got = torch.ops.sfcl.prefill_attention(q, k, v, 0.125).isnan().any(-1)[0]  # (T, nh)
        want = torch.zeros(S, 9, dtype=torch.bool)
        want[key:, :3] = True
        assert torch.equal(got, want), key


def test_a_key_far_below_the_rows_max_weighs_nothing(avx2):
    """A key whose scaled score is ~800 below the others' gets weight 0, as from torch's softmax: the
    rows equal those with its value set to 0, bit for bit (the exp's clamp at -87 once gave it
    ~1.6e-38, which 1e37 in its value made visible)."""
    q, k, v = (x.clone() for x in _qkv(1, 9, 3, 40, 40, seed=12))
    q[:, 3:6] = 1.0  # heads 3-5 read KV head 1
    k[0, 1, 10] = -100.0  # their score of key 10: 0.125 * 64 * -100 = -800
    v[0, 1, 10] = 0.0
    zero = torch.ops.sfcl.prefill_attention(q, k, v, 0.125)
    v[0, 1, 10] = 1e37
    assert torch.equal(torch.ops.sfcl.prefill_attention(q, k, v, 0.125), zero)


@pytest.mark.parametrize("S", (130, 300))  # the first block of 128 keys all -inf, then finite keys
def test_a_first_block_of_minus_inf_scores_leaves_the_row_finite(avx2, S):
    """Keys whose score is -inf (k overflowed to inf) weigh 0 and the later keys decide the row, as
    in torch's SDPA, even when a whole block of 128 keys comes first (exp(-inf - -inf) had made the
    row NaN; found by a tester)."""
    q, k, v = (x.clone() for x in _qkv(1, 3, 3, S, S, seed=S))
    q[..., 0] = -1.0
    k[:, :, :128, 0] = float("inf")  # q . k = -inf for keys 0-127
    got = torch.ops.sfcl.prefill_attention(q, k, v, 0.125)
    ref = _sdpa(q, k, v, 0.125)
    assert got[0, 128:].isfinite().all()
    torch.testing.assert_close(got[0, 128:].double(), ref[0, 128:], atol=1e-5, rtol=0)


def test_an_overflowing_score_makes_its_row_nan(avx2):
    """q . k = +inf (q, k ~ 1e19): NaN, as from torch's float32 SDPA, not a finite mean of v."""
    q, k, v = _qkv(1, 3, 3, 20, 20, seed=17)
    big = torch.full_like(q, 1e19)
    got = torch.ops.sfcl.prefill_attention(big, big[:, :, :].clone(), v, 1.0)
    assert got.isnan().all()
    assert F.scaled_dot_product_attention(big, big, v, is_causal=True, scale=1.0).isnan().all()


def test_flat_rows_over_a_long_cache_keep_torchs_accuracy(avx2):
    """T = 64 queries over S = 8,192 keys of nearly equal scores, values around 1: within twice torch's
    float32 error (plus 1e-6) of float64. Chaining every key's product onto one running output had
    grown the error to ~10x torch's here (found by a tester); a block's product is now summed apart."""
    q, k, v = _qkv(1, 4, 2, 64, 8192, hd=128, seed=19, spread=0.1)
    v = v + 1
    got = torch.ops.sfcl.prefill_attention(q, k, v, 128 ** -0.5)
    ref = _sdpa(q, k, v, 128 ** -0.5)
    err = (got.double() - ref).abs().max().item()
    torch_err = (_sdpa(q, k, v, 128 ** -0.5, torch.float32).double() - ref).abs().max().item()
    assert err <= 2 * torch_err + 1e-6, (err, torch_err)


def test_a_short_chunk_over_a_long_cache_matches_the_whole_prompt(avx2):
    """Chunks of 1-40 tokens at the end of 3,000 positions (fewer query positions per work item there,
    so both threads get work): the whole prompt's rows, bit for bit."""
    q, k, v = _qkv(1, 9, 3, 3000, 3000, seed=23)
    whole = torch.ops.sfcl.prefill_attention(q, k, v, 0.125)
    for T in (1, 5, 16, 40):
        part = torch.ops.sfcl.prefill_attention(q[:, :, 3000 - T:], k, v, 0.125)
        assert torch.equal(part, whole[:, 3000 - T:]), T


def test_a_nan_query_makes_only_its_row_nan(avx2):
    q, k, v = (x.clone() for x in _qkv(1, 9, 3, 40, 60, seed=13))
    q[0, 2, 7, 0] = float("nan")  # head 2, query 7
    got = torch.ops.sfcl.prefill_attention(q, k, v, 0.125).isnan().any(-1)[0]  # (T, nh)
    want = torch.zeros(40, 9, dtype=torch.bool)
    want[7, 2] = True
    assert torch.equal(got, want)


@pytest.mark.parametrize("bad, match", [
    (lambda q, k, v: (q.bfloat16(), k.bfloat16(), v.bfloat16()), "float32"),
    (lambda q, k, v: (q[..., :32], k[..., :32], v[..., :32]), "64 or 128"),
    (lambda q, k, v: (q[:, :8], k[:, :3], v[:, :3]), "multiple of nkv"),
    (lambda q, k, v: (q, k[:, :, :5], v[:, :, :5]), "T <= S"),
    (lambda q, k, v: (q[:, :, :0], k, v), "T <= S"),
    (lambda q, k, v: (q, k[:, :, :5], v[:, :, :6]), "v "),
    (lambda q, k, v: (q.expand(2, -1, -1, -1), k, v), "differ in batch"),
    (lambda q, k, v: (torch.stack([q, q], -1).flatten(-2)[..., ::2], k, v), "head dimension must be contiguous"),
    (lambda q, k, v: (q.detach().requires_grad_(), k, v), "no autograd"),
])
def test_bad_input_is_refused(avx2, bad, match):
    q, k, v = _qkv(1, 9, 3, 8, 10, seed=1)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.sfcl.prefill_attention(*bad(q, k, v), 0.125)


def test_without_avx2_it_says_so_and_the_model_keeps_sdpa(kernel):
    if torch.ops.sfcl.prefill_attention_ready():
        pytest.skip("AVX2 and FMA run here")
    with pytest.raises(RuntimeError, match="AVX2"):
        torch.ops.sfcl.prefill_attention(*_qkv(1, 9, 3, 8, 8), 0.125)
    with torch.inference_mode():
        assert not native_prefill_attention(torch.empty(1, 64), 64)


def test_the_model_takes_it_for_float32_and_bf16_its_own(kernel):
    """float32 chunks take this kernel; bf16 chunks of head size 64 take the bf16 one
    (``torch.ops.sfcl.causal_attention``, tests/test_causal_attention.py) where it runs."""
    ready = torch.ops.sfcl.prefill_attention_ready()
    with torch.inference_mode():
        assert native_prefill_attention(torch.empty(2, 576), 64) == ready
        assert native_prefill_attention(torch.empty(2, 576), 128) == ready
        assert not native_prefill_attention(torch.empty(2, 576), 80)
        bf16_ready = torch.ops.sfcl.causal_attention_ready()
        assert native_prefill_attention(torch.empty(2, 576, dtype=torch.bfloat16), 64) == bf16_ready
        assert not native_prefill_attention(torch.empty(2, 576, dtype=torch.bfloat16), 128)
        assert not native_prefill_attention(torch.empty(2, 576, dtype=torch.float64), 64)
        assert model_pass.native_attention(torch.empty(1, 64)) == ready  # the builder's float32 windows
    assert not native_prefill_attention(torch.empty(2, 576, requires_grad=True), 64)  # autograd: torch's SDPA


def test_a_chunked_float32_prefill_with_it_matches_sdpa(avx2, monkeypatch):
    """A 2-layer float32 Llama over a 300-token prompt in two chunks (0-129, 130-299) with the kernel and
    with torch's SDPA (the path float32 took before): the same logits within 1e-4 of their spread and
    the same greedy tokens, the kernel called once per layer and chunk."""
    from sfcl.model.kv_cache import KVCache
    from sfcl.model.llama import AttnBatch

    a, m = tiny_llama(n_heads=6, max_positions=1024)
    ids = torch.randint(0, 200, (1, 300), generator=torch.Generator().manual_seed(1))

    def run():
        kv = KVCache(a, 1, 512, torch.float32)
        kv.ensure_initialized(1, 512)
        out = []
        with torch.inference_mode():
            for s, e in ((0, 130), (130, 300)):
                batch = AttnBatch(is_prefill=True, slots=torch.tensor([0]), positions=torch.arange(s, e), kv_len=e)
                out.append(m(ids[:, s:e], batch, kv, 1, all_positions=True, want_probs=False).logits)
        return torch.cat(out, 1)

    calls = []
    op = torch.ops.sfcl.prefill_attention
    monkeypatch.setattr(torch.ops.sfcl, "prefill_attention", lambda *x: calls.append(x[0].shape) or op(*x))
    native = run()
    assert calls == [(1, 6, 130, 64)] * 2 + [(1, 6, 170, 64)] * 2
    monkeypatch.setattr(llama, "native_prefill_attention", lambda *x: False)
    ref = run()
    assert len(calls) == 4
    torch.testing.assert_close(native, ref, rtol=1e-4, atol=1e-4 * float(ref.std()))
    assert torch.equal(native.argmax(-1), ref.argmax(-1))


def test_the_builders_float32_windows_take_it(avx2, monkeypatch):
    """run_windows in float32 over three windows (two of one length): each layer but the snapshot
    layer's calls the kernel once per length, and the tap states match the pass on SDPA."""
    _, m = tiny_llama(n_heads=6, max_positions=1024)
    wins = [list(range(5, 69)), list(range(70, 134)), list(range(10, 40))]
    calls = []
    op = torch.ops.sfcl.prefill_attention
    monkeypatch.setattr(torch.ops.sfcl, "prefill_attention", lambda *x: calls.append(x[0].shape) or op(*x))
    got = model_pass.run_windows(m, wins, 1, 4)  # tap layer 1: layer 0 takes the kernel
    assert calls == [(2, 6, 64, 64), (1, 6, 30, 64)]
    monkeypatch.setattr(model_pass, "native_attention", lambda q: False)
    ref = model_pass.run_windows(m, wins, 1, 4)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.hidden, r.hidden, rtol=1e-3, atol=1e-3 * float(r.hidden.std()))
        assert torch.equal(g.top_ids[:, 0], r.top_ids[:, 0])
