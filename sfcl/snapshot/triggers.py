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
2. ``attention_dispersion``: (D3 - mu_D3) / sigma_D3 > 1.2, with mu/sigma of D3 measured on the
   anchor corpus at build time. The report's "standard deviation of attention over 3 tokens above
   1.2" has no stated unit; we read it as 1.2 corpus standard deviations above the corpus mean.
3. ``surprisal_deviation``: |s - mu_s| / sigma_s > 2.0, corpus calibration as above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    """Corpus statistics of the signals (stored in the anchor library manifest)."""

    surprisal_mean: float
    surprisal_std: float
    dispersion_mean: float  # of D3
    dispersion_std: float

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        try:
            c = cls(*(float(d[k]) for k in ("surprisal_mean", "surprisal_std", "dispersion_mean", "dispersion_std")))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"anchor library calibration is incomplete: {e}") from e
        if not (c.surprisal_std > 0 and c.dispersion_std > 0):
            raise ValueError("anchor library calibration has a non-positive standard deviation")
        return c


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


def dispersion_trigger(d3: torch.Tensor, cal: Calibration, z: float = 1.2) -> torch.Tensor:
    """(B,) bool: the 3-token mean dispersion is more than ``z`` corpus std above the corpus mean."""
    return (d3 - cal.dispersion_mean) / cal.dispersion_std > z


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
