"""Threshold search of ``sfcl anchors calibrate`` (sfcl.eval.calibrate) on synthetic signal arrays."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sfcl.eval.calibrate import (TokenSignals, calibrate_thresholds, fire_masks, signals_from_tokens,
                                 thresholds_for_share, trigger_shares, write_library)
from sfcl.snapshot import entity
from sfcl.snapshot.triggers import TRIGGER_NAMES, Calibration, TriggerConfig

CAL = Calibration(surprisal_mean=2.0, surprisal_std=1.5, dispersion_mean=0.5, dispersion_std=0.1)


def synthetic(n: int = 20000, seed: int = 0, entity_share: float = 0.3) -> TokenSignals:
    rng = np.random.default_rng(seed)
    s = np.where(rng.random(n) < 0.85, rng.gamma(1.2, 0.6, n), rng.gamma(2.0, 2.5, n))  # mostly confident
    d3 = rng.normal(0.5, 0.08, n)
    d3[rng.random(n) < 0.05] = np.nan  # first tokens of sequences: undefined
    return TokenSignals(s, d3, rng.random(n) < entity_share)


def test_fire_masks_follow_the_runner_rules():
    sig = TokenSignals(surprisal=[-np.log(0.5), -np.log(0.95), 7.0, 0.1], d3=[np.nan, 0.9, 0.5, 0.5],
                       in_entity=[True, True, False, False])
    thr = {"entity_prob_threshold": 0.85, "dispersion_z": 1.2, "surprisal_z": 2.0}
    m = fire_masks(sig, CAL, thr)
    # token 0: entity with p = 0.5 < 0.85; token 1: D3 z = 4 > 1.2; token 2: |z| = 3.33 > 2
    assert m.tolist() == [[True, False, False], [False, True, False], [False, False, True], [False, False, False]]
    assert fire_masks(sig, CAL, thr, enabled=("surprisal_deviation",))[:, :2].sum() == 0


@pytest.mark.parametrize("target", [1 / 64, 1 / 16, 0.2])
def test_calibrated_union_share_hits_the_target(target):
    sig = synthetic()
    res = calibrate_thresholds(sig, CAL, target)
    assert abs(res.achieved - target) < 0.003
    assert res.achieved == pytest.approx(trigger_shares(sig, CAL, res.thresholds)["union"])
    TriggerConfig(**res.thresholds)  # valid configuration values
    # equal split: each trigger alone fires on about the same share q
    shares = [res.per_trigger[n] for n in TRIGGER_NAMES]
    assert max(shares) - min(shares) < 0.004 and res.q >= target / 3 - 1e-3


def test_surprisal_trigger_stays_one_sided():
    sig = synthetic()
    sig.surprisal[:2000] = 0.0  # near-certain tokens: z = -mean/std = -1.33
    for target in (1 / 16, 0.3):
        res = calibrate_thresholds(sig, CAL, target)
        m = fire_masks(sig, CAL, res.thresholds)
        assert not m[:2000, 2].any()
        assert res.thresholds["surprisal_z"] >= CAL.surprisal_mean / CAL.surprisal_std


def test_lower_target_gives_stricter_thresholds():
    sig = synthetic()
    lo, hi = calibrate_thresholds(sig, CAL, 1 / 64), calibrate_thresholds(sig, CAL, 1 / 8)
    assert lo.thresholds["entity_prob_threshold"] < hi.thresholds["entity_prob_threshold"]
    assert lo.thresholds["dispersion_z"] > hi.thresholds["dispersion_z"]
    assert lo.thresholds["surprisal_z"] > hi.thresholds["surprisal_z"]


def test_entity_trigger_is_capped_by_the_entity_share():
    sig = synthetic(entity_share=0.02)
    thr = thresholds_for_share(sig, CAL, 0.2)
    assert thr["entity_prob_threshold"] == 1.0
    res = calibrate_thresholds(sig, CAL, 0.25)
    assert res.per_trigger["entity_low_confidence"] <= 0.02 + 1e-9
    assert abs(res.achieved - 0.25) < 0.005  # the other triggers take up the rest


def test_bad_inputs():
    with pytest.raises(ValueError):
        calibrate_thresholds(synthetic(100), CAL, 0.0)
    with pytest.raises(ValueError):
        TokenSignals([1.0, 2.0], [0.1], [True, False])
    with pytest.raises(ValueError):
        TokenSignals([], [], [])


def test_signals_from_tokens_entity_state_and_d3():
    # class table: token 0 plain word, 1 digit, 2 "," (CONT), 3 sentence end "."
    table = np.zeros(4, np.uint8)
    table[1] = entity.DIGIT
    table[2] = entity.CONT
    table[3] = entity.SENT_END | entity.CONT
    sig = signals_from_tokens([0, 1, 2, 0, 2], [-0.1] * 5, [0.3, 0.6, 0.9, 0.0, 0.3], table)
    assert sig.in_entity.tolist() == [False, True, True, False, False]  # "," continues the digit span only
    assert np.isnan(sig.d3[:2]).all() and sig.d3[2:] == pytest.approx([0.6, 0.5, 0.4])
    assert sig.surprisal == pytest.approx([0.1] * 5)


def test_write_library_copies_and_sets_thresholds(tmp_path):
    src = tmp_path / "lib"
    src.mkdir()
    (src / "manifest.json").write_text(json.dumps({"calibration": {"surprisal_mean": 1.0}, "n_anchors": 3}))
    (src / "anchors.safetensors").write_bytes(b"x")
    res = calibrate_thresholds(synthetic(2000), CAL, 1 / 16)
    out = write_library(src, tmp_path / "new", res, ["corpus.json"], {})
    m = json.loads((out / "manifest.json").read_text())
    assert m["calibration"]["thresholds"] == res.thresholds and m["calibration"]["surprisal_mean"] == 1.0
    assert m["calibration"]["threshold_calibration"]["target_rate"] == 1 / 16
    assert json.loads((src / "manifest.json").read_text())["calibration"] == {"surprisal_mean": 1.0}  # source untouched
    assert TriggerConfig.from_calibration(m["calibration"]).surprisal_z == res.thresholds["surprisal_z"]
    with pytest.raises(FileExistsError):
        write_library(src, out, res, [], {})


def test_trigger_config_from_calibration_defaults_and_errors():
    assert TriggerConfig.from_calibration({}) == TriggerConfig()
    assert TriggerConfig.from_calibration({"thresholds": {"dispersion_z": 0.7}}).dispersion_z == 0.7
    with pytest.raises(ValueError):
        TriggerConfig.from_calibration({"thresholds": {"bogus": 1}})
    with pytest.raises(ValueError):
        TriggerConfig.from_calibration({"thresholds": {"entity_prob_threshold": 1.5}})


def test_served_engine_reads_thresholds_from_the_manifest(lm, nda_library, tmp_path):
    from sfcl.anchors.versions import load_library
    from sfcl.config import EngineConfig
    from sfcl.serving import make_llm_engine

    res = calibrate_thresholds(synthetic(4000), Calibration.from_dict(nda_library.calibration), 1 / 16)
    out = write_library(nda_library.path, tmp_path / "calibrated", res, ["synthetic"], {})
    lib = load_library(out, expect_fingerprint=lm.fingerprint)  # checksums still valid
    eng = make_llm_engine(lm, lib, EngineConfig(max_num_seqs=1, max_model_len=64))
    cfg = eng.runner.snapshotter.cfg
    assert (cfg.entity_prob_threshold, cfg.dispersion_z, cfg.surprisal_z) == (
        res.thresholds["entity_prob_threshold"], res.thresholds["dispersion_z"], res.thresholds["surprisal_z"])
    plain = make_llm_engine(lm, nda_library, EngineConfig(max_num_seqs=1, max_model_len=64))
    # the builder's serving calibration set thresholds of its own (``sfcl.anchors.builder``)
    assert plain.runner.snapshotter.cfg == TriggerConfig.from_calibration(nda_library.calibration) != TriggerConfig()


def test_calibrate_command_end_to_end(nda_library, cache_dir, tmp_path, capsys):
    from sfcl.anchors.versions import load_library
    from sfcl.cli import main
    from tests.conftest import contractnli_docs, CONTRACTNLI

    contractnli_docs(1)  # skips without the data
    out = tmp_path / "cal"
    rc = main(["anchors", "calibrate", str(nda_library.path), str(CONTRACTNLI), "--out", str(out),
               "--docs", "1", "--questions-per-doc", "2", "--max-doc-tokens", "300", "--max-tokens", "16",
               "--sweep", "0.0625", "--sweep-items", "2", "--cache-dir", str(cache_dir), "--threads", "2"])
    assert rc == 0
    lib = load_library(out)
    thr = lib.calibration["thresholds"]
    rep = json.loads((out / "calibration.json").read_text())
    assert rep["thresholds"] == thr and rep["n_tokens"] > 10
    assert abs(rep["achieved_rate"] - 0.0625) <= 0.5 / rep["n_tokens"] + 0.06  # few tokens: coarse steps
    assert len(rep["sweep"]) == 1 and rep["sweep"][0]["lookups_per_1k_tokens"] >= 0
    assert (out / "calibration.png").is_file()
    assert main(["anchors", "calibrate", str(nda_library.path), "x.json", "--out", str(out)]) == 2  # exists
    assert "already exists" in capsys.readouterr().err


def test_signals_carry_the_attended_length_and_fire_per_length():
    table = np.zeros(4, np.uint8)
    sig = signals_from_tokens([0, 0, 0, 0], [-0.1] * 4, [0.5, 0.5, 0.5, 0.5], table, prompt_len=100)
    assert sig.n_attended.tolist() == [100, 101, 102, 103]
    assert np.isnan(signals_from_tokens([0], [-0.1], [0.5], table).n_attended).all()  # unknown length
    # D3 = 0.5 everywhere: above the short-context statistics' 1.2 sd only at the long context
    tab = {"log2_n": [5.0, 11.0], "mean": [0.6, 0.4], "std": [0.05, 0.05]}
    cal = Calibration.from_dict({"surprisal_mean": 2.0, "surprisal_std": 1.5, "dispersion_mean": 0.5,
                                 "dispersion_std": 0.1, "dispersion_by_length": tab})
    s = TokenSignals([0.1] * 3, [0.5] * 3, [False] * 3, [32, 2048, float("nan")])
    thr = {"entity_prob_threshold": 0.85, "dispersion_z": 1.2, "surprisal_z": 2.0}
    assert fire_masks(s, cal, thr)[:, 1].tolist() == [False, True, False]  # NaN length: flat z = 0
    assert s.dispersion_z(cal) == pytest.approx([-2.0, 2.0, 0.0])
    with pytest.raises(ValueError, match="n_attended"):
        TokenSignals([0.1], [0.5], [False], [1.0, 2.0])


def test_write_library_stores_the_length_table(tmp_path):
    src = tmp_path / "lib"
    src.mkdir()
    base = {"surprisal_mean": 2.0, "surprisal_std": 1.5, "dispersion_mean": 0.5, "dispersion_std": 0.1}
    (src / "manifest.json").write_text(json.dumps({"calibration": base}))
    sig = synthetic(4000)
    sig.n_attended = np.full(sig.n, 300.0)
    from sfcl.snapshot.triggers import dispersion_length_table
    tab = dispersion_length_table(sig.d3, sig.n_attended, source="test")
    res = calibrate_thresholds(sig, Calibration.from_dict({**base, "dispersion_by_length": tab}), 1 / 16)
    out = write_library(src, tmp_path / "new", res, ["c"], {}, tab)
    c = json.loads((out / "manifest.json").read_text())["calibration"]
    cal = Calibration.from_dict(c)
    assert cal.by_length and c["dispersion_by_length"]["source"] == "test"
    assert cal.dispersion_means[0] == pytest.approx(np.nanmean(sig.d3))
    assert abs(trigger_shares(sig, cal, c["thresholds"])["union"] - 1 / 16) < 0.005
