"""``sfcl anchors calibrate LIB CORPUS``: the lookback model and trigger thresholds of a library,
from greedy answers to questions generated from CORPUS.

Callers: the CLI, and ``sfcl eval`` (which calibrates on other documents than it evaluates).
Steps (``calibrate``):

1. greedy answers to questions generated from CORPUS (``sfcl.eval.questions``, the serving prompt
   format), through the real engine with ``ModelRunner(record_signals=True)``: every generated
   token carries the trigger inputs the runner computed (``sfcl.snapshot.calibration.TokenRecords``);
2. every token is labelled "inside an entity the document does not support" (``sfcl.eval.labels``,
   the scorer's entities);
3. the lookback model (``sfcl.snapshot.lookback.train``: scikit-learn logistic regression, ratios
   only and ratios + token features, cross-validated by document; the better one is kept);
4. the D3 statistics per attended length are re-measured on these answers
   (``calibration.dispersion_by_length``: teacher-forced corpus text is a poor reference) and the
   thresholds set with serving's rules: the triggers whose signal separates the unsupported-entity
   tokens get the budget (``sfcl.snapshot.calibration.select_triggers``), and their thresholds are
   set (``calibrate_thresholds``) so that the 95th percentile over document resamples of the share
   of triggering tokens is the target (a margin for unseen documents).

Why generated tokens: the server sees greedy *answers*, whose surprisal is much lower than that
of teacher-forced corpus text, so thresholds set on corpus text rarely fire in serving.

The result is written into a *copy* of LIB (``--out``): ``manifest.json`` gains
``calibration.thresholds``, ``calibration.lookback`` and ``calibration.threshold_calibration``; the
data files and checksums are unchanged. An optional sweep answers a few questions in
``triggered`` mode with the default steering at several target shares and plots lookups per 1,000
tokens against entity-consistency error (``calibration.png``).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from sfcl.eval.drive import EngineSpec
from sfcl.snapshot.calibration import (DEFAULT_QUANTILE, DEFAULT_TARGET, MIN_TRIGGER_AUROC, TokenRecords, calibrate_thresholds,
                                       select_triggers, trigger_shares, write_library)
from sfcl.snapshot.lookback import RATIO_ONLY, WITH_TOKEN, LookbackModel, feature_names, train
from sfcl.snapshot.triggers import TRIGGER_NAMES, Calibration, TriggerConfig, dispersion_length_table


@dataclass(slots=True)
class CalibrationRun:
    entries: dict  # manifest ``calibration`` entries (thresholds, dispersion_by_length, lookback, ...)
    report: dict  # figures for calibration.json / eval.json
    signals: torch.Tensor  # (n, 5) trigger signals of the recorded tokens under the new calibration
    cal: Calibration  # the new signal statistics
    groups: list  # (n,) the document of each recorded token
    models: dict = field(default_factory=dict)  # lookback fits by feature subset (the kept one is in entries)


def calibrate(eng, library, items, target: float = DEFAULT_TARGET, desc: str = "calibrate: answers") -> CalibrationRun:
    """Run ``items`` greedily (observe-only), label their tokens, train the lookback model and
    set the thresholds. Raises ValueError when the answers give no token to calibrate on."""
    from sfcl.eval.drive import TokenRecorder, run_items
    from sfcl.eval.labels import label_answer
    from sfcl.eval.scorer import Source

    runner = eng.engine.runner
    snap = runner.snapshotter
    with TokenRecorder(runner) as rec:
        recs, wall = run_items(eng, items, snapshot_mode="off", desc=desc)
    rec.fill(recs)
    parts, ys, groups = [], [], []
    for it, r in zip(items, recs):
        if not r.records:
            continue
        lab = label_answer(eng.tokenizer, r.token_ids, Source.of(it.meta["source"]))
        parts.append(TokenRecords.from_rows(r.records))
        ys.append(np.asarray(lab.token_unsupported[:len(r.records)] + [False] * (len(r.records) - len(lab.token_unsupported)),
                             np.int64))
        groups += [it.meta["question"].doc_id] * len(r.records)
    if not parts:
        raise ValueError("the calibration answers have no generated token")
    recs_all = TokenRecords.concat(parts)
    y, groups = np.concatenate(ys), np.array(groups)
    try:  # D3 statistics per attended length, from the answers themselves
        table = dispersion_length_table(recs_all.d3, recs_all.n_attended, source="greedy answers to generated questions")
    except ValueError:  # too few tokens for any bucket: keep the library's statistics
        table = None
    cal = Calibration.from_dict({**library.calibration, **({"dispersion_by_length": table} if table else {})})
    model, fits = None, {}
    if recs_all.features is not None:
        names = feature_names(runner.model.a.n_heads)
        for subset in (RATIO_ONLY, WITH_TOKEN):
            try:
                fits[subset] = train(recs_all.features, y, groups, names, subset)
            except ValueError as e:  # too few positive tokens: no lookback trigger
                print(f"sfcl calibrate: lookback model ({subset}) not trained: {e}", file=sys.stderr)
        scored = [m for m in fits.values() if m.training.get("cv_auroc_by_document") is not None]
        if scored:
            model = max(scored, key=lambda m: m.training["cv_auroc_by_document"])
            model.training["compared"] = {k: m.training["cv_auroc_by_document"] for k, m in fits.items()}
    signals = recs_all.signals(cal, model)
    enabled, aurocs = select_triggers(signals, y > 0, TRIGGER_NAMES,  # all five: a recalibration judges each anew
                                      model.training["cv_auroc_by_document"] if model is not None else None)
    res = calibrate_thresholds(signals, cal, target, enabled, snap.cfg.dispersion_window, groups=groups.tolist())
    default = trigger_shares(signals, TriggerConfig())
    entries = {"thresholds": res.thresholds, "enabled_triggers": list(enabled),
               "threshold_calibration": {
                   "target_rate": res.target, "achieved_rate": res.achieved, "per_trigger_rate": res.per_trigger,
                   "per_trigger_share_q": res.q, "n_tokens": res.n_tokens, "items": len(items),
                   "rate_quantile_over_documents": {"quantile": DEFAULT_QUANTILE, "value": res.upper},
                   "trigger_auroc": aurocs, "min_trigger_auroc": MIN_TRIGGER_AUROC,
                   "documents": len(set(groups.tolist())), "unsupported_entity_tokens": int(y.sum()),
                   "default_thresholds_rate": default["union"],
                   "rule": "equal per-trigger share among the enabled triggers, union quantile = target",
                   "signals": "greedy answers to generated questions (ModelRunner record_signals)"}}
    if table:
        entries["dispersion_by_length"] = table
    if model is not None:
        entries["lookback"] = model.to_dict()
    report = {"thresholds": res.thresholds, "enabled_triggers": list(enabled), "trigger_auroc": aurocs,
              "target_rate": res.target, "achieved_rate": res.achieved,
              "rate_quantile_over_documents": {"quantile": DEFAULT_QUANTILE, "value": res.upper},
              "per_trigger_rate": res.per_trigger, "n_tokens": res.n_tokens, "rate_with_default_thresholds": default,
              "lookback": {k: m.training for k, m in fits.items()}, "wall_s": wall}
    return CalibrationRun(entries, report, signals, cal, groups.tolist(), fits)


def plot_tradeoff(points: list[dict], path: Path, chosen: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    x = [p["lookups_per_1k_tokens"] for p in points]
    y = [100 * p["entity_error_rate"]["value"] for p in points]
    lo = [100 * p["entity_error_rate"]["ci_lo"] for p in points]
    hi = [100 * p["entity_error_rate"]["ci_hi"] for p in points]
    ax.errorbar(x, y, yerr=np.nan_to_num(np.array([np.subtract(y, lo), np.subtract(hi, y)]).clip(min=0)),
                marker="o", capsize=3)
    for p, xi, yi in zip(points, x, y):
        ax.annotate(f"{p['target_rate']:.3g}" + (" (chosen)" if abs(p["target_rate"] - chosen) < 1e-12 else ""),
                    (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("anchor lookups per 1,000 generated tokens (triggered + default steering)")
    ax.set_ylabel("entity-consistency error (%)")
    ax.set_title("trigger threshold sweep (labels: target share of tokens)", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _float_list(text: str) -> list[float]:
    try:
        vals = [float(t) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise ValueError(f"--sweep: {e}") from e
    if any(not 0 < v < 1 for v in vals):
        raise ValueError("--sweep shares must be in (0, 1)")
    return vals


@dataclass(kw_only=True)
class CalibrateConfig(EngineSpec):
    """``sfcl anchors calibrate`` (fields = the command's flags; ``anchors`` is the library read)."""

    library: str  # library directory to calibrate (left unchanged)
    corpus: list[str]  # documents to generate questions from
    out: str  # new library directory
    target_rate: float
    docs: int  # first N documents
    questions_per_doc: int
    max_tokens: int
    max_doc_tokens: int
    sweep: str  # comma-separated target shares ("" = none)
    sweep_items: int
    seed: int


def run_calibrate(a: CalibrateConfig) -> int:
    """Calibrate ``a.library`` on ``a.corpus`` and write the copy with thresholds and lookback model
    to ``a.out`` (+ calibration.json, calibration.png with a sweep). Returns 0. Raises ValueError,
    FileExistsError (``a.out`` not empty)."""
    from sfcl.anchors.corpus import read_corpus
    from sfcl.eval import stats
    from sfcl.eval.drive import build, run_items
    from sfcl.eval.run import build_items, score

    if not 0 < a.target_rate < 1:
        raise ValueError("--target-rate must be in (0, 1)")
    sweep = _float_list(a.sweep) if a.sweep else []
    out = Path(a.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not empty; write the calibrated library to a new directory")
    docs = read_corpus(a.corpus)[: a.docs]
    if not docs:
        raise ValueError("the corpus has no documents")
    built = build(a)
    eng = built.engine
    snap = eng.engine.runner.snapshotter
    try:
        if snap is None:
            raise ValueError(f"{a.library}: no snapshotter (library failed to load)")
        budget = min(a.max_doc_tokens, eng.max_model_len - a.max_tokens - 256)
        items, _ = build_items(docs, eng.tokenizer, eng.encode_chat, questions_per_doc=a.questions_per_doc, seed=a.seed,
                               max_tokens=a.max_tokens, summary_tokens=a.max_tokens, max_doc_tokens=budget, summary=True)
        run = calibrate(eng, built.library, items, a.target_rate)
        entries, report = run.entries, run.report
        snap.cal = run.cal  # the sweep runs with the new statistics and lookback model
        if "lookback" in entries:
            snap.lookback = LookbackModel.from_dict(entries["lookback"])
        points = []
        sweep_items = items[: a.sweep_items]
        for r_ in sorted(set(sweep + [a.target_rate])) if sweep else []:
            thr = calibrate_thresholds(run.signals, run.cal, r_, entries["enabled_triggers"], snap.cfg.dispersion_window,
                                       groups=run.groups).thresholds
            snap.cfg = TriggerConfig.from_calibration({**entries, "thresholds": thr}, snap.cfg.dispersion_window)
            rs, _ = run_items(eng, sweep_items, snapshot_mode="triggered", steer=True, desc=f"sweep {r_:.3g}")
            c = score(sweep_items, rs)
            idx = stats.bootstrap_indices(len(sweep_items), 1000, a.seed)
            points.append({"target_rate": r_, "thresholds": thr,
                           "lookups_per_1k_tokens": stats.ratio_of_sums(c["lookups"], c["tokens"], None, 1000.0),
                           "entity_error_rate": stats.estimate(
                               lambda i, c=c: stats.ratio_of_sums(c["unsupported"], c["entities"], i), idx),
                           "answer_accuracy": stats.ratio_of_sums(c["correct"], c["is_qa"])})
    finally:
        eng.shutdown()
    entries["threshold_calibration"].update({"corpus": [str(c) for c in a.corpus], "docs": len(docs)})
    write_library(Path(a.library), out, entries)
    report["sweep"] = points
    (out / "calibration.json").write_text(json.dumps(report, indent=1, default=float))
    if points:
        plot_tradeoff(points, out / "calibration.png", a.target_rate)
    t, sh = report["thresholds"], report["per_trigger_rate"]
    print(f"sfcl anchors calibrate: {report['n_tokens']} generated tokens from {len(items)} answers; default thresholds "
          f"fire on {100 * report['rate_with_default_thresholds']['union']:.2f}% of tokens; calibrated "
          f"({', '.join(f'{k} {v:.4g}' for k, v in t.items())}) fire on {100 * report['achieved_rate']:.2f}% "
          f"(target {100 * report['target_rate']:.2f}%: " + ", ".join(f"{k} {100 * v:.2f}%" for k, v in sh.items()) + ")")
    for k, f in report["lookback"].items():
        print(f"  lookback model ({k}): cross-validated AUROC by document {f['cv_auroc_by_document']}, "
              f"{f['n_positive']} positive of {f['n_tokens']} tokens")
    for p in points:
        e = p["entity_error_rate"]
        print(f"  sweep {p['target_rate']:.4g}: {p['lookups_per_1k_tokens']:.1f} lookups/1k tok, "
              f"entity error {100 * e['value']:.1f}% [{100 * e['ci_lo']:.1f}, {100 * e['ci_hi']:.1f}]")
    print(f"sfcl anchors calibrate: wrote {out} (manifest calibration.thresholds, calibration.json"
          f"{', calibration.png' if points else ''})", file=sys.stderr)
    return 0
