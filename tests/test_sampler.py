"""Sampler edge cases."""

import torch

from sfcl.engine.sampler import sample


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
