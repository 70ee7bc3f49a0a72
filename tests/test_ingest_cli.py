"""End-to-end tests of ``sfcl ingest`` (sfcl.ingest.cli + pipeline) and reading its output back
with ``read_corpus`` (what ``sfcl anchors build DIR`` does)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, contractnli_docs
from sfcl.anchors.corpus import read_corpus
from sfcl.cli import main
from test_ingest_html import PAGE
from test_ingest_pdf import render_pdf
from sfcl.ingest.clean import heading_rank

# Our own short Chinese contract (written for these tests).
ZH = (
    "技术服务合同\n"
    "第一条 服务内容\n"
    "乙方为甲方提供数据分析平台的安装、调试及为期一年的维护服务。\n"
    "第二条 保密义务\n"
    "双方对在履行本合同过程中知悉的对方商业秘密负有保密义务，保密期限为合同终止后三年。\n"
)
FR = ("Accord de confidentialité\n\n"
      "La Société Générale à Zürich s'engage à protéger les données reçues du Bénéficiaire.\n\n"
      "Cette obligation reste en vigueur pendant cinq (5) années après la résiliation.\n")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("in")
    nda = contractnli_docs(1)[0]
    lines = [ln.strip() for ln in nda.text.split("\n") if ln.strip()]
    render_pdf([(ln, heading_rank(ln)) for ln in lines], "Two-way NDA (draft)", d / "nda.pdf")
    (d / "contract_gbk.txt").write_bytes(ZH.encode("gbk"))
    (d / "contract_gb18030.md").write_bytes(("# 合同\n\n" + ZH).encode("gb18030"))
    (d / "accord.txt").write_bytes(FR.encode("latin-1"))
    (d / "damaged.txt").write_bytes(
        "The Recipient shall keep the Information confidential – “strictly”.".encode() + b"\xff\xfe"
        + " It applies for five (5) years.".encode())
    (d / "page.html").write_text(PAGE, encoding="utf-8")
    (d / "notes.docx").write_bytes(b"PK\x03\x04 not supported")
    return d


def _run(tmp: Path, inputs: Path, *extra: str) -> tuple[int, Path]:
    out = tmp / "out"
    names = ["nda.pdf", "contract_gbk.txt", "contract_gb18030.md", "accord.txt", "damaged.txt", "page.html",
             "notes.docx", "missing.pdf"]
    rc = main(["ingest", *[str(inputs / n) for n in names], "--out", str(out), "--quiet", *extra])
    return rc, out


def test_ingest_end_to_end_and_read_corpus(tmp_path: Path, inputs: Path, capsys):
    rc, out = _run(tmp_path, inputs)
    assert rc == 0
    printed = capsys.readouterr().out
    assert "missing.pdf [pdf] error: no such file or directory" in printed
    assert "notes.docx [?] error: unsupported file type '.docx'" in printed
    assert "2 undecodable bytes at offsets" in printed
    assert "total: 8 files (6 ok, 0 empty, 2 failed)" in printed

    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    files = {f["doc_id"]: f for f in report["files"]}
    assert report["format"] == "sfcl-ingest"
    assert files["contract_gbk.txt"]["encoding"]["encoding"] in ("gbk", "gb18030")
    assert files["contract_gb18030.md"]["encoding"]["encoding"] in ("gbk", "gb18030")
    assert files["accord.txt"]["encoding"]["encoding"] == "cp1252"
    dmg = files["damaged.txt"]["encoding"]
    raw = (inputs / "damaged.txt").read_bytes()
    assert dmg["undecodable_bytes"] == 2 and [raw[o] for o in dmg["undecodable_offsets"]] == [0xFF, 0xFE]
    assert files["nda.pdf"]["dropped"]["page_number"]["count"] == files["nda.pdf"]["pages"]
    assert files["nda.pdf"]["dropped"]["running_header"]["count"] == files["nda.pdf"]["pages"]
    assert files["page.html"]["dropped"]["html_boilerplate"]["count"] == 5
    assert report["totals"]["undecodable_bytes"] == 2
    assert report["totals"]["paragraphs"] == sum(f["paragraphs"] for f in report["files"])

    docs = {d.doc_id: d for d in read_corpus([out])}
    assert list(docs) == ["nda.pdf", "contract_gbk.txt", "contract_gb18030.md", "accord.txt", "damaged.txt",
                          "page.html"]
    zh = docs["contract_gbk.txt"]
    assert zh.text == ("乙方为甲方提供数据分析平台的安装、调试及为期一年的维护服务。\n\n"
                       "双方对在履行本合同过程中知悉的对方商业秘密负有保密义务，保密期限为合同终止后三年。")
    assert [p["headings"] for p in zh.meta["paragraphs"]] == [["第一条 服务内容"], ["第二条 保密义务"]]
    assert docs["contract_gb18030.md"].meta["paragraphs"][0]["headings"] == ["合同", "第一条 服务内容"]
    assert "La Société Générale à Zürich" in docs["accord.txt"].text
    assert "confidential – “strictly”.\ufffd\ufffd It applies" in docs["damaged.txt"].text
    assert docs["nda.pdf"].meta["source_file"] == str(inputs / "nda.pdf")
    # Record offsets index the rebuilt document text.
    records = [json.loads(ln) for ln in (out / "paragraphs.jsonl").read_text(encoding="utf-8").splitlines()]
    for rec in records:
        assert docs[rec["doc_id"]].text[rec["char_start"] : rec["char_end"]] == rec["text"]
    assert {r["page"] for r in records if r["doc_id"] == "nda.pdf"} >= {1, 2, 3}


def test_strict_and_nothing_ingested(tmp_path: Path, inputs: Path, capsys):
    rc, _ = _run(tmp_path, inputs, "--strict")
    assert rc == 1
    assert "--strict: 2 files failed" in capsys.readouterr().err
    rc = main(["ingest", str(inputs / "notes.docx"), str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o2"),
               "--quiet"])
    assert rc == 1
    assert "nothing was ingested" in capsys.readouterr().err


def test_length_flags(tmp_path: Path, inputs: Path):
    out = tmp_path / "o"
    assert main(["ingest", str(inputs / "accord.txt"), "--out", str(out), "--quiet", "--min-chars", "30",
                 "--max-chars", "80", "--long", "drop"]) == 0
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    f = report["files"][0]
    assert report["config"] == {"min_chars": 30, "max_chars": 80, "long": "drop"}
    assert f["dropped"]["too_short"]["count"] == 1   # the 25-character title
    assert f["dropped"]["too_long"]["count"] == 1    # the 84-character sentence
    assert f["paragraphs"] == 1


def test_bad_out_dir_and_help(tmp_path: Path, inputs: Path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "x").write_text("x")
    r = subprocess.run([sys.executable, "-m", "sfcl.cli", "ingest", str(inputs / "accord.txt"), "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == f"sfcl: error: {out}: output directory must not exist or be empty"
    with pytest.raises(SystemExit) as e:
        main(["ingest", "--help"])
    assert e.value.code == 0
