"""sfcl.anchors.kmeans: spherical k-means, the share of clusters per cell, two-level k-means."""

import numpy as np
import pytest
import torch

from sfcl.anchors.kmeans import share_clusters, spherical_kmeans, two_level_kmeans


def planted(n_centres=24, per=60, d=32, noise=0.15, seed=0):
    """Unit points around ``n_centres`` random unit centres; returns (points (n, d), centre of each)."""
    g = torch.Generator().manual_seed(seed)
    c = torch.nn.functional.normalize(torch.randn(n_centres, d, generator=g), dim=-1)
    lab = torch.arange(n_centres).repeat_interleave(per)
    x = torch.nn.functional.normalize(c[lab] + noise * torch.randn(len(lab), d, generator=g) / d ** 0.5, dim=-1)
    return x, lab.numpy()


def objective(x, labels, cent):
    """Mean cosine of each point to its centroid (what spherical k-means maximises)."""
    return float((x * cent[torch.from_numpy(labels)]).sum(1).mean())


@pytest.mark.parametrize("sizes,k", [([10, 0, 5, 1], 7), ([3, 3, 3], 9), ([100, 1, 1, 1], 4), ([5, 5], 3),
                                     ([7, 2, 9, 1, 0, 30], 40), ([1000, 3, 500], 50)])
def test_share_clusters_proportional_and_bounded(sizes, k):
    s = np.array(sizes)
    out = share_clusters(s, k)
    assert out.sum() == min(k, s.sum())
    assert (out <= s).all() and (out[s > 0] >= 1).all() and (out[s == 0] == 0).all()
    bigger = s[:, None] > s[None, :]
    assert (out[:, None] >= out[None, :])[bigger].all()  # a larger cell never gets fewer clusters than a smaller one


def test_spherical_kmeans_finds_planted_clusters_and_is_seeded():
    x, truth = planted()
    lab, cent = spherical_kmeans(x, 24, seed=1, iters=15, progress=False)
    assert cent.shape == (24, 32) and torch.allclose(cent.norm(dim=1), torch.ones(24), atol=1e-5)
    # as good as the planted partition (Lloyd from random seeds may split one centre and merge two)
    planted_cent = torch.nn.functional.normalize(torch.zeros(24, 32).index_add_(0, torch.from_numpy(truth), x), dim=-1)
    assert objective(x, lab, cent) > 0.9 * objective(x, truth, planted_cent)
    assert objective(x, lab, cent) >= objective(x, *spherical_kmeans(x, 24, seed=1, iters=1, progress=False)) - 1e-6
    lab2, cent2 = spherical_kmeans(x, 24, seed=1, iters=15, progress=False)
    assert (lab == lab2).all() and torch.equal(cent, cent2)
    ident, same = spherical_kmeans(x[:10], 50, seed=0, iters=3, progress=False)
    assert (ident == np.arange(10)).all() and torch.equal(same, x[:10])


def test_two_level_labels_match_centroids_and_count():
    x, _ = planted(n_centres=40, per=50, d=24, noise=0.6, seed=2)
    lab, cent = two_level_kmeans(x, 300, seed=0, iters=8, progress=False)
    assert cent.shape[0] == 300 and lab.min() == 0 and lab.max() == 299
    assert np.bincount(lab, minlength=300).min() >= 1  # every anchor has members
    # each point's centroid is the normalised mean of its members
    means = torch.nn.functional.normalize(torch.zeros(300, 24).index_add_(0, torch.from_numpy(lab), x), dim=-1)
    assert torch.allclose(means, cent, atol=1e-4)
    lab2, cent2 = two_level_kmeans(x, 300, seed=0, iters=8, progress=False)
    assert (lab == lab2).all() and torch.equal(cent, cent2)


def test_two_level_objective_close_to_flat():
    """The hierarchical split loses little: within 2% of flat k-means' mean cosine (same iterations)."""
    x, _ = planted(n_centres=64, per=40, d=48, noise=0.8, seed=3)
    flat = objective(x, *spherical_kmeans(x, 256, seed=0, iters=10, progress=False))
    two = objective(x, *two_level_kmeans(x, 256, seed=0, iters=10, progress=False))
    assert two > 0.98 * flat


def test_two_level_more_clusters_than_points_is_identity():
    x, _ = planted(n_centres=3, per=4)
    lab, cent = two_level_kmeans(x, 100, seed=0, iters=3, progress=False)
    assert (lab == np.arange(12)).all() and torch.equal(cent, x)
