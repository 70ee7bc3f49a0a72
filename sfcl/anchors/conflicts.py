"""Conflict check between domain and general anchors (``sfcl anchors conflicts``).

A domain anchor that sits among general anchors competes with them in every snapshot lookup
near it: either it duplicates general content (wasted, and its weight skews the lookup) or the
general anchors drown it. The seed's operators found 12 of 193 injected anchors averaging cosine
0.87 > 0.85 with general anchors and dropped those within 0.3 of a general cluster centre.

Both tests run in the **centred** anchor space by default: every unit vector minus the mean of the
general anchors' unit vectors, re-normalised (the mean-removal step of "All-but-the-top", Mu &
Viswanath, ICLR 2018). Hidden states are anisotropic. Measured on the NDA library (SmolLM2-135M,
layer 22, inject's last-token anchors, mean cosine to the 5 nearest general anchors): raw, clauses
from medical and insurance policies score 0.77-0.93 and clauses copied from the library's own NDAs
0.75-0.95, so a raw 0.85 flags nearly every sentence-final clause; centred, general anchors' own
5-NN score has median 0.67, medical clauses score 0.45-0.83 and NDA prefixes 0.48-0.85. With this
small model the score mostly reflects the position type (a sentence end), not the clause's content:
only a near-exact duplicate of a general anchor's state is clear-cut (centred 1-NN cosine > 0.97,
see tests/test_anchor_conflicts.py). ``--raw`` uses plain cosine instead.

- **kNN similarity** of domain anchor d: mean cosine to its ``k`` nearest general anchors;
  flagged when > ``sim`` (0.85).
- **Centre distance**: 1 - cosine to the nearest of ``n_clusters`` general cluster centres
  (spherical k-means over the general anchors, ``sfcl.anchors.kmeans.spherical_kmeans``, seeded); flagged
  when < ``centre_dist`` (0.15; about 3% of the NDA library's general anchors are that close to
  their own centre, centred space, 32 clusters). The seed's 0.3 was for another model's space.

CPU only; cost O(M * N_general * D) plus the k-means.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from sfcl.library.store import AnchorLibrary

REPORT_FILE, SUMMARY_FILE = "conflicts.json", "conflicts.txt"


@dataclass(slots=True)
class ConflictConfig:
    sim: float = 0.85  # mean cosine to the k nearest general anchors above which d conflicts
    k: int = 5
    centre_dist: float = 0.15  # cosine distance to a general cluster centre below which d conflicts
    n_clusters: int = 32
    centred: bool = True  # compare in the centred space (module docstring)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.k < 1 or self.n_clusters < 1:
            raise ValueError("--k and --n-clusters must be >= 1")
        if not -1.0 <= self.sim <= 1.0:
            raise ValueError("--sim must be a cosine in [-1, 1]")
        if not 0.0 <= self.centre_dist <= 2.0:
            raise ValueError("--centre-dist must be a cosine distance in [0, 2]")


@dataclass(slots=True)
class ConflictResult:
    domain_ids: np.ndarray  # (M,) anchor ids of the domain anchors
    knn_sim: np.ndarray  # (M,) mean cosine to the k nearest general anchors
    nearest_general: np.ndarray  # (M, k) general anchor ids, nearest first
    centre_dist: np.ndarray  # (M,) cosine distance to the nearest general cluster centre
    by_sim: np.ndarray  # (M,) bool, knn_sim > sim
    by_centre: np.ndarray  # (M,) bool, centre_dist < centre_dist threshold

    @property
    def flagged(self) -> np.ndarray:
        """(M,) bool: either test fired."""
        return self.by_sim | self.by_centre

    @property
    def flagged_ids(self) -> np.ndarray:
        return self.domain_ids[self.flagged]


def find_conflicts(lib: AnchorLibrary, cfg: ConflictConfig | None = None, progress: bool = True) -> ConflictResult:
    """Score every domain anchor of ``lib`` against its general anchors (module docstring).

    Raises ValueError if the library has no general anchors."""
    from sfcl.anchors.kmeans import spherical_kmeans

    cfg = cfg or ConflictConfig()
    kinds = lib.kinds.long()
    dom = torch.nonzero(kinds == 1)[:, 0]
    gen = torch.nonzero(kinds == 0)[:, 0]
    if len(gen) == 0:
        raise ValueError("the library has no general anchors to compare domain anchors with")
    v = lib.vectors.float()
    if cfg.centred:
        v = torch.nn.functional.normalize(v - v[gen].mean(0), dim=-1)
    g, d = v[gen], v[dom]  # (G, D), (M, D)
    k = min(cfg.k, len(gen))
    sims, near = (d @ g.T).topk(k, dim=1) if len(dom) else (torch.zeros(0, k), torch.zeros(0, k, dtype=torch.long))
    _, cent = spherical_kmeans(g.contiguous(), min(cfg.n_clusters, len(gen)), cfg.seed, 10, progress)
    cdist = 1.0 - (d @ cent.T).amax(1) if len(dom) else torch.zeros(0)
    knn_sim = sims.double().mean(1).numpy()
    cd = cdist.double().numpy()
    return ConflictResult(domain_ids=dom.numpy(), knn_sim=knn_sim, nearest_general=gen[near].numpy(),
                          centre_dist=cd, by_sim=knn_sim > cfg.sim, by_centre=cd < cfg.centre_dist)


def report(lib: AnchorLibrary, res: ConflictResult, cfg: ConflictConfig) -> tuple[dict, str]:
    """(JSON-able report, readable text)."""
    rows = []
    for j in np.argsort(-res.knn_sim):
        i = int(res.domain_ids[j])
        rows.append({"anchor": i, "span": lib.span_texts[i], "knn_sim": round(float(res.knn_sim[j]), 4),
                     "centre_dist": round(float(res.centre_dist[j]), 4), "by_sim": bool(res.by_sim[j]),
                     "by_centre": bool(res.by_centre[j]),
                     "nearest_general": [{"anchor": int(a), "span": lib.span_texts[int(a)]}
                                         for a in res.nearest_general[j][:3]]})
    rep = {"library": str(lib.path), "content_hash": lib.content_hash, "config": asdict(cfg),
           "n_domain": int(len(res.domain_ids)), "n_flagged": int(res.flagged.sum()),
           "flagged": [int(i) for i in res.flagged_ids], "domain": rows}
    space = "centred" if cfg.centred else "raw"
    lines = [f"Conflict check of {lib.path}: {rep['n_flagged']} of {rep['n_domain']} domain anchors flagged "
             f"({space} cosine; mean of {cfg.k} nearest general > {cfg.sim}, or < {cfg.centre_dist} from one of "
             f"{cfg.n_clusters} general centres)"]
    for r in rows:
        if r["by_sim"] or r["by_centre"]:
            why = " + ".join(w for w, on in (("kNN", r["by_sim"]), ("centre", r["by_centre"])) if on)
            lines.append(f"  anchor {r['anchor']} [{why}] kNN {r['knn_sim']:.3f} centre-dist {r['centre_dist']:.3f}: "
                         f"{r['span'][:90]!r}")
            lines.append(f"      nearest general: {r['nearest_general'][0]['span'][:90]!r}")
    return rep, "\n".join(lines) + "\n"
