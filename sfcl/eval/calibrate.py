"""``sfcl anchors calibrate LIB CORPUS``: trigger thresholds for a target share of triggering tokens.

Callers: the CLI. Signals are recorded from the real engine (CPU/GPU as configured) and the
threshold search runs in numpy on the CPU.

Why generated tokens: the builder's calibration statistics (surprisal and 3-token dispersion
mean/std) come from teacher-forced corpus text, but the server sees greedy *answers*, whose
surprisal is much lower (the model picks its own most likely token), so z-thresholds set on corpus
text rarely fire in serving. Calibration therefore records the per-token signals of greedy answers
to questions generated from CORPUS (``sfcl.eval.questions``), with the serving prompt format:
token probability p, surprisal s = -log p, the snapshot layer's attention dispersion and its
3-token mean D3, and the entity-span flag (``sfcl.snapshot.entity``) - exactly what the runner
computes per step.

Threshold rule (documented default): the target share ``r`` (default 1/16 = 0.0625, the source
design's ratio of event-triggered checks to tokens, "1,427 -> 89" checks) is split *equally*
across the enabled triggers: one scalar q sets every trigger's threshold so that this trigger
alone fires on a share q of the recorded tokens (``thresholds_for_share``), and q is found by
bisection so that the union (a token that fires several triggers is looked up once) fires on r
(``calibrate_thresholds``). The dispersion statistics per attended length
(``calibration.dispersion_by_length``, ``sfcl.snapshot.triggers``) are re-measured on the recorded
answers (normalised attention entropy depends on the attended length and on the prompt format, so
teacher-forced corpus text is a poor reference); the flat corpus mean/std stay as they are, and the
thresholds change (``dispersion_z``, ``surprisal_z`` in those z units, ``entity_prob_threshold``
as a probability). The entity trigger can never fire on more than the share of tokens inside
entity spans; a larger q leaves it at threshold 1.0 and the other triggers take up the rest. The
surprisal trigger reads |z|; its threshold is kept >= mean/std so that only *surprising* tokens
fire it (below that, the near-certain tokens that make up most of a greedy answer would fire, since
their z is about -mean/std).

The new thresholds are written into a *copy* of LIB (``--out``): ``manifest.json`` gains
``calibration.thresholds`` (read by ``sfcl.snapshot.triggers.TriggerConfig.from_calibration`` when
the server loads the library) and ``calibration.threshold_calibration`` (target, achieved share,
per-trigger shares, token count, corpus). The data files and their checksums are unchanged.

The trade-off curve: for each share in ``--sweep`` the thresholds are applied to the running
engine and a small question set is answered in ``triggered`` mode with steering on; lookups per
1,000 tokens vs entity-consistency error (``sfcl.eval.scorer``) go to ``calibration.png``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from sfcl.snapshot.triggers import TRIGGER_NAMES, Calibration, dispersion_length_table

DEFAULT_TARGET = 1.0 / 16.0
_EPS = 1e-6


@dataclass(slots=True)
class TokenSignals:
    """Per-token trigger signals of generated tokens (all (n,) numpy arrays, CPU).

    surprisal: float64 nats (-log p); d3: float64 mean dispersion of the last 3 tokens, NaN where
    fewer than 3 tokens of the sequence were generated; in_entity: bool, token inside an
    entity-like span; n_attended: float64 positions attended by the query that produced the token
    (prompt length + tokens generated before it; NaN when unknown -> flat dispersion statistics).
    """

    surprisal: np.ndarray
    d3: np.ndarray
    in_entity: np.ndarray
    n_attended: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.surprisal = np.asarray(self.surprisal, np.float64)
        self.d3 = np.asarray(self.d3, np.float64)
        self.in_entity = np.asarray(self.in_entity, bool)
        self.n_attended = np.full(self.surprisal.shape, np.nan) if self.n_attended is None else \
            np.asarray(self.n_attended, np.float64)
        if not (self.surprisal.shape == self.d3.shape == self.in_entity.shape == self.n_attended.shape) \
                or self.surprisal.ndim != 1:
            raise ValueError("surprisal, d3, in_entity and n_attended must be 1-D arrays of one length")
        if self.surprisal.size == 0:
            raise ValueError("no tokens to calibrate on")

    @property
    def n(self) -> int:
        return int(self.surprisal.size)

    @classmethod
    def concat(cls, parts: list["TokenSignals"]) -> "TokenSignals":
        return cls(np.concatenate([p.surprisal for p in parts]), np.concatenate([p.d3 for p in parts]),
                   np.concatenate([p.in_entity for p in parts]), np.concatenate([p.n_attended for p in parts]))

    def dispersion_z(self, cal: Calibration) -> np.ndarray:
        """(n,) z-score of D3 under ``cal`` at each token's attended length (NaN where D3 is
        undefined); tokens with unknown length use the flat statistics."""
        mu, sd = cal.dispersion_stats_np(np.nan_to_num(self.n_attended, nan=0.0))
        known = np.isfinite(self.n_attended)
        mu = np.where(known, mu, cal.dispersion_mean)
        sd = np.where(known, sd, cal.dispersion_std)
        return (self.d3 - mu) / sd


def fire_masks(sig: TokenSignals, cal: Calibration, thr: dict, enabled=TRIGGER_NAMES) -> np.ndarray:
    """(n, 3) bool, TRIGGER_NAMES order, with the runner's rules (``sfcl.snapshot.triggers``):
    entity: in_entity & p < entity_prob_threshold; dispersion: (D3 - mu(n))/sigma(n) > dispersion_z
    (never where D3 is undefined); surprisal: |s - mu|/sigma > surprisal_z."""
    p = np.exp(-sig.surprisal)
    with np.errstate(invalid="ignore"):
        dz = sig.dispersion_z(cal)
        m = np.stack([sig.in_entity & (p < thr["entity_prob_threshold"]),
                      np.nan_to_num(dz, nan=-np.inf) > thr["dispersion_z"],
                      np.abs(sig.surprisal - cal.surprisal_mean) / cal.surprisal_std > thr["surprisal_z"]], 1)
    return m & np.array([n in enabled for n in TRIGGER_NAMES])


def trigger_shares(sig: TokenSignals, cal: Calibration, thr: dict, enabled=TRIGGER_NAMES) -> dict:
    """{"union": share of tokens firing any trigger, <trigger name>: share firing that one}."""
    m = fire_masks(sig, cal, thr, enabled)
    return {"union": float(m.any(1).mean()), **{n: float(m[:, j].mean()) for j, n in enumerate(TRIGGER_NAMES)}}


def _upper_cut(values: np.ndarray, k: int) -> float:
    """A threshold t with exactly the k largest of ``values`` strictly above it (ties aside)."""
    v = np.sort(values)[::-1]
    if k <= 0:
        return float(v[0]) + 1.0 if v.size else 1.0
    if k >= v.size:
        return float(v[-1]) - 1.0
    return float((v[k - 1] + v[k]) / 2.0)


def thresholds_for_share(sig: TokenSignals, cal: Calibration, q: float) -> dict:
    """Thresholds with which each trigger alone fires on about ``q`` of all tokens (0 <= q <= 1).

    Limits of the configuration (``TriggerConfig`` validation) are respected: z thresholds are
    kept > 0 and the entity probability threshold in (0, 1], so a trigger whose signal cannot reach
    share q fires less."""
    if not 0.0 <= q <= 1.0:
        raise ValueError("share q must be in [0, 1]")
    k = int(round(q * sig.n))
    p_ent = np.exp(-sig.surprisal[sig.in_entity])
    ent = -_upper_cut(-p_ent, k) if p_ent.size else _EPS  # the k smallest p lie below the cut
    dz = sig.dispersion_z(cal)
    dz = dz[np.isfinite(dz)]
    disp = _upper_cut(dz, k) if dz.size else 1e9
    sz = np.abs(sig.surprisal - cal.surprisal_mean) / cal.surprisal_std
    # One-sided: the trigger reads |z|, and below |z| = mean/std the lower tail (p close to 1, the
    # bulk of a greedy answer) would fire; keeping the threshold at or above mean/std means only
    # surprising tokens can fire (surprisal is >= 0, so z >= -mean/std).
    sur = max(_upper_cut(sz, k), cal.surprisal_mean / cal.surprisal_std * (1 + 1e-9))
    return {"entity_prob_threshold": float(min(1.0, max(_EPS, ent))),
            "dispersion_z": float(max(_EPS, disp)), "surprisal_z": float(max(_EPS, sur))}


@dataclass(slots=True)
class ThresholdResult:
    thresholds: dict  # TriggerConfig fields: entity_prob_threshold, dispersion_z, surprisal_z
    target: float  # requested share of triggering tokens
    achieved: float  # share of the recorded tokens the thresholds fire on (union)
    per_trigger: dict  # share per trigger name
    q: float  # the per-trigger share the bisection settled on
    n_tokens: int


def calibrate_thresholds(sig: TokenSignals, cal: Calibration, target: float = DEFAULT_TARGET,
                         enabled=TRIGGER_NAMES, iters: int = 50) -> ThresholdResult:
    """Bisection on the per-trigger share q so that the union fires on ``target`` of the tokens
    (equal split across the enabled triggers; the union share is non-decreasing in q).
    Raises ValueError when target is not in (0, 1)."""
    if not 0.0 < target < 1.0:
        raise ValueError("target rate must be in (0, 1)")
    lo, hi = 0.0, 1.0
    best = (float("inf"), 0.0)
    for _ in range(iters):
        q = (lo + hi) / 2.0
        u = trigger_shares(sig, cal, thresholds_for_share(sig, cal, q), enabled)["union"]
        best = min(best, (abs(u - target), q))
        if u < target:
            lo = q
        else:
            hi = q
    q = best[1]
    thr = thresholds_for_share(sig, cal, q)
    sh = trigger_shares(sig, cal, thr, enabled)
    return ThresholdResult(thresholds=thr, target=target, achieved=sh["union"],
                           per_trigger={n: sh[n] for n in TRIGGER_NAMES}, q=q, n_tokens=sig.n)


def signals_from_tokens(tokens: list[int], logprobs: list[float], dispersion: list[float], class_table: np.ndarray,
                        window: int = 3, prompt_len: int | None = None) -> TokenSignals:
    """Signals of one generated sequence, computed as the runner does (entity state starts at a
    sentence end, D3 defined from the ``window``-th token on; the i-th generated token (0-based)
    came from a query attending prompt_len + i positions; unknown when prompt_len is None)."""
    from sfcl.snapshot import entity

    n = len(tokens)
    d = np.asarray(dispersion, np.float64)
    d3 = np.full(n, np.nan)
    if n >= window:
        c = np.convolve(d, np.ones(window) / window, mode="valid")  # c[j] = mean d[j..j+w-1]
        d3[window - 1:] = c
    ins = np.zeros(n, bool)
    prev = entity.SENT_END
    for i, t in enumerate(tokens):
        c_ = int(class_table[t])
        strong = (c_ & (entity.DIGIT | entity.CURRENCY | entity.MONTH | entity.REFWORD)) != 0
        name = (c_ & entity.CAP) != 0 and (prev & entity.SENT_END) == 0
        cont = (c_ & entity.CONT) != 0 and (prev & entity.IN_ENTITY) != 0
        ins[i] = strong or name or cont
        prev = (entity.IN_ENTITY if ins[i] else 0) | (c_ & entity.SENT_END)
    natt = np.full(n, np.nan) if prompt_len is None else prompt_len + np.arange(n, dtype=np.float64)
    return TokenSignals(-np.asarray(logprobs, np.float64), d3, ins, natt)


class SignalRecorder:
    """Wraps a ``ModelRunner.execute`` and keeps (token, logprob, dispersion) per request id.

    Install with ``runner.execute = SignalRecorder(runner.execute)`` while no request runs; it runs
    on the engine thread; read ``seqs`` once the requests finished."""

    def __init__(self, execute):
        self.execute = execute
        self.seqs: dict[str, tuple[list[int], list[float], list[float]]] = {}

    def __call__(self, plan):
        out = self.execute(plan)
        for rid, r in out.results.items():
            t, lp, d = self.seqs.setdefault(rid, ([], [], []))
            t.append(r.token_id)
            lp.append(r.logprob)
            d.append(r.dispersion)
        return out


def write_library(src: Path, out: Path, res: ThresholdResult, corpus: list[str], extra: dict,
                  length_table: dict | None = None) -> Path:
    """Copy library ``src`` to ``out`` (must not exist or be empty) with the thresholds (and, when
    given, the per-length dispersion table) in the manifest. Raises FileExistsError when ``out``
    holds files."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not empty; write the calibrated library to a new directory")
    if out.exists():
        out.rmdir()
    shutil.copytree(src, out)
    mf = out / "manifest.json"
    m = json.loads(mf.read_text(encoding="utf-8"))
    cal = dict(m.get("calibration") or {})
    cal["thresholds"] = res.thresholds
    if length_table:
        cal["dispersion_by_length"] = length_table
    cal["threshold_calibration"] = {
        "target_rate": res.target, "achieved_rate": res.achieved, "per_trigger_rate": res.per_trigger,
        "per_trigger_share_q": res.q, "n_tokens": res.n_tokens, "rule": "equal per-trigger share, union = target",
        "signals": "greedy answers to generated questions", "corpus": corpus, "derived_from": str(src),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), **extra}
    m["calibration"] = cal
    mf.write_text(json.dumps(m, indent=2), encoding="utf-8")
    return out


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
    ax.set_xlabel("anchor lookups per 1,000 generated tokens (triggered + steering)")
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


def cmd_calibrate(a: argparse.Namespace) -> int:
    from sfcl.anchors.corpus import read_corpus
    from sfcl.eval import stats
    from sfcl.eval.drive import build, run_items
    from sfcl.eval.run import build_items, score
    from sfcl.snapshot.triggers import TriggerConfig

    if not 0 < a.target_rate < 1:
        raise ValueError("--target-rate must be in (0, 1)")
    sweep = _float_list(a.sweep) if a.sweep else []
    out = Path(a.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not empty; write the calibrated library to a new directory")
    docs = read_corpus(a.corpus)[: a.docs]
    if not docs:
        raise ValueError("the corpus has no documents")
    a.anchors = a.library
    built = build(a)
    eng = built.engine
    runner = eng.engine.runner
    snap = runner.snapshotter
    try:
        if snap is None:
            raise ValueError(f"{a.library}: no snapshotter (library failed to load)")
        budget = min(a.max_doc_tokens, eng.max_model_len - a.max_tokens - 256)
        items, _ = build_items(docs, eng.tokenizer, eng.encode_chat, questions_per_doc=a.questions_per_doc, seed=a.seed,
                               max_tokens=a.max_tokens, summary_tokens=a.max_tokens, max_doc_tokens=budget, summary=True)
        rec = SignalRecorder(runner.execute)
        runner.execute = rec
        try:
            recs, _ = run_items(eng, items, snapshot_mode="off", steer=False, desc="calibrate: signals")
        finally:
            runner.execute = rec.execute
        table = snap.class_table.cpu().numpy()
        sig = TokenSignals.concat([signals_from_tokens(*rec.seqs[r.request_id], table, snap.cfg.dispersion_window,
                                                       prompt_len=r.prompt_tokens)
                                   for r in recs if r.request_id in rec.seqs and rec.seqs[r.request_id][0]])
        try:  # D3 statistics per attended length, from the answers themselves
            length_table = dispersion_length_table(sig.d3, sig.n_attended, source="greedy answers to generated questions")
        except ValueError:  # too few tokens for any bucket: keep the library's statistics
            length_table = None
        cal = Calibration.from_dict({**built.library.calibration,
                                     **({"dispersion_by_length": length_table} if length_table else {})})
        snap.cal = cal  # the sweep runs with the new statistics
        res = calibrate_thresholds(sig, cal, a.target_rate, snap.cfg.enabled)
        default = trigger_shares(sig, cal, {"entity_prob_threshold": 0.85, "dispersion_z": 1.2, "surprisal_z": 2.0},
                                 snap.cfg.enabled)
        points = []
        sweep_items = items[: a.sweep_items]
        for r_ in sorted(set(sweep + [a.target_rate])) if sweep else []:
            thr = calibrate_thresholds(sig, cal, r_, snap.cfg.enabled)
            snap.cfg = TriggerConfig(**thr.thresholds, dispersion_window=snap.cfg.dispersion_window,
                                     enabled=snap.cfg.enabled)
            rs, _ = run_items(eng, sweep_items, snapshot_mode="triggered", steer=True, desc=f"sweep {r_:.3g}")
            c = score(sweep_items, rs)
            idx = stats.bootstrap_indices(len(sweep_items), 1000, a.seed)
            points.append({"target_rate": r_, "predicted_rate": thr.achieved, "thresholds": thr.thresholds,
                           "lookups_per_1k_tokens": stats.ratio_of_sums(c["lookups"], c["tokens"], None, 1000.0),
                           "entity_error_rate": stats.estimate(
                               lambda i, c=c: stats.ratio_of_sums(c["unsupported"], c["entities"], i), idx),
                           "answer_accuracy": stats.ratio_of_sums(c["correct"], c["is_qa"])})
    finally:
        eng.shutdown()
    write_library(Path(a.library), out, res, [str(c) for c in a.corpus],
                  {"default_thresholds_rate": default["union"], "docs": len(docs), "items": len(items)}, length_table)
    report = {"thresholds": res.thresholds, "target_rate": res.target, "achieved_rate": res.achieved,
              "per_trigger_rate": res.per_trigger, "n_tokens": res.n_tokens,
              "rate_with_default_thresholds": default, "sweep": points}
    (out / "calibration.json").write_text(json.dumps(report, indent=1, default=float))
    if points:
        plot_tradeoff(points, out / "calibration.png", a.target_rate)
    t = res.thresholds
    print(f"sfcl anchors calibrate: {res.n_tokens} generated tokens from {len(items)} answers; default thresholds fire "
          f"on {100 * default['union']:.2f}% of tokens; calibrated (entity p < {t['entity_prob_threshold']:.4f}, "
          f"dispersion z > {t['dispersion_z']:.3f}, |surprisal z| > {t['surprisal_z']:.3f}) fire on "
          f"{100 * res.achieved:.2f}% (target {100 * res.target:.2f}%: "
          + ", ".join(f"{k} {100 * v:.2f}%" for k, v in res.per_trigger.items()) + ")")
    for p in points:
        e = p["entity_error_rate"]
        print(f"  sweep {p['target_rate']:.4g}: {p['lookups_per_1k_tokens']:.1f} lookups/1k tok, "
              f"entity error {100 * e['value']:.1f}% [{100 * e['ci_lo']:.1f}, {100 * e['ci_hi']:.1f}]")
    print(f"sfcl anchors calibrate: wrote {out} (manifest calibration.thresholds, calibration.json"
          f"{', calibration.png' if points else ''})", file=sys.stderr)
    return 0


def add_parser(asub) -> None:
    """``sfcl anchors calibrate`` on the ``anchors`` subparsers."""
    p = asub.add_parser("calibrate", help="set trigger thresholds for a target share of triggering tokens",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("library", help="anchor library directory to calibrate (left unchanged)")
    p.add_argument("corpus", nargs="+", help="documents to generate questions from (ContractNLI .json, .txt, ...)")
    p.add_argument("--out", required=True, help="new library directory (copy of LIBRARY with the thresholds)")
    p.add_argument("--target-rate", type=float, default=DEFAULT_TARGET,
                   help="share of generated tokens that should trigger a lookup (1/16: the source design's ratio)")
    p.add_argument("--docs", type=int, default=8, help="use the first N documents of the corpus")
    p.add_argument("--questions-per-doc", type=int, default=4, help="questions per document (plus one summary)")
    p.add_argument("--max-tokens", type=int, default=96, help="generated tokens at most per answer")
    p.add_argument("--max-doc-tokens", type=int, default=6000, help="document tokens at most per prompt")
    p.add_argument("--sweep", default="0.015625,0.03125,0.0625,0.125,0.25",
                   help="target shares for the trade-off curve (empty: no sweep)")
    p.add_argument("--sweep-items", type=int, default=12, help="answers per sweep point")
    p.add_argument("--seed", type=int, default=0, help="question selection and bootstrap seed")
    from sfcl.eval.drive import add_engine_flags

    add_engine_flags(p, with_anchors=False)
    p.set_defaults(fn=cmd_calibrate)
