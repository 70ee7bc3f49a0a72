"""``sfcl eval`` (sfcl.eval.run, sfcl.eval.arms): arm parsing, running the arms through an engine,
metrics with cluster-bootstrap CIs, and one tiny end-to-end run on the real bundled model."""

from __future__ import annotations

import json
import zlib
from types import SimpleNamespace

import numpy as np
import pytest

from sfcl.eval.arms import Arm, parse_arms, run_arms, time_arms
from sfcl.eval.run import COLUMNS, copy_and_repeats, doc_range, metrics, speed_vs_off, table
from sfcl.snapshot.mechanisms import DEFAULT_STEER


def test_parse_arms():
    arms = parse_arms("off,triggered+source,always+cad,triggered+source+cad,random+best,always")
    assert [a.name for a in arms] == ["off", "triggered+source", "always+cad", "triggered+cad+source",
                                      "random+" + "+".join(DEFAULT_STEER), "always"]
    r = arms[4]
    assert r.random and r.mode == "triggered" and r.steer == DEFAULT_STEER
    for bad in ("", "off+source", "random", "never", "triggered+banana", "off,off"):
        with pytest.raises(ValueError):
            parse_arms(bad)


def test_doc_range():
    assert doc_range("0-3") == [0, 1, 2, 3] and doc_range("5,7-8") == [5, 7, 8]
    for bad in ("", "3-1", "-1"):
        with pytest.raises(ValueError):
            doc_range(bad)


def test_copy_and_repeats():
    src = "the receiving party shall return all confidential information within thirty days of a request".split()
    grams = {tuple(src[i:i + 8]) for i in range(len(src) - 7)}
    n, copied, ng, rep = copy_and_repeats("The Receiving Party shall return all confidential information. Yes yes yes "
                                          "yes yes", grams)
    assert (n, copied, ng, rep) == (13, 8, 10, 1)  # an 8-word copy; "yes" x5 holds "yes yes yes yes" twice
    assert copy_and_repeats("", grams) == (0, 0, 0, 0)


def _cols(correct, ents, unsup, lookups, tokens):
    n = len(correct)
    c = {k: np.zeros(n) for k in COLUMNS}
    c.update(items=np.ones(n), is_qa=np.ones(n), correct=np.asarray(correct, float), entities=np.asarray(ents, float),
             unsupported=np.asarray(unsup, float), lookups=np.asarray(lookups, float), tokens=np.asarray(tokens, float),
             words=np.asarray(tokens, float))
    return c


def test_metrics_values_paired_comparisons_and_cluster_cis():
    cols = {"off": _cols([1, 0, 1, 0], [2, 2, 2, 2], [1, 1, 0, 0], [0, 0, 0, 0], [10, 10, 10, 10]),
            "triggered+source": _cols([1, 1, 1, 0], [2, 2, 2, 2], [1, 0, 0, 0], [1, 1, 0, 0], [10, 10, 10, 10]),
            "always+source": _cols([1, 0, 1, 0], [2, 2, 2, 2], [0, 1, 0, 0], [10, 10, 10, 10], [10, 10, 10, 10]),
            "random+source": _cols([1, 0, 1, 0], [2, 2, 2, 2], [1, 1, 0, 0], [1, 1, 0, 0], [10, 10, 10, 10])}
    arms = parse_arms(",".join(cols))
    texts = {"off": ["a", "b", "c", "d"], "triggered+source": ["a", "x", "c", "d"], "always+source": list("abcd"),
             "random+source": list("abcd")}
    res = metrics(cols, arms, texts, ["d1", "d1", "d2", "d2"], reps=300, seed=0)
    t = res["triggered+source"]
    assert t["answer_accuracy"]["value"] == pytest.approx(0.75)
    assert t["entity_error_rate"]["value"] == pytest.approx(1 / 8)
    assert t["entity_error_change_vs_off"]["value"] == pytest.approx(-0.5)
    assert t["entity_error_diff_vs_off"]["value"] == pytest.approx(1 / 8 - 2 / 8)
    assert t["accuracy_diff_vs_off"]["value"] == pytest.approx(0.25)
    assert t["lookups_per_1k_tokens"]["value"] == pytest.approx(50.0)
    assert t["lookups_vs_always"] == pytest.approx(2 / 40)
    assert t["entity_error_diff_vs_always"]["value"] == pytest.approx(0.0)
    assert t["entity_error_diff_vs_random"]["value"] == pytest.approx(-1 / 8)
    assert t["same_text_as_off"] == 0.75 and res["always+source"]["same_text_as_off"] == 1.0
    # two documents: a replicate draws d1 twice, d2 twice or one of each -> three possible values only
    e = res["off"]["entity_error_rate"]
    assert (e["ci_lo"], e["ci_hi"]) == (0.0, 0.5)
    md = table(res)
    assert md.count("\n") == 5 and "`triggered+source`" in md and "-50.0%" in md


def test_speed_vs_off_is_the_per_round_ratio():
    s = speed_vs_off({"off": [100.0, 50.0], "triggered+source": [90.0, 50.0]})
    v = s["triggered+source"]["vs_off"]
    assert v["value"] == pytest.approx(np.sqrt(0.9)) and (v["ci_lo"], v["ci_hi"]) == (0.9, 1.0)
    assert s["off"]["vs_off"]["value"] == 1.0


def _items(docs=3, per=2):
    from sfcl.eval.drive import Item
    from sfcl.eval.questions import Question

    return [Item(f"d{d}#q{q}", [1, 2, 3], 8, {"question": Question(f"d{d}#q{q}", f"d{d}", "duration", "?")})
            for d in range(docs) for q in range(per)]


def test_run_arms_mixes_arms_per_document_and_runs_random_arms_last():
    from sfcl.server.testing import FakeEngine

    items = _items()
    eng = FakeEngine(snapshot_every=4)
    arms = parse_arms("off,triggered+source,always,random+source")
    seen = []
    recs = run_arms(eng, items, arms, lambda r: seen.append(sorted(r)) or 0.25)
    assert all([r.key for r in recs[a.name]] == [it.key for it in items] for a in arms)
    assert [r.lookups for r in recs["off"]] == [0] * 6 and [r.lookups for r in recs["triggered+source"]] == [2] * 6
    assert all(r.lookups == r.completion_tokens == 8 for r in recs["always"])
    assert seen == [["always", "off", "random+source", "triggered+source"]]  # asked once, after the others ran
    reqs = eng.requests
    assert [r.params.random_trigger for r in reqs[-6:]] == [0.25] * 6 and reqs[-1].params.steer == ("source",)
    assert {r.params.snapshot_mode for r in reqs[:3]} == {"off", "triggered", "always"}  # one batch mixes the arms
    assert all(r.params.random_trigger == 0 and r.params.seed is None for r in reqs[:-6])
    # the random draws are seeded per item, not per request id (which carries a random prefix):
    # the control repeats from run to run
    assert [r.params.seed for r in reqs[-6:]] == [zlib.crc32(it.key.encode()) for it in items]


def test_random_draw_follows_the_request_seed_not_its_id():
    from sfcl.engine.model_runner import ModelRunner
    from sfcl.engine.request import SamplingParams
    from sfcl.engine.scheduler import Sequence

    def draws(request_id: str, seed) -> list[bool]:
        runner = SimpleNamespace(_random={})
        seq = Sequence(request_id=request_id, prompt_ids=[1, 2],
                       params=SamplingParams(random_trigger=0.3, seed=seed))
        return [ModelRunner._random_draw(runner, seq) for _ in range(200)]

    assert draws("a1-k", 7) == draws("b2-k", 7)  # same seed, other ids: the same draws
    assert draws("a1-k", 7) != draws("a1-k", 8)
    assert draws("a1-k", None) != draws("b2-k", None)  # no seed: the id seeds them
    assert 30 < sum(draws("a1-k", 7)) < 90  # Bernoulli(0.3) over 200 draws


def test_time_arms_rotates_the_order_per_round():
    from sfcl.server.testing import FakeEngine

    eng = FakeEngine(snapshot_every=4)
    arms = parse_arms("off,triggered+source,always")
    tps = time_arms(eng, _items(1, 2), arms, 0.1, rounds=3, max_in_flight=2)
    assert set(tps) == {"off", "triggered+source", "always"} and all(len(v) == 3 for v in tps.values())
    modes = [r.params.snapshot_mode for r in eng.requests[2:]][::2]  # after the warm-up pass, one per batch
    assert modes == ["off", "triggered", "always", "triggered", "always", "off", "always", "off", "triggered"]


def test_eval_end_to_end_on_the_real_model(tmp_path, cache_dir, nda_library):
    from sfcl.cli import main

    out = tmp_path / "ev"
    rc = main(["eval", "--docs", "0", "--calibrate-on", "2", "--questions-per-doc", "2", "--no-summary",
               "--arms", "off,always,triggered+source,random+source", "--max-doc-tokens", "300", "--max-tokens", "8",
               "--bootstrap", "50", "--speed-rounds", "1", "--anchors", str(nda_library.path),
               "--cache-dir", str(cache_dir), "--threads", "2", "--max-num-seqs", "4", "--dtype", "float32",
               "--out", str(out)])  # float32: arms that share prefix-cache blocks compute alike (bf16 rounds by row count)
    assert rc == 0
    d = json.loads((out / "eval.json").read_text())
    m = d["metrics"]
    assert set(m) == {"off", "always", "triggered+source", "random+source"}
    assert m["off"]["lookups"] == 0 and m["always"]["lookups"] == m["always"]["tokens"] > 0
    assert m["always"]["same_text_as_off"] == 1.0  # snapshots observe only
    assert "vs_off" not in m["off"] and m["triggered+source"]["decode_speed_vs_off"]["rounds"] == 1
    cal = d["calibration"]
    assert len(cal["documents"]) == 1 and cal["rate_on_calibration_docs"] > 0 and cal["rate_on_evaluated_docs"] >= 0
    assert (out / "library" / "manifest.json").is_file()
    det = d["detection"]
    assert det["n_tokens"] > 0 and set(det["per_trigger"]) >= {"union", "lookback_ratio"}
    assert "snapshot_confidence (low = risk)" in det["auroc"]
    item = d["items"][0]
    assert item["gold"] and set(item["answers"]) == set(m)
    assert (out / "eval.png").stat().st_size > 1000 and "| `always` |" in (out / "eval.md").read_text()
