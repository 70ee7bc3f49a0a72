"""Property tests (hypothesis) of the SSE writer and of the incremental detokenizer.

SSE: whatever the event name, data, id and comment (newlines of every kind, U+2028 and the other
characters ``str.splitlines`` breaks on, NUL, lone surrogates...), a frame must be valid UTF-8 and
read back, by a parser that follows the WHATWG rules and by httpx-sse's decoder, as exactly one
event (or none, for a comment) with the same data; a run of frames must never split into more
events nor merge into fewer. The frames the routes send (``named_event`` / ``data_event``) must
carry JSON that decodes back to the payload.

Detokenizer: with a byte-level tokenizer (one token = one UTF-8 byte), for any text and stop
list, released text + flush is the text cut where the first stop sequence completes, never holds
U+FFFD the text did not have, and never contains a stop sequence.

Examples per test: ``SFCL_FUZZ_EXAMPLES`` (default 200).
"""

from __future__ import annotations

import json
import os
import re

import httpx_sse
from httpx_sse._decoders import SSEDecoder, SSELineDecoder
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sfcl.engine.detokenizer import IncrementalDetokenizer
from sfcl.server.sse import DONE, comment_event, data_event, format_frame, named_event

EXAMPLES = int(os.environ.get("SFCL_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

NEWLINE = re.compile(r"\r\n|\r|\n")
SURROGATE = re.compile(r"[\ud800-\udfff]")
# Every character str.splitlines() treats as a line break, plus NUL, BOM, colon and spaces.
TRICKY = "\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029\x00\ufeff: \t"

# Any code point, lone surrogates included, with the tricky ones over-represented.
any_text = st.text(st.one_of(st.characters(codec=None), st.sampled_from(TRICKY)), max_size=40)
valid_text = st.text(st.one_of(st.characters(exclude_categories=["Cs"]),
                               st.sampled_from(TRICKY)), max_size=40)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | any_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=12)


# -- a spec-following SSE reader ----------------------------------------------------------------


def parse(stream: str) -> list[dict]:
    """Events of an SSE stream per https://html.spec.whatwg.org/multipage/server-sent-events.html
    ("interpreting an event stream"): ``[{"event", "data", "id", "comments"}]``; comment-only
    blocks are returned as events with ``data`` None so that comments can be checked too."""
    stream = stream.removeprefix("\ufeff")
    lines = NEWLINE.split(stream)
    lines.pop()  # the text after the last line break is an incomplete line: discarded
    events: list[dict] = []
    data: list[str] = []
    event_type, last_id, comments = "", "", []
    for line in lines:
        if line == "":
            if data:
                events.append({"event": event_type or "message", "data": "\n".join(data),
                               "id": last_id, "comments": comments})
            elif comments:
                events.append({"event": None, "data": None, "id": last_id,
                               "comments": comments})
            data, event_type, comments = [], "", []
            continue
        if line.startswith(":"):
            comments.append(line[1:].removeprefix(" "))
            continue
        name, colon, value = line.partition(":")
        value = value.removeprefix(" ") if colon else ""
        if name == "event":
            event_type = value
        elif name == "data":
            data.append(value)
        elif name == "id" and "\x00" not in value:
            last_id = value
    return events  # an unterminated block at the end of the stream is discarded (the spec's rule)


def parse_httpx_sse(stream: str) -> list[httpx_sse.ServerSentEvent]:
    """The same stream through httpx-sse's line and event decoders (what the SDK tests use)."""
    lines, decoder, out = SSELineDecoder(), SSEDecoder(), []
    for line in lines.decode(stream) + lines.flush():
        ev = decoder.decode(line)
        if ev is not None:
            out.append(ev)
    return out


def sent(text: str) -> str:
    """What a UTF-8 stream can carry of ``text``: lone surrogates become U+FFFD."""
    return SURROGATE.sub("\ufffd", text)


def one_line(text: str) -> str:
    """An event name or id as sent: one line, so CR / LF are dropped."""
    return NEWLINE.sub("", sent(text))


def as_data(text: str) -> str:
    """Data as read back: every line break (CRLF, CR, LF) is a LF."""
    return NEWLINE.sub("\n", sent(text))


# -- format_frame ---------------------------------------------------------------------------------


@FUZZ
@given(data=st.one_of(st.none(), any_text), event=st.one_of(st.none(), any_text),
       id=st.one_of(st.none(), any_text, st.integers()), comment=st.one_of(st.none(), any_text))
@example(data="a\u2028b", event=None, id=None, comment=None)
@example(data="line\n", event=None, id=None, comment=None)
@example(data="x", event="evil\n\ndata: injected", id="1\nevent: other", comment="c\n\ndata: y")
@example(data="\ud800", event="\udfff", id="\ud800", comment="\udc00")
def test_format_frame_reads_back_as_one_event(data, event, id, comment):
    frame = format_frame(data, event=event, id=id, comment=comment)
    frame.encode("utf-8")  # always valid UTF-8: never raises
    events = parse(frame)
    if data is None and comment is None:
        assert events == []
        return
    assert frame.endswith("\n\n")
    assert len(events) == 1, (frame, events)
    [ev] = events
    expect_id = "" if id is None else one_line(str(id))
    if "\x00" in expect_id:
        expect_id = ""  # readers ignore an id with NUL (the spec's rule)
    if comment is not None:
        assert ev["comments"] == NEWLINE.split(sent(comment))
    if data is None:
        assert ev["data"] is None
        return
    assert ev["data"] == as_data(data)
    assert ev["event"] == ((one_line(event) if event is not None else "") or "message")
    assert ev["id"] == expect_id
    # httpx-sse (used by the SDK-level tests) reads the same thing
    [hx] = parse_httpx_sse(frame)
    assert (hx.event, hx.data) == (ev["event"], ev["data"])


@FUZZ
@given(frames=st.lists(st.tuples(st.one_of(st.none(), any_text), st.one_of(st.none(), any_text),
                                 st.one_of(st.none(), any_text)), max_size=6))
def test_a_run_of_frames_never_splits_nor_merges(frames):
    # An event name with no data is not an event (the spec's rule; httpx-sse would still yield
    # one); the routes never send such a frame.
    frames = [(d, e if d is not None else None, c) for d, e, c in frames]
    stream = "".join(format_frame(d, event=e, comment=c) for d, e, c in frames)
    events = [ev for ev in parse(stream) if ev["data"] is not None]
    with_data = [(d, e) for d, e, _ in frames if d is not None]
    assert [ev["data"] for ev in events] == [as_data(d) for d, _ in with_data]
    assert [ev["event"] for ev in events] == [
        (one_line(e) if e is not None else "") or "message" for _, e in with_data]
    assert [(e.event, e.data) for e in parse_httpx_sse(stream)] == [
        (ev["event"], ev["data"]) for ev in events]


@FUZZ
@given(data=json_values.filter(lambda v: not isinstance(v, str) and v is not None),
       event=st.one_of(st.none(), any_text))
@example(data={"text": "a\u2028b\x85c\r\n", "\ud800": ["\udfff"]}, event=None)
def test_json_data_is_one_data_line_that_decodes_to_the_payload(data, event):
    """Non-str data is JSON: one line, whatever its strings hold, decoding to the payload."""
    frame = format_frame(data, event=event)
    frame.encode("utf-8")
    [ev] = parse(frame)
    assert "\n" not in ev["data"]  # compact JSON: a single data: line
    assert json.loads(ev["data"]) == data


# -- the frames the routes send (sse-starlette ServerSentEvent) -----------------------------------


@FUZZ
@given(event_type=any_text, payload=st.dictionaries(any_text, json_values, max_size=4),
       id=st.one_of(st.none(), st.integers(min_value=0), any_text))
@example(event_type="content_block_delta", id=None,
         payload={"delta": {"type": "text_delta", "text": "a\u2028b\r\n\ud800"}})
def test_named_event_round_trips(event_type, payload, id):
    frame = named_event(event_type, payload, id=id).encode().decode("utf-8")
    assert frame == format_frame({"type": event_type, **payload}, event=event_type, id=id)
    [ev] = parse(frame)
    assert ev["event"] == (one_line(event_type) or "message")
    assert json.loads(ev["data"]) == {"type": event_type, **payload}
    [hx] = parse_httpx_sse(frame)
    assert (hx.event, json.loads(hx.data)) == (ev["event"], json.loads(ev["data"]))


@FUZZ
@given(payload=st.one_of(st.dictionaries(any_text, json_values, max_size=4), any_text))
def test_data_event_round_trips(payload):
    frame = data_event(payload).encode().decode("utf-8")
    assert frame == format_frame(payload)
    [ev] = parse(frame)
    assert ev["event"] == "message" and ev["id"] == ""
    if isinstance(payload, str):
        assert ev["data"] == as_data(payload)
    else:
        assert json.loads(ev["data"]) == payload


def test_done_and_ping_frames():
    assert data_event(DONE).encode() == b"data: [DONE]\n\n"
    assert comment_event().encode() == b": ping\n\n"
    assert parse(comment_event().encode().decode()) == [
        {"event": None, "data": None, "id": "", "comments": ["ping"]}]


@FUZZ
@given(text=any_text)
def test_comment_event_is_never_an_event(text):
    frame = comment_event(text).encode().decode("utf-8")
    assert frame == format_frame(comment=text)
    [ev] = parse(frame)
    assert ev["data"] is None and ev["comments"] == NEWLINE.split(sent(text))
    assert parse_httpx_sse(frame) == []


# -- IncrementalDetokenizer -----------------------------------------------------------------------


class ByteTokenizer:
    """Each token id is one byte (ids 0..255); decodes like a byte-level BPE tokenizer."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return bytes(ids).decode("utf-8", errors="replace")


def detokenize(data: bytes, stop: list[str]) -> tuple[list[str], str, str | None]:
    d = IncrementalDetokenizer(ByteTokenizer(), stop)
    pieces, hit = [], None
    for b in data:
        out, hit = d.add(b)
        pieces.append(out)
        if hit:
            break
    return pieces, d.flush(), hit


def first_stop(text: str, stop: list[str]) -> tuple[str, str | None]:
    """Reference: generation ends at the first character that completes a stop sequence; the
    text is cut where the earliest-starting stop sequence that completes there begins."""
    stops = [s for s in stop if s]
    for end in range(1, len(text) + 1):
        head = text[:end]
        found = [(head.find(s), s) for s in stops if s in head]
        if found:
            cut, hit = min(found, key=lambda f: (f[0], -len(f[1])))
            return text[:cut], hit
    return text, None


# The byte tokenizer cannot tell a real U+FFFD from the bytes of an unfinished character (both
# decode to U+FFFD), so the detokenizer waits on both; texts here hold no U+FFFD. Stops are drawn
# from small alphabets too so that they actually occur in the text.
chars = st.characters(exclude_categories=["Cs"], exclude_characters="\ufffd")
small = st.sampled_from("ab\n:é你👍🏽")
det_text = st.text(st.one_of(chars, small, small), max_size=60)
det_stops = st.lists(st.text(st.one_of(small, small, chars), max_size=5), max_size=4)


@FUZZ
@given(text=det_text, stop=det_stops)
@example(text="Answer: 5.\nUser: more", stop=["\nUser:"])
@example(text="xx END yy STOP", stop=["STOP", "END"])
@example(text="abcd", stop=["abcd", "bc"])
@example(text="合同 👍🏽 done", stop=["👍🏽"])
def test_detokenizer_cuts_at_the_first_stop(text, stop):
    pieces, tail, hit = detokenize(text.encode("utf-8"), stop)
    out = "".join(pieces) + tail
    expect, expect_hit = first_stop(text, stop)
    assert (out, hit) == (expect, expect_hit)
    assert "\ufffd" not in out
    assert not any(s and s in out for s in stop)
    # every released piece is whole characters, and no piece ever shows part of a stop that hit
    for p in pieces + [tail]:
        assert p.encode("utf-8").decode("utf-8") == p


@FUZZ
@given(text=det_text, stop=det_stops, data=st.data())
def test_detokenizer_cut_by_max_tokens(text, stop, data):
    """Generation may end after any byte (max_tokens): the unfinished character is dropped."""
    raw = text.encode("utf-8")
    n = data.draw(st.integers(min_value=0, max_value=len(raw)), label="bytes generated")
    pieces, tail, hit = detokenize(raw[:n], stop)
    out = "".join(pieces) + tail
    expect, expect_hit = first_stop(raw[:n].decode("utf-8", errors="ignore"), stop)
    assert (out, hit) == (expect, expect_hit)
    assert "\ufffd" not in out
    assert not any(s and s in out for s in stop)


@FUZZ
@given(text=st.text(st.one_of(st.characters(exclude_categories=["Cs"]), st.just("\ufffd")),
                    max_size=40),
       stop=st.lists(st.text(st.sampled_from("ab\ufffd"), min_size=1, max_size=3), max_size=3))
def test_detokenizer_with_real_replacement_characters(text, stop):
    """Texts holding a real U+FFFD: the output may lose a trailing U+FFFD (it cannot be told
    from an unfinished character), but never gains one and never shows a stop sequence."""
    pieces, tail, _ = detokenize(text.encode("utf-8"), stop)
    out = "".join(pieces) + tail
    assert out.count("\ufffd") <= text.count("\ufffd")
    assert text.startswith(out)
    assert not any(s and s in out for s in stop)
