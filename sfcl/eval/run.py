"""``sfcl eval``: answer accuracy and entity consistency on ContractNLI NDAs per snapshot mode x steering.

Pipeline (CPU or GPU, whatever the engine runs on):
1. questions from each document by rules (``sfcl.eval.questions``), a summary task per document;
2. one prompt per question, document first (consecutive questions share the prefix); documents
   longer than ``--max-doc-tokens`` are cut around the gold spans of their questions;
3. every configuration (``off``, ``off+steer``, ``triggered``, ``triggered+steer``, ``always``,
   ``always+steer``) answers every item greedily through the real engine (``sfcl.eval.drive``),
   document by document with the configuration order rotated per document (``--order doc``), so
   that load changes on a shared machine do not favour one configuration;
4. scoring (``sfcl.eval.scorer``) and paired percentile-bootstrap 95% CIs over items
   (``sfcl.eval.stats``); outputs ``eval.md`` (table), ``eval.json`` (metrics + every answer) and
   ``eval.png`` (bars with CIs) in ``--out``.

Metrics per configuration: answer accuracy (QA items; normalised containment of the gold span),
entity-consistency error rate (unsupported / extracted entities, all items incl. summaries),
lookups per 1,000 generated tokens, decode tokens/s relative to ``off`` (tokens after the first /
time after the first token, summed over items, measured in the same run), and the share of answers
identical to ``off`` (steering off must not change greedy output).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from sfcl.eval import stats
from sfcl.eval.drive import SYSTEM_QA, Item, Record, add_engine_flags, build, qa_prompt, run_items, token_budget_chars
from sfcl.eval.questions import Question, fit_document, generate_questions
from sfcl.eval.scorer import Source, answer_correct, entity_errors

ALL_CONFIGS = ("off", "off+steer", "triggered", "triggered+steer", "always", "always+steer")
from sfcl.bench.workloads import CONTRACTNLI_DEV  # ../shared beside the checkout, whatever the cwd

DEFAULT_DATA = str(CONTRACTNLI_DEV)


def parse_configs(text: str) -> list[tuple[str, str, bool]]:
    """"off,triggered+steer" -> [(name, snapshot_mode, steer), ...]. Raises ValueError on unknown names."""
    out = []
    for name in (t.strip() for t in text.split(",") if t.strip()):
        if name not in ALL_CONFIGS:
            raise ValueError(f"unknown configuration {name!r}; known: {', '.join(ALL_CONFIGS)}")
        mode, _, st = name.partition("+")
        out.append((name, mode, bool(st)))
    if not out:
        raise ValueError("--configs names no configuration")
    return out


def build_items(docs, tokenizer, encode_chat, *, questions_per_doc: int, seed: int, max_tokens: int,
                summary_tokens: int, max_doc_tokens: int, summary: bool = True) -> tuple[list[Item], list[dict]]:
    """Items (prompt ids + metadata incl. the scoring source) and per-document notes."""
    items, notes = [], []
    for d in docs:
        qs = generate_questions(d, n=questions_per_doc, seed=seed, summary=summary)
        chars = token_budget_chars(tokenizer, d.text, max_doc_tokens)
        text, off, kept = fit_document(d.text, qs, chars)
        notes.append({"doc_id": d.doc_id, "chars": len(d.text), "excerpt_start": off, "excerpt_chars": len(text),
                      "questions": len(qs), "kept": len(kept)})
        for q in kept:
            ids = encode_chat([{"role": "user", "content": qa_prompt(text, q.question)}], SYSTEM_QA)
            items.append(Item(key=q.qid, prompt_ids=ids, max_tokens=summary_tokens if q.type == "summary" else max_tokens,
                              meta={"question": q, "source": text + "\n" + q.question}))
    return items, notes


def score(items: list[Item], recs: list[Record]) -> dict[str, np.ndarray]:
    """Per-item arrays: is_qa, correct, entities, unsupported, lookups, tokens, decode_tokens, decode_s."""
    cols = {k: [] for k in ("is_qa", "correct", "entities", "unsupported", "lookups", "tokens", "decode_tokens", "decode_s")}
    for it, r in zip(items, recs):
        q: Question = it.meta["question"]
        rep = entity_errors(r.text, Source.of(it.meta["source"]))
        cols["is_qa"].append(1.0 if q.gold else 0.0)
        cols["correct"].append(float(answer_correct(r.text, q.gold_texts, q.match)) if q.gold else 0.0)
        cols["entities"].append(rep.n)
        cols["unsupported"].append(rep.n_unsupported)
        cols["lookups"].append(r.lookups)
        cols["tokens"].append(r.completion_tokens)
        cols["decode_tokens"].append(max(0, r.completion_tokens - 1))
        cols["decode_s"].append(r.decode_s)
    return {k: np.asarray(v, np.float64) for k, v in cols.items()}


def _div(a, b):
    """a / b elementwise; NaN (or inf) instead of an exception where b is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.asarray(a, np.float64) / np.asarray(b, np.float64)
    return float(r) if r.ndim == 0 else r


def metrics(cols: dict[str, dict[str, np.ndarray]], names: list[str], texts: dict[str, list[str]],
            reps: int, seed: int) -> dict[str, dict]:
    """Point estimates and paired bootstrap CIs per configuration."""
    n = len(next(iter(cols.values()))["tokens"])
    idx = stats.bootstrap_indices(n, reps, seed)
    R = stats.ratio_of_sums
    base = "off" if "off" in cols else None
    out = {}
    for name in names:
        c = cols[name]
        tps = lambda i, c=c: R(c["decode_tokens"], c["decode_s"], i)  # noqa: E731
        m = {
            "answer_accuracy": stats.estimate(lambda i: R(c["correct"], c["is_qa"], i), idx),
            "entity_error_rate": stats.estimate(lambda i: R(c["unsupported"], c["entities"], i), idx),
            "lookups_per_1k_tokens": stats.estimate(lambda i: R(c["lookups"], c["tokens"], i, 1000.0), idx),
            "decode_tokens_per_s": stats.estimate(tps, idx),
            "n_items": n, "n_qa": int(c["is_qa"].sum()), "entities": int(c["entities"].sum()),
            "unsupported": int(c["unsupported"].sum()), "lookups": int(c["lookups"].sum()),
            "tokens": int(c["tokens"].sum()),
        }
        if base:
            b = cols[base]
            tps_b = lambda i: R(b["decode_tokens"], b["decode_s"], i)  # noqa: E731
            err_b = lambda i: R(b["unsupported"], b["entities"], i)  # noqa: E731
            m["decode_speed_vs_off"] = stats.estimate(lambda i: _div(tps(i), tps_b(i)), idx)
            m["entity_error_change_vs_off"] = stats.estimate(
                lambda i: _div(R(c["unsupported"], c["entities"], i), err_b(i)) - 1.0, idx)
            m["same_text_as_off"] = float(np.mean([a == b_ for a, b_ in zip(texts[name], texts[base])]))
        out[name] = m
    for name in names:  # lookups relative to always with the same steering setting
        ref = "always+steer" if name.endswith("+steer") else "always"
        if ref in cols and cols[ref]["lookups"].sum() > 0:
            out[name]["lookups_vs_always"] = float(cols[name]["lookups"].sum() / cols[ref]["lookups"].sum())
    return out


def run_configs(eng, items: list[Item], configs: list[tuple[str, str, bool]], order: str = "doc",
                max_in_flight: int = 32) -> tuple[dict[str, list[Record]], dict[str, float]]:
    """Answer every item under every configuration; returns (records per config in item order,
    wall seconds per config).

    order "doc": document by document, all configurations on that document's items in turn, the
    configuration order rotated by one per document, so that load changes on the machine spread
    evenly over the configurations (and a prefix cache serves the document to all of them).
    order "config": each configuration on all items as one batch (bigger batches, but the
    configurations run at different times)."""
    recs: dict[str, list[Record]] = {n: [] for n, _, _ in configs}
    walls = {n: 0.0 for n, _, _ in configs}
    if order == "config":
        for name, mode, steer in configs:
            recs[name], walls[name] = run_items(eng, items, snapshot_mode=mode, steer=steer, desc=f"eval {name}",
                                                max_in_flight=max_in_flight)
        return recs, walls
    groups: list[list[Item]] = []
    for it in items:
        if groups and groups[-1][0].meta["question"].doc_id == it.meta["question"].doc_id:
            groups[-1].append(it)
        else:
            groups.append([it])
    bar = tqdm(total=len(items) * len(configs), desc="eval", unit="req")
    try:
        for gi, grp in enumerate(groups):
            # one discarded pass over the document's prompts first: the first forward at new shapes
            # pays one-off costs (allocator growth, kernel selection) that would land on whichever
            # configuration happens to run first
            run_items(eng, [Item(it.key, it.prompt_ids, 2, it.meta) for it in grp], snapshot_mode="off", steer=False,
                      max_in_flight=max_in_flight, progress=False)
            k = gi % len(configs)
            for name, mode, steer in configs[k:] + configs[:k]:
                r, w = run_items(eng, grp, snapshot_mode=mode, steer=steer, max_in_flight=max_in_flight, progress=False)
                recs[name].extend(r)
                walls[name] += w
                bar.update(len(grp))
                bar.set_postfix_str(f"doc {gi + 1}/{len(groups)} {name}")
    finally:
        bar.close()
    return recs, walls


def _fmt(e: dict, pct: bool = False, digits: int = 2) -> str:
    v, lo, hi = e["value"], e["ci_lo"], e["ci_hi"]
    if v is None or not np.isfinite(v):
        return "n/a"
    f = (lambda x: f"{100 * x:.1f}%") if pct else (lambda x: f"{x:.{digits}f}")
    return f"{f(v)} [{f(lo)}, {f(hi)}]" if np.isfinite(lo) else f(v)


def table(res: dict[str, dict]) -> str:
    rows = ["| configuration | answer accuracy | entity-consistency error | vs off | lookups / 1k tok | "
            "lookups vs always | decode speed vs off | same text as off |",
            "|---|---|---|---|---|---|---|---|"]
    for name, m in res.items():
        rows.append("| " + " | ".join([
            f"`{name}`", _fmt(m["answer_accuracy"], pct=True),
            _fmt(m["entity_error_rate"], pct=True) + f" ({m['unsupported']}/{m['entities']})",
            _fmt(m["entity_error_change_vs_off"], pct=True) if "entity_error_change_vs_off" in m else "",
            _fmt(m["lookups_per_1k_tokens"], digits=1),
            f"{m['lookups_vs_always']:.3f}" if "lookups_vs_always" in m else "",
            _fmt(m["decode_speed_vs_off"], digits=3) if "decode_speed_vs_off" in m else "",
            f"{100 * m['same_text_as_off']:.0f}%" if "same_text_as_off" in m else "",
        ]) + " |")
    return "\n".join(rows)


def plot(res: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res)
    panels = [("answer_accuracy", "answer accuracy (%)", 100), ("entity_error_rate", "entity-consistency error (%)", 100),
              ("lookups_per_1k_tokens", "lookups per 1,000 tokens", 1), ("decode_speed_vs_off", "decode speed vs off", 1)]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for ax, (key, label, k) in zip(axes, panels):
        vals = [res[n].get(key, {"value": np.nan, "ci_lo": np.nan, "ci_hi": np.nan}) for n in names]
        v = np.array([x["value"] for x in vals], float) * k
        lo = np.array([x["ci_lo"] for x in vals], float) * k
        hi = np.array([x["ci_hi"] for x in vals], float) * k
        err = np.nan_to_num(np.vstack([v - lo, hi - v]).clip(min=0))
        ax.bar(range(len(names)), np.nan_to_num(v), yerr=err, capsize=3,
               color=["#888" if not n.endswith("steer") else "#3a7" for n in names])
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.set_ylim(bottom=0)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_eval(a: argparse.Namespace) -> int:
    from sfcl.anchors.corpus import read_corpus

    configs = parse_configs(a.configs)
    if a.docs < 1 or a.questions_per_doc < 0 or a.max_tokens < 1 or a.bootstrap < 1:
        raise ValueError("--docs and --max-tokens must be >= 1, --questions-per-doc >= 0, --bootstrap >= 1")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    docs = read_corpus(a.data)[: a.docs]
    built = build(a)
    eng = built.engine
    try:
        if built.library is None:
            raise ValueError("snapshots are unavailable (no anchor library); sfcl eval needs one")
        budget = min(a.max_doc_tokens, eng.max_model_len - max(a.max_tokens, a.summary_tokens) - 256)
        items, notes = build_items(docs, eng.tokenizer, eng.encode_chat, questions_per_doc=a.questions_per_doc,
                                   seed=a.seed, max_tokens=a.max_tokens, summary_tokens=a.summary_tokens,
                                   max_doc_tokens=budget, summary=not a.no_summary)
        if not items:
            raise ValueError("no questions could be generated from the selected documents")
        print(f"sfcl eval: {len(items)} items from {len(docs)} documents, configurations: "
              f"{', '.join(n for n, _, _ in configs)}", file=sys.stderr)
        run_items(eng, items[:1], snapshot_mode="off", steer=False, progress=False)  # warm-up, discarded
        recs, walls = run_configs(eng, items, configs, a.order, a.max_num_seqs * 2)
    finally:
        eng.shutdown()
    errors = [(n, r.key, r.error) for n, rs in recs.items() for r in rs if r.error]
    cols = {n: score(items, rs) for n, rs in recs.items()}
    texts = {n: [r.text for r in rs] for n, rs in recs.items()}
    names = [n for n, _, _ in configs]
    res = metrics(cols, names, texts, a.bootstrap, a.seed)
    for n in names:
        res[n]["wall_s"] = walls[n]
        res[n]["wall_tokens_per_s"] = res[n]["tokens"] / walls[n] if walls[n] > 0 else None
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    dtype = str(next(built.lm.model.parameters()).dtype).removeprefix("torch.")  # what --dtype auto resolved to
    meta = {"date": when, "command": "sfcl " + " ".join(sys.argv[1:]) if sys.argv[0].endswith(("sfcl", "cli.py")) else None,
            "model": built.lm.name, "anchors": str(built.library.path), "n_anchors": built.library.n_anchors,
            "docs": len(docs), "items": len(items), "seed": a.seed, "max_tokens": a.max_tokens,
            "summary_tokens": a.summary_tokens, "max_doc_tokens": budget, "bootstrap": a.bootstrap,
            "device": a.device, "dtype": dtype, "documents": notes, "errors": errors}
    per_item = [{"key": it.key, "doc_id": it.meta["question"].doc_id, "type": it.meta["question"].type,
                 "question": it.meta["question"].question, "gold": it.meta["question"].gold_texts,
                 "answers": {n: {"text": recs[n][i].text, "correct": bool(cols[n]["correct"][i]),
                                 "entities": int(cols[n]["entities"][i]), "unsupported": int(cols[n]["unsupported"][i]),
                                 "lookups": recs[n][i].lookups, "tokens": recs[n][i].completion_tokens}
                             for n in names}} for i, it in enumerate(items)]
    (out / "eval.json").write_text(json.dumps({"meta": meta, "metrics": res, "items": per_item}, indent=1, default=str))
    md = (f"Evaluation on {len(docs)} ContractNLI NDAs, {len(items)} items ({sum(1 for it in items if it.meta['question'].gold)} "
          f"QA), model {built.lm.name}, {built.library.n_anchors} anchors, greedy, {a.device}/{dtype}, {when}; "
          f"95% paired bootstrap CIs ({a.bootstrap} replicates).\n\n" + table(res) + "\n")
    (out / "eval.md").write_text(md)
    plot(res, out / "eval.png", f"sfcl eval: {len(docs)} NDAs, {len(items)} items, {built.lm.name}")
    print(md)
    print(f"sfcl eval: wrote {out / 'eval.md'}, {out / 'eval.json'}, {out / 'eval.png'}", file=sys.stderr)
    if errors:
        print(f"sfcl eval: {len(errors)} requests ended with an error (see eval.json meta.errors)", file=sys.stderr)
        return 1
    return 0


def add_parser(sub) -> None:
    """``sfcl eval`` on the top-level subparsers."""
    p = sub.add_parser("eval", help="entity-consistency evaluation on ContractNLI NDAs (snapshot mode x steering)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", nargs="+", default=[DEFAULT_DATA], help="ContractNLI .json (or any corpus read_corpus reads)")
    p.add_argument("--docs", type=int, default=8, help="use the first N documents")
    p.add_argument("--questions-per-doc", type=int, default=4, help="QA questions per document (plus one summary)")
    p.add_argument("--no-summary", action="store_true", help="skip the per-document summarisation task")
    p.add_argument("--max-tokens", type=int, default=48, help="generated tokens at most per QA answer")
    p.add_argument("--summary-tokens", type=int, default=128, help="generated tokens at most per summary")
    p.add_argument("--max-doc-tokens", type=int, default=6000,
                   help="document tokens at most per prompt; longer documents are cut around the gold spans")
    p.add_argument("--configs", default=",".join(ALL_CONFIGS),
                   help=f"comma-separated configurations out of {', '.join(ALL_CONFIGS)}")
    p.add_argument("--order", default="doc", choices=["doc", "config"],
                   help="doc: all configurations document by document (rotated order; spreads machine load "
                        "evenly); config: one configuration after another over all items (bigger batches)")
    p.add_argument("--seed", type=int, default=0, help="question selection and bootstrap seed")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap replicates for the 95%% CIs")
    p.add_argument("--out", default="eval-out", help="output directory (eval.md, eval.json, eval.png)")
    add_engine_flags(p)
    p.set_defaults(fn=cmd_eval)
