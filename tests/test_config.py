"""sfcl.config: where the ContractNLI data is read from (``contractnli_path``)."""

from __future__ import annotations

from pathlib import Path

import sfcl.config
from sfcl.config import contractnli_path


def _data(root: Path) -> Path:
    p = root / "shared" / "data" / "contractnli" / "dev.json"
    p.parent.mkdir(parents=True)
    p.write_text("{}")
    return p


def test_contractnli_path_env_var_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("SFCL_DATA_DIR", str(tmp_path / "d"))
    assert contractnli_path() == tmp_path / "d" / "contractnli" / "dev.json"  # even when missing


def test_contractnli_path_beside_the_checkout_whatever_the_cwd(monkeypatch, tmp_path):
    monkeypatch.delenv("SFCL_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    checkout = Path(sfcl.config.__file__).resolve().parents[1]
    assert contractnli_path() == checkout.parent / "shared" / "data" / "contractnli" / "dev.json"


def test_contractnli_path_installed_package_uses_the_cwd_checkout(monkeypatch, tmp_path):
    """Installed (not editable), the package sits in site-packages with no ../shared beside it:
    the checkout containing the working directory is used instead."""
    monkeypatch.delenv("SFCL_DATA_DIR", raising=False)
    site = tmp_path / "venv" / "lib" / "site-packages" / "sfcl"
    site.mkdir(parents=True)
    monkeypatch.setattr(sfcl.config, "__file__", str(site / "config.py"))
    repo = tmp_path / "work" / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "pyproject.toml").write_text("")
    want = _data(tmp_path / "work")
    monkeypatch.chdir(repo / "docs")
    assert contractnli_path() == want
    monkeypatch.chdir(tmp_path)  # no checkout around the cwd either: ../shared beside the cwd
    assert contractnli_path() == tmp_path.parent / "shared" / "data" / "contractnli" / "dev.json"
