"""Sampler edge cases."""

import torch

from sfcl.model.sampler import sample


def test_sampler_degenerate_settings_do_not_raise():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    out = sample(logits, [1e-320, 0.7, 1.0], [1.0, 1e-320, 1e-9], [None, torch.Generator().manual_seed(0),
                                                                   torch.Generator().manual_seed(0)])
    assert out.tolist() == [1, 0, 2]  # tiny temperature = greedy; tiny top_p keeps only the top token


def test_sampled_rows_follow_the_distribution_and_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    g = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2), None]
    counts = torch.zeros(2, 4)
    for _ in range(2000):
        t = sample(logits, [1.0, 1.0, 0.0], [1.0, 0.7, 1.0], g)
        assert int(t[2]) == 0  # greedy row
        counts[0, t[0]] += 1
        counts[1, t[1]] += 1
    freq = counts / 2000
    assert torch.allclose(freq[0], torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.04)
    assert freq[1, 2:].sum() == 0 and abs(freq[1, 0] - 0.5 / 0.8) < 0.04  # nucleus {0, 1}, renormalised


def test_same_seed_same_tokens_and_degenerate_rows_fall_back_to_argmax():
    logits = torch.randn(2, 50)
    a = [int(sample(logits, [0.8, 0.8], [1.0, 0.9], [torch.Generator().manual_seed(7)] * 2)[i]) for i in range(2)]
    b = [int(sample(logits, [0.8, 0.8], [1.0, 0.9], [torch.Generator().manual_seed(7)] * 2)[i]) for i in range(2)]
    assert a == b
    bad = torch.full((1, 5), float("nan"))
    bad[0, 3] = 1.0
    assert int(sample(torch.tensor([[0.0, 0.0, 0.0, 9.0, 0.0]]), [1e-7], [1.0], [None])[0]) == 3
    out = sample(bad, [1.0], [1.0], [torch.Generator().manual_seed(0)])
    assert out.shape == (1,)


def _nucleus_set(p: torch.Tensor, top_p: float) -> set[int]:
    sp, si = p.sort(descending=True)
    return set(si[(sp.cumsum(0) - sp) < top_p].tolist())


def test_two_level_inverse_cdf_matches_the_plain_prefix_sum_and_skips_zero_weights():
    from sfcl.model.sampler import _inverse_cdf

    g = torch.Generator().manual_seed(0)
    for V in (5000, 49152):  # not / a multiple of the block
        p = torch.rand(8, V, generator=g) ** 8  # skewed
        p[:, ::3] = 0.0  # many zero weights, also at block ends
        u = torch.rand(8, generator=g)
        cdf = p.cumsum(-1)
        ref = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        got = _inverse_cdf(p, u)
        assert (got == ref).float().mean() >= 0.99  # equal up to rounding of the summation order
        assert bool((p.gather(1, got[:, None]) > 0).all())
    # u close to 1 lands on the last positive column, not on the zero padding after it
    p = torch.zeros(2, 5000)
    p[:, 4000] = 1.0
    assert _inverse_cdf(p, torch.tensor([0.999999, 0.0])).tolist() == [4000, 4000]


def test_cpu_nucleus_from_the_top_k_and_from_a_full_sort_stays_in_the_exact_nucleus():
    from sfcl.model.sampler import NUCLEUS_TOPK

    g = torch.Generator().manual_seed(3)
    V = 3000
    peaked = torch.randn(V, generator=g) * 6  # nucleus within the top 64
    flat = torch.randn(V, generator=g) * 0.5  # nucleus of far more than 64 tokens: the full-sort path
    logits = torch.stack([peaked, flat])
    nuc = [_nucleus_set(torch.softmax(row, 0), 0.9) for row in logits]
    assert len(nuc[0]) < NUCLEUS_TOPK < len(nuc[1])
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    seen = [set(), set()]
    counts = torch.zeros(V)
    for _ in range(400):
        t = sample(logits, [1.0, 1.0], [0.9, 0.9], gens).tolist()
        seen[0].add(t[0])
        seen[1].add(t[1])
        counts[t[0]] += 1
    assert seen[0] <= nuc[0] and seen[1] <= nuc[1]
    assert len(seen[1]) > NUCLEUS_TOPK  # the flat row really drew beyond the top 64
    top = int(peaked.argmax())
    p = torch.softmax(peaked, 0)
    mass = float(sum(p[i] for i in nuc[0]))
    assert abs(counts[top] / 400 - float(p[top]) / mass) < 0.08  # renormalised nucleus probability


def test_precomputed_probs_give_the_same_tokens_as_the_sampler_own_softmax():
    logits = torch.randn(4, 2000, generator=torch.Generator().manual_seed(5)) * 2
    args = ([1.0, 1.0, 0.0, 1.0], [1.0, 0.8, 1.0, 1.0])
    a = sample(logits, *args, [torch.Generator().manual_seed(9) for _ in range(4)])
    b = sample(logits, *args, [torch.Generator().manual_seed(9) for _ in range(4)], probs=torch.softmax(logits, -1))
    assert a.tolist() == b.tolist()
