"""Tests for sfcl.ingest.html: boilerplate removal, headings, declared and detected charsets."""

from __future__ import annotations

from pathlib import Path

from sfcl.ingest.clean import DropLog, LengthPolicy
from sfcl.ingest.html import declared_charset, html_blocks
from sfcl.ingest.pipeline import ingest_file

PAGE = """<!DOCTYPE html>
<html><head><title>Acme NDA</title>
<style>body { font-family: serif }</style>
<script>window.analytics = {track: function () {}};</script></head>
<body>
<header class="site-header"><a href="/">Acme Legal Portal</a> | Sign in to your account</header>
<nav><ul><li><a href="/home">Home page of the portal</a></li><li><a href="/docs">All contract templates</a></li></ul></nav>
<div class="cookie-banner">We use cookies to improve your experience on this site.</div>
<main>
  <h1>Mutual Non-Disclosure Agreement</h1>
  <p>This Agreement is entered into by Acme Ltd and Widget GmbH on the Effective Date.</p>
  <h2>ARTICLE 5</h2>
  <h3>5.2 Term</h3>
  <p>The obligations of confidentiality survive for five (5) years<br>after termination of
     this Agreement.</p>
  <ul><li>Each party returns all copies of Confidential Information.</li>
      <li>Each party certifies the return in writing.</li></ul>
  <!-- an editor's comment that must not appear in the output -->
  <div>Loose text directly inside a div is a paragraph too.<p>Nested paragraph inside that div.</p></div>
  <h2>ARTICLE 6</h2>
  <p>This Agreement is governed by the laws of England and Wales.</p>
  <aside>Related: how to sign electronically in three steps</aside>
</main>
<footer>© 2024 Acme Ltd. All rights reserved. Privacy policy and terms of use.</footer>
<script src="/app.js"></script>
</body></html>
"""


def test_boilerplate_removed_and_headings_kept(tmp_path: Path):
    f = tmp_path / "nda.html"
    f.write_text(PAGE, encoding="utf-8")
    res = ingest_file(f, "nda.html", LengthPolicy())
    got = [(p.text, p.headings) for p in res.paragraphs]
    assert got == [
        ("This Agreement is entered into by Acme Ltd and Widget GmbH on the Effective Date.",
         ["Mutual Non-Disclosure Agreement"]),
        ("The obligations of confidentiality survive for five (5) years after termination of this Agreement.",
         ["Mutual Non-Disclosure Agreement", "ARTICLE 5", "5.2 Term"]),
        ("Each party returns all copies of Confidential Information.",
         ["Mutual Non-Disclosure Agreement", "ARTICLE 5", "5.2 Term"]),
        ("Each party certifies the return in writing.", ["Mutual Non-Disclosure Agreement", "ARTICLE 5", "5.2 Term"]),
        ("Loose text directly inside a div is a paragraph too.",
         ["Mutual Non-Disclosure Agreement", "ARTICLE 5", "5.2 Term"]),
        ("Nested paragraph inside that div.", ["Mutual Non-Disclosure Agreement", "ARTICLE 5", "5.2 Term"]),
        ("This Agreement is governed by the laws of England and Wales.",
         ["Mutual Non-Disclosure Agreement", "ARTICLE 6"]),
    ]
    text = " ".join(t for t, _ in got)
    for junk in ("analytics", "cookies", "Sign in", "Home page", "rights reserved", "sign electronically",
                 "editor's comment", "font-family"):
        assert junk not in text
    assert res.drops.counts["html_script"] == 3  # style and two scripts
    assert res.drops.counts["html_boilerplate"] == 5  # header, nav, cookie banner, aside, footer
    assert res.encoding.encoding == "utf-8"


def test_body_without_main_and_class_based_chrome():
    html = ('<html><body><div id="menu">Products Pricing Contact us today</div>'
            '<div class="content"><p>Only this paragraph is the document body.</p></div>'
            '<div role="contentinfo">Company address line and phone</div></body></html>')
    drops = DropLog()
    blocks = html_blocks(html, drops)
    assert [b.text for b in blocks] == ["Only this paragraph is the document body."]
    assert drops.counts["html_boilerplate"] == 2


def test_gbk_html_with_meta_charset(tmp_path: Path):
    body = "<h1>保密协议</h1><p>第一条 保密信息</p><p>乙方对甲方提供的全部技术资料负有保密义务，不得向任何第三方披露。</p>"
    markup = f'<html><head><meta charset="gb2312"></head><body>{body}</body></html>'
    data = markup.encode("gbk")
    assert declared_charset(data) == "gb2312"
    f = tmp_path / "zh.html"
    f.write_bytes(data)
    res = ingest_file(f, "zh.html", LengthPolicy())
    assert res.encoding.method == "declared" and res.encoding.undecodable == 0
    assert [(p.text, p.headings) for p in res.paragraphs] == [
        ("乙方对甲方提供的全部技术资料负有保密义务，不得向任何第三方披露。", ["保密协议", "第一条 保密信息"]),
    ]
