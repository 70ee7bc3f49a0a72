"""Pollution audit and prune on the real NDA library with a planted boilerplate clump."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sfcl.anchors.audit import AuditConfig, audit_library, project, span_pollution
from sfcl.cli import main
from sfcl.library.versions import append, library_fields, load_library, write_version

FILLER = ["the", "of", "and", "to", "in", "a", "or", "for", "by", "with", ",", ".", ";", "(", ")", "-", "the", "of"]


def boilerplate(rng: np.random.Generator, n_tokens: int = 12) -> str:
    return " ".join(rng.choice(FILLER, n_tokens))


def clump(lib, n: int, spans: list[str], centre: torch.Tensor, noise: float, seed: int) -> dict:
    """n anchors around unit ``centre`` (cosine to it ~ 1/sqrt(1+noise^2*D)) with the given spans."""
    g = torch.Generator().manual_seed(seed)
    d, k = lib.hidden_size, lib.top_k_next
    v = centre[None] + noise * torch.randn(n, d, generator=g)
    return {"vectors": v, "counts": torch.full((n,), 5), "weights": torch.ones(n), "decay": torch.full((n,), 10.0),
            "next_ids": torch.full((n, k), -1), "next_probs": torch.zeros(n, k),
            "kinds": torch.zeros(n, dtype=torch.uint8), "span_doc": torch.zeros(n, dtype=torch.int32),
            "span_start": torch.zeros(n, dtype=torch.int32), "span_end": torch.zeros(n, dtype=torch.int32),
            "span_texts": spans, "doc_ids": ["planted"]}


@pytest.fixture(scope="module")
def polluted(nda_library, tmp_path_factory):
    """NDA library (2,048) + 150 boilerplate anchors in one dense clump + 2 controls:
    60 clean clause spans in a dense clump, and 60 boilerplate spans scattered at real anchors."""
    lib = nda_library
    rng = np.random.default_rng(0)
    f = library_fields(lib)
    n0 = lib.n_anchors
    generic = torch.nn.functional.normalize(lib.vectors.float().mean(0), dim=0)
    f = append(f, clump(lib, 150, [boilerplate(rng) for _ in range(150)], generic, 0.008, 1))
    clean_centre = lib.vectors[7].float()
    clean_spans = [lib.span_texts[i] for i in rng.choice(n0, 60, replace=False)]
    f = append(f, clump(lib, 60, clean_spans, clean_centre, 0.008, 2))
    scattered = rng.choice(n0, 60, replace=False)
    sc = clump(lib, 60, [boilerplate(rng) for _ in range(60)], generic, 0.0, 3)
    sc["vectors"] = lib.vectors[torch.from_numpy(scattered)].float() + 0.01 * torch.randn(60, lib.hidden_size)
    f = append(f, sc)
    path = write_version(tmp_path_factory.mktemp("polluted") / "lib", f, command="test: plant clump", parent=lib)
    return load_library(path), n0


def test_span_pollution_orders_boilerplate_above_clause_text():
    clause = "the Receiving Party shall not disclose any Confidential Information to third parties"
    assert span_pollution("the , of the . and to the ( ) ,") > 0.8
    assert span_pollution(clause) < 0.45
    assert span_pollution("") == 1.0
    assert span_pollution("Page Page Page Page") > span_pollution("Page 3 of 12 Schedule")


def test_audit_flags_planted_clump_and_few_others(polluted):
    lib, n0 = polluted
    res = audit_library(lib, AuditConfig(), progress=False)
    planted = np.zeros(lib.n_anchors, bool)
    planted[n0 : n0 + 150] = True
    hit = res.flagged[planted].mean()
    false = res.flagged[~planted].sum()
    assert hit >= 0.9, f"only {hit:.0%} of the planted clump flagged"
    assert false <= 0.01 * (~planted).sum(), f"{false} anchors outside the clump flagged"
    # the clean dense clump and the scattered boilerplate are not flagged: both conditions matter
    assert res.flagged[n0 + 150 : n0 + 210].sum() == 0
    assert res.flagged[n0 + 210 :].sum() <= 3
    top = res.regions[0]
    assert top["size"] >= 130 and top["mean_pollution"] > 0.75
    assert set(top["members"]) <= set(range(n0, n0 + 150)) | set(np.nonzero(res.flagged)[0].tolist())


def test_audit_cli_report_and_prune(polluted, tmp_path, capsys):
    lib, n0 = polluted
    rep = tmp_path / "report"
    root = lib.path.parent
    assert main(["anchors", "audit", str(root), "--out", str(rep), "--projection", "pca"]) == 0
    report = json.loads((rep / "report.json").read_text())
    assert report["n_anchors"] == lib.n_anchors and report["n_flagged"] == len(report["flagged"]) >= 135
    assert (rep / "projection.png").stat().st_size > 10_000
    assert "R0:" in (rep / "summary.txt").read_text()
    assert main(["anchors", "prune", str(root), "--flagged", "--report", str(rep), "--out", str(root)]) == 0
    pruned = load_library(root)  # CURRENT moved to the new version
    assert pruned.path.name == "v0002" and pruned.n_anchors == lib.n_anchors - report["n_flagged"]
    assert pruned.manifest["version"]["parent"] == str(lib.path.resolve())
    assert load_library(lib.path).n_anchors == lib.n_anchors  # the old version is untouched
    assert len(set(pruned.span_texts) & set(lib.span_texts[n0 : n0 + 150])) <= 15  # planted clump gone
    # a report of other content is refused (clear one-line error, exit 2)
    assert main(["anchors", "prune", str(root), "--flagged", "--report", str(rep), "--out", str(root)]) == 2
    assert "another library" in capsys.readouterr().err


@pytest.mark.slow  # openTSNE has a fixed ~50 s start-up cost on this 2-core machine
def test_tsne_projection_separates_the_clump(polluted):
    """openTSNE (the default projection) on a small sample: the planted clump lands together."""
    lib, n0 = polluted
    ids = np.r_[np.arange(0, n0, 20), np.arange(n0, n0 + 40)]  # 103 real + 40 planted
    xy = project(lib.vectors[torch.from_numpy(ids)].float().numpy(), "tsne", 0)
    assert xy.shape == (len(ids), 2) and np.isfinite(xy).all()
    real, planted = xy[: len(ids) - 40], xy[len(ids) - 40 :]
    spread = lambda p: np.linalg.norm(p - p.mean(0), axis=1).mean()  # noqa: E731
    assert spread(planted) < 0.5 * spread(real)
