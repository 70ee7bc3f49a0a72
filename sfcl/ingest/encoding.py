"""Byte decoding for the ingest gate: detect the encoding, decode, and account for every byte.

Called by :mod:`sfcl.ingest.pipeline` for text, markdown and HTML files (PDFs carry their own
text encoding). Everything here is pure Python on bytes already in memory.

Detection order (first match wins):

1. a byte-order mark: UTF-8, UTF-16 LE/BE, UTF-32 LE/BE (WHATWG Encoding, "BOM sniffing");
2. strict UTF-8;
3. UTF-8 with a few bad bytes: the data holds more valid multi-byte UTF-8 sequences than
   invalid bytes, so it is UTF-8 with damage rather than a legacy encoding;
4. GB18030 (a superset of GBK and GB2312), decided from the bytes rather than from a
   statistical model: in real simplified-Chinese text nearly every double-byte character lies in
   the GB2312 block (lead and trail bytes both 0xA1..0xFE), whereas Latin-1/cp1252 text misread as
   GBK pairs an accented letter with a following ASCII byte (trail < 0x80). This stays reliable on
   texts of a handful of characters, where frequency models such as charset-normalizer's have too
   little to go on (it reads "保密协议" in GBK as cp949). At most a few pairs may be broken
   (damaged GB text); Latin text fails here because accented letters are followed by spaces;
5. cp1252/Latin-1, when the non-ASCII characters read as letters next to letters (as in
   "Société", "Zürich") -- the usual look of Western European text;
6. otherwise charset-normalizer's best guess (Big5, Shift_JIS, cp1251, ...), and cp1252 as the
   last resort.

Bytes that the chosen codec cannot decode become U+FFFD in the text and are reported with their
byte offsets (:attr:`Decoded.undecodable_offsets`); nothing is dropped silently.
"""

from __future__ import annotations

import codecs
import threading
from dataclasses import dataclass, field

__all__ = ["Decoded", "decode_bytes"]

_BOMS: tuple[tuple[bytes, str], ...] = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),  # before UTF-16 LE: it starts with the same two bytes
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)

#: Most undecodable-byte offsets kept in a report (the count is always exact).
MAX_OFFSETS = 100


@dataclass(slots=True)
class Decoded:
    """The result of :func:`decode_bytes`.

    Attributes:
        text: Decoded text; each undecodable byte run is one U+FFFD per byte.
        encoding: Python codec name used (``"utf-8"``, ``"gbk"``, ``"gb18030"``, ``"cp1252"``,
            ``"latin-1"``, ``"utf-16-le"``, ...).
        method: How it was chosen: ``"bom"``, ``"utf-8"``, ``"utf-8-damaged"``, ``"gb-bytes"``,
            ``"latin"``, ``"charset-normalizer"``, ``"declared"`` or ``"fallback"``.
        bom: Whether a byte-order mark was present (and removed).
        undecodable: Number of bytes that could not be decoded.
        undecodable_offsets: Byte offsets (into the input, BOM included) of the first
            :data:`MAX_OFFSETS` undecodable bytes.
    """

    text: str
    encoding: str
    method: str
    bom: bool = False
    undecodable: int = 0
    undecodable_offsets: list[int] = field(default_factory=list)

    def as_report(self) -> dict:
        return {"encoding": self.encoding, "method": self.method, "bom": self.bom,
                "undecodable_bytes": self.undecodable,
                "undecodable_offsets": self.undecodable_offsets}


_ERRORS = threading.local()  # the bad-byte spans seen by the current thread's decode call


def _count_errors(exc: UnicodeError) -> tuple[str, int]:
    if not isinstance(exc, UnicodeDecodeError):
        raise exc
    _ERRORS.spans.append((exc.start, exc.end))
    return "\ufffd" * (exc.end - exc.start), exc.end


codecs.register_error("sfcl-ingest-count", _count_errors)


def _decode_counting(data: bytes, codec: str, base: int = 0) -> Decoded:
    """Decode with one U+FFFD per bad byte, recording the bad bytes' offsets (``base`` is added)."""
    _ERRORS.spans = []
    text = data.decode(codec, errors="sfcl-ingest-count")
    count = sum(end - start for start, end in _ERRORS.spans)
    offsets: list[int] = []
    for start, end in _ERRORS.spans:
        offsets.extend(range(base + start, base + min(end, start + MAX_OFFSETS - len(offsets))))
        if len(offsets) >= MAX_OFFSETS:
            break
    return Decoded(text, codec, "", False, count, offsets)


def _utf8_stats(data: bytes) -> tuple[int, int]:
    """(valid multi-byte UTF-8 sequences, invalid bytes) in ``data``."""
    valid = invalid = 0
    i, n = 0, len(data)
    while i < n:
        b = data[i]
        if b < 0x80:
            i += 1
            continue
        need = 1 if 0xC2 <= b <= 0xDF else 2 if 0xE0 <= b <= 0xEF else 3 if 0xF0 <= b <= 0xF4 else 0
        seq = data[i + 1 : i + 1 + need]
        if need and len(seq) == need and all(0x80 <= c <= 0xBF for c in seq):
            try:
                data[i : i + 1 + need].decode("utf-8")
                valid += 1
                i += 1 + need
                continue
            except UnicodeDecodeError:
                pass
        invalid += 1
        i += 1
    return valid, invalid


def _gb_pairs(data: bytes) -> tuple[int, int, int]:
    """Read ``data`` as GB18030 byte pairs: (pairs with a valid GBK trail byte, of those inside
    the GB2312 block, pairs whose trail byte is invalid -- an error or a Latin letter + space)."""
    valid = in_gb2312 = invalid = 0
    i, n = 0, len(data)
    while i < n:
        b = data[i]
        if b < 0x80:
            i += 1
            continue
        if i + 1 >= n:
            invalid += 1
            break
        t = data[i + 1]
        if 0x30 <= t <= 0x39:  # GB18030 four-byte sequence: rare in Chinese prose
            valid += 1
            i += 4
            continue
        if t < 0x40 or t == 0x7F or t == 0xFF or b == 0xFF:
            invalid += 1
            i += 1
            continue
        valid += 1
        if 0xA1 <= b <= 0xF7 and 0xA1 <= t <= 0xFE:
            in_gb2312 += 1
        i += 2
    return valid, in_gb2312, invalid


def _latin_plausible(text: str) -> bool:
    """Non-ASCII characters are mostly letters with a letter on at least one side."""
    non_ascii = [i for i, ch in enumerate(text) if ord(ch) >= 0x80 and ch != "\ufffd"]
    if not non_ascii:
        return True
    good = 0
    for i in non_ascii:
        ch = text[i]
        if ch.isalpha():
            left = text[i - 1] if i else " "
            right = text[i + 1] if i + 1 < len(text) else " "
            # Mojibake of multi-byte encodings puts high characters next to each other
            # ("ºÏÍ¬"); real accents sit between ASCII letters or at word edges.
            if (left.isascii() and (left.isalpha() or left in " '-(")) or (right.isascii() and right.isalpha()):
                good += 1
        elif ch in "€‚„…†‡‰‹›‘’“”•–—™«»°£§©®±²³µ¶·¹º¼½¾×÷¿¡¢¥¦¨¬¯´¸ \u00a0":
            good += 1
    return good / len(non_ascii) >= 0.8


def decode_bytes(data: bytes, declared: str | None = None) -> Decoded:
    """Detect the encoding of ``data`` and decode it.

    Args:
        data: Raw file bytes.
        declared: An encoding named by the document itself (an HTML ``<meta charset>``); used
            when the data is not valid UTF-8 and Python knows the name. GB2312/GBK
            declarations are widened to GB18030, ISO-8859-1/ASCII to cp1252 (WHATWG Encoding).

    Returns:
        :class:`Decoded`. Never raises for any input: undecodable bytes are counted instead.
    """
    for bom, codec in _BOMS:
        if data.startswith(bom):
            d = _decode_counting(data[len(bom) :], codec, base=len(bom))
            d.method, d.bom = "bom", True
            d.encoding = codec
            return d
    try:
        return Decoded(data.decode("utf-8"), "utf-8", "utf-8")
    except UnicodeDecodeError:
        pass
    valid, invalid = _utf8_stats(data)
    if valid >= invalid:
        d = _decode_counting(data, "utf-8")
        d.method = "utf-8-damaged"
        return d
    if declared:
        name = _whatwg_label(declared)
        if name:
            d = _decode_counting(data, name)
            d.method = "declared"
            return d
    valid, in_gb2312, bad = _gb_pairs(data)
    if valid and in_gb2312 >= 0.9 * valid and bad <= max(2, 0.1 * valid):
        for codec in ("gbk", "gb18030"):
            try:
                return Decoded(data.decode(codec), codec, "gb-bytes")
            except UnicodeDecodeError:
                continue
        d = _decode_counting(data, "gb18030")
        d.method = "gb-bytes"
        return d
    latin = _decode_counting(data, "cp1252")
    if _latin_plausible(latin.text):
        if latin.undecodable:
            # Bytes 0x81/0x8D/0x8F/0x90/0x9D are unassigned in cp1252; Latin-1 maps them to
            # C1 control characters, which are no better than U+FFFD, so report them.
            latin.encoding = "cp1252"
        latin.method = "latin"
        return latin
    guess = _charset_normalizer_guess(data)
    if guess:
        d = _decode_counting(data, guess)
        d.method = "charset-normalizer"
        return d
    latin.method = "fallback"
    return latin


def _whatwg_label(label: str) -> str | None:
    name = label.strip().lower()
    if name in ("gb2312", "gbk", "x-gbk", "gb_2312-80", "chinese"):
        name = "gb18030"
    elif name in ("iso-8859-1", "latin1", "latin-1", "us-ascii", "ascii", "windows-1252"):
        name = "cp1252"
    try:
        return codecs.lookup(name).name
    except LookupError:
        return None


def _charset_normalizer_guess(data: bytes) -> str | None:
    try:
        from charset_normalizer import from_bytes
    except ImportError:  # pragma: no cover - a declared dependency
        return None
    best = from_bytes(data).best()
    if best is None or not best.encoding:
        return None
    try:
        return codecs.lookup(best.encoding).name
    except LookupError:
        return None
