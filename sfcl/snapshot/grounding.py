"""Grounded correction of a triggered token, before it is emitted: the steering mechanisms of a
request (``sfcl.snapshot.steering.parse_steer``) applied in order cad -> knn -> source.

Called by the model runner on the engine thread, only for rows whose trigger fired and whose
request steers (nothing here runs on other tokens): the row's model logits are on the host
already (the runner brings them over with the looked-up hidden state).

1. ``cad``: the no-document side sequence is caught up (one forward for all such rows of the
   step, ``sfcl.snapshot.cad.ContextFreeSequences``) and the distribution becomes the AdaCAD
   contrast (alpha = JS divergence);
2. ``knn``: the library-anchor kNN-LM mixture (``sfcl.snapshot.steering``; lambda = lambda_max *
   snapshot confidence);
3. where 1 or 2 changed the distribution the token is drawn again from it (same sampler, same
   per-request generator); otherwise the model's token stays;
4. ``source``: if that token is inside an entity-like span, the model's top-k candidates whose
   entity so far is a span of the prompt (``sfcl.snapshot.source``) are re-ranked by log p plus
   ``span_bonus`` per token of the prompt span they extend (capped), and the token is drawn from
   them like the model's own (greedy: the best); when no candidate is supported the model's
   token stays and the event says ``supported: false``.

Per-request host state: the prompt's ``SourceIndex`` (built when the prompt's last chunk is
prefilled, ``prepare``) and the CAD side sequence; ``release`` drops both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sfcl.model.sampler import sample
from sfcl.snapshot import entity
from sfcl.snapshot.cad import ContextFreeSequences, contrast, js_divergence
from sfcl.snapshot.source import (NUM_END, NUM_START, SourceConfig, SourceIndex, canonical_run, canonical_table, is_number,
                                  marked, number_joiners, number_support, repeats_ngram, token_texts)
from sfcl.snapshot.steering import SteerInfo, anchor_distribution, interpolate


@dataclass(slots=True)
class SteerRow:
    """One triggered token of a steering request (host data only)."""

    request_id: str
    mechanisms: tuple[str, ...]  # parse_steer order
    prompt_ids: list[int]
    output_ids: list[int]  # tokens emitted before this one
    token: int  # the model's sampled token
    temperature: float
    top_p: float
    generator: torch.Generator | None  # CPU generator of sampled rows
    cad_prompt_ids: list[int] | None = None  # the request without its document (None: none found)
    hit: object = None  # the row's SnapshotHit (knn reads its anchors and confidence)
    snap: object = None  # the Snapshotter of that hit (knn: next-token lists, SteerConfig)


class Grounding:
    """Steering state and rules for one engine (one tokenizer vocabulary, one model).

    class_table: (V,) entity class bits (``sfcl.snapshot.entity.vocab_class_table``), any device;
    canon: ``sfcl.snapshot.source.canonical_table`` (per token id, its canonical ids); cad: the side sequences (None: requests that
    ask for ``cad`` get ``reason: "cad_unavailable"``)."""

    def __init__(self, class_table: torch.Tensor, canon: list[tuple[int, ...]], cad: ContextFreeSequences | None = None,
                 source: SourceConfig | None = None, plausibility: float = 0.1, joiners: dict[int, int] | None = None):
        self.classes = class_table.cpu().tolist()
        self.canon = canon
        self.joiners = joiners or {}  # ``source.number_joiners``: "." / "," inside a number, for the number check
        self.cad = cad
        self.cfg = source or SourceConfig()
        self.plausibility = plausibility
        self.indexes: dict[str, SourceIndex] = {}

    @classmethod
    def for_model(cls, lm, n_slots: int, device: str = "cpu", class_table: torch.Tensor | None = None,
                  side_len: int = 1024) -> "Grounding":
        """Built from a ``LoadedModel``: its vocabulary tables (class_table: the snapshotter's, when
        at hand) and a side KV cache of ``n_slots`` rows x ``side_len`` positions for CAD."""
        if class_table is None:
            class_table = entity.vocab_class_table(lm.tokenizer, lm.args.vocab_size)
        dtype = next(lm.model.parameters()).dtype
        texts = token_texts(lm.tokenizer, lm.args.vocab_size)  # decoded once for both tables
        return cls(class_table, canonical_table(lm.tokenizer, lm.args.vocab_size, texts),
                   ContextFreeSequences(lm.model, lm.args, n_slots, side_len, dtype, device),
                   joiners=number_joiners(lm.tokenizer, lm.args.vocab_size, texts))

    def prepare(self, request_id: str, prompt_ids: list[int]) -> None:
        """Build the request's source index (once; the runner calls it at the prompt's last chunk of
        every request with snapshots: the ``unsupported_number`` trigger reads it too)."""
        if request_id not in self.indexes:
            self.indexes[request_id] = SourceIndex(prompt_ids, self.canon, self.joiners)

    def number_signal(self, request_id: str, output_ids: list[int], token: int) -> float:
        """The ``unsupported_number`` trigger's signal for ``token`` sampled after ``output_ids``
        (``sfcl.snapshot.source.number_support``): 1.0 / 0.0 on number tokens; NaN on other tokens,
        without a source index, or when the prompt is shorter than ``min_source_tokens``."""
        idx = self.indexes.get(request_id)
        if idx is None or not self.canon:
            return math.nan
        return number_support(idx, output_ids, token, self.canon, self.cfg.min_source_tokens)

    def release(self, request_id: str) -> None:
        self.indexes.pop(request_id, None)
        if self.cad is not None:
            self.cad.release(request_id)

    def steer(self, rows: list[SteerRow], logits: torch.Tensor) -> list[tuple[int, SteerInfo]]:
        """Apply each row's mechanisms. logits: (n, V) float32 model logits on the host, one row
        per ``rows`` entry. Returns per row (token to emit, what was done)."""
        lp = torch.log_softmax(logits.float(), -1)  # (n, V) the model's distribution
        info = [SteerInfo(mechanism="+".join(r.mechanisms), original_token=r.token, token=r.token, changed=False)
                for r in rows]
        moved = [False] * len(rows)  # did cad / knn change the distribution?
        cad_rows = [j for j, r in enumerate(rows) if "cad" in r.mechanisms]
        if cad_rows:
            self._cad(rows, cad_rows, lp, info, moved)
        for j, r in enumerate(rows):
            if "knn" in r.mechanisms:
                lam = r.snap.steer.lambda_max * r.hit.confidence
                info[j].lam = lam
                if lam > 0:  # lambda 0 leaves the distribution as it was
                    sc, nid, npr = r.snap.next_lists([r.hit])
                    q = anchor_distribution(sc, nid, npr, lp.shape[1], r.snap.steer.tau)  # (1, V)
                    lp[j] = interpolate(lp[j:j + 1], q, torch.tensor([lam]))[0]
                    moved[j] = True
        tokens = [r.token for r in rows]
        redraw = [j for j in range(len(rows)) if moved[j]]
        if redraw:
            t = sample(lp[redraw], [rows[j].temperature for j in redraw], [rows[j].top_p for j in redraw],
                       [rows[j].generator for j in redraw]).tolist()
            for j, tok in zip(redraw, t):
                tokens[j] = tok
        for j, r in enumerate(rows):
            if "source" in r.mechanisms:
                tokens[j] = self._source(r, tokens[j], lp[j], info[j])
            info[j].token, info[j].changed = tokens[j], tokens[j] != r.token
        return [(t, i) for t, i in zip(tokens, info)]

    def _cad(self, rows: list[SteerRow], idx: list[int], lp: torch.Tensor, info: list[SteerInfo],
             moved: list[bool]) -> None:
        ask = [j for j in idx if rows[j].cad_prompt_ids]
        for j in idx:
            if not rows[j].cad_prompt_ids:
                info[j].reason = "no_document"
        if not ask:
            return
        if self.cad is None:
            for j in ask:
                info[j].reason = "cad_unavailable"
            return
        free = self.cad.logits([(rows[j].request_id, list(rows[j].cad_prompt_ids) + list(rows[j].output_ids))
                                for j in ask])
        for j, f in zip(ask, free):
            if f is None:
                info[j].reason = "cad_context_too_long"
                continue
            lf = torch.log_softmax(f.float(), -1)[None]  # (1, V)
            alpha = js_divergence(lp[j:j + 1], lf)  # (1,)
            info[j].alpha = float(alpha)
            lp[j] = contrast(lp[j:j + 1], lf, alpha, self.plausibility)[0]
            moved[j] = True

    def _source(self, r: SteerRow, tok: int, lp: torch.Tensor, info: SteerInfo) -> int:
        """Source re-rank of one row's token ``tok`` under log-probabilities lp (V,)."""
        idx = self.indexes.get(r.request_id)
        if idx is None or len(idx) == 0:
            info.reason = info.reason or "no_source"
            return tok
        states = entity.span_states(r.output_ids, self.classes)
        prev = states[-1] if states else entity.SENT_END
        if not entity.next_state(self.classes[tok], prev) & entity.IN_ENTITY:
            info.reason = info.reason or "not_entity"
            return tok
        cap = self.cfg.copy_cap
        # the answer's recent tokens as a canonical run (numbers delimited; its last number still open)
        first = max(0, len(r.output_ids) - 2 * (cap + 1))
        hist, src = canonical_run(r.output_ids[first:], self.canon, closed=False)
        ent = len(states)  # the entity so far: the trailing tokens inside an entity-like span
        while ent > first and states[ent - 1] & entity.IN_ENTITY:
            ent -= 1
        run = sum(1 for p in src if p + first >= ent)  # its canonical ids (before this token)
        if NUM_START in hist[len(hist) - run:]:  # inside a number: the number itself must be a prompt number
            run = len(hist) - max(j for j in range(len(hist) - run, len(hist)) if hist[j] == NUM_START)
        hist = hist[-(cap + 1):]
        prev_num = bool(r.output_ids) and is_number(self.canon[r.output_ids[-1]])

        def support(c: int) -> tuple[bool, int, int]:
            cc = marked(self.canon[c], prev_num)  # the canonical ids candidate c adds to the run
            if not cc:  # punctuation: as supported as the entity run it continues
                n, end = idx.longest_suffix(hist, cap) if run else (0, -1)
                return n >= run, n, end
            n, end = idx.longest_suffix(hist + cc, cap)
            need = len(cc) if cc[0] == NUM_START else run + len(cc)  # a new number: judged from its own start
            return n >= need and n <= cap, n, end

        cands = []  # (token, log p, match length L, match end): candidates whose entity so far is a prompt span
        ok, n, end = support(tok)
        if ok:
            cands.append((tok, float(lp[tok]), n, end))
        closing = not ok and prev_num and is_number(self.canon[tok])  # the model continues an unsupported number
        if closing:  # a candidate that ends the number there is supported when the number so far is a prompt number
            n_end, end_end = idx.longest_suffix(hist + [NUM_END], cap)
            closing = n_end >= run + 1 and n_end <= cap
        p_tok = float(lp[tok].exp())
        top_p, top_i = lp.topk(self.cfg.top_k)
        for lpc, c in zip(top_p.tolist(), top_i.tolist()):
            if c == tok or lpc == float("-inf") or math.exp(lpc) < self.cfg.min_ratio * p_tok:
                continue
            if closing and not is_number(self.canon[c]):
                if not repeats_ngram(r.output_ids, c, self.cfg.ngram):
                    cands.append((c, lpc, n_end, end_end))
                continue
            if not self.canon[c] or not entity.next_state(self.classes[c], prev) & entity.IN_ENTITY:
                continue
            if repeats_ngram(r.output_ids, c, self.cfg.ngram):
                continue
            ok_c, n_c, end_c = support(c)
            if ok_c:
                cands.append((c, lpc, n_c, end_c))
        if not cands:
            info.supported = False
            info.reason = "no_supported_candidate"
            return tok
        # re-rank: log p plus a bonus per token of the prompt span the candidate extends ("for 3" beats "for 5"
        # when the document says "for three (3) years"), drawn like the model's own token (greedy: the best)
        logits = torch.full((1, lp.shape[0]), float("-inf"))
        for c, lpc, n_c, _ in cands:
            logits[0, c] = lpc + self.cfg.span_bonus * min(n_c, self.cfg.bonus_cap)
        pick = int(sample(logits, [r.temperature], [r.top_p], [r.generator])[0])
        c, _, n_c, end_c = next(x for x in cands if x[0] == pick)
        info.supported = True
        info.source_span = idx.span(end_c, n_c) if n_c else None
        return c
