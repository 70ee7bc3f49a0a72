"""``sfcl anchors calibrate`` (sfcl.eval.calibrate): answers on real NDAs -> lookback model and
thresholds in a library copy that the served engine reads. The threshold rules themselves:
tests/test_calibration.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sfcl.snapshot.calibration import TokenRecords, calibrate_thresholds, write_library
from sfcl.snapshot.triggers import Calibration, TriggerConfig


def synthetic_signals(n: int, cal: Calibration):
    rng = np.random.default_rng(0)
    s = np.where(rng.random(n) < 0.85, rng.gamma(1.2, 0.6, n), rng.gamma(2.0, 2.5, n))
    return TokenRecords(-s, rng.random(n) < 0.3, rng.normal(0.5, 0.08, n), np.full(n, 300.0)).signals(cal)


def test_trigger_config_from_calibration_defaults_and_errors():
    assert TriggerConfig.from_calibration({}) == TriggerConfig()
    assert TriggerConfig.from_calibration({"thresholds": {"dispersion_z": 0.7}}).dispersion_z == 0.7
    with pytest.raises(ValueError):
        TriggerConfig.from_calibration({"thresholds": {"bogus": 1}})
    with pytest.raises(ValueError):
        TriggerConfig.from_calibration({"thresholds": {"entity_prob_threshold": 1.5}})


def test_served_engine_reads_thresholds_from_the_manifest(lm, nda_library, tmp_path):
    from sfcl.config import EngineConfig
    from sfcl.engine_stack import make_llm_engine
    from sfcl.library.versions import load_library

    cal = Calibration.from_dict(nda_library.calibration)
    res = calibrate_thresholds(synthetic_signals(4000, cal), cal, 1 / 16)
    out = write_library(nda_library.path, tmp_path / "calibrated", {"thresholds": res.thresholds})
    lib = load_library(out, expect_fingerprint=lm.fingerprint)  # checksums still valid
    eng = make_llm_engine(lm, lib, EngineConfig(max_num_seqs=1, max_model_len=64))
    assert eng.runner.snapshotter.cfg.thresholds() == res.thresholds
    plain = make_llm_engine(lm, nda_library, EngineConfig(max_num_seqs=1, max_model_len=64))
    # the builder's serving calibration set thresholds of its own (``sfcl.anchors.builder``)
    assert plain.runner.snapshotter.cfg == TriggerConfig.from_calibration(nda_library.calibration) != TriggerConfig()


def test_calibrate_command_end_to_end(nda_library, cache_dir, tmp_path, capsys):
    from sfcl.cli import main
    from sfcl.library.versions import load_library
    from tests.conftest import CONTRACTNLI, contractnli_docs

    contractnli_docs(1)  # skips without the data
    out = tmp_path / "cal"
    rc = main(["anchors", "calibrate", str(nda_library.path), str(CONTRACTNLI), "--out", str(out),
               "--docs", "1", "--questions-per-doc", "2", "--max-doc-tokens", "300", "--max-tokens", "16",
               "--sweep", "0.0625", "--sweep-items", "2", "--cache-dir", str(cache_dir), "--threads", "2"])
    assert rc == 0
    lib = load_library(out)
    thr = lib.calibration["thresholds"]
    rep = json.loads((out / "calibration.json").read_text())
    assert rep["thresholds"] == thr and rep["n_tokens"] > 10 and set(thr) == set(TriggerConfig().thresholds())
    assert lib.calibration["threshold_calibration"]["items"] >= 1 and "dispersion_by_length" in lib.calibration
    assert abs(rep["achieved_rate"] - 0.0625) <= 0.5 / rep["n_tokens"] + 0.06  # few tokens: coarse steps
    assert len(rep["sweep"]) == 1 and rep["sweep"][0]["lookups_per_1k_tokens"] >= 0
    assert (out / "calibration.png").is_file()
    assert main(["anchors", "calibrate", str(nda_library.path), "x.json", "--out", str(out)]) == 2  # exists
    assert "already exists" in capsys.readouterr().err
