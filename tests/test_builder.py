"""Static Anchor Generator on real NDAs: contents, calibration, determinism, model binding."""

import numpy as np
import pytest
import torch
from conftest import contractnli_docs

from sfcl.anchors.builder import (MIN_CALIBRATION_WINDOW, BuildConfig, _aggregate, _Collected, build_library,
                                  calibration_prompts,
                                  library_cache_name)
from sfcl.anchors.corpus import Document
from sfcl.library.store import AnchorLibraryError
from sfcl.library.versions import load_library
from sfcl.snapshot.triggers import Calibration, TriggerConfig

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
    cfg = BuildConfig(n_anchors=64, seed=3, max_points=400, window_tokens=256, calibration_prompts=0)
    a = load_library(build_library(lm, docs, tmp_path / "a", cfg, progress=False))
    b = load_library(build_library(lm, docs, tmp_path / "b", cfg, progress=False))
    c = load_library(build_library(lm, docs, tmp_path / "c", BuildConfig(n_anchors=64, seed=4, max_points=400,
                                                                        window_tokens=256, calibration_prompts=0),
                                                        progress=False))
    assert a.n_anchors == b.n_anchors and torch.equal(a.vectors, b.vectors) and a.span_texts == b.span_texts
    assert not (a.n_anchors == c.n_anchors and torch.equal(a.vectors, c.vectors))
    with pytest.raises(AnchorLibraryError, match="fingerprint"):
        load_library(tmp_path / "a", expect_fingerprint="0" * 64)
    with pytest.raises(AnchorLibraryError):
        load_library(tmp_path / "a", expect_hidden_size=1024)
    assert np.isfinite(a.decay.numpy()).all() and (a.decay.numpy() > 0).all()
    # the model pass is recorded against its floor, and every phase's time
    build = a.manifest["build"]
    mp = build["model_pass"]
    assert mp["tokens"] == build["n_points"] + mp["windows"]  # a window's last position has no next token
    assert mp["tflop"] > 0 and mp["gemm_gflops"] > 0 and mp["floor_s"] > 0 and mp["seconds"] > 0
    assert set(build["seconds"]) == {"model_pass", "kmeans", "calibration", "total"}
    assert build["clustering"] == "two-level spherical k-means"


def test_serving_calibration_in_the_manifest(lm, tmp_path):
    docs = contractnli_docs(2)
    cfg = BuildConfig(n_anchors=64, max_points=300, window_tokens=256, calibration_prompts=6, calibration_tokens=12,
                      calibration_long_tokens=200)
    prompts = calibration_prompts(lm, docs, cfg)
    assert len(prompts) == 6 and max(map(len, prompts)) > 200 and min(map(len, prompts)) < 300
    c = load_library(build_library(lm, docs, tmp_path / "a", cfg, progress=False)).calibration
    cal = Calibration.from_dict(c)
    tab = c["dispersion_by_length"]
    assert cal.by_length and "greedy answers" in tab["source"] and sum(tab["count"]) > 6 * 4
    assert all(0 < m < 1 for m in tab["mean"]) and c["format"] == 3
    thr = TriggerConfig.from_calibration(c)  # thresholds the server will use
    assert thr != TriggerConfig() and c["threshold_calibration"]["target_rate"] == cfg.calibration_target
    assert abs(c["threshold_calibration"]["achieved_rate"] - cfg.calibration_target) < 0.05
    # no serving calibration: the length table comes from the corpus positions, thresholds stay default
    c0 = load_library(build_library(lm, docs, tmp_path / "b", BuildConfig(n_anchors=64, max_points=300,
                                    window_tokens=256, calibration_prompts=0), progress=False)).calibration
    assert "thresholds" not in c0 and c0["dispersion_by_length"]["source"] == "teacher-forced corpus positions"
    assert library_cache_name("f" * 16, "c" * 16, 22, 64).endswith("-c3-p2")  # old cached defaults get rebuilt
    with pytest.raises(ValueError):
        BuildConfig(calibration_target=1.5)


def test_serving_signals_batched_prefill_equals_one_prompt_at_a_time(lm_fp32):
    """Prompts prefilled several per forward (the runner's prompt chunks) give the signals of
    prompts prefilled alone: same greedy tokens, same logprobs and dispersions up to rounding.
    In float32: on an Intel Xeon with AMX (2026-12-05) a bf16 GEMM rounds some outputs one bf16 step
    differently for 64 or 128 rows than for 512, which moved logprobs by up to 0.07 and flipped a
    near tie in bf16."""
    from sfcl.anchors.builder import serving_signals

    lm = lm_fp32

    docs = contractnli_docs(2)
    prompts = calibration_prompts(lm, docs, BuildConfig(calibration_prompts=4, calibration_long_tokens=120))
    alone = serving_signals(lm, prompts, 22, 8, progress=False, batch_tokens=1)  # a batch holds at least one prompt
    together = serving_signals(lm, prompts, 22, 8, progress=False, batch_tokens=4096)
    assert alone.token_logp.shape == together.token_logp.shape
    np.testing.assert_allclose(together.token_logp, alone.token_logp, atol=1e-3)
    np.testing.assert_allclose(together.d3, alone.d3, atol=1e-4)
    assert (together.in_entity == alone.in_entity).all()


def test_a_two_token_window_builds(lm, tmp_path):
    """A document (or a document's tail) of 2 tokens is one window with one position: it has no
    dispersion statistic (that averages 3 positions) and used to stop the build with avg_pool1d's
    "Output size is too small"."""
    two = Document("two", "Hello world", "two.txt")
    assert len(lm.tokenizer(two.text, add_special_tokens=False)["input_ids"]) == 2
    cfg = BuildConfig(n_anchors=32, max_points=300, window_tokens=256, calibration_prompts=0)
    lib = load_library(build_library(lm, [two, *contractnli_docs(1)], tmp_path / "lib", cfg, progress=False))
    assert lib.n_anchors == 32 and lib.calibration["dispersion_std"] > 0


def test_windows_too_short_or_too_long_are_refused_with_the_reason(lm, tmp_path):
    assert BuildConfig(window_tokens=MIN_CALIBRATION_WINDOW).window_tokens == MIN_CALIBRATION_WINDOW
    with pytest.raises(ValueError, match=f">= {MIN_CALIBRATION_WINDOW}"):  # a full window gives no dispersion statistic
        BuildConfig(window_tokens=MIN_CALIBRATION_WINDOW - 1)
    with pytest.raises(ValueError, match="too short to calibrate"):  # every document under a window's minimum
        build_library(lm, [Document("short", "The term is three years.", "short.txt")], tmp_path / "a",
                      BuildConfig(n_anchors=4, calibration_prompts=0), progress=False)
    ctx = lm.args.max_position_embeddings
    with pytest.raises(ValueError, match=f"more than the model's context of {ctx}"):
        build_library(lm, contractnli_docs(1), tmp_path / "b", BuildConfig(window_tokens=ctx + 1), progress=False)
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())


def test_model_with_a_short_context_builds_with_its_calibration_prompts_cut_to_fit(shallow_model, tmp_path):
    """A model whose context is shorter than the long calibration prompts (1,536 document tokens +
    the chat template and question + the answer): the prompts are cut to leave room for the answer,
    and the build finishes instead of running past the rotary tables."""
    import dataclasses

    ctx = 600
    lm = shallow_model(torch.float32)
    args = dataclasses.replace(lm.args, max_position_embeddings=ctx)
    lm.model.a = args
    lm = dataclasses.replace(lm, args=args)
    m = lm.model  # what a 600-token model's constructor gives: tables for positions 0..599
    m.set_rope(m.inv_freq, ctx)
    docs = contractnli_docs(2)
    cfg = BuildConfig(n_anchors=64, max_points=300, window_tokens=256, calibration_prompts=6)
    prompts = calibration_prompts(lm, docs, cfg)
    assert len(prompts) == 6 and max(len(p) for p in prompts) <= ctx - cfg.calibration_tokens
    assert max(len(p) for p in prompts) > ctx - cfg.calibration_tokens - 16  # the long ones: cut to the limit
    lib = load_library(build_library(lm, docs, tmp_path / "lib", cfg, progress=False))
    assert lib.n_anchors == 64 and lib.calibration["threshold_calibration"]["prompts"] == 6


def test_a_clusters_representative_is_its_first_member_attaining_the_max():
    """Members whose hidden states are equal tie for the cluster's best cosine; the representative
    (whose span the anchor names) is the lowest position among them, so two builds of one corpus name
    the same spans (an index_put with repeated indices had kept any one of them)."""
    n, H = 4_000, 8
    g = torch.Generator().manual_seed(0)
    base = torch.nn.functional.normalize(torch.randn(40, H, generator=g), dim=-1)
    hidden = base.repeat(n // 40, 1)  # position p holds base[p % 40]: 100 equal copies of each state
    labels = np.arange(n) % 40  # cluster c: the copies of base[c], all at cosine 1 to their centroid
    col = _Collected(hidden=hidden, next_ids=torch.zeros(n, 2, dtype=torch.int64), next_probs=torch.ones(n, 2) / 2,
                     doc=np.zeros(n, np.int32), span_start=np.zeros(n, np.int32), span_end=np.zeros(n, np.int32),
                     surprisal=np.zeros(1), d3=np.zeros(1), n_attended=np.zeros(1, np.int64))
    cent = torch.cat([base, torch.zeros(2, H)])  # two clusters with no member
    counts, _, rep, _, _ = _aggregate(col, labels, cent, 2)
    assert counts.tolist() == [100] * 40 + [0, 0]
    assert rep.tolist() == list(range(40)) + [-1, -1]
