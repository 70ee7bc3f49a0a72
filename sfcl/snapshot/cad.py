"""Trigger-gated adaptive context-aware decoding (CAD).

CAD (Shi et al. 2023, "Trusting Your Evidence: Hallucinate Less with Context-aware Decoding")
contrasts the next-token distribution with the document and without it:

    log p_cad(y) = (1 + alpha) log p(y | doc, q, a<t) - alpha log p(y | q, a<t)   (renormalised)

so tokens the document makes likelier gain and tokens the model would say anyway (its prior)
lose. A fixed alpha hurts answers that were already right; AdaCAD (Wang et al. 2024, "AdaCAD:
Adaptively Decoding to Balance Conflicts between Contextual and Parametric Knowledge") sets it
per token to the Jensen-Shannon divergence of the two distributions (base 2, in [0, 1]): where
the document changes nothing, alpha ~ 0 and the model's distribution stays. As in contrastive
decoding (Li et al. 2023) tokens below ``plausibility`` x the top probability *with* the document
are excluded, so the contrast cannot promote a token the model finds implausible.

SFCL pays for the second distribution only where a trigger fires: the no-document sequence
(the system prompt when short, and the last paragraph of the last user message: the question) is
a separate short sequence in its own small ``KVCache`` (``ContextFreeSequences``), caught up with
the answer tokens generated since its last use in one forward (all rows that need it in the step
share that forward) only when a trigger fires on a request that steers with ``cad``.

Callers: ``sfcl.snapshot.grounding``. Which part of a request is its document is decided where
the messages are (API layers, ``sfcl.eval``): ``sfcl.snapshot.mechanisms.no_document_messages``. Tensors: the side forward runs on the
model's device; the contrast on the host rows (n, V) float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sfcl.model.kv_cache import KVCache
from sfcl.model.llama import ChunkSpec, StepBatch


def js_divergence(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence in bits, (n,) in [0, 1], of rows of log-probabilities (n, V)."""
    p, q = logp.exp(), logq.exp()
    m = (0.5 * (p + q)).clamp_min(1e-30).log()
    kl = lambda a, la: (a * (la - m)).nan_to_num(0.0).sum(-1)  # noqa: E731  (0 log 0 = 0)
    return ((0.5 * kl(p, logp) + 0.5 * kl(q, logq)) / math.log(2.0)).clamp(0.0, 1.0)


def contrast(logp_ctx: torch.Tensor, logp_free: torch.Tensor, alpha: torch.Tensor,
             plausibility: float = 0.1) -> torch.Tensor:
    """CAD log-probabilities (n, V) float32 from the with-document and no-document rows (n, V)
    log-probabilities and alpha (n,); tokens with p_ctx < plausibility * max p_ctx get -inf."""
    a = alpha.float()[:, None]  # (n, 1)
    s = (1.0 + a) * logp_ctx.float() - a * logp_free.float()  # (n, V)
    keep = logp_ctx >= logp_ctx.amax(-1, keepdim=True) + math.log(plausibility)
    return torch.log_softmax(s.masked_fill(~keep, float("-inf")), -1)


@dataclass(slots=True)
class _Side:
    slot: int
    fed: int = 0  # tokens whose KV is in the slot
    last_logits: torch.Tensor | None = None  # (V,) logits after the last fed token


class ContextFreeSequences:
    """No-document side sequences in their own ``KVCache`` (n_slots rows of max_len positions;
    pages are touched only as written). Engine thread only.

    model: the ``LlamaModel``; args its ``LlamaArgs``; dtype/device its own. A request whose side
    sequence would exceed max_len, or that finds no free slot, gets None (no CAD for it)."""

    def __init__(self, model, args, n_slots: int, max_len: int, dtype: torch.dtype, device: str):
        self.model, self.device = model, device
        self.kv = KVCache(args, n_slots, max_len, dtype, device)
        self.max_len = self.kv.max_len
        self.free = list(range(n_slots))
        self.seqs: dict[str, _Side] = {}

    def release(self, request_id: str) -> None:
        s = self.seqs.pop(request_id, None)
        if s is not None:
            self.free.append(s.slot)

    @torch.no_grad()
    def logits(self, rows: list[tuple[str, list[int]]]) -> list[torch.Tensor | None]:
        """Next-token logits after each row's full side sequence (no-document prompt + answer so
        far), catching every row up in one forward. rows: (request id, token ids). Returns per
        row (V,) float32 logits on the host, or None (too long, or no slot)."""
        out: list[torch.Tensor | None] = [None] * len(rows)
        ids, positions, chunks, sample_rows, who = [], [], [], [], []
        for r, (rid, toks) in enumerate(rows):
            s = self.seqs.get(rid)
            if s is None:
                if not self.free or len(toks) > self.max_len:
                    continue
                s = self.seqs[rid] = _Side(self.free.pop())
            if len(toks) > self.max_len or len(toks) < s.fed or not toks:
                continue
            if len(toks) == s.fed:  # nothing new since the last use
                out[r] = s.last_logits
                continue
            new = toks[s.fed:]
            chunks.append(ChunkSpec(slot=s.slot, start=s.fed, offset=len(ids), length=len(new)))
            ids.extend(new)
            positions.extend(range(s.fed, len(toks)))
            sample_rows.append(len(ids) - 1)
            who.append((r, s, len(toks)))
        if chunks:
            dev = self.device
            step = StepBatch(positions=torch.tensor(positions, device=dev), decode=None, chunks=chunks,
                             sample_index=torch.tensor(sample_rows, device=dev))
            so = self.model.forward_step(torch.tensor([ids], device=dev), step, self.kv, 0)
            lg = so.logits.float().cpu()  # (m, V)
            for j, (r, s, n) in enumerate(who):
                s.fed, s.last_logits = n, lg[j]
                out[r] = lg[j]
        return out
