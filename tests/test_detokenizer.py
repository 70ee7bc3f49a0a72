"""Incremental detokenization: UTF-8 hold-back and stop sequences, with a byte-level fake tokenizer."""

from sfcl.engine.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """Each token id is one byte (ids 0..255); decode like a byte-level BPE tokenizer."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return bytes(ids).decode("utf-8", errors="replace")


def run(text, stop=None):
    d = IncrementalDetokenizer(ByteTokenizer(), stop)
    pieces, hit = [], None
    for b in text.encode("utf-8"):
        out, hit = d.add(b)
        pieces.append(out)
        if hit:
            break
    tail = d.flush()
    return pieces, tail, hit


def test_multibyte_characters_never_split():
    for text in ["合同期限为五年。", "ok 👍🏽 done", "naïve café"]:
        pieces, tail, _ = run(text)
        assert "".join(pieces) + tail == text
        assert all("\ufffd" not in p for p in pieces)
        # every released piece is whole characters: re-encoding concatenations is lossless
        assert all(p.encode("utf-8").decode("utf-8") == p for p in pieces)


def test_stop_sequence_is_cut_and_never_leaks_partially():
    pieces, tail, hit = run("Answer: 5 years.\nUser: more", stop=["\nUser:"])
    assert hit == "\nUser:"
    assert "".join(pieces) + tail == "Answer: 5 years."
    assert not any("\n" in p for p in pieces)


def test_partial_stop_prefix_is_released_when_it_stops_matching():
    pieces, tail, hit = run("a\nUsb end", stop=["\nUser:"])
    assert hit is None
    assert "".join(pieces) + tail == "a\nUsb end"
    # "\nUs" was held back until "b" showed it was not the stop sequence
    assert "\nUs" not in pieces


def test_earliest_stop_wins_and_flush_returns_held_prefix():
    pieces, tail, hit = run("xx END yy STOP", stop=["STOP", "END"])
    assert hit == "END" and "".join(pieces) == "xx "
    pieces, tail, hit = run("value ST", stop=["STOP"])
    assert hit is None and "".join(pieces) == "value " and tail == "ST"


def test_character_cut_by_max_tokens_is_dropped_not_replaced():
    d = IncrementalDetokenizer(ByteTokenizer())
    out = [d.add(b)[0] for b in "ok 你".encode("utf-8")[:-1]]  # generation stops inside 你
    assert "".join(out) + d.flush() == "ok "
