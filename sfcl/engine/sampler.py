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
    """logits (B, V) float32 -> token ids (B,) int64 on the same device.

    Batched over rows: greedy rows take the max; sampled rows draw one uniform u from their own
    generator and take the inverse CDF of softmax(logits / T) (restricted to the nucleus when
    top_p < 1) at u. ``max(-1).indices`` rather than ``argmax``, and one searchsorted rather than a
    ``multinomial`` per row: on CPU those were 3 ms and ~1 ms per row over a 49k vocabulary, a
    quarter of a decode step at batch 16.
    """
    out = logits.max(-1).indices  # (B,)
    rows = [i for i, t in enumerate(temperatures) if t > MIN_TEMPERATURE]  # others: greedy
    if not rows:
        return out
    dev = logits.device
    idx = torch.tensor(rows, device=dev)
    temp = torch.tensor([float(temperatures[i]) for i in rows], device=dev, dtype=torch.float32)
    probs = torch.softmax(logits[idx].float() / temp[:, None], dim=-1)  # (n, V)
    ok = torch.isfinite(probs).all(-1)  # (n,) a degenerate row keeps its argmax
    probs = torch.where(ok[:, None], probs, torch.zeros((), device=dev))
    u = torch.stack([torch.rand((), generator=generators[i], device=dev) for i in rows])  # (n,)
    top_p = torch.tensor([max(float(top_ps[i]), MIN_TOP_P) for i in rows], device=dev)  # (n,)
    tok = torch.empty(len(rows), dtype=torch.long, device=dev)
    # which rows use a nucleus is known on the host: index tensors, not boolean masks, so that on
    # CUDA nothing here waits for the device (a mask's .any() or mask indexing would sync)
    nuc_rows = [j for j, i in enumerate(rows) if float(top_ps[i]) < 1.0]
    plain_rows = [j for j, i in enumerate(rows) if float(top_ps[i]) >= 1.0]
    if plain_rows:
        plain = torch.tensor(plain_rows, device=dev)
        cdf = probs[plain].cumsum(-1)  # (m, V)
        tok[plain] = torch.searchsorted(cdf, (u[plain] * cdf[:, -1])[:, None], right=True)[:, 0].clamp_max(cdf.shape[1] - 1)
    if nuc_rows:
        nuc = torch.tensor(nuc_rows, device=dev)
        sp, si = probs[nuc].sort(-1, descending=True)  # (m, V)
        keep = sp.cumsum(-1) - sp < top_p[nuc][:, None]  # always keeps the most likely token
        sp = torch.where(keep, sp, torch.zeros((), device=dev))
        cdf = sp.cumsum(-1)
        j = torch.searchsorted(cdf, (u[nuc] * cdf[:, -1])[:, None], right=True).clamp_max(cdf.shape[1] - 1)
        tok[nuc] = si.gather(1, j)[:, 0]
    out[idx] = torch.where(ok, tok, out[idx])
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
