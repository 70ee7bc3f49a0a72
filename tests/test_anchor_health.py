"""Library health: drift on the real NDA library, trigger precision and coverage gap from a log."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sfcl.anchors.health import EXIT_DRIFT, drift, extract_entities, trigger_precision
from sfcl.cli import main
from sfcl.library.versions import library_fields, load_library, select, write_version


@pytest.fixture(scope="module")
def versions(nda_library, tmp_path_factory):
    """root/v0001 = the NDA library, v0002 = a 10% random subsample removed (mild change),
    v0003 = every vector shifted by 1 OLD std along OLD's first principal axis (strong change)."""
    lib = nda_library
    root = tmp_path_factory.mktemp("health") / "lib"
    f = library_fields(lib)
    v1 = write_version(root, f, command="copy", parent=lib)
    keep = np.random.default_rng(0).random(lib.n_anchors) > 0.1
    v2 = write_version(root, select(f, torch.from_numpy(keep)), command="subsample", parent=lib)
    x = lib.vectors.double()
    axis = torch.linalg.eigh((x - x.mean(0)).T @ (x - x.mean(0)))[1][:, -1]  # first principal axis
    sd = float(((x - x.mean(0)) @ axis).std())
    shifted = dict(f, vectors=(x + 1.0 * sd * axis).float())
    v3 = write_version(root, shifted, command="shift", parent=lib)
    return load_library(v1), load_library(v2), load_library(v3)


def test_drift_zero_for_identical_small_for_subsample_large_for_shift(versions):
    v1, v2, v3 = versions
    assert drift(v1, v1)["drift"] == 0.0
    mild = drift(v1, v2)["drift"]
    d3 = drift(v1, v3)
    assert 0.0 < mild < 0.05
    # the shift moves axis 1 by ~1 std (the store re-normalises, so not exactly); others barely
    assert 0.6 < d3["axes"][0] < 1.1 and max(d3["axes"][1:]) < d3["axes"][0] / 2
    assert d3["drift"] > 0.15


def test_health_cli_exit_codes_and_report(versions, tmp_path, capsys):
    v1, v2, v3 = versions
    assert main(["anchors", "health", str(v1.path), str(v1.path), "--out", str(tmp_path / "same")]) == 0
    rep = json.loads((tmp_path / "same" / "health.json").read_text())
    assert rep["drift"]["drift"] == 0.0 and not rep["drift_exceeded"]
    assert (tmp_path / "same" / "drift.png").stat().st_size > 5_000
    assert main(["anchors", "health", str(v1.path), str(v3.path)]) == EXIT_DRIFT
    assert "REBUILD (exit 3)" in capsys.readouterr().out
    assert main(["anchors", "health", str(v1.path), str(v3.path), "--max-drift", "10"]) == 0


def test_trigger_precision_counts_snapshotted_errors():
    recs = [{"id": "a", "snapshots": 2, "outcome": "error"}, {"id": "b", "snapshots": 1, "outcome": "correct"},
            {"id": "c", "snapshots": 3, "outcome": "error"}, {"id": "d", "snapshots": 0, "outcome": "error"},
            {"id": "e", "snapshots": 0, "outcome": "correct"}, {"id": "f", "snapshots": 5}]
    tp = trigger_precision(recs)
    assert tp["precision"] == pytest.approx(2 / 3) and tp["recall"] == pytest.approx(2 / 3)
    assert tp["with_outcome"] == 5 and tp["requests"] == 6
    assert trigger_precision([{"snapshots": 0, "outcome": "correct"}])["precision"] is None


def test_entities_by_class():
    e = extract_entities("Under Section 4.2(b), Acme Holdings pays $1,200.50 by March 3, 2025 and 30 days later.")
    assert ("clause_ref", "Section 4.2(b)") in e and ("amount", "$1,200.50") in e
    assert ("date", "March 3, 2025") in e and ("name", "Acme Holdings") in e and ("number", "30") in e
    assert ("number", "4.2") not in e  # already part of the clause reference


def test_coverage_gap_from_a_serve_log(versions, tmp_path, capsys):
    v1 = versions[0]
    # an entity that a real anchor span contains, and two that no NDA span contains
    covered = next(s for ent in map(extract_entities, v1.span_texts) for (c, s) in ent if c == "name")
    log = tmp_path / "serve.jsonl"
    lines = ["sfcl: serving model on http://127.0.0.1:8000"]  # a non-JSON line is skipped
    for i in range(4):
        lines.append(json.dumps({"id": f"r{i}", "route": "/v1/messages", "status": 200, "snapshots": i % 2,
                                 "outcome": "error" if i == 1 else "correct",
                                 "prompt": f"what does {covered} owe under Section 99.7(z) to Zanzibar Quarry Works?"}))
    log.write_text("\n".join(lines) + "\n")
    argv = ["anchors", "health", str(v1.path), str(v1.path), "--traffic", str(log), "--out", str(tmp_path / "r")]
    assert main(argv) == 0
    rep = json.loads((tmp_path / "r" / "health.json").read_text())
    assert rep["traffic"] == {"path": str(log), "records": 4, "skipped_lines": 1}
    assert rep["trigger_precision"]["precision"] == pytest.approx(0.5)  # r1 error, r3 correct
    unc = {e["entity"] for e in rep["coverage"]["top_uncovered"]}
    assert {"Section 99.7(z)", "Zanzibar Quarry Works"} <= unc and covered not in unc
    assert rep["coverage"]["frequent"] == rep["coverage"]["uncovered"] + 1
    assert "coverage gap" in capsys.readouterr().out
