"""Adversarial ingest inputs: deeply nested HTML.

Before: ``html_blocks`` walked the tree recursively (RecursionError, the file reported failed,
beyond ~1,000 levels) and asked every tag ``t.decomposed``, which bs4 answers through
``Tag.__getattr__`` -> ``find("_decomposed")``, a search of the whole subtree: quadratic, so
200,000 nested ``<div>`` kept ``sfcl ingest`` busy for minutes.
"""

import time

import pytest

from sfcl.ingest.clean import DropLog
from sfcl.ingest.html import html_blocks


@pytest.mark.parametrize("markup", [
    "<div>" * 20000 + "deep text in the middle" + "</div>" * 20000,
    "<b>" * 20000 + "deep text in the middle",
    "<p><span>" * 10000 + "deep text in the middle",
])
def test_deeply_nested_html_is_linear_and_keeps_the_text(markup):
    t0 = time.perf_counter()
    blocks = html_blocks(markup, DropLog())
    assert time.perf_counter() - t0 < 10.0
    assert [b.text for b in blocks] == ["deep text in the middle"]


def test_boilerplate_inside_deep_nesting_is_still_removed():
    drops = DropLog()
    markup = ("<div>" * 5000 + "<nav>menu home</nav><p>kept paragraph text</p><script>x()</script>"
              + "<div class='sidebar'>side stuff</div>" + "</div>" * 5000)
    blocks = html_blocks(markup, drops)
    assert [b.text for b in blocks] == ["kept paragraph text"]
