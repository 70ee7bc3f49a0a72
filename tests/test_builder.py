"""Static Anchor Generator on real NDAs: contents, calibration, determinism, model binding."""

import numpy as np
import pytest
import torch

from sfcl.anchors.builder import BuildConfig, build_library
from sfcl.anchors.store import AnchorLibraryError, load_library

from conftest import contractnli_docs

pytestmark = pytest.mark.slow


def test_library_from_ndas(nda_library, lm):
    lib = nda_library
    assert lib.n_anchors <= 2048 and lib.n_anchors > 1500  # k-means ran (more points than anchors)
    assert lib.manifest["build"]["n_points"] > lib.n_anchors
    assert lib.manifest["model_fingerprint"] == lm.fingerprint and lib.layer == 22
    v = lib.vectors.float()
    assert torch.allclose(v.norm(dim=1), torch.ones(lib.n_anchors), atol=1e-2)
    assert int(lib.counts.sum()) == lib.manifest["build"]["n_points"]
    cal = lib.calibration
    assert 0 < cal["surprisal_mean"] < 10 and cal["surprisal_std"] > 0 and 0 < cal["dispersion_mean"] < 1
    # spans are real text of the source documents at the recorded offsets
    docs = {d.doc_id: d for d in contractnli_docs(4)}
    for i in range(0, lib.n_anchors, 97):
        sp = lib.span(i)
        assert sp["text"] and docs[sp["doc_id"]].text[sp["start"]:sp["end"]].endswith(sp["text"])
    # next-token distributions are probabilities, best first
    p = lib.next_probs.float()
    assert (p[:, :-1] >= p[:, 1:] - 1e-3).all() and (p.sum(1) <= 1.01).all() and (lib.next_ids[:, 0] >= 0).all()


def test_same_seed_same_library_and_model_binding(lm, tmp_path):
    docs = contractnli_docs(1)
    cfg = BuildConfig(n_anchors=64, seed=3, max_points=400, window_tokens=256)
    a = load_library(build_library(lm, docs, tmp_path / "a", cfg, progress=False))
    b = load_library(build_library(lm, docs, tmp_path / "b", cfg, progress=False))
    c = load_library(build_library(lm, docs, tmp_path / "c", BuildConfig(n_anchors=64, seed=4, max_points=400,
                                                                        window_tokens=256), progress=False))
    assert a.n_anchors == b.n_anchors and torch.equal(a.vectors, b.vectors) and a.span_texts == b.span_texts
    assert not (a.n_anchors == c.n_anchors and torch.equal(a.vectors, c.vectors))
    with pytest.raises(AnchorLibraryError, match="fingerprint"):
        load_library(tmp_path / "a", expect_fingerprint="0" * 64)
    with pytest.raises(AnchorLibraryError):
        load_library(tmp_path / "a", expect_hidden_size=1024)
    assert np.isfinite(a.decay.numpy()).all() and (a.decay.numpy() > 0).all()
