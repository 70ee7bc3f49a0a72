"""The snapshot triggers and the per-token signals they read. Batched torch functions: they run on
the model's device inside the engine step, one row per sequence, and on the CPU when calibration
(``sfcl.snapshot.calibration``) or the evaluation replays recorded tokens - the same functions.

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
4. ``lookback_ratio``: the probability that the token belongs to an unsupported entity, from a
   logistic regression over the snapshot layer's per-head lookback ratios (Lookback Lens, Chuang
   et al. 2024; ``sfcl.snapshot.lookback``), above 0.5. Fires only when the library carries a
   trained model (``calibration.lookback``).
5. ``unsupported_number``: a grounding check, not a model signal: the token is a digit of a number
   that, as written so far, begins no number of the prompt (``sfcl.snapshot.source.number_support``:
   "1" then "2" of "12 months" fires on the "2" when the document has 10 and 1 but no number
   starting with 12; a "." or "," between digits joins them into one number, as the evaluation's
   scorer reads "2.1.3" and "1,000"). Signal 1.0 (fires) or 0.0 on number tokens, -inf elsewhere; computed on the
   host from the sampled token and the request's ``SourceIndex`` (built at prefill for every
   request with snapshots; silent below ``SourceConfig.min_source_tokens`` prompt tokens, where
   there is no document), so the device never computes it (its column is -inf there) and the
   runner fills it in after the step's transfer. No threshold to calibrate: it takes the share of
   the lookup budget it needs and the calibration splits the rest (``sfcl.snapshot.calibration``).
   Why: on the dev NDAs almost every unsupported entity is a number (clause numbers, periods,
   dates), and the model signals above catch about three in four of them (docs/fidelity.md).

One rule for all five: every trigger reads one *signal* oriented so that it fires when
``signal > cutoff`` (``trigger_signals``, ``fire``): -p inside entity spans (-inf outside), the
dispersion z-score (-inf before the window is full), |surprisal z|, the lookback probability
(-inf without a model), the number check. ``TriggerConfig.cutoffs`` maps the stored thresholds onto
that scale.

The thresholds can be recalibrated per library (``calibration.thresholds``, written by the
builder's serving calibration and by ``sfcl anchors calibrate``; ``TriggerConfig.from_calibration``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

TRIGGER_NAMES = ("entity_low_confidence", "attention_dispersion", "surprisal_deviation", "lookback_ratio",
                 "unsupported_number")
THRESHOLD_KEYS = ("entity_prob_threshold", "dispersion_z", "surprisal_z", "lookback_threshold")  # TRIGGER_NAMES order
NUMBER_CUTOFF = 0.5  # unsupported_number: signal 1.0 fires, 0.0 (a number the prompt has) does not
# columns of a recorded token (``StepSignals.record`` -> ``calibration.TokenRecords``): token logprob,
# in_entity, d3, n_attended, the number check (filled in on the host), then the lookback features
RECORD_NUMBER_COL, RECORD_FEATURES_AT = 4, 5


@dataclass(slots=True)
class TriggerConfig:
    entity_prob_threshold: float = 0.85  # trigger 1: p below this inside an entity span
    dispersion_z: float = 1.2  # trigger 2: z-score of D3 above this
    surprisal_z: float = 2.0  # trigger 3: |z-score| of surprisal above this
    lookback_threshold: float = 0.5  # trigger 4: lookback-model probability above this
    dispersion_window: int = 3  # tokens averaged into D3 (and into the windowed lookback ratios)
    enabled: tuple[str, ...] = TRIGGER_NAMES

    def __post_init__(self) -> None:
        if not 0.0 < self.entity_prob_threshold <= 1.0:
            raise ValueError("entity_prob_threshold must be in (0, 1]")
        if self.dispersion_z <= 0 or self.surprisal_z <= 0:
            raise ValueError("z thresholds must be > 0")
        if not 0.0 < self.lookback_threshold < 1.0:
            raise ValueError("lookback_threshold must be in (0, 1)")
        if self.dispersion_window < 1:
            raise ValueError("dispersion_window must be >= 1")
        bad = set(self.enabled) - set(TRIGGER_NAMES)
        if bad:
            raise ValueError(f"unknown trigger(s) {sorted(bad)}; known: {', '.join(TRIGGER_NAMES)}")

    def cutoffs(self) -> tuple[float, float, float, float, float]:
        """Cutoffs on the ``trigger_signals`` scale, TRIGGER_NAMES order (fire: signal > cutoff)."""
        return (-self.entity_prob_threshold, self.dispersion_z, self.surprisal_z, self.lookback_threshold, NUMBER_CUTOFF)

    def thresholds(self) -> dict[str, float]:
        """The four thresholds as stored in a manifest's ``calibration.thresholds``."""
        return {k: float(getattr(self, k)) for k in THRESHOLD_KEYS}

    @staticmethod
    def thresholds_from_cutoffs(cutoffs) -> dict[str, float]:
        """Inverse of ``cutoffs``: {threshold key: value} for cutoffs in TRIGGER_NAMES order (the
        number check's fixed cutoff, if given, is not a threshold)."""
        c = [float(x) for x in cutoffs]
        return {"entity_prob_threshold": -c[0], "dispersion_z": c[1], "surprisal_z": c[2], "lookback_threshold": c[3]}

    @classmethod
    def from_calibration(cls, calibration: dict, dispersion_window: int = 3) -> "TriggerConfig":
        """Defaults overridden by ``calibration["thresholds"]`` of a library manifest (written by
        ``sfcl anchors calibrate``) and, when present, ``calibration["enabled_triggers"]`` (the
        triggers whose signal separated unsupported-entity tokens on the calibration answers,
        ``sfcl.snapshot.calibration.select_triggers``; absent: all five). Raises ValueError on
        unknown keys or names and out-of-range values."""
        if not isinstance(calibration or {}, dict):
            raise ValueError(f"anchor library calibration must be an object, got {type(calibration).__name__}")
        enabled = (calibration or {}).get("enabled_triggers", TRIGGER_NAMES)
        if not isinstance(enabled, (list, tuple)) or not all(isinstance(n, str) for n in enabled):
            raise ValueError(f"anchor library enabled_triggers must be a list of trigger names, got {enabled!r}")
        thr = (calibration or {}).get("thresholds") or {}
        if not isinstance(thr, dict):
            raise ValueError(f"anchor library thresholds must be an object, got {type(thr).__name__}")
        bad = set(thr) - set(THRESHOLD_KEYS)
        if bad:
            raise ValueError(f"anchor library thresholds: unknown key(s) {sorted(bad)}")
        values = {}
        for k, v in thr.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"anchor library thresholds: {k} must be a finite number, got {v!r}")
            values[k] = float(v)
        return cls(**values, dispersion_window=dispersion_window, enabled=tuple(sorted(set(enabled), key=lambda n: (TRIGGER_NAMES + (n,)).index(n))))


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
    return dispersion_from_entropy(-(probs * p.log()).sum(-1).mean(-1), n_valid)


def dispersion_from_entropy(entropy: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
    """The dispersion rule of :func:`attention_dispersion` from the head-mean attention entropy:
    entropy (B,) float32 nats / log(n_valid), 0 where n_valid < 2 (a single attended position
    has no spread). n_valid (B,) int64. Returns (B,) float32 in [0, 1]. The anchor builder's model
    pass gets the entropies from a native kernel (``torch.ops.sfcl.causal_softmax_entropy_``)."""
    denom = n_valid.float().clamp_min(2).log()
    return torch.where(n_valid >= 2, entropy.float() / denom, torch.zeros_like(entropy, dtype=torch.float32))


def trigger_signals(token_logp: torch.Tensor, in_entity: torch.Tensor, d3: torch.Tensor,
                    n_attended: torch.Tensor | None, lookback_p: torch.Tensor | None, cal: Calibration,
                    number: torch.Tensor | None = None) -> torch.Tensor:
    """The five trigger signals, oriented so that each trigger fires when its signal exceeds its
    cutoff (``fire``).

    token_logp (B,) float32 model log-probability of the token (nats); in_entity (B,) bool;
    d3 (B,) float32 windowed dispersion, NaN where the window is not full yet; n_attended (B,)
    int64 positions attended by the producing query (None: the library's flat statistics);
    lookback_p (B,) float32 lookback-model probability (None: no model); number (B,) float32
    ``source.number_support`` value (1.0 unsupported, 0.0 supported, NaN not a number token or no
    source; None: not known here - the runner fills the column in on the host). Returns (B, 5)
    float32, TRIGGER_NAMES order: [-p inside entity spans else -inf, (D3 - mu(n)) / sigma(n) else
    -inf, |surprisal z|, lookback probability else -inf, number check else -inf].
    """
    lp = token_logp.float()
    ninf = torch.full_like(lp, float("-inf"))
    mu, sd = cal.dispersion_stats(n_attended, lp)
    dz = (d3.float() - mu) / sd
    return torch.stack([
        torch.where(in_entity, -lp.exp(), ninf),
        torch.where(torch.isnan(dz), ninf, dz),
        ((-lp - cal.surprisal_mean) / cal.surprisal_std).abs(),
        ninf if lookback_p is None else lookback_p.float(),
        ninf if number is None else torch.where(torch.isnan(number.float()), ninf, number.float()),
    ], dim=1)


def fire(signals: torch.Tensor, cfg: TriggerConfig) -> torch.Tensor:
    """(B, 5) bool: which triggers fire, from ``trigger_signals`` (B, 5) and the thresholds of
    ``cfg`` (disabled triggers never fire). The one rule serving, calibration and the
    evaluation apply."""
    cut = torch.tensor(cfg.cutoffs(), dtype=signals.dtype, device=signals.device)  # (5,)
    on = torch.tensor([n in cfg.enabled for n in TRIGGER_NAMES], device=signals.device)  # (5,)
    return (signals > cut) & on


def window_mean(hist: torch.Tensor, count: torch.Tensor, window: int) -> torch.Tensor:
    """Mean of the last ``window`` values per row: hist (B, window, ...) newest last, zeros before
    the first value; count (B,) values seen (capped at window). NaN where fewer than ``window``
    values were seen (the windowed statistic is undefined there). Returns (B, ...) float32."""
    m = hist.float().sum(1) / count.clamp_min(1).float().view(-1, *([1] * (hist.dim() - 2)))
    full = (count >= window).view(-1, *([1] * (hist.dim() - 2)))
    return torch.where(full, m, torch.full_like(m, float("nan")))


def token_entropy(logp: torch.Tensor) -> torch.Tensor:
    """(B, V) log-probabilities -> (B,) Shannon entropy in nats."""
    return -(logp.exp() * logp).sum(-1)


def anchor_confidence_each(scores, weights, decay):
    """Per-anchor snapshot confidence.

    scores: (B, k) cosine similarities; weights, decay: (B, k) of the retrieved anchors; all torch
    tensors or all numpy arrays (the CPU lookup's epilogue in numpy: 0.095 vs 0.159 ms p50 in torch
    for one row right after a 64 MB copy, ``scripts/lookup_parts.py``, AVX-512 BF16 EPYC). conf_i = min(1, w_i * exp(-lambda_i *
    max(0, 1 - s_i))), (B, k) float32, of the inputs' kind. lambda_i is set at build time to
    ln 2 / (1 - typical member similarity of the anchor's cluster), so a query as close as a
    typical member gets confidence 0.5 * w.
    """
    exp = np.exp if isinstance(scores, np.ndarray) else torch.exp
    return (weights * exp(-decay * (1.0 - scores).clip(0.0, None))).clip(0.0, 1.0)


def anchor_confidence(scores: torch.Tensor, weights: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """Snapshot confidence from the top-k anchors: (B,) max over k of ``anchor_confidence_each``."""
    return anchor_confidence_each(scores, weights, decay).amax(-1)


LN2 = math.log(2.0)
