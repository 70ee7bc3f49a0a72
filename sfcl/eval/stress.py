"""``sfcl stress``: the source design's anchor stress test (``docs/SEED.md``, "Stress test").

Three families of high-risk prompts, generated from contracts by rules (no model):

- ``entity_blank``: a clause number left blank ("Under clause __ of the agreement, the provisions
  on <a section title of the document> require that ...");
- ``numeric_jump``: figures of the document (durations, amounts; synthetic dollar amounts when the
  document has fewer than two) whose total is left blank ("... the total is __");
- ``mixed_citation``: several clauses of the document cited together with its governing law.

Each prompt carries a short excerpt of the document around the spans it uses. The prompts run in
``triggered`` mode, greedily, family after family, either in-process through the real engine
(``sfcl.eval.drive``) or against a running server (``--url``, ``sfcl.client``), and the run reports
per family and overall: anchor lookups (``snapshot_triggered`` events), trigger rate per minute of
wall time, and per 1,000 generated tokens, and whether the chosen rate lies in the healthy band
(the seed: 1.8-2.2 per minute). Per-minute rates scale with the server's throughput (a faster
server generates more tokens, hence more triggers, per minute); the per-1,000-token rate is the
portable one, and ``--band-metric`` selects which the band applies to.
"""

from __future__ import annotations

import json
import random
import re
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

from sfcl.anchors.corpus import Document
from sfcl.eval.drive import EngineSpec
from sfcl.eval.questions import AMOUNT_RE, DURATION_RE, Question, Span, fit_document, law_questions, section_questions

FAMILIES = ("entity_blank", "numeric_jump", "mixed_citation")
SEED_BAND = (1.8, 2.2)  # lookups per minute, the source design's healthy stress-test band


@dataclass(slots=True)
class StressPrompt:
    family: str  # one of FAMILIES
    doc_id: str
    instruction: str  # the high-risk part of the prompt
    excerpt: str  # document text shown before it
    spans: list[str]  # document spans the instruction is built from

    @property
    def text(self) -> str:
        return f"Contract excerpt:\n{self.excerpt}\n\n{self.instruction}"


def _sections(doc: Document) -> list[tuple[Span, Span]]:
    """(number span, title span) pairs of the document's numbered headings."""
    qs = [q for q in section_questions(doc) if q.type == "section_title"]
    out = []
    for q in qs:
        n = re.search(r"section (\d+)\?$", q.question).group(1)
        out.append((Span(-1, -1, n), q.gold[0]))
    return out


def _excerpt(doc: Document, spans: list[Span], max_chars: int) -> str:
    q = Question("x", doc.doc_id, "stress", "", [s for s in spans if s.start >= 0])
    text, _, _ = fit_document(doc.text, [q], max_chars)
    return text


def stress_prompts(doc: Document, seed: int = 0, excerpt_chars: int = 1500) -> list[StressPrompt]:
    """One prompt per family for ``doc`` (deterministic in doc and seed)."""
    rng = random.Random(zlib.crc32(doc.doc_id.encode()) ^ seed)
    secs = _sections(doc)
    law = law_questions(doc)
    law_span = law[0].gold[0] if law else None
    out = []
    # entity blank
    if secs:
        _, title = rng.choice(secs)
        instr = (f'Fill in the blank with the exact clause number and continue the sentence: "Under clause __ of '
                 f'the agreement, the provisions on {title.text} require that"')
        spans = [title]
    else:
        instr = ('Fill in the blank with the exact clause number and continue the sentence: "Under clause __ of the '
                 'agreement, the Receiving Party must"')
        spans = []
    out.append(StressPrompt("entity_blank", doc.doc_id, instr, _excerpt(doc, spans, excerpt_chars), [s.text for s in spans]))
    # numeric jump
    nums = [m for m in AMOUNT_RE.finditer(doc.text)] or []
    if len(nums) < 2:
        nums += list(DURATION_RE.finditer(doc.text))
    figs = [Span(m.start(), m.end(), m.group(0)) for m in nums]
    uniq: dict[str, Span] = {}
    for s in figs:
        uniq.setdefault(s.text.casefold(), s)
    figs = list(uniq.values())
    if len(figs) >= 2:
        pick = rng.sample(figs, min(3, len(figs)))
        listed = ", ".join(s.text for s in pick[:-1]) + f" and {pick[-1].text}"
        instr = (f"The agreement states {listed}. Add these figures up and state the total: the total is __. "
                 f"Then list each figure with the clause it comes from.")
        spans = pick
    else:
        a, b, c = (rng.randrange(10, 900) * 250 for _ in range(3))
        instr = (f"A payment of ${a:,} is due on signing, ${b:,} after thirty (30) days and ${c:,} at the end of the "
                 f"term. The total amount payable under the agreement is $__. Fill in the total and cite the clause "
                 f"that sets each payment.")
        spans = []
    out.append(StressPrompt("numeric_jump", doc.doc_id, instr, _excerpt(doc, spans, excerpt_chars), [s.text for s in spans]))
    # mixed citations
    pick = rng.sample(secs, min(3, len(secs))) if secs else []
    cites = ", ".join(f"Section {n.text} ({t.text})" for n, t in pick) or "the confidentiality clause, the term clause"
    law_txt = f"the laws of the {law_span.text}" if law_span is not None else "the governing law"
    instr = (f"In one paragraph, explain how {cites} and {law_txt} interact, citing each clause by its number and "
             f"naming the parties and any time limits they set.")
    spans = [t for _, t in pick] + ([law_span] if law_span is not None else [])
    out.append(StressPrompt("mixed_citation", doc.doc_id, instr, _excerpt(doc, spans, excerpt_chars),
                            [s.text for s in spans]))
    return out


@dataclass(slots=True)
class FamilyStats:
    family: str
    requests: int
    lookups: int  # snapshot lookups (triggered mode)
    tokens: int  # generated tokens
    wall_s: float  # wall time of this family's batch

    @property
    def per_minute(self) -> float:
        return 60.0 * self.lookups / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def per_1k_tokens(self) -> float:
        return 1000.0 * self.lookups / self.tokens if self.tokens > 0 else float("nan")


def combine(fams: list[FamilyStats]) -> FamilyStats:
    return FamilyStats("all", sum(f.requests for f in fams), sum(f.lookups for f in fams),
                       sum(f.tokens for f in fams), sum(f.wall_s for f in fams))


def in_band(value: float, band: tuple[float, float]) -> bool:
    """lo <= value <= hi (NaN is never in the band)."""
    return band[0] <= value <= band[1]


def parse_band(text: str) -> tuple[float, float]:
    """"1.8,2.2" -> (1.8, 2.2). Raises ValueError on malformed or reversed bands."""
    try:
        lo, hi = (float(t) for t in text.split(","))
    except ValueError as e:
        raise ValueError(f"--band must be LO,HI (got {text!r})") from e
    if not 0 <= lo <= hi:
        raise ValueError(f"--band needs 0 <= LO <= HI (got {text!r})")
    return lo, hi


def report(fams: list[FamilyStats], band: tuple[float, float], metric: str) -> dict:
    rows = fams + [combine(fams)]
    key = "per_minute" if metric == "per_minute" else "per_1k_tokens"
    return {"band": list(band), "band_metric": metric,
            "families": [{**asdict(f), "per_minute": f.per_minute, "per_1k_tokens": f.per_1k_tokens,
                          "in_band": in_band(getattr(f, key), band)} for f in rows]}


def table(rep: dict) -> str:
    lo, hi = rep["band"]
    unit = "per minute" if rep["band_metric"] == "per_minute" else "per 1k tokens"
    lines = [f"healthy band: {lo:g}-{hi:g} lookups {unit}", "",
             "| family | requests | tokens | lookups | lookups / min | lookups / 1k tok | in band |",
             "|---|---|---|---|---|---|---|"]
    for f in rep["families"]:
        lines.append(f"| {f['family']} | {f['requests']} | {f['tokens']} | {f['lookups']} | {f['per_minute']:.2f} | "
                     f"{f['per_1k_tokens']:.1f} | {'yes' if f['in_band'] else 'no'} |")
    return "\n".join(lines)


def _run_url(url: str, api_key: str | None, prompts: list[StressPrompt], max_tokens: int) -> tuple[int, int]:
    from sfcl.client import SFCLClient, Snapshot, Stop

    lookups = tokens = 0
    with SFCLClient(url, api_key=api_key) as client:
        for p in prompts:
            for ev in client.stream_messages(p.text, max_tokens=max_tokens, snapshot_mode="triggered", temperature=0.0):
                if isinstance(ev, Snapshot):
                    lookups += 1
                elif isinstance(ev, Stop):
                    tokens += int(ev.usage.get("output_tokens") or 0)
    return lookups, tokens


@dataclass(kw_only=True)
class StressConfig(EngineSpec):
    """``sfcl stress`` (fields = the command's flags, see ``sfcl stress --help``)."""

    url: str | None  # a server to run against; None = an in-process engine
    api_key: str | None
    data: list[str]
    docs: int
    max_tokens: int
    excerpt_chars: int
    band: str  # "LO,HI"
    band_metric: str  # per_minute | per_1k_tokens
    strict: bool
    steer: bool
    seed: int
    out: str | None


def run_stress(a: StressConfig) -> int:
    """Run the three stress families, print the table, write stress.json/.md under ``a.out``.
    Returns 1 when ``a.strict`` and the overall rate is outside the band, else 0. Raises
    ValueError for bad settings or a missing library."""
    from sfcl.anchors.corpus import read_corpus

    band = parse_band(a.band)
    if a.docs < 1 or a.max_tokens < 1:
        raise ValueError("--docs and --max-tokens must be >= 1")
    docs = read_corpus(a.data)[: a.docs]
    prompts = [p for d in docs for p in stress_prompts(d, a.seed, a.excerpt_chars)]
    fams: list[FamilyStats] = []
    if a.url:
        for fam in FAMILIES:
            ps = [p for p in prompts if p.family == fam]
            t0 = time.perf_counter()
            lk, tk = _run_url(a.url, a.api_key, ps, a.max_tokens)
            fams.append(FamilyStats(fam, len(ps), lk, tk, time.perf_counter() - t0))
    else:
        from sfcl.eval.drive import Item, build, run_items

        built = build(a)
        eng = built.engine
        try:
            if built.library is None:
                raise ValueError("snapshots are unavailable (no anchor library)")
            for fam in FAMILIES:
                ps = [p for p in prompts if p.family == fam]
                items = [Item(f"{p.doc_id}#{fam}", eng.encode_chat([{"role": "user", "content": p.text}]), a.max_tokens)
                         for p in ps]
                recs, wall = run_items(eng, items, snapshot_mode="triggered", steer=a.steer, desc=f"stress {fam}")
                fams.append(FamilyStats(fam, len(ps), sum(r.lookups for r in recs),
                                        sum(r.completion_tokens for r in recs), wall))
        finally:
            eng.shutdown()
    rep = report(fams, band, a.band_metric)
    rep.update({"url": a.url, "docs": len(docs), "max_tokens": a.max_tokens, "seed": a.seed,
                "prompts": [{"family": p.family, "doc_id": p.doc_id, "instruction": p.instruction} for p in prompts]})
    print(table(rep))
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "stress.json").write_text(json.dumps(rep, indent=1))
        (out / "stress.md").write_text(table(rep) + "\n")
    overall = rep["families"][-1]
    if a.strict and not overall["in_band"]:
        print(f"sfcl stress: overall trigger rate outside the healthy band {band[0]:g}-{band[1]:g}", file=sys.stderr)
        return 1
    return 0
