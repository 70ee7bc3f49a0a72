"""``sfcl eval`` runner (sfcl.eval.run): configuration parsing, metrics with paired CIs, and one
tiny end-to-end run on the real bundled model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sfcl.eval.run import ALL_CONFIGS, metrics, parse_configs, table


def test_parse_configs():
    assert parse_configs("off,triggered+steer") == [("off", "off", False), ("triggered+steer", "triggered", True)]
    assert [n for n, _, _ in parse_configs(",".join(ALL_CONFIGS))] == list(ALL_CONFIGS)
    for bad in ("", "off,never", "always+steer+x"):
        with pytest.raises(ValueError):
            parse_configs(bad)


def _cols(correct, ents, unsup, lookups, tokens, decode_s):
    n = len(correct)
    return {"is_qa": np.ones(n), "correct": np.asarray(correct, float), "entities": np.asarray(ents, float),
            "unsupported": np.asarray(unsup, float), "lookups": np.asarray(lookups, float),
            "tokens": np.asarray(tokens, float), "decode_tokens": np.asarray(tokens, float) - 1,
            "decode_s": np.asarray(decode_s, float)}


def test_metrics_values_and_paired_comparisons():
    cols = {"off": _cols([1, 0, 1, 0], [2, 2, 2, 2], [1, 1, 0, 0], [0, 0, 0, 0], [11, 11, 11, 11], [1, 1, 1, 1]),
            "triggered": _cols([1, 1, 1, 0], [2, 2, 2, 2], [1, 0, 0, 0], [1, 1, 0, 0], [11, 11, 11, 11], [2, 2, 2, 2]),
            "always": _cols([1, 0, 1, 0], [2, 2, 2, 2], [1, 1, 0, 0], [11, 11, 11, 11], [11, 11, 11, 11], [1, 1, 1, 1])}
    texts = {"off": ["a", "b", "c", "d"], "triggered": ["a", "x", "c", "d"], "always": ["a", "b", "c", "d"]}
    res = metrics(cols, ["off", "triggered", "always"], texts, reps=200, seed=0)
    t = res["triggered"]
    assert t["answer_accuracy"]["value"] == pytest.approx(0.75)
    assert t["entity_error_rate"]["value"] == pytest.approx(1 / 8)
    assert t["entity_error_change_vs_off"]["value"] == pytest.approx(-0.5)
    assert t["lookups_per_1k_tokens"]["value"] == pytest.approx(1000 * 2 / 44)
    assert t["decode_speed_vs_off"]["value"] == pytest.approx(0.5)
    assert t["lookups_vs_always"] == pytest.approx(2 / 44)
    assert t["same_text_as_off"] == 0.75 and res["always"]["same_text_as_off"] == 1.0
    for m in res.values():
        for k in ("answer_accuracy", "entity_error_rate", "lookups_per_1k_tokens"):
            e = m[k]
            assert e["ci_lo"] <= e["value"] + 1e-12 and e["value"] <= e["ci_hi"] + 1e-12
    md = table(res)
    assert md.count("\n") == 4 and "`triggered`" in md and "-50.0%" in md


def test_eval_end_to_end_on_the_real_model(tmp_path, cache_dir, nda_library):
    from sfcl.cli import main

    out = tmp_path / "ev"
    rc = main(["eval", "--docs", "1", "--questions-per-doc", "1", "--no-summary", "--configs", "off,triggered,always",
               "--max-doc-tokens", "300", "--max-tokens", "8", "--bootstrap", "50", "--anchors", str(nda_library.path),
               "--cache-dir", str(cache_dir), "--threads", "2", "--out", str(out)])
    assert rc == 0
    d = json.loads((out / "eval.json").read_text())
    m = d["metrics"]
    assert set(m) == {"off", "triggered", "always"}
    assert m["off"]["lookups"] == 0 and m["always"]["lookups"] == m["always"]["tokens"] > 0
    assert m["triggered"]["same_text_as_off"] == 1.0  # snapshots observe only
    item = d["items"][0]
    assert item["gold"] and set(item["answers"]) == {"off", "triggered", "always"}
    assert (out / "eval.png").stat().st_size > 1000 and "| `always` |" in (out / "eval.md").read_text()


def test_run_configs_interleaves_documents_and_keeps_item_order():
    from sfcl.eval.drive import Item
    from sfcl.eval.questions import Question
    from sfcl.eval.run import run_configs
    from sfcl.server.testing import FakeEngine

    items = [Item(f"d{d}#q{q}", [1, 2, 3], 8, {"question": Question(f"d{d}#q{q}", f"d{d}", "duration", "?")})
             for d in range(3) for q in range(2)]
    eng = FakeEngine(snapshot_every=4)
    cfgs = parse_configs("off,triggered,always")
    recs, walls = run_configs(eng, items, cfgs, order="doc")
    assert all([r.key for r in recs[n]] == [it.key for it in items] for n in recs)
    assert [r.lookups for r in recs["off"]] == [0] * 6 and [r.lookups for r in recs["triggered"]] == [2] * 6
    assert all(r.lookups == r.completion_tokens == 8 for r in recs["always"])
    warm = [r for r in eng.requests if r.params.max_tokens == 2]
    assert len(warm) == 6 and {r.params.snapshot_mode for r in warm} == {"off"}  # one warm-up pass per document
    modes = [r.params.snapshot_mode for r in eng.requests if r.params.max_tokens != 2]
    # document 0: off, triggered, always; document 1 starts with triggered; document 2 with always
    assert modes[0::2] == ["off", "triggered", "always", "triggered", "always", "off", "always", "off", "triggered"]
    assert set(walls) == {"off", "triggered", "always"} and all(w > 0 for w in walls.values())
    recs2, _ = run_configs(eng, items, cfgs, order="config")
    assert [r.key for r in recs2["always"]] == [it.key for it in items]
