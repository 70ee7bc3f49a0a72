"""Benchmark prompts: short varied prompts from the bundled sample corpus, and one long ContractNLI
NDA with several questions (the long-document QA workload).

The sample corpus (``sfcl/anchors/sample_corpus``) is original text written for this project;
ContractNLI (Koreeda & Manning 2021, CC BY 4.0) is read at run time from
``sfcl.config.contractnli_path()`` (``$SFCL_DATA_DIR`` or ``../shared/data/contractnli``) and
never copied. Prompts are chat messages (OpenAI format); every system sees the same ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from sfcl.config import contractnli_path

SAMPLE_CORPUS = Path(__file__).resolve().parents[1] / "anchors" / "sample_corpus"
CONTRACTNLI_DEV = contractnli_path()  # sfcl.eval.run's default; resolved at import
CHARS_PER_TOKEN = 4.0  # rough English BPE ratio, only used to pick a document of about the right size

INSTRUCTIONS = (
    "Explain the following passage in plain language, point by point:",
    "Summarise the obligations in this text and say who carries each one:",
    "Rewrite this clause as a short checklist, then comment on each item:",
    "What risks does this passage create for the parties? Discuss in detail:",
)


@dataclass(slots=True, frozen=True)
class LongDoc:
    """One long document and the questions asked about it, in order (the first one is cold)."""

    doc_id: str
    text: str
    questions: tuple[str, ...]

    def messages(self, i: int) -> list[dict]:
        """Chat messages for question i: the document first, so all questions share its prefix."""
        return [{"role": "user", "content": f"{self.text}\n\nQuestion: {self.questions[i]} Answer briefly."}]


def _paragraphs(text: str) -> list[str]:
    parts = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
    return [p for p in parts if 200 <= len(p) <= 900 and not p.startswith("#")]


def short_prompts(n: int, corpus: Path = SAMPLE_CORPUS) -> list[list[dict]]:
    """``n`` varied short chat prompts (one instruction + one corpus paragraph, ~60-250 tokens).

    Deterministic: the same n gives the same prompts. Raises FileNotFoundError if the corpus is
    missing and ValueError if it has no usable paragraph or n < 1."""
    if n < 1:
        raise ValueError("need at least one prompt")
    files = sorted(p for p in Path(corpus).glob("*") if p.suffix in (".md", ".txt"))
    if not files:
        raise FileNotFoundError(f"no .md/.txt files in {corpus}")
    paras = [p for f in files for p in _paragraphs(f.read_text(encoding="utf-8"))]
    if not paras:
        raise ValueError(f"no paragraph of 200-900 characters in {corpus}")
    out = []
    for i in range(n):
        para = paras[(i * 7) % len(paras)]  # stride 7: neighbouring requests come from different files
        out.append([{"role": "user", "content": f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]}\n\n{para}"}])
    return out


def long_document(path: Path | None = None, target_tokens: int = 4000, n_questions: int = 5,
                  index: int = 0) -> LongDoc:
    """The ContractNLI NDA whose length is the ``index``-th closest to ``target_tokens`` (estimated at
    4 characters per token), with ``n_questions`` questions built from ContractNLI hypotheses.
    ``path``: the ContractNLI JSON file (None: ``sfcl.config.contractnli_path()``).

    Raises FileNotFoundError when the data is missing, ValueError on bad arguments."""
    import json

    if n_questions < 1 or target_tokens < 1:
        raise ValueError("n_questions and target_tokens must be >= 1")
    path = Path(path) if path is not None else contractnli_path()
    if not path.is_file():
        raise FileNotFoundError(f"ContractNLI not found at {path} (expected ../shared/data/contractnli/dev.json, "
                                "or set SFCL_DATA_DIR to the directory holding contractnli/dev.json)")
    data = json.loads(path.read_text(encoding="utf-8"))
    docs = sorted(data["documents"], key=lambda d: (abs(len(d["text"]) - target_tokens * CHARS_PER_TOKEN), d["id"]))
    doc = docs[index % len(docs)]
    hyps = [v["hypothesis"] for _, v in sorted(data["labels"].items(), key=lambda kv: int(kv[0].split("-")[-1]))]
    qs = tuple(f"Is this true of the agreement: {h}" for h in hyps[:n_questions])
    while len(qs) < n_questions:  # more questions than hypotheses: ask again (still a cache hit)
        qs = qs + qs[: n_questions - len(qs)]
    return LongDoc(doc_id=str(doc["id"]), text=doc["text"], questions=qs)


def tagged(prompts: list[list[dict]], tag: str) -> list[list[dict]]:
    """Copies of ``prompts`` whose first user message starts with ``Ref <tag>-<i>.``.

    Why: a server with a prefix KV cache would otherwise reuse the KV of a prompt it saw in an
    earlier level or snapshot mode, and later runs would look faster than they are. The tag breaks
    the shared prefix right after the chat template's header, the same way for every system."""
    out = []
    for i, msgs in enumerate(prompts):
        m = [dict(x) for x in msgs]
        first = next(j for j, x in enumerate(m) if x["role"] == "user")
        m[first]["content"] = f"Ref {tag}-{i}. {m[first]['content']}"
        out.append(m)
    return out
