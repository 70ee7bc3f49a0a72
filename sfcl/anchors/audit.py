"""Pollution audit of an anchor library (``sfcl anchors audit``) and pruning (``sfcl anchors prune``).

The seed's operators found 2,137 of 32,768 anchors piled up in one spot of a 2-D projection, all on
stop-word-like content: such a clump attracts many snapshot lookups and answers them with
uninformative spans. This module finds such clumps offline. Data lives on the CPU.

Definitions (all documented in report.json as well):

- **Span pollution** p(span) in [0, 1]: the span text is split into word runs and single
  punctuation marks (``\\w+|[^\\w\\s]``). ``filler`` = share of tokens that are English stop-words
  (scikit-learn's ENGLISH_STOP_WORDS, 318 words) or contain no letter or digit; ``repetition`` =
  1 - distinct/total (lower-cased) tokens. p = 0.75 filler + 0.25 repetition; an empty span is 1.
  Clause text scores about 0.3-0.5 ("the Receiving Party shall not disclose any ..."); a run of
  "the , of . and" scores 0.9+.
- **Density** of anchor i: mean cosine similarity to its k nearest other anchors (exact kNN over
  the unit vectors, k = 10), and its robust z-score ``(d - median) / (1.4826 MAD)`` over the library.
- **Neighbourhood pollution**: mean p over the anchor and its k nearest neighbours, so a region is
  judged by what is in it, not by one span.
- **Flagged**: neighbourhood pollution >= 0.6 and density z >= 1.0 (a dense, low-quality region).
- **Regions**: connected components of flagged anchors in the kNN graph, largest first, each with
  its size, mean pollution and density and the spans of its most central members.

The projection PNG shows at most ``max_points`` anchors (default 5,000): every flagged anchor up to
half of that budget, the rest a seeded uniform sample of the others; openTSNE (cosine metric) or
PCA (``--projection pca``, fast).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from sfcl.library.store import AnchorLibrary

_TOKEN = re.compile(r"\w+|[^\w\s]")
REPORT_FILE, SUMMARY_FILE, PLOT_FILE = "report.json", "summary.txt", "projection.png"


def _stop_words() -> frozenset[str]:
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS

    return frozenset(ENGLISH_STOP_WORDS)


def span_pollution(text: str, stop_words: frozenset[str] | None = None) -> float:
    """Pollution score of one span text in [0, 1] (module docstring): 0.75 filler + 0.25 repetition."""
    toks = [t.lower() for t in _TOKEN.findall(text)]
    if not toks:
        return 1.0
    sw = _stop_words() if stop_words is None else stop_words
    filler = sum(1 for t in toks if t in sw or not any(c.isalnum() for c in t)) / len(toks)
    repetition = 1.0 - len(set(toks)) / len(toks)
    return 0.75 * filler + 0.25 * repetition


@torch.inference_mode()
def knn(vectors: torch.Tensor, k: int, progress: bool = True, chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact k nearest neighbours by cosine (self excluded). vectors: (N, D) unit rows, any float
    dtype. Returns (sims (N, k') float32, ids (N, k') int64), k' = min(k, N-1). Cost N^2 D
    multiply-adds in float32 chunks of ``chunk`` rows (N=32,768, D=576: ~6e11, tens of seconds)."""
    x = vectors.float()
    n = x.shape[0]
    k = min(k, n - 1)
    if k < 1:
        return torch.zeros(n, 0), torch.zeros(n, 0, dtype=torch.int64)
    S, I = [], []
    for s in tqdm(range(0, n, chunk), desc="audit: kNN", unit="chunk", disable=not progress):
        sim = x[s : s + chunk] @ x.T  # (c, N)
        sim[torch.arange(sim.shape[0]), torch.arange(s, s + sim.shape[0])] = -2.0  # not itself
        v, i = sim.topk(k, dim=1)
        S.append(v)
        I.append(i)
    return torch.cat(S), torch.cat(I)


@dataclass(slots=True)
class AuditConfig:
    k: int = 10  # neighbours for density and neighbourhood pollution
    pollution_threshold: float = 0.6  # neighbourhood pollution at or above which a region is low-quality
    density_z: float = 1.0  # robust z of kNN density at or above which an anchor is in a dense region
    max_points: int = 5000  # anchors shown in the projection
    projection: str = "tsne"  # "tsne" (openTSNE) or "pca"
    seed: int = 0
    top_regions: int = 10  # regions listed in the report
    examples: int = 5  # example spans per region

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError("--k must be >= 1")
        if not 0.0 <= self.pollution_threshold <= 1.0:
            raise ValueError("--pollution-threshold must be in [0, 1]")
        if self.max_points < 10:
            raise ValueError("--max-points must be >= 10")
        if self.projection not in ("tsne", "pca"):
            raise ValueError("--projection must be tsne or pca")


@dataclass(slots=True)
class AuditResult:
    pollution: np.ndarray  # (N,) float64 span pollution
    density: np.ndarray  # (N,) float64 mean cosine to k nearest anchors
    density_z: np.ndarray  # (N,) float64 robust z of density
    nbr_pollution: np.ndarray  # (N,) float64 mean pollution of anchor + k neighbours
    flagged: np.ndarray  # (N,) bool
    knn_ids: np.ndarray  # (N, k) int64
    regions: list  # [{"id", "size", "members", "mean_pollution", "mean_density", "examples"}]


def _components(flagged: np.ndarray, knn_ids: np.ndarray) -> list[np.ndarray]:
    """Connected components of flagged anchors over kNN edges between flagged anchors."""
    parent = np.arange(len(flagged))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for i in np.nonzero(flagged)[0]:
        for j in knn_ids[i]:
            if flagged[j]:
                ri, rj = find(int(i)), find(int(j))
                if ri != rj:
                    parent[ri] = rj
    groups: dict[int, list[int]] = {}
    for i in np.nonzero(flagged)[0]:
        groups.setdefault(find(int(i)), []).append(int(i))
    return sorted((np.asarray(g) for g in groups.values()), key=len, reverse=True)


def audit_library(lib: AnchorLibrary, cfg: AuditConfig | None = None, progress: bool = True) -> AuditResult:
    """Score every anchor of ``lib`` and flag dense low-quality regions (module docstring)."""
    cfg = cfg or AuditConfig()
    n = lib.n_anchors
    if n < 2:
        raise ValueError(f"the library has {n} anchor(s); an audit needs at least 2")
    sw = _stop_words()
    pol = np.asarray([span_pollution(t, sw) for t in lib.span_texts], np.float64)
    sims, ids = knn(lib.vectors, cfg.k, progress)
    dens = sims.double().mean(1).numpy()
    med = np.median(dens)
    mad = 1.4826 * np.median(np.abs(dens - med)) or 1e-9
    dz = (dens - med) / mad
    ids = ids.numpy()
    nbr = (pol + pol[ids].sum(1)) / (1 + ids.shape[1])
    flagged = (nbr >= cfg.pollution_threshold) & (dz >= cfg.density_z)
    regions = []
    vec = lib.vectors.float()
    for r, members in enumerate(_components(flagged, ids)):
        centre = torch.nn.functional.normalize(vec[members].mean(0), dim=0)
        central = members[np.argsort(-(vec[members] @ centre).numpy())[: cfg.examples]]
        regions.append({"id": r, "size": int(len(members)), "members": members.tolist(),
                        "mean_pollution": round(float(pol[members].mean()), 4),
                        "mean_density": round(float(dens[members].mean()), 4),
                        "examples": [lib.span_texts[int(i)] for i in central]})
    return AuditResult(pollution=pol, density=dens, density_z=dz, nbr_pollution=nbr, flagged=flagged,
                       knn_ids=ids, regions=regions)


def _sample(flagged: np.ndarray, max_points: int, seed: int) -> np.ndarray:
    n = len(flagged)
    if n <= max_points:
        return np.arange(n)
    rng = np.random.default_rng(seed)
    f, o = np.nonzero(flagged)[0], np.nonzero(~flagged)[0]
    f = rng.choice(f, min(len(f), max_points // 2), replace=False)
    o = rng.choice(o, min(len(o), max_points - len(f)), replace=False)
    return np.sort(np.concatenate([f, o]))


def project(x: np.ndarray, method: str, seed: int) -> np.ndarray:
    """(n, D) unit rows -> (n, 2) float64: openTSNE with the cosine metric, or PCA."""
    if method == "pca" or x.shape[0] < 40:
        from sklearn.decomposition import PCA

        return PCA(n_components=2, random_state=seed).fit_transform(x)
    from openTSNE import TSNE

    perplexity = min(30.0, (x.shape[0] - 1) / 3.0)
    return np.asarray(TSNE(n_components=2, perplexity=perplexity, metric="cosine", random_state=seed,
                           n_jobs=2, verbose=False).fit(x))


def plot_projection(xy: np.ndarray, flagged: np.ndarray, region_of: np.ndarray, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 7), dpi=110)
    ax.scatter(xy[~flagged, 0], xy[~flagged, 1], s=3, c="#9aa3ad", alpha=0.5, linewidths=0,
               label=f"kept ({int((~flagged).sum())} shown)")
    ax.scatter(xy[flagged, 0], xy[flagged, 1], s=5, c="#d62728", alpha=0.8, linewidths=0,
               label=f"flagged: dense + low-quality ({int(flagged.sum())} shown)")
    for r in sorted(set(region_of[region_of >= 0].tolist()))[:10]:
        m = region_of == r
        ax.annotate(f"R{r}", xy[m].mean(0), fontsize=9, weight="bold")
    ax.set_title(title, fontsize=10)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.legend(loc="best", fontsize=8, markerscale=3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(lib: AnchorLibrary, res: AuditResult, cfg: AuditConfig, out_dir, progress: bool = True) -> Path:
    """Write report.json, summary.txt and projection.png into ``out_dir``; returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n, nf = len(res.flagged), int(res.flagged.sum())
    region_of = np.full(n, -1)
    for r in res.regions:
        region_of[r["members"]] = r["id"]
    pick = _sample(res.flagged, cfg.max_points, cfg.seed)
    with tqdm(total=1, desc=f"audit: {cfg.projection} projection of {len(pick)}", disable=not progress) as bar:
        xy = project(lib.vectors[torch.from_numpy(pick)].float().numpy(), cfg.projection, cfg.seed)
        bar.update(1)
    plot_projection(xy, res.flagged[pick], region_of[pick], out / PLOT_FILE,
                    f"{lib.path.name}: {nf} of {n} anchors flagged ({cfg.projection}, "
                    f"{len(pick)} shown)")
    report = {
        "library": str(lib.path), "content_hash": lib.content_hash, "n_anchors": n, "n_flagged": nf,
        "config": asdict(cfg),
        "definitions": {
            "pollution": "0.75 * share of stop-word or non-alphanumeric tokens + 0.25 * (1 - distinct/total tokens)",
            "density": f"mean cosine similarity to the {cfg.k} nearest anchors",
            "density_z": "(density - median) / (1.4826 * MAD)",
            "flagged": f"mean pollution of anchor and its {cfg.k} neighbours >= {cfg.pollution_threshold} "
                       f"and density_z >= {cfg.density_z}",
            "projection_sample": "all flagged anchors up to max_points/2, then a seeded uniform sample",
        },
        "library_stats": {"median_pollution": float(np.median(res.pollution)),
                          "median_density": float(np.median(res.density))},
        "flagged": [int(i) for i in np.nonzero(res.flagged)[0]],
        "regions": [{k: v for k, v in r.items() if k != "members"} | {"members": r["members"][:2000]}
                    for r in res.regions[: cfg.top_regions]],
        "n_regions": len(res.regions),
    }
    (out / REPORT_FILE).write_text(json.dumps(report, indent=1, ensure_ascii=False), encoding="utf-8")
    (out / SUMMARY_FILE).write_text(summary_text(lib, res, cfg), encoding="utf-8")
    return out


def summary_text(lib: AnchorLibrary, res: AuditResult, cfg: AuditConfig) -> str:
    n, nf = len(res.flagged), int(res.flagged.sum())
    lines = [f"Anchor audit of {lib.path} ({n} anchors)",
             f"flagged: {nf} ({100.0 * nf / n:.1f}%) in {len(res.regions)} region(s) "
             f"(neighbourhood pollution >= {cfg.pollution_threshold}, density z >= {cfg.density_z}, k={cfg.k})",
             f"library median pollution {np.median(res.pollution):.2f}, median kNN density "
             f"{np.median(res.density):.3f}", ""]
    for r in res.regions[: cfg.top_regions]:
        lines.append(f"R{r['id']}: {r['size']} anchors, mean pollution {r['mean_pollution']:.2f}, "
                     f"mean density {r['mean_density']:.3f}")
        lines += [f"    {t!r}" for t in r["examples"]]
    return "\n".join(lines) + "\n"


def flagged_from_report(lib: AnchorLibrary, report_dir) -> np.ndarray:
    """Flagged anchor ids from an audit report of exactly this library (content hash checked)."""
    p = Path(report_dir) / REPORT_FILE
    try:
        rep = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read audit report {p}: {e}") from e
    if rep.get("content_hash") != lib.content_hash:
        raise ValueError(f"audit report {p} is for another library content ({rep.get('library')}); "
                         f"run `sfcl anchors audit {lib.path}` again")
    ids = np.asarray(rep.get("flagged", []), np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= lib.n_anchors):
        raise ValueError(f"audit report {p} has anchor ids outside 0..{lib.n_anchors - 1}")
    return ids
