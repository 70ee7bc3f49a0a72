"""HTML -> :class:`~sfcl.ingest.clean.Block` s with beautifulsoup4 (called by the pipeline).

Boilerplate is removed before any text is read, and logged: ``script``/``style``/``noscript``/
``template``/``svg``/``iframe``/``form``/``button`` (reason ``html_script``), page chrome
``nav``/``header``/``footer``/``aside`` and elements with ARIA roles navigation/banner/
contentinfo/complementary/search or an id/class such as ``nav``, ``menu``, ``sidebar``,
``breadcrumb``, ``cookie...`` (reason ``html_boilerplate``). When the page has ``<main>`` or
``<article>``, only that is read. ``h1``..``h6`` become headings of rank 1..6; every other block
element (``p``, ``li``, ``td``, ``div``, ...) closes a paragraph.
"""

from __future__ import annotations

import re

from bs4 import BeautifulSoup, Comment, Doctype, NavigableString, ProcessingInstruction, Tag

from sfcl.ingest.clean import Block, DropLog, heading_rank

__all__ = ["html_blocks", "declared_charset"]

_SCRIPT_TAGS = ("script", "style", "noscript", "template", "svg", "iframe", "form", "button", "select",
                "object", "canvas")
_CHROME_TAGS = ("nav", "header", "footer", "aside")
_CHROME_ROLES = frozenset({"navigation", "banner", "contentinfo", "complementary", "search"})
_CHROME_NAME = re.compile(r"^(?:nav|navbar|navigation|menu|menubar|sidebar|breadcrumbs?|cookies?"
                          r"|cookie[-_].*|site[-_](?:header|footer|nav)|skip[-_]link|social[-_].*)$", re.I)
_BLOCK_TAGS = frozenset("p div li ul ol dl dt dd table tr td th thead tbody tfoot caption pre blockquote"
                        " section article main figure figcaption address center hr body html".split())
_HEADINGS = {f"h{i}": i for i in range(1, 7)}
_META_CHARSET = re.compile(rb"<meta[^>]+charset\s*=\s*[\"']?\s*([A-Za-z0-9_.:-]+)", re.I)


def declared_charset(data: bytes) -> str | None:
    """The charset named by ``<meta charset>`` / ``http-equiv`` in the first 4 KiB, if any."""
    m = _META_CHARSET.search(data[:4096])
    return m.group(1).decode("ascii") if m else None


def _is_chrome(tag: Tag) -> bool:
    if tag.name in _CHROME_TAGS:
        return True
    if (tag.get("role") or "").lower() in _CHROME_ROLES:
        return True
    names = [tag.get("id") or ""] + list(tag.get("class") or [])
    return any(_CHROME_NAME.match(n) for n in names if n)


def _outermost(root: Tag, pred) -> list[Tag]:
    """Tags under ``root`` matching ``pred``, in document order, without those inside a match.

    Iterative (a deeply nested page must not exhaust the stack) and never asks a tag for
    ``decomposed``: bs4 answers unknown attributes through ``Tag.__getattr__`` -> ``find()``, a
    search of the whole subtree per tag, quadratic in the nesting depth."""
    out: list[Tag] = []
    stack = list(reversed(root.contents))
    while stack:
        node = stack.pop()
        if not isinstance(node, Tag):
            continue
        if pred(node):
            out.append(node)
        else:
            stack.extend(reversed(node.contents))
    return out


def html_blocks(markup: str, drops: DropLog) -> list[Block]:
    """Split an HTML document into heading and paragraph blocks; log what was removed."""
    soup = BeautifulSoup(markup, "html.parser")
    for t in _outermost(soup, lambda t: t.name in _SCRIPT_TAGS):
        drops.add("html_script", t.name + ": " + " ".join(t.get_text(" ").split()))
        t.decompose()
    for t in _outermost(soup, _is_chrome):
        drops.add("html_boilerplate", t.name + ": " + " ".join(t.get_text(" ").split()))
        t.decompose()
    roots = soup.find_all("main") or soup.find_all("article") or [soup.body or soup]
    blocks: list[Block] = []
    buf: list[str] = []

    def flush() -> None:
        text = " ".join("".join(buf).split())
        buf.clear()
        if text:
            rank = heading_rank(text)
            blocks.append(Block(text, heading_rank=rank))

    flush_mark = object()  # "this block element ends here": flush

    def walk(node: Tag) -> None:  # iterative: nesting depth is the page's, not ours to bound
        stack: list = list(reversed(node.contents))
        while stack:
            child = stack.pop()
            if child is flush_mark:
                flush()
                continue
            if isinstance(child, (Comment, Doctype, ProcessingInstruction)):
                continue
            if isinstance(child, NavigableString):
                buf.append(str(child))
                continue
            if not isinstance(child, Tag):
                continue
            if child.name in _HEADINGS:
                flush()
                text = " ".join(child.get_text(" ").split())
                if text:
                    blocks.append(Block(text, heading_rank=_HEADINGS[child.name]))
            elif child.name == "br":
                buf.append(" ")
            elif child.name in _BLOCK_TAGS:
                flush()
                stack.append(flush_mark)
                stack.extend(reversed(child.contents))
            else:
                stack.extend(reversed(child.contents))

    for root in roots:
        walk(root)
        flush()
    return blocks
