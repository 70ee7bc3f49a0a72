"""Versioned library roots: build/boost write new immutable versions, CURRENT, listing, legacy dirs."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from sfcl.cli import main
from sfcl.library.store import AnchorLibraryError, KeywordBoost, _sha256, parse_keyword_boost
from sfcl.library.versions import (CURRENT_FILE, is_root, library_fields, list_versions, load_library,
                                   resolve_library_dir, select, set_current, write_version)
from sfcl.snapshot.boost import kind_multipliers

SAMPLE = Path(__file__).resolve().parents[1] / "sfcl" / "anchors" / "sample_corpus"


def small(lib, n: int = 32) -> dict:
    return select(library_fields(lib), torch.arange(n))


def test_build_writes_versions_and_boost_adds_one(cache_dir, tmp_path, capsys):
    root = tmp_path / "lib"
    build = ["anchors", "build", str(SAMPLE / "01_mutual_nda.md"), "--out", str(root), "--n-anchors", "64",
             "--max-points", "300", "--cache-dir", str(cache_dir), "--threads", "2"]
    assert main(build) == 0
    assert (root / CURRENT_FILE).read_text().strip() == "v0001" and is_root(root)
    v1 = load_library(root)
    assert v1.path == root / "v0001" and v1.n_anchors == 64 and v1.keyword_boost == []
    assert v1.manifest["version"]["number"] == 1 and v1.manifest["version"]["parent"] is None
    assert "anchors build" in v1.manifest["version"]["command"]
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([{"keywords": ["indemnif", "Clause"], "kinds": ["domain"], "multiplier": 1.5}]))
    assert main(["anchors", "boost", str(root), "--rules", str(rules), "--out", str(root)]) == 0
    v2 = load_library(root)
    assert v2.path.name == "v0002" and v2.content_hash == v1.content_hash  # same anchors, new rules
    assert v2.keyword_boost == [KeywordBoost(("indemnif", "Clause"), ("domain",), 1.5)]
    assert v2.manifest["version"]["parent"] == str(v1.path.resolve())
    assert kind_multipliers(v2.keyword_boost, "the INDEMNIFICATION clause") == {"domain": 1.5}
    assert kind_multipliers(v2.keyword_boost, "nothing relevant") == {}
    # the older version still loads by its directory and its files still match their checksums
    assert load_library(v1.path).keyword_boost == []
    for f, h in v1.manifest["files"].items():
        assert _sha256(v1.path / f) == h
    capsys.readouterr()
    assert main(["anchors", "versions", str(root)]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[1].startswith("  v0001") and listing[2].startswith("* v0002") and "boost" in listing[2]
    rules.write_text(json.dumps([{"keywords": [], "kinds": ["domain"], "multiplier": 1.5}]))
    assert main(["anchors", "boost", str(root), "--rules", str(rules), "--out", str(root)]) == 2
    assert "keywords" in capsys.readouterr().err


def test_keyword_boost_rules_are_validated():
    with pytest.raises(ValueError, match="multiplier"):
        parse_keyword_boost([{"keywords": ["x"], "kinds": ["domain"], "multiplier": 0}])
    with pytest.raises(ValueError, match="kinds"):
        parse_keyword_boost([{"keywords": ["x"], "kinds": ["special"], "multiplier": 2}])
    with pytest.raises(ValueError, match="lists"):
        parse_keyword_boost([{"keywords": "indemnity", "multiplier": 2}])
    assert parse_keyword_boost([{"keywords": ["x"], "multiplier": 2}])[0].kinds == ("domain",)


def test_plain_library_loads_and_is_never_written_into(nda_library, tmp_path):
    assert not is_root(nda_library.path) and resolve_library_dir(nda_library.path) == nda_library.path
    with pytest.raises(FileExistsError, match="plain"):
        write_version(nda_library.path, small(nda_library), command="t")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not an anchor-library root"):
        write_version(tmp_path / "junk", small(nda_library), command="t")


def test_current_pointer_damage_and_recovery(nda_library, tmp_path):
    root = tmp_path / "lib"
    write_version(root, small(nda_library, 16), command="a", parent=nda_library)
    write_version(root, small(nda_library, 24), command="b", parent=nda_library)
    assert load_library(root).n_anchors == 24
    set_current(root, "v0001")  # roll back: only the pointer moves
    assert load_library(root).n_anchors == 16 and [v.current for v in list_versions(root)] == [True, False]
    (root / CURRENT_FILE).write_text("v0009\n")
    with pytest.raises(AnchorLibraryError, match="v0009"):
        load_library(root)
    (root / CURRENT_FILE).unlink()  # a crash between the version rename and the pointer update
    assert load_library(root).n_anchors == 24
    with pytest.raises(ValueError):
        set_current(root, "v0042")


def test_concurrent_writers_get_distinct_versions(nda_library, tmp_path):
    root = tmp_path / "lib"
    paths, errors = [], []

    def writer(n: int) -> None:
        try:
            paths.append(write_version(root, small(nda_library, n), command=f"w{n}"))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(8 + i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(p.name for p in paths) == ["v0001", "v0002", "v0003", "v0004"]
    assert sorted(v.n_anchors for v in list_versions(root)) == [8, 9, 10, 11]
    assert (root / CURRENT_FILE).read_text().strip() == "v0004"  # never moved backwards
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_manifest_without_lifecycle_fields_still_loads(nda_library, tmp_path):
    """Libraries written before versions/boost (no keyword_boost, content_hash, version) load."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(nda_library.path, old)
    m = json.loads((old / "manifest.json").read_text())
    want = load_library(nda_library.path).content_hash
    for key in ("keyword_boost", "content_hash", "version"):
        m.pop(key, None)
    (old / "manifest.json").write_text(json.dumps(m))
    lib = load_library(old)
    assert lib.keyword_boost == [] and lib.content_hash == want and lib.n_anchors == nda_library.n_anchors
    m["keyword_boost"] = [{"keywords": ["x"], "kinds": ["domain"], "multiplier": -1}]
    (old / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(AnchorLibraryError, match="keyword_boost"):
        load_library(old)
