"""Detection metrics: do the triggers fire on the tokens of unsupported entities?

Input: the greedy answers of one arm with, per generated token, the five trigger signals the
runner computed (``SeqResult.signals``) and the labels of ``sfcl.eval.labels``. Which tokens fire
is ``sfcl.snapshot.triggers.fire`` on those signals - serving's rule, not a re-derivation.

- recall (per trigger and for their union): share of unsupported entities with at least one
  fired token among their tokens;
- precision (``trigger_precision`` of the source design): share of fired tokens that belong to
  an unsupported entity;
- a random-trigger control firing each token independently at the union's rate r: its expected
  recall is the mean over unsupported entities of 1 - (1 - r)^(tokens of the entity) and its
  expected precision the share of unsupported-entity tokens;
- AUROC of each per-token signal (and of the snapshot confidence, where an ``always`` arm gives
  one per token) for "this token belongs to an unsupported entity" (``sklearn.metrics``).

CIs: 95% percentile cluster bootstrap over documents (``sfcl.eval.stats``); AUROC replicates
weight each token by how often its document was drawn. numpy/torch on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from sfcl.eval import stats
from sfcl.eval.labels import AnswerLabels
from sfcl.snapshot.calibration import signal_auroc
from sfcl.snapshot.triggers import TRIGGER_NAMES, TriggerConfig, fire


@dataclass(slots=True)
class AnswerSignals:
    """One answer: its document, per-token signals (n, K) and labels (K = len(TRIGGER_NAMES))."""

    doc_id: str
    signals: np.ndarray  # (n, K) float, TRIGGER_NAMES order
    labels: AnswerLabels
    confidence: np.ndarray | None = None  # (n,) snapshot confidence per token (always arm), NaN where none
    extra: dict = field(default_factory=dict)  # name -> (n,) more per-token risk scores to report AUROC for


def detection(answers: list[AnswerSignals], cfg: TriggerConfig, reps: int = 1000, seed: int = 0,
              auroc_reps: int = 300) -> dict:
    """Recall, precision and fire rate per trigger and for the union, the random control at the
    union's rate, and AUROC per signal, each {"value", "ci_lo", "ci_hi"} (cluster bootstrap over
    documents; ``auroc_reps`` replicates for the AUROC CIs). Raises ValueError without answers."""
    if not answers:
        raise ValueError("no answers to measure detection on")
    docs = np.array(sorted({a.doc_id for a in answers}))
    tok_doc, ent_doc = [], []
    K = len(TRIGGER_NAMES)
    S, F, Y, C = [], [], [], []  # per answer: signals (n, K), fired (n, K + 1: K + union), labels, confidence
    X: dict[str, list] = {k: [] for a in answers for k in a.extra}  # extra scores
    ent_len, ent_fired = [], []  # per unsupported entity: token count, fired (K + 1,) within its tokens
    for a in answers:
        s = np.asarray(a.signals, np.float64).reshape(-1, K)
        n = min(len(a.labels.token_unsupported), len(s))
        f = fire(torch.from_numpy(s[:n]).float(), cfg).numpy()  # (n, K)
        f = np.concatenate([f, f.any(1, keepdims=True)], 1)  # (n, K + 1)
        S.append(s[:n])
        F.append(f)
        Y.append(np.asarray(a.labels.token_unsupported[:n], bool))
        C.append(a.confidence[:n] if a.confidence is not None else np.full(n, np.nan))
        for k in X:
            X[k].append(np.asarray(a.extra[k], np.float64)[:n] if k in a.extra else np.full(n, np.nan))
        tok_doc += [a.doc_id] * n
        for e in a.labels.entities:
            toks = [k for k in e.tokens if k < n]
            if not e.supported and toks:
                ent_len.append(len(toks))
                ent_fired.append(f[toks].any(0))
                ent_doc.append(a.doc_id)
    S, F, Y, C = np.concatenate(S), np.concatenate(F), np.concatenate(Y), np.concatenate(C)
    tok_doc, ent_doc = np.array(tok_doc), np.array(ent_doc)
    E = np.array(ent_fired, bool).reshape(-1, K + 1)
    L = np.array(ent_len, np.float64)
    idx = stats.bootstrap_indices(len(docs), reps, seed)
    names = list(TRIGGER_NAMES) + ["union"]
    out: dict = {"n_tokens": int(len(Y)), "n_unsupported_tokens": int(Y.sum()), "n_unsupported_entities": int(len(L)),
                 "n_documents": int(len(docs)), "per_trigger": {}}
    ones_t = stats.cluster_sums(np.ones(len(Y)), tok_doc, docs)
    ones_e = stats.cluster_sums(np.ones(len(L)), ent_doc, docs) if len(L) else np.zeros(len(docs))
    y_t = stats.cluster_sums(Y.astype(float), tok_doc, docs)
    R = stats.ratio_of_sums
    for j, name in enumerate(names):
        fired_t = stats.cluster_sums(F[:, j].astype(float), tok_doc, docs)
        hit_t = stats.cluster_sums((F[:, j] & Y).astype(float), tok_doc, docs)
        caught = stats.cluster_sums(E[:, j].astype(float), ent_doc, docs) if len(L) else np.zeros(len(docs))
        out["per_trigger"][name] = {
            "recall": stats.estimate(lambda i: R(caught, ones_e, i), idx),
            "precision": stats.estimate(lambda i: R(hit_t, fired_t, i), idx),
            "fire_rate": stats.estimate(lambda i: R(fired_t, ones_t, i), idx),
            "fired_tokens": int(F[:, j].sum()), "caught_entities": int(E[:, j].sum()) if len(L) else 0}
    rate = float(F[:, K].mean()) if len(F) else 0.0
    exp_caught = stats.cluster_sums(1.0 - (1.0 - rate) ** L, ent_doc, docs) if len(L) else np.zeros(len(docs))
    out["random_control"] = {"rate": rate, "recall": stats.estimate(lambda i: R(exp_caught, ones_e, i), idx),
                             "precision": stats.estimate(lambda i: R(y_t, ones_t, i), idx)}
    w = stats.draw_weights(idx, len(docs))  # (reps, k) draws per document
    dpos = {d: i for i, d in enumerate(docs.tolist())}
    tok_di = np.array([dpos[d] for d in tok_doc.tolist()], np.int64)
    scores = {name: S[:, j] for j, name in enumerate(TRIGGER_NAMES)}
    if np.isfinite(C).any():
        scores["snapshot_confidence (low = risk)"] = -C
    scores.update({k: np.concatenate(v) for k, v in X.items()})
    out["auroc"] = {}
    for name, sc in scores.items():
        keep = ~np.isnan(sc)  # -inf (a trigger that cannot fire on the token) ranks lowest; NaN: no value
        v = signal_auroc(sc[keep], Y[keep])
        reps_v = np.array([signal_auroc(sc[keep], Y[keep], w[r][tok_di[keep]]) for r in range(min(reps, auroc_reps))])
        lo, hi = stats.percentile_ci(reps_v)
        out["auroc"][name] = {"value": v, "ci_lo": lo, "ci_hi": hi, "n_tokens": int(keep.sum())}
    return out
