"""Adversarial checks of sfcl.model.sampler (mixed batches, vocab sizes around NUCLEUS_TOPK and
CDF_BLOCK, degenerate rows, nucleus exclusion, frequencies, the two-level inverse CDF)."""

import pytest
import torch

from sfcl.model.sampler import CDF_BLOCK, NUCLEUS_TOPK, _inverse_cdf, sample


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _nucleus_set(p: torch.Tensor, top_p: float) -> set[int]:
    """Exact nucleus of one probability row in float64 (ties broken generously: all tied tokens)."""
    p = p.double()
    sp, si = p.sort(descending=True)
    keep = (sp.cumsum(0) - sp) < top_p * (1 + 1e-6)  # rounding slack toward a larger nucleus
    cut = sp[keep].min()
    return set((p >= cut).nonzero()[:, 0].tolist())


def test_two_level_inverse_cdf_never_returns_a_zero_weight_column_at_a_block_start():
    """Regression: the in-block offset was bcdf[b] - bsum[b], which rounds above bcdf[b - 1]; a
    target in between landed on column 0 of block b even when its weight is 0 (e.g. a banned,
    -inf logit token). Search for such rows and uniforms (multiples of 2**-24, as torch.rand gives)."""
    torch.manual_seed(0)
    nb, checked = 5, 0
    for _ in range(3000):
        p = torch.rand(1, nb * CDF_BLOCK) ** 8
        p[0, 2 * CDF_BLOCK] = 0.0  # the first column of block 2 weighs nothing
        bcdf = p.reshape(1, nb, CDF_BLOCK).sum(-1).cumsum(-1)
        prev, total = bcdf[0, 1], bcdf[0, -1]
        k0 = int((prev / total).item() * 2 ** 24)
        # 80 uniforms whose target sits right at the block boundary, one row each (rows are independent)
        u = torch.arange(k0 - 40, k0 + 40, dtype=torch.float32) * 2.0 ** -24
        j = _inverse_cdf(p.repeat(len(u), 1), u)
        assert (p[0, j] > 0).all(), [(x.item(), y.item()) for x, y in zip(u, j) if p[0, y] == 0]
        checked += len(u)
    assert checked == 3000 * 80


@pytest.mark.parametrize("V", [3, 63, 64, 65, 255, 256, 257, 1000, 1024, 1025, 2048, 5000])
def test_mixed_batch_tokens_stay_in_the_support_and_nucleus(V):
    torch.manual_seed(V)
    logits = torch.randn(6, V) * 4
    logits[:, ::7] = float("-inf")  # banned tokens must never be drawn
    logits[:, 1] = 2.0  # a finite token in every row
    temps = [0.0, 1.0, 0.7, 1.0, 0.7, 1.3]
    top_ps = [1.0, 1.0, 1.0, 0.6, 0.95, 1e-9]
    for with_probs in (False, True):
        for rep in range(15):
            gens = [None] + [_gen(1000 * rep + i) for i in range(1, 6)]
            probs = torch.softmax(logits, -1) if with_probs else None
            tok = sample(logits, temps, top_ps, gens, probs=probs)
            for r in range(6):
                t = int(tok[r])
                if temps[r] == 0.0:
                    assert t == int(logits[r].argmax())
                    continue
                p = torch.softmax(logits[r] / temps[r], -1)
                assert p[t] > 0, (r, t)
                assert t in _nucleus_set(p, top_ps[r]), (r, t)


def test_all_rows_at_temperature_one_reuse_probs_with_zeros():
    """probs with exact zeros (underflow in the caller's exp(log_softmax)): never drawn."""
    V = 3000
    logits = torch.full((4, V), -200.0)
    logits[:, 5:40] = torch.randn(4, 35)
    logits[:, 2000:2300] = torch.randn(4, 300)
    probs = torch.log_softmax(logits, -1).exp()
    assert (probs == 0).any()
    for s in range(100):
        tok = sample(logits, [1.0] * 4, [1.0, 0.9, 0.5, 1.0], [_gen(s * 4 + i) for i in range(4)], probs=probs)
        assert (probs.gather(1, tok[:, None]) > 0).all()


@pytest.mark.parametrize("n_nuc", [63, 64, 65])
def test_nucleus_of_about_nucleus_topk_tokens(n_nuc):
    """Nucleus boundary at the top-K size: the K-token fast path or the full-sort fallback."""
    assert NUCLEUS_TOPK == 64
    V = 2000
    logits = torch.full((1, V), -30.0)
    hot = torch.randperm(V)[:n_nuc]
    logits[0, hot] = torch.linspace(0.0, 0.5, n_nuc)
    p = torch.softmax(logits[0], -1).double()
    sp = p.sort(descending=True).values
    top_p = float(sp[:n_nuc - 1].sum() + sp[n_nuc - 1] / 2)  # exactly n_nuc tokens reach it
    allowed = set(hot.tolist())
    seen = set()
    for s in range(1500):
        t = int(sample(logits, [1.0], [top_p], [_gen(s)])[0])
        assert t in allowed
        seen.add(t)
    assert len(seen) > n_nuc * 0.8  # the whole nucleus is reachable, not only its top


def test_frequencies_small_vocab_mixed_temperatures_and_nucleus():
    logits = torch.log(torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05]))[None].repeat(3, 1)
    n = 4000
    counts = torch.zeros(3, 5)
    g = [_gen(11), _gen(12), _gen(13)]
    for _ in range(n):
        tok = sample(logits, [1.0, 0.5, 2.0], [1.0, 0.8, 0.85], g)
        counts[torch.arange(3), tok] += 1
    freq = counts / n
    p1 = torch.softmax(logits[0], -1)
    p2 = torch.softmax(logits[1] / 0.5, -1)  # [.58, .23, .15, .04, .01] -> nucleus {0, 1}
    p2 = torch.where(torch.arange(5) < 2, p2, 0) / p2[:2].sum()
    p3 = torch.softmax(logits[2] / 2.0, -1)  # [.30, .24, .21, .15, .11]: mass before token 4 is .894
    p3 = torch.where(torch.arange(5) < 4, p3, 0) / p3[:4].sum()  # top_p .85: first four tokens
    for f, p in zip(freq, (p1, p2, p3)):
        assert torch.allclose(f, p, atol=0.03), (f, p)
        assert (f[p == 0] == 0).all()


def test_frequencies_wide_vocab_mass_over_several_blocks():
    """5000 columns (not a multiple of CDF_BLOCK), mass in four far-apart groups."""
    V = 5000
    logits = torch.full((1, V), float("-inf"))
    groups = [(3, 40, 0.1), (700, 760, 0.2), (2560, 2570, 0.3), (4990, 5000, 0.4)]
    for a, b, m in groups:
        logits[0, a:b] = torch.log(torch.tensor(m / (b - a)))
    n = 4000
    g = _gen(5)
    counts = torch.zeros(len(groups))
    for _ in range(n):
        t = int(sample(logits, [1.0], [1.0], [g])[0])
        hit = [i for i, (a, b, _) in enumerate(groups) if a <= t < b]
        assert len(hit) == 1, t
        counts[hit[0]] += 1
    assert torch.allclose(counts / n, torch.tensor([0.1, 0.2, 0.3, 0.4]), atol=0.03)


def test_degenerate_rows_do_not_disturb_good_rows_and_keep_their_argmax():
    torch.manual_seed(3)
    V = 1500
    good = torch.randn(V)
    logits = torch.stack([good, good.clone(), good.clone(), good.clone(), good.clone()])
    logits[1, 10] = float("nan")
    logits[2] = float("-inf")
    logits[3, 20] = float("inf")
    logits[4, 30] = 1e30  # huge but finite: a sharp, valid distribution
    for top_p in (1.0, 0.7):
        for with_probs in (False, True):
            probs = torch.softmax(logits, -1) if with_probs else None
            out = sample(logits, [1.0] * 5, [top_p] * 5, [_gen(9 + i) for i in range(5)],
                         probs=probs)
            alone = sample(good[None], [1.0], [top_p], [_gen(9)])
            assert int(out[0]) == int(alone[0])
            assert int(out[1]) == 10  # NaN row: its argmax (max propagates NaN)
            assert int(out[2]) == int(logits[2].max(-1).indices)
            assert int(out[3]) == 20
            assert int(out[4]) == 30


def test_temperature_near_min_and_half_precision_logits():
    torch.manual_seed(4)
    logits = torch.randn(3, 700)
    ref = logits.argmax(-1)
    out = sample(logits, [1.0001e-5, 1e-5, 2e-5], [1.0, 1.0, 0.5], [_gen(1), None, _gen(2)])
    assert out.tolist() == ref.tolist()  # tiny temperatures: one token holds all the mass
    for dt in (torch.float16, torch.bfloat16):
        lg = logits.to(dt)
        out = sample(lg, [0.0, 1.0, 0.8], [1.0, 1.0, 0.9], [None, _gen(1), _gen(2)])
        assert out.dtype == torch.int64 and int(out[0]) == int(lg[0].float().argmax())
        assert ((out >= 0) & (out < 700)).all()


def test_same_seed_same_tokens_regardless_of_batch_companions():
    torch.manual_seed(6)
    V = 4000
    row = torch.randn(V) * 2
    other = torch.randn(V)
    a = [int(sample(row[None], [0.9], [0.8], [_gen(s)])[0]) for s in range(30)]
    b = [int(sample(torch.stack([other, row, other]), [0.0, 0.9, 1.0], [1.0, 0.8, 0.3],
                    [None, _gen(s), _gen(99)])[1]) for s in range(30)]
    assert a == b


def test_top_k_fast_path_agrees_with_the_full_sort_when_top_p_sits_between_sum_and_cumsum():
    """Regression: the CPU fast path judged "nucleus within the top K" by sum() while _nucleus keeps
    by the prefix sum; with top_p between the two roundings it dropped the (K+1)-th token that the
    exact (full-sort) nucleus keeps."""
    torch.manual_seed(1)
    V = 2000
    for _ in range(500):
        top = (0.0140 + torch.rand(NUCLEUS_TOPK) * 1e-4).sort(descending=True).values
        if top.sum() > top.cumsum(0)[-1]:
            break
    else:
        pytest.skip("no row with sum() above the prefix sum")
    nxt = top[-1] * 0.99  # the (K+1)-th token, ~1.5% of the nucleus
    p = torch.cat([top, nxt[None], torch.full((V - NUCLEUS_TOPK - 1,), float((1 - top.sum() - nxt) / (V - 65)))])
    perm = torch.randperm(V)
    probs = torch.empty(V)
    probs[perm] = p
    top_p = float(top.sum())  # prefix sum of the top K < top_p <= sum(): the exact nucleus has K + 1 tokens
    hits = sum(int(sample(probs.log()[None], [1.0], [top_p], [_gen(k)], probs=probs[None])[0]) == int(perm[NUCLEUS_TOPK])
               for k in range(1500))
    assert hits > 5  # ~23 expected; 0 before the fix
