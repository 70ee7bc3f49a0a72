"""Bootstrap confidence intervals for ratio-of-sums metrics (numpy, CPU).

Percentile bootstrap (Efron & Tibshirani 1993, ch. 13) over *items* (requests): each replicate
draws n item indices with replacement and recomputes the metric from the drawn items; the CI is the
(alpha/2, 1-alpha/2) percentiles of the replicates. Drawing the same indices for every
configuration (``paired``) keeps comparisons between configurations on the same questions.
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
