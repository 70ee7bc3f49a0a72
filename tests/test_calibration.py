"""Threshold calibration (sfcl.snapshot.calibration) on synthetic token records: the thresholds
come out of serving's own signal and fire rules."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sfcl.snapshot import entity
from sfcl.snapshot.calibration import (TokenRecords, calibrate_thresholds, cutoffs_for_share, records_from_tokens,
                                       select_triggers, signal_auroc, trigger_shares, write_library)
from sfcl.snapshot.lookback import LookbackModel
from sfcl.snapshot.triggers import TRIGGER_NAMES, Calibration, TriggerConfig, fire, trigger_signals

CAL = Calibration(surprisal_mean=2.0, surprisal_std=1.5, dispersion_mean=0.5, dispersion_std=0.1)


def synthetic(n: int = 20000, seed: int = 0, entity_share: float = 0.3, features: bool = False) -> TokenRecords:
    rng = np.random.default_rng(seed)
    s = np.where(rng.random(n) < 0.85, rng.gamma(1.2, 0.6, n), rng.gamma(2.0, 2.5, n))  # mostly confident
    d3 = rng.normal(0.5, 0.08, n)
    d3[rng.random(n) < 0.05] = np.nan  # first tokens of sequences: undefined
    f = rng.normal(0, 1, (n, 3)) if features else None
    return TokenRecords(-s, rng.random(n) < entity_share, d3, np.full(n, 300.0), f)


def test_record_signals_are_the_runner_signals():
    rec = TokenRecords(token_logp=[np.log(0.5), np.log(0.95), -7.0, -0.1], in_entity=[True, True, False, False],
                       d3=[np.nan, 0.9, 0.5, 0.5], n_attended=[10, 11, 12, 13])
    sig = rec.signals(CAL)
    direct = trigger_signals(torch.tensor(rec.token_logp).float(), torch.tensor(rec.in_entity),
                             torch.tensor(rec.d3).float(), torch.tensor([10, 11, 12, 13]), None, CAL)
    assert torch.equal(sig, direct)
    # token 0: entity with p = 0.5 < 0.85; token 1: D3 z = 4 > 1.2; token 2: |z| = 3.33 > 2
    assert fire(sig, TriggerConfig()).tolist() == [[True, False, False, False, False], [False, True, False, False, False],
                                                   [False, False, True, False, False], [False, False, False, False, False]]


def test_lookback_signal_comes_from_the_model_score():
    rec = synthetic(50, features=True)
    m = LookbackModel(("a", "b", "c"), (0.0,) * 3, (1.0,) * 3, (2.0, 0.0, 0.0), -1.0)
    sig = rec.signals(CAL, m)
    assert torch.allclose(sig[:, 3], m.score(torch.from_numpy(rec.features).float()))
    assert torch.isneginf(synthetic(50).signals(CAL, m)[:, 3]).all()  # no features: the trigger cannot fire


@pytest.mark.parametrize("target", [1 / 64, 1 / 16, 0.2])
def test_calibrated_union_share_hits_the_target(target):
    sig = synthetic().signals(CAL)
    res = calibrate_thresholds(sig, CAL, target, TRIGGER_NAMES[:3])
    assert abs(res.achieved - target) < 0.003
    cfg = TriggerConfig(**res.thresholds)  # valid configuration values
    assert res.achieved == pytest.approx(trigger_shares(sig, cfg)["union"])
    shares = [res.per_trigger[n] for n in TRIGGER_NAMES[:3]]  # equal split
    assert max(shares) - min(shares) < 0.004 and res.q >= target / 3 - 1e-3


def test_lookback_trigger_takes_its_share_when_a_model_exists():
    rec = synthetic(features=True)
    m = LookbackModel(("a", "b", "c"), (0.0,) * 3, (1.0,) * 3, (1.0, 0.5, 0.0), 0.0)
    res = calibrate_thresholds(rec.signals(CAL, m), CAL, 1 / 16)
    assert 0.0 < res.thresholds["lookback_threshold"] < 1.0
    assert abs(res.per_trigger["lookback_ratio"] - res.per_trigger["attention_dispersion"]) < 0.004


def test_surprisal_trigger_stays_one_sided():
    rec = synthetic()
    rec.token_logp[:2000] = 0.0  # near-certain tokens: z = -mean/std = -1.33
    sig = rec.signals(CAL)
    for target in (1 / 16, 0.3):
        res = calibrate_thresholds(sig, CAL, target)
        assert not fire(sig[:2000], TriggerConfig(**res.thresholds))[:, 2].any()
        assert res.thresholds["surprisal_z"] >= CAL.surprisal_mean / CAL.surprisal_std


def test_lower_target_gives_stricter_thresholds():
    sig = synthetic().signals(CAL)
    lo, hi = calibrate_thresholds(sig, CAL, 1 / 64), calibrate_thresholds(sig, CAL, 1 / 8)
    assert lo.thresholds["entity_prob_threshold"] < hi.thresholds["entity_prob_threshold"]
    assert lo.thresholds["dispersion_z"] > hi.thresholds["dispersion_z"]
    assert lo.thresholds["surprisal_z"] > hi.thresholds["surprisal_z"]


def test_entity_trigger_is_capped_by_the_entity_share():
    sig = synthetic(entity_share=0.02).signals(CAL)
    assert cutoffs_for_share(sig, CAL, 0.2)["entity_prob_threshold"] == 1.0
    res = calibrate_thresholds(sig, CAL, 0.25)
    assert res.per_trigger["entity_low_confidence"] <= 0.02 + 1e-9
    assert abs(res.achieved - 0.25) < 0.005  # the other triggers take up the rest


def test_bad_inputs():
    with pytest.raises(ValueError):
        calibrate_thresholds(synthetic(100).signals(CAL), CAL, 0.0)
    with pytest.raises(ValueError):
        TokenRecords([1.0, 2.0], [True, False], [0.1], [1, 2])
    with pytest.raises(ValueError):
        TokenRecords([], [], [], [])
    with pytest.raises(ValueError):
        TokenRecords([1.0], [True], [0.1], [1], np.zeros((2, 3)))


def test_records_from_tokens_apply_the_runner_rules():
    # class table: token 0 plain word, 1 digit, 2 "," (CONT), 3 sentence end "."
    table = [0, entity.DIGIT, entity.CONT, entity.SENT_END | entity.CONT]
    rec = records_from_tokens([0, 1, 2, 0, 2], [-0.1] * 5, [0.3, 0.6, 0.9, 0.0, 0.3], table, prompt_len=100)
    assert rec.in_entity.tolist() == [False, True, True, False, False]  # "," continues the digit span only
    assert np.isnan(rec.d3[:2]).all() and rec.d3[2:] == pytest.approx([0.6, 0.5, 0.4])
    assert rec.n_attended.tolist() == [100, 101, 102, 103, 104]
    assert rec.token_logp == pytest.approx([-0.1] * 5)


def test_records_from_tokens_apply_the_number_check_given_the_prompt():
    from sfcl.snapshot.source import SourceIndex

    table = [0, entity.DIGIT, entity.DIGIT, 0]  # 0 " days", 1 "1", 2 "2", 3 " word"
    canon = [(20,), (1,), (2,), (23,)]
    src = SourceIndex([3] * 70 + [1, 0], canon)  # a 72-token prompt whose one number is 1
    rec = records_from_tokens([1, 2, 0, 1], [-0.1] * 4, [0.3] * 4, table, source=src, canon=canon)
    assert rec.number[:2].tolist() == [0.0, 1.0] and np.isnan(rec.number[2]) and rec.number[3] == 0.0  # "12" is not
    assert np.isnan(records_from_tokens([1, 2], [-0.1] * 2, [0.3] * 2, table).number).all()  # no prompt given


def test_records_round_trip_the_runner_rows():
    rows = [[-0.5, 1.0, float("nan"), 40.0, 1.0, 0.1, 0.2], [-0.1, 0.0, 0.4, 41.0, float("nan"), 0.3, 0.4]]
    rec = TokenRecords.from_rows(rows)
    assert rec.in_entity.tolist() == [True, False] and rec.features.tolist() == [[0.1, 0.2], [0.3, 0.4]]
    assert rec.number[0] == 1.0 and np.isnan(rec.number[1])
    both = TokenRecords.concat([rec, rec])
    assert both.n == 4 and both.features.shape == (4, 2) and both.number.shape == (4,)
    # the number column reaches the unsupported_number trigger: it fires on the first token only
    f = fire(both.signals(CAL), TriggerConfig(enabled=("unsupported_number",)))
    assert f[:, -1].tolist() == [True, False, True, False] and not f[:, :-1].any()


def test_dispersion_fires_per_attended_length():
    tab = {"log2_n": [5.0, 11.0], "mean": [0.6, 0.4], "std": [0.05, 0.05]}
    cal = Calibration.from_dict({"surprisal_mean": 2.0, "surprisal_std": 1.5, "dispersion_mean": 0.5,
                                 "dispersion_std": 0.1, "dispersion_by_length": tab})
    rec = TokenRecords([-0.1] * 2, [False] * 2, [0.5] * 2, [32, 2048])
    assert fire(rec.signals(cal), TriggerConfig())[:, 1].tolist() == [False, True]


def test_write_library_copies_and_merges_the_calibration(tmp_path):
    src = tmp_path / "lib"
    src.mkdir()
    (src / "manifest.json").write_text(json.dumps({"calibration": {"surprisal_mean": 1.0}, "n_anchors": 3}))
    (src / "anchors.safetensors").write_bytes(b"x")
    res = calibrate_thresholds(synthetic(2000).signals(CAL), CAL, 1 / 16)
    out = write_library(src, tmp_path / "new", {"thresholds": res.thresholds,
                                                "threshold_calibration": {"target_rate": 1 / 16}})
    m = json.loads((out / "manifest.json").read_text())
    assert m["calibration"]["thresholds"] == res.thresholds and m["calibration"]["surprisal_mean"] == 1.0
    assert m["calibration"]["threshold_calibration"]["derived_from"] == str(src)
    assert json.loads((src / "manifest.json").read_text())["calibration"] == {"surprisal_mean": 1.0}  # source untouched
    assert TriggerConfig.from_calibration(m["calibration"]).surprisal_z == res.thresholds["surprisal_z"]
    with pytest.raises(FileExistsError):
        write_library(src, out, {})


def test_write_library_from_a_root_copies_its_current_version(tmp_path):
    """``sfcl anchors build --out ROOT`` writes ROOT/CURRENT + ROOT/v000N: calibrating ROOT copies the
    version CURRENT names, which is the one serving ROOT loads (before: the whole root was copied
    and its manifest not found, after the calibration's generation had run)."""
    root = tmp_path / "lib"
    for v, n in (("v0001", 3), ("v0002", 5)):
        (root / v).mkdir(parents=True)
        (root / v / "manifest.json").write_text(json.dumps({"calibration": {}, "n_anchors": n}))
    (root / "CURRENT").write_text("v0001")
    out = write_library(root, tmp_path / "cal", {"threshold_calibration": {"target_rate": 0.05}})
    m = json.loads((out / "manifest.json").read_text())
    assert m["n_anchors"] == 3 and m["calibration"]["threshold_calibration"]["derived_from"] == str(root / "v0001")
    assert not (out / "CURRENT").exists() and not (out / "v0002").exists()


def test_thresholds_for_unseen_documents_keep_a_margin():
    rec = synthetic(6000)
    rng = np.random.default_rng(1)
    docs = np.repeat(np.arange(20), 300)
    rec.token_logp -= np.repeat(rng.gamma(1.0, 1.0, 20), 300)  # documents differ: some run much hotter
    sig = rec.signals(CAL)
    plain = calibrate_thresholds(sig, CAL, 1 / 16)
    held = calibrate_thresholds(sig, CAL, 1 / 16, groups=docs.tolist())
    assert abs(held.upper - 1 / 16) < 0.004 and held.achieved < plain.achieved  # stricter on average
    assert held.thresholds["surprisal_z"] >= plain.thresholds["surprisal_z"]
    with pytest.raises(ValueError, match="groups"):
        calibrate_thresholds(sig, CAL, 1 / 16, groups=[0, 1])


def test_signal_auroc_ranks_tokens_that_cannot_fire_lowest():
    y = np.array([True, True, False, False, False])
    assert signal_auroc(np.array([0.9, 0.8, 0.1, -np.inf, -np.inf]), y) == 1.0
    assert signal_auroc(np.array([-np.inf, -np.inf, 0.1, 0.2, 0.3]), y) == 0.0
    assert np.isnan(signal_auroc(np.array([0.1, 0.2]), np.array([False, False])))


def test_triggers_without_signal_for_unsupported_tokens_get_no_budget():
    rec = synthetic(8000, seed=3)
    rng = np.random.default_rng(3)
    # unsupported tokens: low-probability entity tokens (the entity and surprisal signals see them),
    # D3 unrelated to them
    y = rec.in_entity & (rec.token_logp < np.quantile(rec.token_logp, 0.2)) & (rng.random(rec.n) < 0.5)
    sig = rec.signals(CAL)
    kept, auc = select_triggers(sig, y)
    assert "entity_low_confidence" in kept and "attention_dispersion" not in kept and auc["attention_dispersion"] < 0.6
    assert "lookback_ratio" not in kept  # no model: its signal is -inf everywhere
    res = calibrate_thresholds(sig, CAL, 1 / 16, kept)
    assert res.per_trigger["attention_dispersion"] == 0.0 and abs(res.achieved - 1 / 16) < 0.004
    # the lookback model is judged by its cross-validated AUROC, not its in-sample signal
    assert "lookback_ratio" not in select_triggers(sig, y, lookback_cv_auroc=0.55)[0]
    # no labelled positive: every trigger keeps its share
    assert select_triggers(sig, np.zeros(rec.n, bool))[0] == TRIGGER_NAMES
    with pytest.raises(ValueError):
        select_triggers(sig, y[:10])


def test_enabled_triggers_round_trip_through_the_manifest():
    c = {"thresholds": {"dispersion_z": 2.0}, "enabled_triggers": ["lookback_ratio", "entity_low_confidence"]}
    cfg = TriggerConfig.from_calibration(c, dispersion_window=5)
    assert cfg.enabled == ("entity_low_confidence", "lookback_ratio") and cfg.dispersion_window == 5
    sig = torch.tensor([[-np.inf, 9.0, 9.0, -np.inf, 1.0]])  # dispersion, surprisal, number check all above their cutoffs
    assert not fire(sig, cfg).any()
    with pytest.raises(ValueError, match="unknown trigger"):
        TriggerConfig.from_calibration({"enabled_triggers": ["bogus"]})
    with pytest.raises(ValueError, match="enabled_triggers"):
        TriggerConfig.from_calibration({"enabled_triggers": "entity_low_confidence"})
