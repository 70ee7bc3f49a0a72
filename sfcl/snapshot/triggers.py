"""The three snapshot triggers and the per-token signals they read. Batched torch functions: they
run on the model's device inside the engine step, one row per sequence.

Signals (all natural-log units):
- token probability p = softmax(logits)[token] of the *model* distribution (temperature 1);
- surprisal s = -log p (nats);
- attention dispersion d: the snapshot layer's attention row for the query that produced the
  token, as *normalised entropy* averaged over heads,
      d = mean_h( -sum_j a_hj log a_hj / log(n) ),  n = number of attended positions (n >= 2),
  in [0, 1]: 0 = all weight on one position, 1 = uniform over the context. The trigger reads
  ``D3`` = the mean of d over the last 3 generated tokens; undefined (never fires) before the
  third generated token.

Triggers (defaults from the source design where it gives one, ``docs/SEED.md``):
1. ``entity_low_confidence``: token inside an entity-like span (``sfcl.snapshot.entity``) and
   p < 0.85.
2. ``attention_dispersion``: (D3 - mu_D3(n)) / sigma_D3(n) > 1.2. The report's "standard deviation
   of attention over 3 tokens above 1.2" has no stated unit; we read it as 1.2 calibration
   standard deviations above the calibration mean. Normalised entropy depends strongly on the
   attended length n (on SmolLM2-135M: mean D3 0.41 at n ~ 25, 0.32 at n ~ 700, 0.30 at n ~ 5000),
   so mu and sigma are looked up per attended length: the calibration stores them per
   power-of-two bucket of n (``dispersion_by_length``) and ``Calibration.dispersion_stats``
   interpolates linearly in log2 n between bucket centres (flat beyond the outer ones). A library
   without the table (older manifests) uses the flat ``dispersion_mean`` / ``dispersion_std``.
3. ``surprisal_deviation``: |s - mu_s| / sigma_s > 2.0, corpus calibration as above.

The thresholds can be recalibrated per library (``calibration.thresholds``, written by the
builder's serving calibration and by ``sfcl anchors calibrate``; ``TriggerConfig.from_calibration``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

TRIGGER_NAMES = ("entity_low_confidence", "attention_dispersion", "surprisal_deviation")


@dataclass(slots=True)
class TriggerConfig:
    entity_prob_threshold: float = 0.85  # trigger 1: p below this inside an entity span
    dispersion_z: float = 1.2  # trigger 2: z-score of D3 above this
    surprisal_z: float = 2.0  # trigger 3: |z-score| of surprisal above this
    dispersion_window: int = 3  # tokens averaged into D3
    enabled: tuple[str, ...] = TRIGGER_NAMES

    def __post_init__(self) -> None:
        if not 0.0 < self.entity_prob_threshold <= 1.0:
            raise ValueError("entity_prob_threshold must be in (0, 1]")
        if self.dispersion_z <= 0 or self.surprisal_z <= 0:
            raise ValueError("z thresholds must be > 0")
        if self.dispersion_window < 1:
            raise ValueError("dispersion_window must be >= 1")
        bad = set(self.enabled) - set(TRIGGER_NAMES)
        if bad:
            raise ValueError(f"unknown trigger(s) {sorted(bad)}; known: {', '.join(TRIGGER_NAMES)}")

    @classmethod
    def from_calibration(cls, calibration: dict) -> "TriggerConfig":
        """Defaults overridden by ``calibration["thresholds"]`` of a library manifest (written by
        ``sfcl anchors calibrate``); raises ValueError on unknown keys or out-of-range values."""
        if not isinstance(calibration or {}, dict):
            raise ValueError(f"anchor library calibration must be an object, got {type(calibration).__name__}")
        thr = (calibration or {}).get("thresholds") or {}
        if not isinstance(thr, dict):
            raise ValueError(f"anchor library thresholds must be an object, got {type(thr).__name__}")
        bad = set(thr) - {"entity_prob_threshold", "dispersion_z", "surprisal_z"}
        if bad:
            raise ValueError(f"anchor library thresholds: unknown key(s) {sorted(bad)}")
        values = {}
        for k, v in thr.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"anchor library thresholds: {k} must be a finite number, got {v!r}")
            values[k] = float(v)
        return cls(**values)


@dataclass(slots=True)
class Calibration:
    """Statistics of the signals (stored in the anchor library manifest's ``calibration``).

    The flat ``dispersion_mean`` / ``dispersion_std`` are always present; the optional length
    table (``dispersion_log2_n`` ascending bucket centres = mean log2 of the attended length,
    with the D3 mean and std of each bucket) replaces them in the dispersion z-score when set.
    """

    surprisal_mean: float
    surprisal_std: float
    dispersion_mean: float  # of D3
    dispersion_std: float
    dispersion_log2_n: tuple[float, ...] = ()
    dispersion_means: tuple[float, ...] = ()
    dispersion_stds: tuple[float, ...] = ()
    _tables: dict = field(default_factory=dict, repr=False, compare=False)  # device -> (x, mean, std)

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        """From a manifest's calibration dict: the flat keys (required) and, when present,
        ``dispersion_by_length = {"log2_n": [...], "mean": [...], "std": [...], ...}``.
        Raises ValueError for missing keys, non-positive stds or a malformed table."""
        try:
            c = cls(*(float(d[k]) for k in ("surprisal_mean", "surprisal_std", "dispersion_mean", "dispersion_std")))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"anchor library calibration is incomplete: {e}") from e
        if not (c.surprisal_std > 0 and c.dispersion_std > 0):
            raise ValueError("anchor library calibration has a non-positive standard deviation")
        t = d.get("dispersion_by_length")
        if t is not None:
            bad = "anchor library calibration: dispersion_by_length must be an object with equal-length " \
                  "lists log2_n (strictly ascending), mean, std (> 0)"
            try:
                x, m, sd = ([float(v) for v in t[k]] for k in ("log2_n", "mean", "std"))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{bad}: {e}") from e
            if not (len(x) == len(m) == len(sd) >= 1) or not all(map(math.isfinite, x + m + sd)) \
                    or any(v <= 0 for v in sd) or any(b <= a for a, b in zip(x, x[1:])):
                raise ValueError(bad)
            c.dispersion_log2_n, c.dispersion_means, c.dispersion_stds = tuple(x), tuple(m), tuple(sd)
        return c

    @property
    def by_length(self) -> bool:
        return len(self.dispersion_log2_n) > 0

    def dispersion_stats(self, n_attended: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and std of D3 for attended lengths ``n_attended`` ((B,) int64, on the device).

        Piecewise-linear in log2 n between bucket centres, constant beyond the first and last;
        flat statistics when the library has no table or n_attended is None. Returns two (B,)
        float32 tensors on ``like``'s device. Batched, no host synchronisation."""
        if not self.by_length or n_attended is None:
            return (torch.full_like(like, self.dispersion_mean, dtype=torch.float32),
                    torch.full_like(like, self.dispersion_std, dtype=torch.float32))
        key = str(like.device)
        if key not in self._tables:
            self._tables[key] = tuple(torch.tensor(v, dtype=torch.float32, device=like.device) for v in
                                      (self.dispersion_log2_n, self.dispersion_means, self.dispersion_stds))
        xs, ms, ss = self._tables[key]
        if xs.numel() == 1:
            return ms.expand(like.shape), ss.expand(like.shape)
        x = n_attended.float().clamp_min(1).log2()
        i = torch.searchsorted(xs, x).clamp(1, xs.numel() - 1)  # segment [i-1, i]
        x0, x1 = xs[i - 1], xs[i]
        t = ((x - x0) / (x1 - x0)).clamp(0.0, 1.0)
        return torch.lerp(ms[i - 1], ms[i], t), torch.lerp(ss[i - 1], ss[i], t)

    def dispersion_stats_np(self, n_attended: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """NumPy twin of :meth:`dispersion_stats` (float64 arrays shaped like n_attended)."""
        n = np.asarray(n_attended, np.float64)
        if not self.by_length:
            return np.full(n.shape, self.dispersion_mean), np.full(n.shape, self.dispersion_std)
        x = np.log2(np.maximum(n, 1.0))
        return (np.interp(x, self.dispersion_log2_n, self.dispersion_means),
                np.interp(x, self.dispersion_log2_n, self.dispersion_stds))


def dispersion_length_table(d3: np.ndarray, n_attended: np.ndarray, min_count: int = 64, source: str = "") -> dict:
    """Per-attended-length statistics of D3 for a manifest's ``dispersion_by_length``.

    d3: (m,) float D3 values (NaN entries are ignored); n_attended: (m,) int attended length of
    the last query of each D3. Buckets are [2^k, 2^(k+1)); buckets with fewer than ``min_count``
    values are dropped (the neighbours' interpolation covers them). Returns {"log2_n", "mean",
    "std", "count", "min_count", "source"}; raises ValueError when no bucket has min_count values.
    """
    d3 = np.asarray(d3, np.float64)
    n = np.asarray(n_attended, np.float64)
    if d3.shape != n.shape:
        raise ValueError("d3 and n_attended must have one shape")
    ok = np.isfinite(d3) & (n >= 1)
    d3, n = d3[ok], n[ok]
    k = np.floor(np.log2(n)).astype(np.int64)
    out = {"log2_n": [], "mean": [], "std": [], "count": []}
    for b in np.unique(k):
        m = k == b
        if m.sum() < min_count:
            continue
        out["log2_n"].append(float(np.log2(n[m]).mean()))
        out["mean"].append(float(d3[m].mean()))
        out["std"].append(float(max(d3[m].std(), 1e-6)))
        out["count"].append(int(m.sum()))
    if not out["count"]:
        raise ValueError(f"no attended-length bucket has {min_count} dispersion values to calibrate on")
    return {**out, "min_count": int(min_count), "source": source}


def attention_dispersion(probs: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
    """Normalised attention entropy per sequence.

    probs: (B, nh, S) float32 attention weights of one query per sequence (0 beyond n_valid).
    n_valid: (B,) int64 attended positions per sequence.
    Returns (B,) float32 in [0, 1] (0 where n_valid < 2).
    """
    p = probs.clamp_min(1e-30)
    ent = -(probs * p.log()).sum(-1).mean(-1)  # (B,) nats
    denom = n_valid.float().clamp_min(2).log()
    return torch.where(n_valid >= 2, ent / denom, torch.zeros_like(ent))


def entity_low_confidence(token_prob: torch.Tensor, in_entity: torch.Tensor, threshold: float = 0.85) -> torch.Tensor:
    """(B,) bool: token inside an entity-like span sampled with probability < threshold."""
    return in_entity & (token_prob < threshold)


def dispersion_trigger(d3: torch.Tensor, cal: Calibration, z: float = 1.2,
                       n_attended: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) bool: the 3-token mean dispersion is more than ``z`` calibration std above the
    calibration mean for the attended length (``n_attended`` (B,) int64 of the latest token; None:
    the flat statistics)."""
    mu, sd = cal.dispersion_stats(n_attended, d3)
    return (d3 - mu) / sd > z


def surprisal_trigger(surprisal: torch.Tensor, cal: Calibration, z: float = 2.0) -> torch.Tensor:
    """(B,) bool: surprisal more than ``z`` corpus std from the corpus mean (either side)."""
    return ((surprisal - cal.surprisal_mean) / cal.surprisal_std).abs() > z


def token_entropy(logp: torch.Tensor) -> torch.Tensor:
    """(B, V) log-probabilities -> (B,) Shannon entropy in nats."""
    return -(logp.exp() * logp).sum(-1)


def anchor_confidence(scores: torch.Tensor, weights: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """Snapshot confidence from the top-k anchors.

    scores: (B, k) cosine similarities; weights, decay: (B, k) of the retrieved anchors.
    conf_i = min(1, w_i * exp(-lambda_i * max(0, 1 - s_i))); returns (B,) max over i.
    lambda_i is set at build time to ln 2 / (1 - typical member similarity of the anchor's
    cluster), so a query as close as a typical member gets confidence 0.5 * w.
    """
    c = weights * torch.exp(-decay * (1.0 - scores).clamp_min(0.0))
    return c.clamp(0.0, 1.0).amax(-1)


LN2 = math.log(2.0)
