"""``sfcl eval``: do event-triggered checks catch unsupported entities on real contracts, and does
grounded steering on the triggered tokens remove them without making answers worse?

One command, on the ContractNLI dev NDAs (CPU or GPU, whatever the engine runs on):

1. calibration on other documents (``--calibrate-on``, default NDAs 31-60): greedy answers to
   questions generated from them train the lookback model and set the trigger thresholds for 1/16
   of the generated tokens (``sfcl.eval.calibrate``); the calibrated library is written to
   ``OUT/library`` and used for the rest;
2. questions from the evaluated documents (``--docs``, default NDAs 0-30; ``sfcl.eval.questions``,
   at most ``--questions-per-doc`` per NDA plus one summary), asked about the document's first
   ``--max-doc-tokens`` tokens (the questions are generated from that excerpt), document first and
   question last so that a document's questions share their prompt prefix;
3. every arm (``sfcl.eval.arms``) answers every item greedily through the real engine;
4. scoring (``sfcl.eval.scorer``, per item), detection (``sfcl.eval.detection``, on the ``off``
   arm's tokens, with the ``always`` arm's snapshot confidences) and per-document cluster-bootstrap
   95% CIs paired across arms (``sfcl.eval.stats``); ``eval.md`` (tables), ``eval.json`` (metrics,
   every answer) and ``eval.png``.

Metrics per arm: answer accuracy (QA items), entity-consistency error (unsupported / extracted
entities, all items) and its change against ``off``; guard metrics so that no arm wins by saying
less: entities per answer, answer length (tokens), verbatim-copy rate (share of answer words inside
an 8-word run of the document), repeated 4-grams (share of an answer's word 4-grams that repeat an
earlier one); lookups per 1,000 tokens and against ``always`` with the same steering; decode
tokens/s against ``off`` (tokens after the first / time after the first token, summed over the
arm's requests, measured in the same run); the share of answers identical to ``off``.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from sfcl.bench.workloads import CONTRACTNLI_DEV  # ../shared beside the checkout, whatever the cwd
from sfcl.eval import stats
from sfcl.eval.arms import Arm, parse_arms, run_arms, time_arms
from sfcl.eval.drive import SYSTEM_QA, EngineSpec, Item, Record, build, qa_prompt, token_budget_chars
from sfcl.eval.questions import Question, generate_questions
from sfcl.eval.scorer import Source, answer_correct, entity_errors
from sfcl.snapshot.mechanisms import no_document_messages

DEFAULT_DATA = str(CONTRACTNLI_DEV)
COPY_WORDS = 8  # a run of this many answer words found in the document counts as copied
REPEAT_N = 4  # word n-grams checked for repetition


def doc_range(text: str) -> list[int]:
    """"0-30" -> [0, ..., 30]; "0,3,7-9" -> [0, 3, 7, 8, 9]. Raises ValueError."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        a, _, b = part.partition("-")
        lo, hi = int(a), int(b) if b else int(a)
        if lo < 0 or hi < lo:
            raise ValueError(f"bad document range {part!r}")
        out.extend(range(lo, hi + 1))
    if not out:
        raise ValueError("empty document range")
    return out


def build_items(docs, tokenizer, encode_chat, *, questions_per_doc: int, seed: int, max_tokens: int,
                summary_tokens: int, max_doc_tokens: int, summary: bool = True) -> tuple[list[Item], list[dict]]:
    """Items (prompt ids, the no-document prompt for cad, metadata incl. the scoring source) and
    per-document notes. Each document is cut to its first ``max_doc_tokens`` tokens and the
    questions are generated from that excerpt."""
    from dataclasses import replace

    items, notes = [], []
    for d in docs:
        text = d.text[:token_budget_chars(tokenizer, d.text, max_doc_tokens)]
        qs = generate_questions(replace(d, text=text), n=questions_per_doc, seed=seed, summary=summary)
        notes.append({"doc_id": d.doc_id, "chars": len(d.text), "excerpt_chars": len(text), "questions": len(qs)})
        for q in qs:
            msgs = [{"role": "user", "content": qa_prompt(text, q.question)}]
            nd = no_document_messages(msgs, SYSTEM_QA)
            items.append(Item(key=q.qid, prompt_ids=encode_chat(msgs, SYSTEM_QA),
                              max_tokens=summary_tokens if q.type == "summary" else max_tokens,
                              meta={"question": q, "source": text + "\n" + q.question},
                              cad_prompt_ids=encode_chat(*nd) if nd else None))
    return items, notes


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.casefold())


def copy_and_repeats(answer: str, source_grams: set) -> tuple[int, int, int, int]:
    """(answer words, words inside a COPY_WORDS-word run of the source, word REPEAT_N-grams,
    of those the ones repeating an earlier one)."""
    w = _words(answer)
    cov = [False] * len(w)
    for i in range(len(w) - COPY_WORDS + 1):
        if tuple(w[i:i + COPY_WORDS]) in source_grams:
            cov[i:i + COPY_WORDS] = [True] * COPY_WORDS
    grams = [tuple(w[i:i + REPEAT_N]) for i in range(len(w) - REPEAT_N + 1)]
    seen, rep = set(), 0
    for g in grams:
        rep += g in seen
        seen.add(g)
    return len(w), sum(cov), len(grams), rep


COLUMNS = ("items", "is_qa", "correct", "entities", "unsupported", "lookups", "tokens", "decode_tokens", "decode_s",
           "words", "copied", "ngrams", "repeats", "steered", "no_support")


def score(items: list[Item], recs: list[Record]) -> dict[str, np.ndarray]:
    """Per-item columns (``COLUMNS``) as float64 arrays."""
    cols = {k: [] for k in COLUMNS}
    grams: dict[str, set] = {}
    for it, r in zip(items, recs):
        q: Question = it.meta["question"]
        rep = entity_errors(r.text, Source.of(it.meta["source"]))
        src = it.meta["source"]
        if src not in grams:
            sw = _words(src)
            grams[src] = {tuple(sw[i:i + COPY_WORDS]) for i in range(len(sw) - COPY_WORDS + 1)}
        nw, cp, ng, rp = copy_and_repeats(r.text, grams[src])
        steer = [s.steer for s in r.snapshots if s.steer]
        vals = {"items": 1.0, "is_qa": 1.0 if q.gold else 0.0,
                "correct": float(answer_correct(r.text, q.gold_texts, q.match)) if q.gold else 0.0,
                "entities": rep.n, "unsupported": rep.n_unsupported, "lookups": r.lookups,
                "tokens": r.completion_tokens, "decode_tokens": max(0, r.completion_tokens - 1), "decode_s": r.decode_s,
                "words": nw, "copied": cp, "ngrams": ng, "repeats": rp,
                "steered": sum(1 for s in steer if s.get("changed")),
                "no_support": sum(1 for s in steer if s.get("unsupported"))}
        for k in COLUMNS:
            cols[k].append(vals[k])
    return {k: np.asarray(v, np.float64) for k, v in cols.items()}


def _div(a, b):
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.asarray(a, np.float64) / np.asarray(b, np.float64)
    return float(r) if r.ndim == 0 else r


def metrics(cols: dict[str, dict[str, np.ndarray]], arms: list[Arm], texts: dict[str, list[str]],
            doc_ids: list[str], reps: int, seed: int) -> dict[str, dict]:
    """Point estimates and 95% cluster-bootstrap CIs (documents drawn with replacement, the same
    draws for every arm) per arm, and the paired comparisons with ``off``, with ``always`` of the
    same steering and with the random arm of the same steering."""
    docs = np.array(sorted(set(doc_ids)))
    g = np.array(doc_ids)
    sums = {a: {k: stats.cluster_sums(v, g, docs) for k, v in c.items()} for a, c in cols.items()}
    idx = stats.bootstrap_indices(len(docs), reps, seed)
    R = stats.ratio_of_sums
    E = stats.estimate
    rate = {  # metric name -> (numerator, denominator, scale)
        "answer_accuracy": ("correct", "is_qa", 1.0), "entity_error_rate": ("unsupported", "entities", 1.0),
        "entities_per_answer": ("entities", "items", 1.0), "answer_tokens": ("tokens", "items", 1.0),
        "copy_rate": ("copied", "words", 1.0), "repeated_ngram_rate": ("repeats", "ngrams", 1.0),
        "lookups_per_1k_tokens": ("lookups", "tokens", 1000.0), "steered_per_1k_tokens": ("steered", "tokens", 1000.0)}

    def f(arm: str, key: str):
        n, d, k = rate[key]
        return lambda i: R(sums[arm][n], sums[arm][d], i, k)

    out = {}
    names = [a.name for a in arms]
    for a in arms:
        c = cols[a.name]
        m = {key: E(f(a.name, key), idx) for key in rate}
        m.update({"n_items": int(c["items"].sum()), "n_qa": int(c["is_qa"].sum()), "entities": int(c["entities"].sum()),
                  "unsupported": int(c["unsupported"].sum()), "lookups": int(c["lookups"].sum()),
                  "tokens": int(c["tokens"].sum()), "steered": int(c["steered"].sum()),
                  "no_support_events": int(c["no_support"].sum())})
        if "off" in cols:
            err, err0 = f(a.name, "entity_error_rate"), f("off", "entity_error_rate")
            m["entity_error_change_vs_off"] = E(lambda i: _div(err(i), err0(i)) - 1.0, idx)
            m["entity_error_diff_vs_off"] = E(lambda i: err(i) - err0(i), idx)
            acc, acc0 = f(a.name, "answer_accuracy"), f("off", "answer_accuracy")
            m["accuracy_diff_vs_off"] = E(lambda i: acc(i) - acc0(i), idx)
            ent, ent0 = f(a.name, "entities_per_answer"), f("off", "entities_per_answer")
            m["entities_per_answer_vs_off"] = E(lambda i: _div(ent(i), ent0(i)), idx)
            m["same_text_as_off"] = float(np.mean([x == y for x, y in zip(texts[a.name], texts["off"])]))
        mech = ("+" + a.mechanism) if a.steer else ""
        ref = "always" + mech
        if ref in cols and cols[ref]["lookups"].sum() > 0:
            m["lookups_vs_always"] = float(cols[a.name]["lookups"].sum() / cols[ref]["lookups"].sum())
            if a.mode == "triggered" and ref != a.name:
                err, err1 = f(a.name, "entity_error_rate"), f(ref, "entity_error_rate")
                m["entity_error_diff_vs_always"] = E(lambda i: err(i) - err1(i), idx)
        rnd = "random" + mech
        if a.mode == "triggered" and not a.random and rnd in names:
            err, err1 = f(a.name, "entity_error_rate"), f(rnd, "entity_error_rate")
            m["entity_error_diff_vs_random"] = E(lambda i: err(i) - err1(i), idx)
        out[a.name] = m
    return out


def speed_vs_off(tps: dict[str, list[float]]) -> dict[str, dict]:
    """Per arm: decode tokens/s over the timing rounds and its ratio to ``off`` of the same round
    ({"value": geometric mean of the per-round ratios, "ci_lo"/"ci_hi": their min and max})."""
    out = {}
    for name, v in tps.items():
        r = np.asarray(v, np.float64) / np.asarray(tps.get("off", v), np.float64)
        r = r[np.isfinite(r) & (r > 0)]
        out[name] = {"decode_tokens_per_s": [float(x) for x in v],
                     "vs_off": {"value": float(np.exp(np.log(r).mean())) if r.size else float("nan"),
                                "ci_lo": float(r.min()) if r.size else float("nan"),
                                "ci_hi": float(r.max()) if r.size else float("nan"), "rounds": int(r.size)}}
    return out


def _fmt(e: dict | None, pct: bool = False, digits: int = 2, ci: bool = True) -> str:
    if not e or e.get("value") is None or not np.isfinite(e["value"]):
        return "n/a"
    f = (lambda x: f"{100 * x:.1f}%") if pct else (lambda x: f"{x:.{digits}f}")
    v, lo, hi = e["value"], e["ci_lo"], e["ci_hi"]
    return f"{f(v)} [{f(lo)}, {f(hi)}]" if ci and np.isfinite(lo) else f(v)


def table(res: dict[str, dict]) -> str:
    rows = ["| arm | answer accuracy | entity-consistency error | vs off | entities / answer | tokens / answer | "
            "copy rate | repeated 4-grams | lookups / 1k tok | lookups vs always | decode speed vs off | "
            "same text as off |", "|" + "---|" * 12]
    for name, m in res.items():
        rows.append("| " + " | ".join([
            f"`{name}`", _fmt(m["answer_accuracy"], pct=True),
            _fmt(m["entity_error_rate"], pct=True) + f" ({m['unsupported']}/{m['entities']})",
            _fmt(m.get("entity_error_change_vs_off"), pct=True) if name != "off" else "",
            _fmt(m["entities_per_answer"], ci=False), _fmt(m["answer_tokens"], digits=1, ci=False),
            _fmt(m["copy_rate"], pct=True, ci=False), _fmt(m["repeated_ngram_rate"], pct=True, ci=False),
            _fmt(m["lookups_per_1k_tokens"], digits=1, ci=False),
            f"{m['lookups_vs_always']:.3f}" if "lookups_vs_always" in m else "",
            _fmt(m.get("decode_speed_vs_off"), digits=2) if name != "off" else "",
            f"{100 * m['same_text_as_off']:.0f}%" if "same_text_as_off" in m else ""]) + " |")
    return "\n".join(rows)


def detection_table(det: dict) -> str:
    rows = ["| trigger | recall (unsupported entities) | precision (fired tokens) | fire rate | AUROC of its signal |",
            "|---|---|---|---|---|"]
    for name, d in det["per_trigger"].items():
        rows.append(f"| `{name}` | {_fmt(d['recall'], pct=True)} | {_fmt(d['precision'], pct=True)} | "
                    f"{_fmt(d['fire_rate'], pct=True, ci=False)} | {_fmt(det['auroc'].get(name))} |")
    rc = det["random_control"]
    rows.append(f"| random at the union's rate | {_fmt(rc['recall'], pct=True)} | {_fmt(rc['precision'], pct=True)} | "
                f"{100 * rc['rate']:.1f}% | 0.50 |")
    for name, a in det["auroc"].items():
        if name not in det["per_trigger"]:
            rows.append(f"| {name} | | | | {_fmt(a)} |")
    return "\n".join(rows)


def plot(res: dict[str, dict], det: dict | None, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res)
    panels = [("entity_error_rate", "entity-consistency error (%)", 100), ("answer_accuracy", "answer accuracy (%)", 100),
              ("entities_per_answer", "entities per answer", 1), ("lookups_per_1k_tokens", "lookups per 1,000 tokens", 1),
              ("decode_speed_vs_off", "decode speed vs off", 1)]
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(4 * (len(panels) + 1), 4.4))
    colour = {"off": "#888", "triggered": "#3a7", "always": "#37a", "random": "#c84"}
    for ax, (key, label, k) in zip(axes, panels):
        vals = [res[n].get(key) or {"value": np.nan, "ci_lo": np.nan, "ci_hi": np.nan} for n in names]
        v = np.array([x["value"] for x in vals], float) * k
        lo = np.array([x["ci_lo"] for x in vals], float) * k
        hi = np.array([x["ci_hi"] for x in vals], float) * k
        err = np.nan_to_num(np.vstack([v - lo, hi - v]).clip(min=0))
        ax.bar(range(len(names)), np.nan_to_num(v), yerr=err, capsize=3,
               color=[colour.get(n.split("+")[0], "#888") for n in names])
        ax.set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=7)
        ax.set_title(label, fontsize=10)
        ax.set_ylim(bottom=0)
    ax = axes[-1]
    if det:
        trig = list(det["per_trigger"]) + ["random"]
        v = [det["per_trigger"][t]["recall"]["value"] for t in trig[:-1]] + [det["random_control"]["recall"]["value"]]
        lo = [det["per_trigger"][t]["recall"]["ci_lo"] for t in trig[:-1]] + [det["random_control"]["recall"]["ci_lo"]]
        hi = [det["per_trigger"][t]["recall"]["ci_hi"] for t in trig[:-1]] + [det["random_control"]["recall"]["ci_hi"]]
        v, lo, hi = (100 * np.nan_to_num(np.array(x, float)) for x in (v, lo, hi))
        ax.bar(range(len(trig)), v, yerr=np.vstack([v - lo, hi - v]).clip(min=0), capsize=3,
               color=["#3a7"] * (len(trig) - 2) + ["#275", "#c84"])
        ax.set_xticks(range(len(trig)), [t.replace("_", "\n", 1) for t in trig], rotation=40, ha="right", fontsize=7)
        ax.set_title("detection: recall of unsupported entities (%)", fontsize=10)
        ax.set_ylim(0, 100)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _observed_rate(recs: list[Record], cfg) -> float:
    """Share of the records' tokens on which ``cfg``'s triggers fire (``triggers.fire`` on the
    signals the runner computed)."""
    import torch

    from sfcl.snapshot.triggers import fire

    sig = [s for r in recs for s in r.signals if s]
    return float(fire(torch.tensor(sig, dtype=torch.float32), cfg).any(1).float().mean()) if sig else 0.0


@dataclass(kw_only=True)
class EvalConfig(EngineSpec):
    """``sfcl eval``: what to evaluate and how (fields = the command's flags, see ``sfcl eval --help``)."""

    data: list[str]  # corpus files (ContractNLI .json)
    docs: str  # evaluated documents: "0-30", "0,4,9-12"
    calibrate_on: str  # calibration documents, or "none"
    target_rate: float  # share of tokens the triggers should fire on
    questions_per_doc: int
    no_summary: bool
    max_tokens: int  # per answer
    summary_tokens: int  # per summary
    max_doc_tokens: int  # document tokens per prompt
    arms: str  # comma-separated arms (sfcl.eval.arms.parse_arms)
    speed_rounds: int  # 0: no decode-speed measurement
    seed: int
    bootstrap: int  # replicates
    out: str  # output directory


def run_eval(a: EvalConfig) -> int:
    """Run the evaluation ``a`` describes, write eval.md / eval.json / eval.png (and the calibrated
    library) under ``a.out``, print the tables. Returns 0, or 1 when some request ended with an error.
    Raises ValueError (bad settings, overlapping document sets, no questions, no library),
    FileExistsError (``a.out``/library exists), and what the engine build raises."""
    import torch

    from sfcl.anchors.corpus import read_corpus
    from sfcl.eval.calibrate import calibrate
    from sfcl.eval.detection import AnswerSignals, detection
    from sfcl.eval.labels import label_answer
    from sfcl.snapshot.calibration import MIN_TRIGGER_AUROC, write_library
    from sfcl.snapshot.lookback import LookbackModel
    from sfcl.snapshot.triggers import RECORD_FEATURES_AT, TriggerConfig

    arms = parse_arms(a.arms)
    if a.questions_per_doc < 0 or a.max_tokens < 1 or a.bootstrap < 1:
        raise ValueError("--max-tokens and --bootstrap must be >= 1, --questions-per-doc >= 0")
    out = Path(a.out)
    if a.calibrate_on != "none" and (out / "library").exists():
        raise FileExistsError(f"{out / 'library'} exists: use another --out (or --calibrate-on none --anchors it)")
    out.mkdir(parents=True, exist_ok=True)
    corpus = read_corpus(a.data)
    docs = [corpus[i] for i in doc_range(a.docs) if i < len(corpus)]
    cal_docs = [] if a.calibrate_on == "none" else [corpus[i] for i in doc_range(a.calibrate_on) if i < len(corpus)]
    if set(d.doc_id for d in docs) & set(d.doc_id for d in cal_docs):
        raise ValueError("--docs and --calibrate-on overlap: calibrate on other documents than the evaluated ones")
    built = build(a)
    eng = built.engine
    snap = eng.engine.runner.snapshotter
    calib = None
    try:
        if snap is None:
            raise ValueError("snapshots are unavailable (no anchor library); sfcl eval needs one")
        budget = min(a.max_doc_tokens, eng.max_model_len - max(a.max_tokens, a.summary_tokens) - 256)
        kw = dict(questions_per_doc=a.questions_per_doc, seed=a.seed, max_tokens=a.max_tokens,
                  summary_tokens=a.summary_tokens, max_doc_tokens=budget, summary=not a.no_summary)
        if cal_docs:
            cal_items, _ = build_items(cal_docs, eng.tokenizer, eng.encode_chat, **kw)
            print(f"sfcl eval: calibrating on {len(cal_docs)} documents, {len(cal_items)} items", file=sys.stderr)
            calib = calibrate(eng, built.library, cal_items, a.target_rate)
            write_library(built.library.path, out / "library",
                          {**calib.entries, "threshold_calibration": {**calib.entries["threshold_calibration"],
                                                                      "docs": [d.doc_id for d in cal_docs]}})
            snap.cal = calib.cal  # what `sfcl serve --anchors OUT/library` would load
            snap.lookback = LookbackModel.from_dict(calib.entries["lookback"]) if "lookback" in calib.entries else None
            snap.cfg = TriggerConfig.from_calibration(calib.entries, snap.cfg.dispersion_window)
        items, notes = build_items(docs, eng.tokenizer, eng.encode_chat, **kw)
        if not items:
            raise ValueError("no questions could be generated from the selected documents")
        print(f"sfcl eval: {len(items)} items ({sum(1 for it in items if it.meta['question'].gold)} questions) from "
              f"{len(docs)} documents, arms: {', '.join(x.name for x in arms)}", file=sys.stderr)

        def matched_rate(recs: dict[str, list[Record]]) -> float:
            for name in [x.name for x in arms if x.mode == "triggered" and not x.random] + ["off"]:
                rs = recs.get(name) or []
                if name != "off" and rs:
                    return sum(r.lookups for r in rs) / max(1, sum(r.completion_tokens for r in rs))
                if rs:
                    return _observed_rate(rs, snap.cfg)
            return 1.0 / 16.0

        recs = run_arms(eng, items, arms, matched_rate, a.max_num_seqs * 2)
        rate = matched_rate(recs)
        qa = [it for it in items if it.meta["question"].gold][: a.max_num_seqs]
        speed = speed_vs_off(time_arms(eng, qa, arms, rate, a.speed_rounds, a.max_num_seqs)) if a.speed_rounds else {}
        cfg = snap.cfg
    finally:
        eng.shutdown()
    errors = [(n, r.key, r.error) for n, rs in recs.items() for r in rs if r.error]
    cols = {n: score(items, rs) for n, rs in recs.items()}
    texts = {n: [r.text for r in rs] for n, rs in recs.items()}
    doc_ids = [it.meta["question"].doc_id for it in items]
    res = metrics(cols, arms, texts, doc_ids, a.bootstrap, a.seed)
    for n in res:
        if n in speed:
            res[n]["decode_tokens_per_s"] = speed[n]["decode_tokens_per_s"]
            res[n]["decode_speed_vs_off"] = speed[n]["vs_off"]
    det = None
    if "off" in recs and any(r.signals for r in recs["off"]):
        conf_by = {}
        if "always" in recs:
            for it, r, r0 in zip(items, recs["always"], recs["off"]):
                if r.text == r0.text:
                    c = np.full(len(r.token_ids), np.nan)
                    for s in r.snapshots:
                        if s.token_index < len(c):
                            c[s.token_index] = s.confidence
                    conf_by[it.key] = c
        fits = calib.models if calib is not None else {}

        def extra(r: Record) -> dict:  # every trained lookback model's score, for the AUROC comparison
            if not fits or not r.records or len(r.records[0]) <= RECORD_FEATURES_AT:
                return {}
            x = torch.tensor([row[RECORD_FEATURES_AT:] for row in r.records], dtype=torch.float32)
            return {f"lookback model ({k})": m.score(x).numpy() for k, m in fits.items()}

        answers = [AnswerSignals(it.meta["question"].doc_id, np.asarray(r.signals, np.float64),
                                 label_answer(built.lm.tokenizer, r.token_ids, Source.of(it.meta["source"])),
                                 conf_by.get(it.key), extra(r))
                   for it, r in zip(items, recs["off"]) if r.signals]
        det = detection(answers, cfg, a.bootstrap, a.seed)
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    dtype = str(next(built.lm.model.parameters()).dtype).removeprefix("torch.")  # what --dtype auto resolved to
    from sfcl.model.hardware import cpu_summary

    cpu = cpu_summary()  # which CPU kind the figures come from
    eval_rate = _observed_rate(recs["off"], cfg) if "off" in recs else None
    cal_info = None if calib is None else {
        "documents": [d.doc_id for d in cal_docs], "thresholds": calib.entries["thresholds"],
        "target_rate": a.target_rate, "rate_on_calibration_docs": calib.report["achieved_rate"],
        "rate_quantile_over_calibration_doc_resamples": calib.report["rate_quantile_over_documents"],
        "enabled_triggers": calib.entries["enabled_triggers"], "trigger_auroc_on_calibration": calib.report["trigger_auroc"],
        "rate_on_evaluated_docs": eval_rate, "lookback": calib.report["lookback"],
        "per_trigger_rate": calib.report["per_trigger_rate"], "library": str(out / "library")}
    meta = {"date": when, "command": "sfcl " + " ".join(sys.argv[1:]) if sys.argv[0].endswith(("sfcl", "cli.py")) else None,
            "model": built.lm.name, "anchors": str(built.library.path), "n_anchors": built.library.n_anchors,
            "docs": [d.doc_id for d in docs], "items": len(items), "questions": sum(1 for it in items if it.meta["question"].gold),
            "seed": a.seed, "max_tokens": a.max_tokens, "summary_tokens": a.summary_tokens, "max_doc_tokens": budget,
            "bootstrap": a.bootstrap, "device": a.device, "dtype": dtype, "cpu": cpu, "documents": notes, "errors": errors,
            "random_trigger_rate": rate, "speed": {"rounds": a.speed_rounds, "streams": a.max_num_seqs,
                                                   "items": len(qa)},
            "thresholds": {k: getattr(cfg, k) for k in ("entity_prob_threshold", "dispersion_z", "surprisal_z",
                                                        "lookback_threshold")}}
    per_item = [{"key": it.key, "doc_id": it.meta["question"].doc_id, "type": it.meta["question"].type,
                 "question": it.meta["question"].question, "gold": it.meta["question"].gold_texts,
                 "answers": {n: {"text": recs[n][i].text, "correct": bool(cols[n]["correct"][i]),
                                 "entities": int(cols[n]["entities"][i]), "unsupported": int(cols[n]["unsupported"][i]),
                                 "lookups": recs[n][i].lookups, "tokens": recs[n][i].completion_tokens,
                                 "steer": [s.steer for s in recs[n][i].snapshots if s.steer and s.steer.get("changed")]}
                             for n in recs}} for i, it in enumerate(items)]
    (out / "eval.json").write_text(json.dumps({"meta": meta, "calibration": cal_info, "metrics": res, "detection": det,
                                               "items": per_item}, indent=1, default=str))
    md = [f"Evaluation on {len(docs)} ContractNLI NDAs, {len(items)} items ({meta['questions']} questions + summaries), "
          f"model {built.lm.name} ({a.device}/{dtype}, CPU {cpu}), {built.library.n_anchors} anchors, greedy, {when}; 95% "
          f"cluster-bootstrap CIs over documents ({a.bootstrap} replicates), paired across arms; decode speed: "
          f"{a.speed_rounds} rounds of {len(qa)} requests per arm at {a.max_num_seqs} streams, [min, max] over rounds; "
          f"random arms fire at {100 * rate:.2f}% of tokens.", "", table(res)]
    if cal_info:
        qd = cal_info["rate_quantile_over_calibration_doc_resamples"]
        auc = ", ".join(f"{k} {v:.2f}" for k, v in cal_info["trigger_auroc_on_calibration"].items())
        md += ["", f"Calibration on {len(cal_docs)} other NDAs: triggers kept {', '.join(cal_info['enabled_triggers'])} "
                   f"(AUROC on the calibration answers: {auc}; kept at >= {MIN_TRIGGER_AUROC}), thresholds "
                   f"{cal_info['thresholds']}; the triggers fire on "
                   f"{100 * cal_info['rate_on_calibration_docs']:.2f}% of generated tokens there "
                   f"({100 * qd['quantile']:.0f}th percentile over document resamples {100 * (qd['value'] or 0):.2f}%, "
                   f"set to the target {100 * a.target_rate:.2f}%) and on {100 * (eval_rate or 0):.2f}% on the evaluated "
                   f"documents (observe-only answers)."]
    if det:
        md += ["", f"Detection on the `off` answers ({det['n_tokens']} tokens, {det['n_unsupported_entities']} unsupported "
                   f"entities, {det['n_unsupported_tokens']} of their tokens):", "", detection_table(det)]
    (out / "eval.md").write_text("\n".join(md) + "\n")
    plot(res, det, out / "eval.png", f"sfcl eval: {len(docs)} NDAs, {len(items)} items, {built.lm.name} ({dtype})")
    print("\n".join(md))
    print(f"sfcl eval: wrote {out / 'eval.md'}, {out / 'eval.json'}, {out / 'eval.png'}", file=sys.stderr)
    if errors:
        print(f"sfcl eval: {len(errors)} requests ended with an error (see eval.json meta.errors)", file=sys.stderr)
        return 1
    return 0
