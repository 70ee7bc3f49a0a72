"""Steering settings (which mechanisms a request asked for, what steering did to a token) and the
library-anchor kNN-LM mixture, one of the three mechanisms.

``steer`` on a request (both APIs, ``sfcl generate``, ``SamplingParams.steer``) names the
mechanisms applied when a trigger fires (``sfcl.snapshot.mechanisms.parse_steer``): ``"source"`` (source-constrained
entities, ``sfcl.snapshot.source``), ``"cad"`` (trigger-gated adaptive context-aware decoding,
``sfcl.snapshot.cad``), ``"knn"`` (the library-anchor mixture below), a ``+``-joined combination
(applied as cad, knn, then source), ``true`` = ``DEFAULT_STEER`` (the mechanism that measured best,
docs/fidelity.md), ``false`` / ``"off"`` = none. ``sfcl.snapshot.grounding`` applies them.

kNN-LM mixture:

Follows kNN-LM (Khandelwal et al. 2020, "Generalization through Memorization: Nearest Neighbor
Language Models"): p(y) = (1 - lam) * p_model(y) + lam * p_anchors(y), with an adaptive
interpolation weight in the spirit of He et al. 2021 ("Efficient Nearest Neighbor Language
Models"): lam = lam_max * confidence, where confidence is the snapshot's anchor confidence in
[0, 1] (``sfcl.snapshot.triggers.anchor_confidence``), so a weak match barely moves the model.

``p_anchors`` combines the retrieved anchors' next-token distributions (the library stores a
top-K list per anchor; a context anchor's list is the one-hot next prompt token) with weights
softmax(similarity / tau) over the retrieved anchors. A stored top-K list covers only part of
an anchor's mass m (library anchors are clusters, their lists often hold 20-60 %); the unknown
tail 1 - m backs off to the model distribution instead of being invented or renormalised away:
p = (1 - lam * m) * p_model + lam * q, q = the combined top-K mass. A diffuse cluster therefore
moves the model little, a context anchor (one-hot, m = 1) as much as lam allows.

Called by the model runner on the CPU, only for rows that looked up an anchor and asked for
steering; everything here is (n, V) float32 on the CPU, n = steered rows of one step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

@dataclass(slots=True)
class SteerConfig:
    lambda_max: float = 0.5  # interpolation weight at confidence 1 (kNN-LM tunes ~0.25 on text)
    tau: float = 0.1  # softmax temperature over anchor similarities (cosine, so ~0.1 is sharp-ish)

    def __post_init__(self) -> None:
        if not 0.0 <= self.lambda_max <= 1.0:
            raise ValueError("lambda_max must be in [0, 1]")
        if self.tau <= 0:
            raise ValueError("tau must be > 0")


@dataclass(slots=True)
class SteerInfo:
    """What steering did to one token (crosses into the engine's update as part of a SnapshotHit)."""

    mechanism: str  # the mechanisms applied, "+"-joined ("source", "cad+source", ...)
    original_token: int  # token the model alone had sampled
    token: int  # token emitted
    changed: bool  # token != original_token
    supported: bool | None = None  # source: the emitted token continues a prompt span (None: not checked)
    source_span: tuple[int, int] | None = None  # source: prompt token positions [start, end) of that span
    reason: str = ""  # why nothing was changed: "not_entity", "no_source", "no_supported_candidate", "no_document", ...
    lam: float | None = None  # knn: interpolation weight used, lambda_max * confidence
    alpha: float | None = None  # cad: contrast weight used (JS divergence, bits)


def anchor_distribution(scores: torch.Tensor, next_ids: torch.Tensor, next_probs: torch.Tensor,
                        vocab_size: int, tau: float) -> torch.Tensor:
    """Combine retrieved anchors' next-token lists into one distribution per row.

    scores: (n, k) float32 cosine similarities of the k retrieved anchors (-inf marks a missing one).
    next_ids: (n, k, K) int64 token ids (-1 = padding). next_probs: (n, k, K) float32 (0 at padding).
    Returns q (n, V) float32: sum_j w_j * list_j, with row mass in [0, 1] (the weighted share of
    the anchors' next-token mass their top-K lists cover).
    """
    w = torch.softmax(scores / tau, dim=1)  # (n, k)
    valid = next_ids >= 0
    probs = torch.where(valid, next_probs.float(), torch.zeros_like(next_probs, dtype=torch.float32))
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(1.0)  # a list never holds more than mass 1
    n, k, K = next_ids.shape
    out = torch.zeros(n, vocab_size, dtype=torch.float32)
    out.scatter_add_(1, next_ids.clamp_min(0).reshape(n, k * K), (w[:, :, None] * probs).reshape(n, k * K))
    return out


def interpolate(logits: torch.Tensor, p_anchors: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """kNN-LM mixture as log-probabilities ("logits" for the sampler).

    logits: (n, V) float32 model logits; p_anchors: (n, V) float32 from ``anchor_distribution``
    (row mass m in [0, 1]); lam: (n,) float32 in [0, 1].
    Returns (n, V) float32 log((1 - lam * m) * softmax(logits) + lam * p_anchors): rows sum to 1.
    """
    m = p_anchors.sum(1, keepdim=True)  # (n, 1)
    lam = lam.float()[:, None]  # (n, 1)
    p = (1.0 - lam * m) * torch.softmax(logits.float(), dim=-1) + lam * p_anchors
    return p.clamp_min(1e-30).log()  # log(0) would make temperature scaling produce NaN
