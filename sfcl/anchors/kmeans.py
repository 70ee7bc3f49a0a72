"""Spherical k-means on unit vectors (CPU): flat, and two-level for many clusters.

Owns :func:`spherical_kmeans` (Lloyd iterations, cosine assignment) and :func:`two_level_kmeans`
(the anchor builder's clustering of every corpus position into up to 32,768 anchors). Callers:
``sfcl.anchors.builder`` (anchors), ``sfcl.anchors.conflicts`` (general-anchor centres). Data and
work stay on the CPU; assignment GEMMs run in ``sfcl.model.hardware.fast_float_dtype()``.

Why two levels: a flat Lloyd iteration costs n x k x D multiply-adds. For the 61 ContractNLI NDAs
(n ~ 148k positions, k = 32,768 anchors, D = 576) that is 5.6 TFLOP per iteration, more than the
whole model pass (45 TFLOP) after eight iterations. Clustering first into k1 = ceil(sqrt(k))
coarse cells and then each cell into a share of the k anchors proportional to its size costs
about n x (k1 + k / k1 x imbalance) x D per iteration: ~2 x sqrt(k) instead of k, 90x less here.
This is the hierarchical scheme of faiss's ``contrib.clustering.two_level_clustering``, with the
points' final labels kept (each point belongs to the anchor it was clustered into, inside its
coarse cell) and a progress bar over the cells.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from tqdm.auto import tqdm

from sfcl.model.hardware import fast_float_dtype

SIM_ENTRIES = 1 << 26  # similarity entries per assignment chunk (256 MiB in float32)


def spherical_kmeans(x: torch.Tensor, k: int, seed: int, iters: int, progress: bool = True,
                     desc: str = "anchors: k-means") -> tuple[np.ndarray, torch.Tensor]:
    """Spherical k-means (Lloyd iterations on unit vectors, cosine assignment; Dhillon & Modha,
    "Concept decompositions for large sparse text data using clustering", 2001).

    x: (n, H) float32 unit rows. Returns (labels (n,) int64, centroids (k', H) float32 unit),
    k' = min(k, n); with k >= n every point is its own centroid. Seeded initialisation from k
    distinct random points; an emptied cluster is re-seeded with the point worst served by its
    centroid. Assignment runs in chunks in ``fast_float_dtype()`` (bf16 on CPUs with native
    bf16, float32 elsewhere, where bf16 is emulated and 30-47x slower); centroid updates
    accumulate in float32. Deterministic for a given seed and thread count.
    """
    n = x.shape[0]
    if k >= n:
        return np.arange(n), x.clone()
    g = torch.Generator().manual_seed(seed)
    cent = x[torch.randperm(n, generator=g)[:k]].clone()  # (k, H)
    labels = torch.zeros(n, dtype=torch.int64)
    best = torch.zeros(n)
    fast = fast_float_dtype()
    xb = x.to(fast)
    chunk = max(1, SIM_ENTRIES // k)  # rows per assignment chunk
    for _ in tqdm(range(iters), desc=desc, unit="iter", disable=not progress):
        cb = cent.to(fast).T.contiguous()  # (H, k)
        for s in range(0, n, chunk):
            v, i = (xb[s : s + chunk] @ cb).max(1)  # (c, k) -> (c,)
            labels[s : s + chunk], best[s : s + chunk] = i, v.float()
        new = torch.zeros_like(cent).index_add_(0, labels, x)  # (k, H) sums
        counts = torch.bincount(labels, minlength=k)
        empty = torch.nonzero(counts == 0)[:, 0]
        if len(empty):
            new[empty] = x[torch.argsort(best)[: len(empty)]]
        cent = torch.nn.functional.normalize(new, dim=-1)
    return labels.numpy(), cent


def share_clusters(sizes: np.ndarray, k: int) -> np.ndarray:
    """Split ``k`` clusters over cells of ``sizes`` points proportionally (largest remainder),
    each non-empty cell getting at least 1 and at most its size. Returns (cells,) int64 summing to
    min(k, sizes.sum())."""
    sizes = np.asarray(sizes, np.int64)
    k = min(k, int(sizes.sum()))
    want = sizes * k / max(1, sizes.sum())
    out = np.minimum(np.maximum(np.floor(want).astype(np.int64), (sizes > 0).astype(np.int64)), sizes)
    while out.sum() != k:  # hand out (or take back) one at a time, by remainder
        room = want - out
        if out.sum() < k:
            room[out >= sizes] = -np.inf
            out[int(np.argmax(room))] += 1
        else:
            room[out <= np.minimum(1, sizes)] = np.inf
            out[int(np.argmin(room))] -= 1
    return out


def two_level_kmeans(x: torch.Tensor, k: int, seed: int, iters: int,
                     progress: bool = True) -> tuple[np.ndarray, torch.Tensor]:
    """Spherical k-means into at most ``k`` clusters in two levels (module docstring): ``x`` (n, H)
    float32 unit rows into k1 = ceil(sqrt(k)) coarse cells, then each cell into its share of k
    (:func:`share_clusters`), ``iters`` Lloyd iterations at each level. Returns (labels (n,) int64,
    centroids (k', H) float32 unit), k' = min(k, n); deterministic for a seed and thread count."""
    n = x.shape[0]
    if k >= n:
        return np.arange(n), x.clone()
    k1 = min(n, math.ceil(math.sqrt(k)))
    coarse, _ = spherical_kmeans(x, k1, seed, iters, progress, desc="anchors: k-means, coarse")
    order = np.argsort(coarse, kind="stable")
    sizes = np.bincount(coarse, minlength=k1)
    shares = share_clusters(sizes, k)
    labels = np.empty(n, np.int64)
    cents, base, start = [], 0, 0
    cost = sizes * shares  # work per cell: points x clusters
    with tqdm(total=int(cost.sum()), desc="anchors: k-means, cells", unit="pt*cl", unit_scale=True,
              disable=not progress) as bar:
        for c in range(k1):
            idx = order[start : start + sizes[c]]
            start += sizes[c]
            if shares[c] == 0:
                continue
            lab, cent = spherical_kmeans(x[torch.from_numpy(idx)], int(shares[c]), seed + 1 + c, iters, False)
            labels[idx] = lab + base
            base += cent.shape[0]
            cents.append(cent)
            bar.update(int(cost[c]))
    return labels, torch.cat(cents)
