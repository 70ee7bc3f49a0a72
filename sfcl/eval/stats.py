"""Bootstrap confidence intervals for ratio-of-sums metrics (numpy, CPU).

Percentile bootstrap (Efron & Tibshirani 1993, ch. 13): each replicate draws units with
replacement and recomputes the metric from the drawn units; the CI is the (alpha/2, 1-alpha/2)
percentiles of the replicates. Units are items, or - the *cluster bootstrap* (Field & Welsh 2007,
"Bootstrapping clustered data") - whole documents: answers about one NDA are correlated, so
resampling them one by one understates the variance. ``cluster_sums`` turns per-item columns into
per-document sums and ``bootstrap_indices`` then draws documents; a ratio of sums is the same
function either way. Drawing the same indices for every configuration keeps comparisons paired.
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def bootstrap_indices(n: int, reps: int = 1000, seed: int = 0) -> np.ndarray:
    """(reps, n) int64 indices drawn with replacement. Raises ValueError when n < 1 or reps < 1."""
    if n < 1 or reps < 1:
        raise ValueError("bootstrap needs n >= 1 items and reps >= 1")
    return np.random.default_rng(seed).integers(0, n, size=(reps, n))


def ratio_of_sums(num: np.ndarray, den: np.ndarray, idx: np.ndarray | None = None, scale: float = 1.0) -> np.ndarray | float:
    """scale * sum(num) / sum(den), for the full arrays (float; nan when the denominator is 0) or per
    bootstrap replicate (idx (reps, n) -> (reps,) float64, nan where a replicate's denominator is 0)."""
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    if idx is None:
        d = den.sum()
        return float(scale * num.sum() / d) if d > 0 else float("nan")
    n_s, d_s = num[idx].sum(1), den[idx].sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(d_s > 0, scale * n_s / np.where(d_s > 0, d_s, 1), np.nan)


def percentile_ci(reps: np.ndarray, alpha: float = 0.05) -> tuple[float, float]:
    """(lo, hi) percentiles of the finite replicates; (nan, nan) when none is finite."""
    r = np.asarray(reps, np.float64)
    r = r[np.isfinite(r)]
    if r.size == 0:
        return float("nan"), float("nan")
    return float(np.percentile(r, 100 * alpha / 2)), float(np.percentile(r, 100 * (1 - alpha / 2)))


def estimate(fn: Callable[[np.ndarray | None], np.ndarray | float], idx: np.ndarray, alpha: float = 0.05) -> dict:
    """{"value", "ci_lo", "ci_hi"} for a metric ``fn(idx)`` that accepts None (all items) or (reps, n)."""
    v = fn(None)
    lo, hi = percentile_ci(fn(idx), alpha)
    return {"value": v, "ci_lo": lo, "ci_hi": hi}


def cluster_sums(values: np.ndarray, groups: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Per-cluster sums of ``values`` (n,) for the clusters ``order`` (k,) (ids of ``groups`` (n,));
    (k,) float64. Feed them to ``ratio_of_sums`` with ``bootstrap_indices(k, ...)``."""
    pos = {g: i for i, g in enumerate(order.tolist())}
    out = np.zeros(len(order))
    np.add.at(out, np.array([pos[g] for g in np.asarray(groups).tolist()], dtype=np.int64), np.asarray(values, np.float64))
    return out


def draw_weights(idx: np.ndarray, k: int) -> np.ndarray:
    """(reps, k) how often each of k clusters was drawn in each replicate of ``idx`` (reps, k)."""
    w = np.zeros((idx.shape[0], k))
    for r in range(idx.shape[0]):
        np.add.at(w[r], idx[r], 1.0)
    return w

