"""Token sampling for a batch of rows with per-row settings (greedy, temperature, top-p).

Greedy rows take the argmax of the logits; sampled rows draw from softmax(logits / T) restricted
to the smallest set of tokens whose probability reaches top_p (nucleus sampling, Holtzman et al.
2020), each with its own ``torch.Generator`` so a request's ``seed`` reproduces its output.
"""

from __future__ import annotations

import torch

MIN_TEMPERATURE = 1e-5  # below this a temperature means greedy
MIN_TOP_P = 1e-6  # a smaller top_p keeps only the most likely token anyway


def sample(logits: torch.Tensor, temperatures: list[float], top_ps: list[float],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits (B, V) float32 -> token ids (B,) int64 on the same device."""
    out = logits.argmax(-1)  # (B,)
    for i, t in enumerate(temperatures):
        if t <= MIN_TEMPERATURE:  # 0, or so small that logits / t overflows: greedy
            continue
        probs = torch.softmax(logits[i] / t, dim=-1)  # (V,)
        if not bool(torch.isfinite(probs).all()):
            continue  # degenerate row: keep its argmax rather than fail the batch
        top_p = max(float(top_ps[i]), MIN_TOP_P)
        if top_p < 1.0:
            sp, si = probs.sort(descending=True)
            keep = sp.cumsum(-1) - sp < top_p  # always keeps the most likely token
            sp = torch.where(keep, sp, torch.zeros_like(sp))
            j = torch.multinomial(sp, 1, generator=generators[i])
            out[i] = si[j][0]
        else:
            out[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    return out


def steer_resample(logits: torch.Tensor, hits: list, snap, temperatures: list[float], top_ps: list[float],
                   generators: list[torch.Generator | None]) -> tuple[list[int], list[float], list[float]]:
    """Re-sample steered rows from the kNN-LM mixture of the model and the retrieved anchors.

    logits: (n, V) float32 model logits on the CPU; hits: n ``SnapshotHit`` (their anchors and
    confidence); snap: the ``Snapshotter`` they came from (anchor next-token lists, SteerConfig);
    generators: CPU generators (None for greedy rows).
    Returns (token ids, model log-probabilities of those tokens in nats, lambda used), n each.
    lambda = lambda_max * confidence (adaptive interpolation, He et al. 2021); the mixture is
    ``sfcl.snapshot.steering.interpolate`` (kNN-LM, Khandelwal et al. 2020).
    """
    from sfcl.snapshot.steering import anchor_distribution, interpolate

    cfg = snap.steer
    lam = torch.tensor([cfg.lambda_max * h.confidence for h in hits], dtype=torch.float32)  # (n,)
    sc, nid, npr = snap.next_lists(hits)  # (n, k), (n, k, K), (n, k, K)
    q = anchor_distribution(sc, nid, npr, logits.shape[1], cfg.tau)  # (n, V)
    mixed = interpolate(logits, q, lam)  # (n, V) log-probs
    tok = sample(mixed, temperatures, top_ps, generators)  # (n,)
    model_logp = torch.log_softmax(logits.float(), -1).gather(1, tok[:, None])[:, 0]  # (n,)
    return tok.tolist(), model_logp.tolist(), lam.tolist()
