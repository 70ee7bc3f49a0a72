"""Tests for sfcl.ingest.encoding: BOMs, UTF-8, GBK/GB18030 vs Latin-1 on short texts, bad bytes."""

from __future__ import annotations

import codecs

import pytest

from sfcl.ingest.encoding import MAX_OFFSETS, decode_bytes

# Our own short contract text (written for these tests).
ZH_CONTRACT = (
    "第一条 保密信息\n"
    "甲方向乙方披露的技术资料、客户名单及报价，均属保密信息。\n"
    "第二条 保密期限\n"
    "本协议项下的保密义务自签署之日起五年内有效，期满后自动终止。\n"
)


@pytest.mark.parametrize("text", [
    "保密协议",                              # 4 characters: frequency models guess cp949 here
    "甲方：华东精密仪器有限公司",
    "违约金为人民币伍拾万元整。",
    ZH_CONTRACT,
])
@pytest.mark.parametrize("codec", ["gbk", "gb18030"])
def test_short_chinese_gbk_and_gb18030(text: str, codec: str):
    d = decode_bytes(text.encode(codec))
    assert d.text == text
    assert d.encoding in ("gbk", "gb18030")
    assert d.method == "gb-bytes"
    assert d.undecodable == 0


def test_gb18030_only_characters():
    text = "第三条 𠮷祥物图样及㐀号文件的保密义务"  # U+20BB7 needs GB18030's four-byte form
    with pytest.raises(UnicodeEncodeError):
        text.encode("gbk")
    d = decode_bytes(text.encode("gb18030"))
    assert (d.text, d.encoding, d.undecodable) == (text, "gb18030", 0)


@pytest.mark.parametrize("text", [
    "café",
    "Zürich",
    "Société Générale à Zürich, garçon naïve façade",
    "Le Bénéficiaire s'engage à ne pas divulguer les informations confidentielles reçues.",
    "Die Vertraulichkeitspflicht gilt für fünf Jahre ab Unterzeichnung; Gerichtsstand ist München.",
])
def test_latin1_with_accents(text: str):
    d = decode_bytes(text.encode("latin-1"))
    assert d.text == text
    assert d.encoding == "cp1252"
    assert d.undecodable == 0


def test_cp1252_punctuation():
    text = "“Confidential Information” — the Recipient’s duty… €500"
    d = decode_bytes(text.encode("cp1252"))
    assert d.text == text and d.encoding == "cp1252"


def test_other_legacy_encoding_goes_to_charset_normalizer():
    text = "Договор о неразглашении конфиденциальной информации между сторонами"
    d = decode_bytes(text.encode("cp1251"))
    assert d.text == text
    assert d.method == "charset-normalizer"


@pytest.mark.parametrize("bom, codec", [
    (codecs.BOM_UTF8, "utf-8"), (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"),
    (codecs.BOM_UTF32_LE, "utf-32-le"),
])
def test_bom(bom: bytes, codec: str):
    text = "Section 5 — 保密 — café"
    d = decode_bytes(bom + text.encode(codec))
    assert (d.text, d.encoding, d.bom, d.method) == (text, codec, True, "bom")


def test_plain_utf8_and_empty():
    assert decode_bytes("naïve 保密".encode()).encoding == "utf-8"
    d = decode_bytes(b"")
    assert (d.text, d.encoding, d.undecodable) == ("", "utf-8", 0)


def test_damaged_utf8_reports_offsets():
    data = "Confidential – 保密 ".encode() + b"\xff\xfe" + " end é".encode() + b"\x80"
    d = decode_bytes(data)
    assert d.method == "utf-8-damaged"
    assert d.undecodable == 3
    assert d.undecodable_offsets == [24, 25, len(data) - 1]
    assert d.text == "Confidential – 保密 \ufffd\ufffd end é\ufffd"
    for off in d.undecodable_offsets:
        assert data[off] in (0xFF, 0xFE, 0x80)


def test_damaged_gbk_reports_offsets():
    good = "保密协议第三条".encode("gbk")
    data = good[:-1] + b" ok"  # last character cut in half
    d = decode_bytes(data)
    assert d.encoding == "gb18030"
    assert d.undecodable == 1 and d.undecodable_offsets == [len(good) - 2]
    assert d.text == "保密协议第三\ufffd ok"


def test_bytes_unassigned_in_cp1252_are_reported():
    d = decode_bytes(b"plain ascii \x81 text")
    assert d.encoding == "cp1252"
    assert d.undecodable == 1 and d.undecodable_offsets == [12]


def test_offsets_capped_count_exact():
    data = "ok é ".encode() + b"\xff" * (MAX_OFFSETS + 50) + "é".encode() * 200
    d = decode_bytes(data)
    assert d.undecodable == MAX_OFFSETS + 50
    assert len(d.undecodable_offsets) == MAX_OFFSETS


def test_declared_charset_used_when_not_utf8():
    text = "保密"
    d = decode_bytes(text.encode("gbk"), declared="GB2312")
    assert (d.text, d.method, d.encoding) == (text, "declared", "gb18030")
    # A declaration never overrides valid UTF-8.
    assert decode_bytes("é".encode(), declared="latin-1").text == "é"
