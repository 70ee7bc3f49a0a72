"""Keyword boost (sfcl.snapshot.boost): rules, matching, and their effect on snapshot confidence."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from conftest import REPO

from sfcl.config import EngineConfig
from sfcl.engine.engine import run_to_completion
from sfcl.engine.events import SnapshotEvent
from sfcl.engine.request import SamplingParams
from sfcl.engine_stack import make_llm_engine
from sfcl.snapshot.boost import (KeywordRule, boosted_confidence, kind_multipliers, library_rules, load_rules,
                                 parse_rules)
from sfcl.snapshot.snapshotter import Snapshotter

RULES = [{"keywords": ["Governing Law", "indemnif"], "kinds": ["general"], "multiplier": 1.5}]


def test_parse_and_match_rules():
    [r] = parse_rules(RULES)
    assert r == KeywordRule(("governing law", "indemnif"), ("general",), 1.5)
    assert parse_rules({"rules": RULES}) == [r]
    assert kind_multipliers([r], "Which party shall INDEMNIFY the other?") == {"general": 1.5}
    assert kind_multipliers([r], "How long does the agreement last?") == {}
    two = parse_rules(RULES + [{"keywords": "law", "kinds": ["general", "domain"], "multiplier": 1.2}])
    got = kind_multipliers(two, "governing law")  # matching rules multiply, as the store documents
    assert got == {"general": pytest.approx(1.8), "domain": pytest.approx(1.2)}


@pytest.mark.parametrize("bad", [
    [{"keywords": [], "kinds": ["domain"]}],
    [{"keywords": ["x"], "kinds": []}],
    [{"keywords": ["x"]}, 3],
    [{"keywords": ["x"], "kinds": ["domain"], "multiplier": 0}],
    [{"keywords": ["x"], "kinds": ["domain"], "multiplier": "2"}],
    {"no_rules": []},
    "rules",
])
def test_bad_rules_are_refused(bad):
    with pytest.raises(ValueError):
        parse_rules(bad)


def test_boosted_confidence_multiplies_matching_kinds_and_clamps():
    assert boosted_confidence([0.4, 0.5], ["domain", "general"], {"domain": 1.5}) == pytest.approx(0.6)
    assert boosted_confidence([0.8, 0.5], ["domain", "general"], {"domain": 1.5}) == 1.0
    assert boosted_confidence([0.4, 0.5], ["domain", "general"], {}) == 0.5
    assert boosted_confidence([1.3, 0.5], ["domain", "general"], {}) == 1.0  # clamped without a boost too


def test_a_nan_anchor_confidence_counts_as_zero_not_one():
    """Break-it pass: a NaN hidden state gave NaN scores and confidence 1.0 (min(1.0, nan) is 1.0)."""
    nan = float("nan")
    assert boosted_confidence([nan, nan], ["domain", "general"], {}) == 0.0
    assert boosted_confidence([nan, 0.3], ["domain", "general"], {"general": 2.0}) == pytest.approx(0.6)


def test_load_rules_from_file(tmp_path):
    p = tmp_path / "boost.json"
    p.write_text(json.dumps(RULES))
    assert load_rules(p)[0].multiplier == 1.5
    p.write_text("{not json")
    with pytest.raises(ValueError, match="boost.json"):
        load_rules(p)


def test_serve_refuses_a_bad_rule_file_before_loading_the_model(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps([{"keywords": ["x"], "kinds": ["domain"], "multiplier": -1}]))
    r = subprocess.run([sys.executable, "-m", "sfcl.cli", "serve", "--keyword-boost", str(p)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("sfcl: error:") and "multiplier" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def snapshot_confidences(eng, ids):
    [ev] = run_to_completion(eng, [(ids, SamplingParams(max_tokens=6, snapshot_mode="always"))])
    return [e.confidence for e in ev if isinstance(e, SnapshotEvent)]


def test_boost_applies_to_requests_mentioning_a_keyword(lm, nda_library):
    # no prefix cache: both runs compute the prompt (restored KV can round apart in bf16, e.g. with AMX)
    eng = make_llm_engine(lm, nda_library, EngineConfig(max_num_seqs=2, prefix_cache_tokens=0))
    table = eng.runner.snapshotter.class_table

    def chat(q):
        t = lm.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True)
        return lm.tokenizer(t, add_special_tokens=False)["input_ids"]

    with_kw = chat("Which governing law applies to this agreement?")
    plain = snapshot_confidences(eng, with_kw)
    # rules from the server flag
    eng.runner.snapshotter = Snapshotter(nda_library, table, keyword_boost=parse_rules(RULES))
    boosted = snapshot_confidences(eng, with_kw)
    assert len(plain) == len(boosted) == 6
    assert all(b == pytest.approx(min(1.0, 1.5 * p), rel=1e-5) for p, b in zip(plain, boosted))
    assert any(p < 1.0 and b > p for p, b in zip(plain, boosted))
    # rules from the library's manifest (sfcl anchors boost writes them; older libraries have none)
    assert library_rules(nda_library) == []
    lib = dataclasses.replace(nda_library, manifest={**nda_library.manifest, "keyword_boost": RULES})
    assert library_rules(lib) == parse_rules(RULES)
    eng.runner.snapshotter = Snapshotter(lib, table)
    assert snapshot_confidences(eng, with_kw) == pytest.approx(boosted, rel=1e-5)
    # a request without the keyword is not boosted
    other = chat("Which court decides disputes about this agreement?")
    eng.runner.snapshotter = Snapshotter(nda_library, table)
    base = snapshot_confidences(eng, other)
    eng.runner.snapshotter = Snapshotter(nda_library, table, keyword_boost=parse_rules(RULES))
    # rel 1e-5: the second run of a prompt restores its prefix from the prefix cache, which moves the
    # last float32 digits of the hidden state (seen: 2e-6)
    assert snapshot_confidences(eng, other) == pytest.approx(base, rel=1e-5)
