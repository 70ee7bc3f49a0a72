"""Threshold calibration of the snapshot triggers: thresholds for a target share of triggering
tokens, from recorded greedy answers, with serving's own rules.

Callers: ``sfcl anchors calibrate`` (``sfcl.eval.calibrate``, which generates the answers and
trains the lookback model), the library builder's serving calibration (``sfcl.anchors.builder``),
and ``sfcl eval``. Everything that decides whether a token fires is the serving code:
``TokenRecords`` holds what the runner records per token (``ModelRunner(record_signals=True)``:
``StepSignals.record``; or ``records_from_tokens`` for a builder's own decode loop, which applies
the entity rule ``entity.span_states`` and the window rule ``triggers.window_mean``), and
``TokenRecords.signals`` / ``trigger_shares`` call ``triggers.trigger_signals``, ``fire`` and
``LookbackModel.score`` - the functions the runner calls on the device. CPU tensors here.

Threshold rule (documented default): the target share ``r`` (default 1/16 = 0.0625, the source
design's ratio of event-triggered checks to tokens, "1,427 -> 89" checks) is split *equally*
across the enabled triggers that can fire: one scalar q sets every trigger's cutoff so that this
trigger alone fires on a share q of the recorded tokens (``cutoffs_for_share``), and q is found by
bisection so that the union (a token that fires several triggers is looked up once) fires on r
(``calibrate_thresholds``). Limits: the entity trigger can never fire on more than the share of
tokens inside entity spans (a larger q leaves it at threshold 1.0 and the others take up the
rest); the surprisal trigger's |z| cutoff stays >= mean/std so that only *surprising* tokens fire
it (below that, the near-certain tokens that make up most of a greedy answer would, since their z
is about -mean/std); the lookback probability cutoff stays in (0, 1). The ``unsupported_number``
trigger has no threshold (it fires on a number the prompt lacks): it takes the share it fires on in
the recorded answers, and q shares out what remains of the target among the others.

Unseen documents: answers about one document resemble each other, so a rate met on average over
the calibration documents is missed on others about as often as not. Given each token's document,
``calibrate_thresholds`` sets the *95th percentile over document resamples* of the union share to
the target instead of its mean (``share_quantile``), so the thresholds keep a margin for documents
that run hotter. (The 90th percentile, used until 2026-12-03, left 31 unseen NDAs firing on 6.38%
against a 6.25% target: docs/fidelity.md.)

Which triggers share the budget: with labelled answers (``sfcl anchors calibrate``, ``sfcl eval``),
``select_triggers`` keeps only the triggers whose signal ranks unsupported-entity tokens above the
others (AUROC >= ``MIN_TRIGGER_AUROC`` on the calibration tokens; the lookback model by its
cross-validated AUROC, grouped by document, since its in-sample figure flatters it). A trigger
with no signal for the errors the budget is meant to catch would otherwise take an equal share of
it (on the dev NDAs the dispersion trigger, AUROC 0.36, fired on 2.2% of tokens and caught no
unsupported entity). The kept set is stored in the manifest (``calibration.enabled_triggers``,
read by ``TriggerConfig.from_calibration``). Without labels (the builder's calibration on corpus
text) all triggers stay enabled.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from sfcl.library.versions import resolve_library_dir
from sfcl.snapshot import entity
from sfcl.snapshot.lookback import LookbackModel
from sfcl.snapshot.source import number_support
from sfcl.snapshot.triggers import (RECORD_FEATURES_AT, RECORD_NUMBER_COL, TRIGGER_NAMES, Calibration, TriggerConfig, fire,
                                   trigger_signals, window_mean)

DEFAULT_TARGET = 1.0 / 16.0
DEFAULT_QUANTILE = 0.95  # of the union share over document resamples, set to the target
MIN_TRIGGER_AUROC = 0.6  # a trigger whose signal ranks unsupported-entity tokens worse than this gets no budget
_EPS = 1e-6


@dataclass(slots=True)
class TokenRecords:
    """Recorded trigger inputs of generated tokens (n rows; numpy, CPU).

    token_logp: float64 model log-probability (nats); in_entity: bool; d3: float64 windowed
    dispersion, NaN before the window is full; n_attended: float64 positions attended by the
    producing query; features: (n, F) float64 lookback features (``sfcl.snapshot.lookback``) or
    None; number: float64 ``unsupported_number`` signal (1.0 / 0.0 on number tokens, NaN elsewhere;
    None: all NaN). Raises ValueError for mismatched shapes or no rows."""

    token_logp: np.ndarray
    in_entity: np.ndarray
    d3: np.ndarray
    n_attended: np.ndarray
    features: np.ndarray | None = None
    number: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.token_logp = np.asarray(self.token_logp, np.float64)
        self.in_entity = np.asarray(self.in_entity, bool)
        self.d3 = np.asarray(self.d3, np.float64)
        self.n_attended = np.asarray(self.n_attended, np.float64)
        self.number = np.full(self.token_logp.shape, np.nan) if self.number is None else np.asarray(self.number, np.float64)
        n = self.token_logp.shape
        if self.token_logp.ndim != 1 or not (self.in_entity.shape == self.d3.shape == self.n_attended.shape
                                             == self.number.shape == n):
            raise ValueError("token_logp, in_entity, d3, n_attended and number must be 1-D arrays of one length")
        if self.features is not None:
            self.features = np.asarray(self.features, np.float64)
            if self.features.ndim != 2 or self.features.shape[0] != n[0]:
                raise ValueError("features must be (n, F)")
        if n[0] == 0:
            raise ValueError("no tokens to calibrate on")

    @property
    def n(self) -> int:
        return int(self.token_logp.size)

    @classmethod
    def from_rows(cls, rows: list[list[float]]) -> "TokenRecords":
        """From ``SeqResult.record`` rows (token logprob, in_entity, d3, n_attended, number check,
        features...; ``triggers.RECORD_FEATURES_AT``)."""
        a = np.asarray(rows, np.float64).reshape(len(rows), -1)
        f = RECORD_FEATURES_AT
        return cls(a[:, 0], a[:, 1] > 0.5, a[:, 2], a[:, 3], a[:, f:] if a.shape[1] > f else None, a[:, RECORD_NUMBER_COL])

    @classmethod
    def concat(cls, parts: list["TokenRecords"]) -> "TokenRecords":
        feats = [p.features for p in parts]
        return cls(*(np.concatenate([getattr(p, k) for p in parts]) for k in ("token_logp", "in_entity", "d3", "n_attended")),
                   np.concatenate(feats) if all(f is not None for f in feats) else None,
                   np.concatenate([p.number for p in parts]))

    def signals(self, cal: Calibration, lookback: LookbackModel | None = None) -> torch.Tensor:
        """(n, 5) float32 trigger signals (``triggers.trigger_signals``; the lookback probability
        from ``lookback.score`` when both a model and features are present)."""
        lp = torch.from_numpy(self.token_logp).float()
        lb = None
        if lookback is not None and self.features is not None:
            lb = lookback.score(torch.from_numpy(self.features).float())
        return trigger_signals(lp, torch.from_numpy(self.in_entity), torch.from_numpy(self.d3).float(),
                               torch.from_numpy(np.nan_to_num(self.n_attended, nan=0.0)).long(), lb, cal,
                               torch.from_numpy(self.number).float())


def records_from_tokens(tokens: list[int], logprobs: list[float], dispersion: list[float], classes: list[int],
                        window: int = 3, prompt_len: int = 0, source=None, canon: list | None = None) -> TokenRecords:
    """Records of one generated sequence from a decode loop that is not the runner's (the
    builder's): the entity rule (``entity.span_states``, from a sentence end), the window
    rule (``triggers.window_mean``) and, given the prompt's ``source.SourceIndex`` and the
    ``canonical_table`` ``canon``, the number check (``source.number_support``) of serving; the
    i-th token (0-based) came from a query attending prompt_len + i positions. classes: class bits
    per token id."""
    n = len(tokens)
    states = entity.span_states(tokens, classes)
    d = torch.tensor(dispersion, dtype=torch.float32)
    hist = torch.cat([torch.zeros(window - 1), d]).unfold(0, window, 1)  # (n, window): the runner's window, newest last
    d3 = window_mean(hist, torch.arange(1, n + 1).clamp_max(window), window)
    number = None
    if source is not None and canon:
        number = [number_support(source, tokens[:i], t, canon) for i, t in enumerate(tokens)]
    return TokenRecords(logprobs, [bool(s & entity.IN_ENTITY) for s in states], d3.double().numpy(),
                        prompt_len + np.arange(n, dtype=np.float64), number=number)


def trigger_shares(signals: torch.Tensor, cfg: TriggerConfig) -> dict:
    """{"union": share of tokens firing any trigger, <trigger name>: share firing that one}
    under ``cfg`` (``triggers.fire``)."""
    m = fire(signals, cfg)
    return {"union": float(m.any(1).float().mean()), **{n: float(m[:, j].float().mean()) for j, n in enumerate(TRIGGER_NAMES)}}


def _upper_cut(values: torch.Tensor, k: int) -> float:
    """A cutoff with exactly the k largest finite ``values`` strictly above it (ties aside)."""
    v = values[torch.isfinite(values)].double().sort(descending=True).values
    if v.numel() == 0:
        return float("inf")
    if k <= 0:
        return float(v[0]) + 1.0
    if k >= v.numel():
        return float(v[-1]) - 1.0
    return float((v[k - 1] + v[k]) / 2.0)


def cutoffs_for_share(signals: torch.Tensor, cal: Calibration, q: float) -> dict:
    """Thresholds (``TriggerConfig`` fields) with which each trigger alone fires on about ``q``
    of all tokens (0 <= q <= 1), within the configuration's limits (a trigger whose signal cannot
    reach share q fires less)."""
    if not 0.0 <= q <= 1.0:
        raise ValueError("share q must be in [0, 1]")
    k = int(round(q * signals.shape[0]))
    c = [_upper_cut(signals[:, j], k) for j in range(signals.shape[1])]
    thr = TriggerConfig.thresholds_from_cutoffs(c)
    return {"entity_prob_threshold": float(min(1.0, max(_EPS, thr["entity_prob_threshold"]))),
            "dispersion_z": float(min(1e9, max(_EPS, thr["dispersion_z"]))),
            "surprisal_z": float(min(1e9, max(thr["surprisal_z"], cal.surprisal_mean / cal.surprisal_std * (1 + 1e-9),
                                              _EPS))),
            "lookback_threshold": float(min(1 - _EPS, max(_EPS, thr["lookback_threshold"])))}


@dataclass(slots=True)
class ThresholdResult:
    thresholds: dict  # TriggerConfig fields (THRESHOLD_KEYS)
    target: float  # requested share of triggering tokens
    achieved: float  # share of the recorded tokens the thresholds fire on (union)
    per_trigger: dict  # share per trigger name
    q: float  # the per-trigger share the bisection settled on
    n_tokens: int
    upper: float | None = None  # with documents: the ``quantile`` of the union share over document resamples


def share_quantile(fired: torch.Tensor, groups: list, quantile: float, reps: int = 400, seed: int = 0) -> float:
    """The ``quantile`` of the union share over resamples of whole documents: fired (n,) bool per
    token, groups (n,) document ids. What a set of unseen documents like these may show."""
    ids = {g: i for i, g in enumerate(dict.fromkeys(groups))}
    g = torch.tensor([ids[x] for x in groups])
    k = len(ids)
    fire_d = torch.zeros(k).index_add_(0, g, fired.float())  # (k,) fired tokens per document
    tok_d = torch.zeros(k).index_add_(0, g, torch.ones(len(groups)))  # (k,) tokens per document
    draw = torch.randint(0, k, (reps, k), generator=torch.Generator().manual_seed(seed))  # (reps, k)
    return float(torch.quantile(fire_d[draw].sum(1) / tok_d[draw].sum(1), quantile))


def calibrate_thresholds(signals: torch.Tensor, cal: Calibration, target: float = DEFAULT_TARGET,
                         enabled=TRIGGER_NAMES, window: int = 3, iters: int = 50,
                         groups: list | None = None, quantile: float = DEFAULT_QUANTILE) -> ThresholdResult:
    """Bisection on the per-trigger share q (equal split across the enabled triggers; shares are
    non-decreasing in q) so that the union fires on ``target`` of the tokens - or, with
    ``groups`` (the document of each token), so that the ``quantile`` of the union share over
    document resamples is ``target``: thresholds meant to hold on unseen documents keep a margin
    for how much documents differ. signals: (n, 5) ``TokenRecords.signals``. Raises ValueError
    when target is not in (0, 1) or groups has the wrong length."""
    if not 0.0 < target < 1.0:
        raise ValueError("target rate must be in (0, 1)")
    if groups is not None and len(groups) != signals.shape[0]:
        raise ValueError("groups must name the document of every token")

    def cfg(q: float) -> TriggerConfig:
        return TriggerConfig(**cutoffs_for_share(signals, cal, q), dispersion_window=window, enabled=tuple(enabled))

    def stat(c: TriggerConfig) -> float:
        if groups is None:
            return trigger_shares(signals, c)["union"]
        return share_quantile(fire(signals, c).any(1), groups, quantile)

    lo, hi = 0.0, 1.0
    best = (float("inf"), 0.0)
    for _ in range(iters):
        q = (lo + hi) / 2.0
        u = stat(cfg(q))
        best = min(best, (abs(u - target), q))
        if u < target:
            lo = q
        else:
            hi = q
    q = best[1]
    c = cfg(q)
    sh = trigger_shares(signals, c)
    return ThresholdResult(thresholds=c.thresholds(), target=target, achieved=sh["union"],
                           per_trigger={n: sh[n] for n in TRIGGER_NAMES}, q=q, n_tokens=int(signals.shape[0]),
                           upper=stat(c) if groups is not None else None)


def signal_auroc(score: np.ndarray, y: np.ndarray, w: np.ndarray | None = None) -> float:
    """AUROC of a per-token signal (n,) float for labels y (n,) bool (``sklearn.metrics.roc_auc_score``),
    with optional token weights w (n,). -inf (a trigger that cannot fire on the token) ranks below
    every finite value; NaN when y holds one class only."""
    from sklearn.metrics import roc_auc_score

    score, y = np.asarray(score, np.float64), np.asarray(y, bool)
    ok = np.isfinite(score)
    s = np.where(ok, score, (score[ok].min() - 1.0) if ok.any() else 0.0)
    if w is not None:
        keep = w > 0
        s, y, w = s[keep], y[keep], w[keep]
    if y.size == 0 or y.min() == y.max():
        return float("nan")
    return float(roc_auc_score(y, s, sample_weight=w))


def select_triggers(signals: torch.Tensor, unsupported: np.ndarray, enabled=TRIGGER_NAMES,
                    lookback_cv_auroc: float | None = None,
                    min_auroc: float = MIN_TRIGGER_AUROC) -> tuple[tuple[str, ...], dict]:
    """The triggers of ``enabled`` that get a share of the lookup budget: those whose signal
    (column of ``signals`` (n, 5), ``TokenRecords.signals``) has AUROC >= ``min_auroc`` for
    ``unsupported`` (n,) bool = "this token belongs to an entity the source does not support".
    The lookback trigger is judged by ``lookback_cv_auroc`` (its model's cross-validated figure,
    grouped by document) when given. Returns (kept names in TRIGGER_NAMES order, {name: AUROC or
    NaN}). When no trigger qualifies (e.g. no unsupported token in the answers), all of
    ``enabled`` are kept: the budget is still spent, on the rule without labels."""
    y = np.asarray(unsupported, bool)
    if y.shape != (signals.shape[0],):
        raise ValueError("unsupported must label every row of signals")
    sig = signals.double().numpy()
    auc = {n: signal_auroc(sig[:, j], y) for j, n in enumerate(TRIGGER_NAMES)}
    if lookback_cv_auroc is not None:
        auc["lookback_ratio"] = float(lookback_cv_auroc)
    keep = tuple(n for n in TRIGGER_NAMES if n in enabled and np.isfinite(sig[:, TRIGGER_NAMES.index(n)]).any()
                 and auc[n] >= min_auroc)
    return (keep or tuple(n for n in TRIGGER_NAMES if n in enabled)), auc


def write_library(src: Path, out: Path, calibration: dict) -> Path:
    """Copy library ``src`` to ``out`` (must not exist or be empty) with ``calibration`` entries
    (``thresholds``, ``dispersion_by_length``, ``lookback``, ``threshold_calibration``, ...)
    merged into its manifest's ``calibration``. ``src`` may be a library root (``sfcl anchors
    build --out``): its current version is copied (``resolve_library_dir``), as serving it would
    load that one. The data files and their checksums are unchanged.
    Raises FileExistsError when ``out`` holds files, AnchorLibraryError for a root whose CURRENT
    names no version."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not empty; write the calibrated library to a new directory")
    src = resolve_library_dir(src)
    if out.exists():
        out.rmdir()
    shutil.copytree(src, out)
    mf = out / "manifest.json"
    m = json.loads(mf.read_text(encoding="utf-8"))
    cal = dict(m.get("calibration") or {})
    cal.update(calibration)
    if "threshold_calibration" in cal:
        cal["threshold_calibration"] = {**cal["threshold_calibration"], "derived_from": str(src),
                                        "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    m["calibration"] = cal
    mf.write_text(json.dumps(m, indent=2), encoding="utf-8")
    return out
