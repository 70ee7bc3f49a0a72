"""``sfcl.model.sampler.sample`` on edge batches: empty and single rows, non-finite rows,
mixed greedy/sampled rows, and seeds that hold whatever the batch holds."""

import torch


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_sample_empty_and_single_row():
    from sfcl.model.sampler import sample

    assert sample(torch.zeros(0, 5), [], [], []).shape == (0,)
    assert sample(torch.tensor([[0.0, 3.0, 1.0]]), [0.0], [1.0], [None]).tolist() == [1]
    t = sample(torch.tensor([[0.0, 3.0, 1.0]]), [1.0], [0.5], [_gen(0)])
    assert t.tolist() == [1] and t.dtype == torch.int64  # nucleus 0.5 keeps only the top token (p=0.84)


def test_sample_nonfinite_rows_fall_back_to_argmax():
    """+inf in a sampled row -> that token; a NaN / all -inf sampled row returns an in-range id;
    other rows of the batch are unaffected."""
    from sfcl.model.sampler import sample

    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([[0.0, inf, 1.0, 2.0], [-inf, -inf, -inf, -inf], [nan, 1.0, 2.0, 0.0],
                           [0.0, 0.0, 50.0, 0.0], [1.0, 5.0, 2.0, 0.0]])
    out = sample(logits, [1.0, 1.0, 0.7, 1.0, 0.0], [1.0, 0.9, 0.5, 1.0, 1.0], [_gen(i) for i in range(5)])
    assert out[0] == 1 and out[3] == 2 and out[4] == 1
    assert all(0 <= int(t) < 4 for t in out)


def test_sample_mixed_batch_distribution():
    """Rows mixing greedy, plain temperature, top_p < 1 and top_p == 1: each sampled row's empirical
    distribution matches softmax(logits / T) restricted to its nucleus."""
    from sfcl.model.sampler import sample

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).repeat(4, 1)
    temps, tops = [0.0, 1.0, 0.5, 1.5], [1.0, 1.0, 0.8, 0.95]
    gens = [None, _gen(1), _gen(2), _gen(3)]
    n = 3000
    counts = torch.zeros(4, 5)
    for _ in range(n):
        out = sample(logits, temps, tops, gens)
        counts[torch.arange(4), out] += 1
    assert counts[0, 0] == n  # greedy
    for r in (1, 2, 3):
        p = torch.softmax(logits[r] / temps[r], -1)
        sp, si = p.sort(descending=True)
        keep = sp.cumsum(0) - sp < tops[r]
        want = torch.zeros(5)
        want[si[keep]] = sp[keep] / sp[keep].sum()
        got = counts[r] / n
        assert (got[want == 0] == 0).all(), (r, got, want)
        assert torch.allclose(got, want, atol=0.03), (r, got, want)


def test_sample_seed_reproducible_across_batch_composition():
    """A seeded row draws the same token whatever rows share its batch (its own generator)."""
    from sfcl.model.sampler import sample

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 50, generator=g)
    alone = sample(logits[1:2], [0.9], [0.9], [_gen(42)])
    mixed = sample(logits, [0.0, 0.9, 1.3], [1.0, 0.9, 1.0], [None, _gen(42), _gen(7)])
    assert alone[0] == mixed[1]
