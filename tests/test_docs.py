"""The documentation site: the generated configuration reference is current, and MkDocs builds it.

* every flag of every ``sfcl`` subcommand (nested ones included) appears in the committed
  ``docs/configuration.md``, as ``scripts/gen_config_reference.py`` would write it;
* ``mkdocs build --strict`` (MkDocs Material, ``mkdocs.yml``) passes: no broken link, no page
  missing from the nav.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _gen_module():
    spec = importlib.util.spec_from_file_location("gen_config_reference", REPO / "scripts" / "gen_config_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_configuration_reference_lists_every_flag_of_every_subcommand():
    gen = _gen_module()
    from sfcl.cli import build_parser

    committed = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    missing = []
    n_commands = 0
    for name, parser, _ in gen.commands(build_parser()):
        n_commands += 1
        heading = f"## `{name}`"
        if heading not in committed:
            missing.append(name)
            continue
        section = committed.split(heading, 1)[1].split("\n## ", 1)[0]
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help") and f"`{flag}" not in section and f", {flag}" not in section:
                    missing.append(f"{name} {flag}")
    assert n_commands >= 10 and any(" anchors build" in n for n, _, _ in gen.commands(build_parser()))
    assert not missing, (f"docs/configuration.md lacks {missing}: run python scripts/gen_config_reference.py "
                         "and commit the result")


def test_mkdocs_build_strict_passes(tmp_path):
    pytest.importorskip("mkdocs")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


def test_api_limits_match_the_code():
    """docs/api.md's table of request limits states the constants the server enforces."""
    from sfcl.engine.request import MAX_STOP_CHARS, MAX_STOP_SEQUENCES
    from sfcl.server.parsing import MAX_BODY_BYTES, OFF_LOOP_BYTES
    from sfcl.text import QUOTE_CHARS

    api = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    assert f"at most {MAX_STOP_SEQUENCES}, each 1-{MAX_STOP_CHARS} characters" in api
    assert f"| {MAX_BODY_BYTES // 2**20} MiB |" in api and f"over {OFF_LOOP_BYTES // 2**10} KiB" in api
    assert f"at most {QUOTE_CHARS} characters" in api
