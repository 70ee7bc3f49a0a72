"""Lookback-ratio trigger: per-head attention on the prompt vs on the answer, scored by a small
logistic regression (Lookback Lens, Chuang et al. 2024, "Lookback Lens: Detecting and Mitigating
Contextual Hallucinations in Large Language Models Using Only Attention Maps").

For the query that produced a token, head h of the snapshot layer puts mean weight A_ctx(h) on
the P prompt positions and A_new(h) on the answer tokens generated so far; the lookback ratio is

    LR(h) = A_ctx(h) / (A_ctx(h) + A_new(h))          (1 for the first answer token: no A_new)

Chuang et al. feed the ratios of every layer and head, averaged over a span, to a logistic
regression; SFCL has the snapshot layer's attention row at hand for free (the dispersion trigger
reads it), so the features are that layer's ratios for the token (nh values) and their mean over
the trigger window (nh values), plus the token's entity flag and surprisal (what the paper's
span-level detector gets from its span boundaries; the evaluation reports the ratios-only model
beside it). The model predicts "this token belongs to an entity the source does not support"
(``sfcl.eval.fidelity`` labels greedy answers to dev questions automatically) and is stored in the
library manifest (``calibration.lookback``) with its training figures. On the device it is one
dot product per row: p = sigmoid(((x - mean) / scale) . coef + intercept).

Who calls what: the model runner computes ``lookback_ratios`` from the tap probabilities (device);
the snapshotter keeps the window and builds ``features``; ``LookbackModel.score`` runs on the
device; ``train`` (scikit-learn, CPU) runs in calibration only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch


def feature_names(n_heads: int) -> list[str]:
    """Feature order of ``features`` for a model with ``n_heads`` query heads."""
    return ([f"lookback_h{h}" for h in range(n_heads)] + [f"lookback_mean_h{h}" for h in range(n_heads)]
            + ["in_entity", "surprisal"])


RATIO_ONLY = "ratios"  # feature subsets ``train`` compares
WITH_TOKEN = "ratios+token"


def lookback_ratios(probs: torch.Tensor, n_valid: torch.Tensor, n_prompt: torch.Tensor) -> torch.Tensor:
    """Per-head lookback ratio of one query per row.

    probs: (B, nh, S) float32 attention weights (0 beyond n_valid); n_valid: (B,) int64 attended
    positions; n_prompt: (B,) int64 prompt length P of each row's sequence (positions [0, P) are
    the prompt, [P, n_valid) the answer so far). Returns (B, nh) float32 in [0, 1]; 1 where the
    query attends no answer token yet.
    """
    B, nh, S = probs.shape
    pos = torch.arange(S, device=probs.device)[None, :]  # (1, S)
    P = n_prompt.clamp_max(S).view(B, 1)
    ctx = (pos < P).float()  # (B, S)
    new = ((pos >= P) & (pos < n_valid.view(B, 1))).float()  # (B, S)
    a_ctx = (probs * ctx[:, None]).sum(-1) / P.clamp_min(1).float()  # (B, nh) mean weight on the prompt
    n_new = new.sum(-1, keepdim=True)  # (B, 1)
    a_new = (probs * new[:, None]).sum(-1) / n_new.clamp_min(1)  # (B, nh) mean weight on the answer
    return a_ctx / (a_ctx + a_new).clamp_min(1e-30)


def features(ratios: torch.Tensor, ratios_mean: torch.Tensor, in_entity: torch.Tensor,
             surprisal: torch.Tensor) -> torch.Tensor:
    """(B, 2 nh + 2) float32 feature rows in ``feature_names`` order from the token's ratios
    (B, nh), their window mean (B, nh), the entity flag (B,) bool and the surprisal (B,) nats."""
    return torch.cat([ratios.float(), ratios_mean.float(), in_entity.float()[:, None], surprisal.float()[:, None]], 1)


@dataclass(slots=True)
class LookbackModel:
    """Logistic regression over ``feature_names(n_heads)`` (standardised inputs).

    Stored in a manifest as ``calibration.lookback`` = {"features", "mean", "scale", "coef",
    "intercept", "training"}. Raises ValueError from ``from_dict`` for a malformed entry."""

    features: tuple[str, ...]
    mean: tuple[float, ...]
    scale: tuple[float, ...]
    coef: tuple[float, ...]
    intercept: float
    training: dict = field(default_factory=dict)  # figures of the fit (not used to score)
    _dev: dict = field(default_factory=dict, repr=False, compare=False)  # device -> (mean, scale, coef)

    @classmethod
    def from_dict(cls, d: dict) -> "LookbackModel":
        bad = "anchor library calibration.lookback must hold equal-length lists features, mean, scale (> 0), " \
              "coef and a finite intercept"
        try:
            f = tuple(str(x) for x in d["features"])
            m, s, c = (tuple(float(x) for x in d[k]) for k in ("mean", "scale", "coef"))
            b = float(d["intercept"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{bad}: {e}") from e
        if not (len(f) == len(m) == len(s) == len(c) >= 1) or any(v <= 0 for v in s) \
                or not all(map(math.isfinite, m + s + c + (b,))):
            raise ValueError(bad)
        return cls(f, m, s, c, b, dict(d.get("training") or {}))

    def to_dict(self) -> dict:
        return {"features": list(self.features), "mean": list(self.mean), "scale": list(self.scale),
                "coef": list(self.coef), "intercept": self.intercept, "training": self.training}

    def check(self, n_heads: int) -> None:
        """Raises ValueError unless the model reads the features of an ``n_heads``-head layer."""
        if list(self.features) != feature_names(n_heads):
            raise ValueError(f"lookback model features {list(self.features)[:3]}... do not match a "
                             f"{n_heads}-head snapshot layer")

    def score(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, F) float32 ``features`` rows on any device -> (B,) float32 probability. A dot
        product; no host synchronisation."""
        key = str(x.device)
        if key not in self._dev:
            self._dev[key] = tuple(torch.tensor(v, dtype=torch.float32, device=x.device)
                                   for v in (self.mean, self.scale, self.coef))
        m, s, c = self._dev[key]
        return torch.sigmoid(((x.float() - m) / s) @ c + self.intercept)


def train(x: np.ndarray, y: np.ndarray, groups: np.ndarray, names: list[str], subset: str = WITH_TOKEN,
          c: float = 1.0, folds: int = 5, seed: int = 0) -> LookbackModel:
    """Fit the regression (scikit-learn ``LogisticRegression``, class_weight "balanced") on
    token rows x (n, F) float with labels y (n,) {0, 1}; groups (n,) document ids for the
    grouped cross-validation whose AUROC is stored in ``training`` (folds by document, so the
    figure speaks for unseen documents). subset: ``RATIO_ONLY`` (lookback ratios only; the other
    coefficients are 0) or ``WITH_TOKEN`` (all features). Raises ValueError with fewer than 2
    positive or negative rows."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score
    from sklearn.model_selection import GroupKFold

    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.int64)
    if x.ndim != 2 or x.shape[1] != len(names) or len(y) != len(x):
        raise ValueError("x must be (n, len(names)) with one label per row")
    if y.sum() < 2 or (1 - y).sum() < 2:
        raise ValueError(f"lookback training needs >= 2 positive and negative tokens, got {int(y.sum())} positive "
                         f"of {len(y)}")
    use = np.array([subset == WITH_TOKEN or n.startswith("lookback") for n in names])
    mean = x.mean(0)
    scale = np.where(x.std(0) > 1e-9, x.std(0), 1.0)
    z = (x - mean) / scale
    cv_scores = np.full(len(y), np.nan)
    k = min(folds, len(set(groups.tolist())))
    if k >= 2:
        for tr, te in GroupKFold(n_splits=k).split(z, y, groups):
            if y[tr].min() == y[tr].max():
                continue
            m = LogisticRegression(C=c, class_weight="balanced", max_iter=2000).fit(z[tr][:, use], y[tr])
            cv_scores[te] = m.decision_function(z[te][:, use])
    ok = np.isfinite(cv_scores)
    cv_auc = float(roc_auc_score(y[ok], cv_scores[ok])) if ok.any() and 0 < y[ok].sum() < ok.sum() else None
    fit = LogisticRegression(C=c, class_weight="balanced", max_iter=2000).fit(z[:, use], y)
    coef = np.zeros(len(names))
    coef[use] = fit.coef_[0]
    train_auc = float(roc_auc_score(y, z @ coef + fit.intercept_[0]))
    return LookbackModel(tuple(names), tuple(map(float, mean)), tuple(map(float, scale)), tuple(map(float, coef)),
                         float(fit.intercept_[0]),
                         {"subset": subset, "C": c, "n_tokens": int(len(y)), "n_positive": int(y.sum()),
                          "n_documents": int(len(set(groups.tolist()))), "train_auroc": train_auc,
                          "cv_auroc_by_document": cv_auc, "cv_folds": k,
                          "estimator": "sklearn LogisticRegression(class_weight='balanced')"})
