"""sfcl.client: the pure SSE parser (split chunks, CRLF, comments, multi-line data, bad JSON), the
typed decoders, context entropy, the sync and async clients on both routes against the FakeEngine
app (hooks, retry policy, typed errors), and the client against the real `sfcl serve`."""

from __future__ import annotations

import asyncio
import json
import math
import time
import warnings
from collections import Counter
from dataclasses import dataclass

import httpx
import pytest

from sfcl.client import (AsyncSFCLClient, Error, RetryPolicy, SFCLAPIError, SFCLClient,
                         SFCLStreamWarning, Snapshot, SSEParser, Stop, StreamDecoder, TextDelta,
                         context_entropy, iter_events, iter_sse_events, word_pieces)
from sfcl.server.testing import FakeEngine


def bits(counts) -> float:
    """Hand computation: Shannon entropy in bits of a list of counts."""
    n = sum(counts)
    return -sum(c / n * math.log2(c / n) for c in counts)


# ---------------------------------------------------------------------------------------------
# hand-made streams

SNAP = {"type": "snapshot_triggered", "status": "snapshot_triggered", "snapshot_id": 0,
        "anchor_id": 5, "confidence": 0.5, "trigger": "entity_low_confidence",
        "triggers": ["entity_low_confidence"], "token_index": 0, "token": "H",
        "token_logprob": -0.7, "entropy": 1.25, "lookup_ms": 0.3, "library_version": "084c3f22b29c",
        "steer": {"mechanism": "source", "changed": True},
        "top": [{"anchor_id": 5, "score": 0.9, "kind": "general",
                 "span": {"doc_id": "d", "start": 0, "end": 4, "text": "t\u2028x"}}]}
SNAP_JSON = json.dumps(SNAP, ensure_ascii=False)
# the snapshot's JSON split over two data lines (multi-line data): joined with "\n", still JSON
_CUT = SNAP_JSON.index('"anchor_id"')
SNAP_A, SNAP_B = SNAP_JSON[:_CUT], SNAP_JSON[_CUT:]

MESSAGES_STREAM = (
    "\ufeff: a comment before anything\r\n"
    "event: message_start\r\n"
    'data: {"type":"message_start","message":{"usage":{"input_tokens":7,"output_tokens":0}}}\r\n'
    "\r\n"
    "event: ping\r\ndata: {\"type\": \"ping\"}\r\n\r\n"
    "event: content_block_delta\r"
    'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"H\u00e9llo \u20ac \U0001F600"}}\r'
    "\r"
    ": ping\n"
    "event: snapshot_triggered\n"
    "id: 0\n"
    f"data: {SNAP_A}\n"
    f"data:{SNAP_B}\n"
    "\n"
    "event: content_block_delta\n"
    'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" ok"}}\n'
    "\n"
    "event: message_delta\r\n"
    'data: {"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},'
    '"usage":{"output_tokens":3},"sfcl":{"snapshots":{"mode":"triggered","lookups":1}}}\r\n'
    "\r\n"
    "event: message_stop\r\n"
    'data: {"type":"message_stop"}\r\n'
    "\r\n"
)
MESSAGES_FRAMES = [
    ("message_start", '{"type":"message_start","message":{"usage":{"input_tokens":7,"output_tokens":0}}}', ""),
    ("ping", '{"type": "ping"}', ""),
    ("content_block_delta", '{"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
                            '"text":"H\u00e9llo \u20ac \U0001F600"}}', ""),
    ("snapshot_triggered", SNAP_A + "\n" + SNAP_B, "0"),
    ("content_block_delta", '{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" ok"}}', "0"),
    ("message_delta", '{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},'
                      '"usage":{"output_tokens":3},"sfcl":{"snapshots":{"mode":"triggered","lookups":1}}}', "0"),
    ("message_stop", '{"type":"message_stop"}', "0"),
]


def chat_chunk(delta: dict | None = None, finish: str | None = None, **extra) -> str:
    body = {"id": "c", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}], **extra}
    return "data: " + json.dumps(body, ensure_ascii=False)


CHAT_STREAM = (
    chat_chunk({"role": "assistant", "content": ""}) + "\r\n\r\n"
    ": ping\r\n\r\n"
    + chat_chunk({"content": "H\u00e9llo"}) + "\n\n"
    + chat_chunk(sfcl_snapshot=SNAP) + "\r\r"
    + chat_chunk({"content": " ok"}) + "\n\n"
    + chat_chunk(finish="length", sfcl={"snapshots": {"mode": "triggered", "lookups": 1}}) + "\n\n"
    'data: {"id":"c","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}\n\n'
    "data: [DONE]\n\n"
)


def frames_of(chunks) -> list[tuple[str, str, str]]:
    return [(f.event, f.data, f.id) for f in iter_sse_events(chunks)]


def expected_events(route: str) -> list:
    evs = list(iter_events([MESSAGES_STREAM if route == "messages" else CHAT_STREAM], route))
    assert [type(e) for e in evs] == [TextDelta, Snapshot, TextDelta, Stop]
    return evs


# ---------------------------------------------------------------------------------------------
# parser tolerance


def test_sse_parser_frames_crlf_cr_lf_comments_bom_multiline():
    data = MESSAGES_STREAM.encode("utf-8")
    assert frames_of([data]) == MESSAGES_FRAMES
    assert frames_of([MESSAGES_STREAM]) == MESSAGES_FRAMES  # str chunks too
    snap = frames_of([data])[3]
    assert json.loads(snap[1]) == SNAP  # multi-line data joined with "\n" is still the JSON


def test_sse_parser_every_byte_boundary():
    data = MESSAGES_STREAM.encode("utf-8")
    for k in range(len(data) + 1):  # every two-way split, inside CRLF and inside UTF-8 characters
        assert frames_of([data[:k], data[k:]]) == MESSAGES_FRAMES, k
    assert frames_of([data[i:i + 1] for i in range(len(data))]) == MESSAGES_FRAMES
    for step in (2, 3, 5, 7):
        for start in range(step):
            chunks = [data[:start]] + [data[i:i + step] for i in range(start, len(data), step)]
            assert frames_of(chunks) == MESSAGES_FRAMES, (step, start)
    text = CHAT_STREAM
    whole = frames_of([text])
    assert len(whole) == 7 and whole[-1][1] == "[DONE]"
    for k in range(len(text) + 1):  # str chunks, including between the two CRs of "\r\r"
        assert frames_of([text[:k], text[k:]]) == whole, k


def test_sse_parser_spec_details():
    stream = ("data\n\n"  # a field name without a colon: empty value
              "data:no-space\ndata:  two spaces\n\n"
              "event: nodata\nid: 9\n\n"  # no data line: not dispatched, but the id is kept
              "data: x\nfoo: unknown field\nretry: 1500\n\n"
              "id: bad\0id\ndata: y\nretry: 12x\n\n"
              "data: z\r\n\r\n")
    frames = list(iter_sse_events([stream]))
    assert [(f.event, f.data, f.id) for f in frames] == [
        ("message", "", ""), ("message", "no-space\n two spaces", ""), ("message", "x", "9"),
        ("message", "y", "9"), ("message", "z", "9")]
    assert [f.retry for f in frames] == [None, None, 1500, None, None]
    # U+2028 / U+0085 are not line breaks in SSE
    assert frames_of(["data: a\u2028b\u0085c\n\n"]) == [("message", "a\u2028b\u0085c", "")]
    # invalid UTF-8 becomes U+FFFD instead of breaking the stream
    assert frames_of([b"data: \xff\xfe\n\n", b"data: ok\n\n"]) == [
        ("message", "\ufffd\ufffd", ""), ("message", "ok", "")]


def test_sse_parser_truncated_stream_warns_and_discards():
    p = SSEParser()
    assert [f.data for f in p.feed(b"data: one\n\ndata: tw")] == ["one"]
    with pytest.warns(SFCLStreamWarning, match="middle of an event"):
        assert p.close() == []
    with pytest.warns(SFCLStreamWarning):
        assert frames_of(["data: complete line but no blank line\n"]) == []


def test_aiter_response_events_reads_an_httpx_stream_and_refuses_non_sse():
    from httpx_sse import SSEError

    from sfcl.client import aiter_response_events

    data = MESSAGES_STREAM.encode("utf-8")

    async def frames(content_type):
        transport = httpx.MockTransport(lambda r: httpx.Response(200, headers={"content-type": content_type},
                                                                 content=data))
        async with httpx.AsyncClient(transport=transport) as c, c.stream("GET", "http://x/") as r:
            return [(f.event, f.data, f.id) async for f in aiter_response_events(r)]

    assert asyncio.run(frames("text/event-stream; charset=utf-8")) == MESSAGES_FRAMES
    with pytest.raises(SSEError, match="text/event-stream"):
        asyncio.run(frames("application/json"))


def test_decoder_every_byte_boundary_both_routes():
    for route, text in (("messages", MESSAGES_STREAM), ("chat", CHAT_STREAM)):
        want = expected_events(route)
        data = text.encode("utf-8")
        for k in range(len(data) + 1):
            assert list(iter_events([data[:k], data[k:]], route)) == want, (route, k)
        assert list(iter_events([data[i:i + 1] for i in range(len(data))], route)) == want


def test_decoder_events_content_both_routes():
    for route in ("messages", "chat"):
        t1, snap, t2, stop = expected_events(route)
        assert t1.text == "H\u00e9llo \u20ac \U0001F600" if route == "messages" else t1.text == "H\u00e9llo"
        assert t2.text == " ok"
        assert (snap.anchor_id, snap.confidence, snap.trigger, snap.token_index, snap.token) == (
            5, 0.5, "entity_low_confidence", 0, "H")
        assert snap.top[0].anchor_id == 5 and snap.top[0].span["text"] == "t\u2028x"
        assert snap.raw == SNAP and snap.snapshot_id == 0 and snap.entropy == 1.25
        assert (snap.lookup_ms, snap.library_version, snap.steer) == (0.3, "084c3f22b29c", SNAP["steer"])
        assert stop.usage == {"input_tokens": 7, "output_tokens": 3}
        assert stop.snapshots_summary == {"mode": "triggered", "lookups": 1}
        assert stop.stop_reason == ("end_turn" if route == "messages" else "length")


def test_bad_json_warns_and_continues():
    bad = ("event: content_block_delta\ndata: {\"type\": broken\n\n"
           "data: [1, 2]\n\n"  # JSON, but not an object
           "event: content_block_delta\ndata: {\"delta\": \"not a dict\"}\n\n")
    text = MESSAGES_STREAM.replace(": ping\n", bad + ": ping\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        evs = list(iter_events([text.encode()], "messages"))
    assert evs == expected_events("messages")
    msgs = [str(w.message) for w in caught if issubclass(w.category, SFCLStreamWarning)]
    assert len(msgs) == 3 and "not valid JSON" in msgs[0] and "not a JSON object" in msgs[1]
    chat = CHAT_STREAM.replace(": ping", "data: {oops\r\n\r\n: ping")
    with pytest.warns(SFCLStreamWarning, match="not valid JSON"):
        assert list(iter_events([chat], "chat")) == expected_events("chat")


def test_error_and_incomplete_streams():
    err = ('event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
           '"message":"Overloaded"}}\n\n')
    evs = list(iter_events([MESSAGES_STREAM.split("event: message_delta")[0] + err], "messages"))
    assert evs[-1] == Error("overloaded_error", "Overloaded")
    chat_err = ('data: {"error":{"message":"boom","type":"server_error","param":null,'
                '"code":"api_error"}}\n\n')
    evs = list(iter_events([chat_chunk({"content": "a"}) + "\n\n" + chat_err], "chat"))
    assert evs == [TextDelta("a"), Error("server_error", "boom", "api_error")]
    # cut before any stop event: an Error; cut after the finish was announced: a Stop
    evs = list(iter_events([MESSAGES_STREAM.split("event: message_delta")[0]], "messages"))
    assert evs[-1].type == "incomplete_stream"
    evs = list(iter_events([CHAT_STREAM.split("data: [DONE]")[0]], "chat"))
    assert evs[-1] == Stop("length", {"input_tokens": 7, "output_tokens": 3},
                           {"mode": "triggered", "lookups": 1})


def test_context_entropy_definition():
    assert context_entropy([]) == 0.0 and context_entropy(["a"] * 5) == 0.0
    assert context_entropy(list("abcd")) == pytest.approx(2.0)
    assert context_entropy(["a", "b", "b", "c"]) == pytest.approx(bits([1, 2, 1]))
    assert context_entropy([f"w{i}" for i in range(32)]) == pytest.approx(5.0)
    assert word_pieces("The term, 3 (three) years.") == [
        "The", "term", ",", "3", "(", "three", ")", "years", "."]
    # windowing: only the last W word pieces before the snapshot event count
    dec = StreamDecoder("messages", window=3)
    from httpx_sse import ServerSentEvent as F
    dec.feed(F("content_block_delta", json.dumps({"delta": {"type": "text_delta",
                                                             "text": "x " * 500 + "a b b"}})))
    snap, = dec.feed(F("snapshot_triggered", json.dumps({**SNAP, "token_index": 7})))
    assert (snap.entropy_basis, snap.entropy_window) == ("words", 3)
    assert snap.context_entropy == pytest.approx(bits([1, 2]))


# ---------------------------------------------------------------------------------------------
# a mock transport feeding the client tiny chunks (sync and async share the stream class)


class Chunks(httpx.SyncByteStream, httpx.AsyncByteStream):
    def __init__(self, chunks):
        self.chunks = chunks

    def __iter__(self):
        yield from self.chunks

    async def __aiter__(self):
        for c in self.chunks:
            yield c


def chunked_transport(text: str, size: int = 3):
    data = text.encode("utf-8")
    chunks = [data[i:i + size] for i in range(0, len(data), size)]
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, headers={"content-type": "text/event-stream; charset=utf-8"},
                              stream=Chunks(chunks))
    return httpx.MockTransport(handler), seen


def test_client_over_tiny_network_chunks_sync_and_async():
    for route, text in (("messages", MESSAGES_STREAM), ("chat", CHAT_STREAM)):
        transport, seen = chunked_transport(text)
        with SFCLClient("http://127.0.0.1:1/v1", transport=transport, api_key="k") as c:
            fn = c.stream_messages if route == "messages" else c.stream_chat
            assert list(fn("hi", 5)) == expected_events(route)
        req = seen[0]
        assert req.url.path == ("/v1/messages" if route == "messages" else "/v1/chat/completions")
        assert req.headers["accept"] == "text/event-stream" and req.headers["x-api-key"] == "k"
        assert req.headers["authorization"] == "Bearer k"
        body = json.loads(req.content)
        assert body["stream"] is True and body["model"] == "default"

        async def run():
            transport, _ = chunked_transport(text, 2)
            async with AsyncSFCLClient("http://127.0.0.1:1", transport=transport) as c:
                fn = c.stream_messages if route == "messages" else c.stream_chat
                return [ev async for ev in fn("hi", 5)]
        assert asyncio.run(run()) == expected_events(route)


def test_non_sse_success_is_an_error():
    transport = httpx.MockTransport(lambda r: httpx.Response(200, json={"ok": True}))
    with SFCLClient("http://127.0.0.1:1", transport=transport) as c:
        with pytest.raises(SFCLAPIError) as e:
            list(c.stream_messages("hi", 5))
    assert e.value.type == "invalid_response"


# ---------------------------------------------------------------------------------------------
# against the app over a FakeEngine


@dataclass
class ScriptedEngine(FakeEngine):
    """FakeEngine whose n-th request generates ``replies[n]`` (the last one repeats)."""
    replies: tuple = ()
    calls: int = 0

    def stream(self, prompt_ids, params, request_id=None):
        if self.replies:
            self.reply = self.replies[min(self.calls, len(self.replies) - 1)]
        self.calls += 1
        return super().stream(prompt_ids, params, request_id)


DISTINCT = " ".join(f"w{i}" for i in range(40))  # 16 distinct words at i=15: 4 bits > 3.8
REPEAT = "yes " * 20  # 0 bits


def record_hooks(client):
    got = {"text": [], "snapshot_triggered": [], "stop": [], "error": []}
    for name in got:
        client.on(name, got[name].append)
    return got


def test_sync_both_routes_events_and_hooks(serve):
    url, engine = serve()
    words = engine.tokens()
    with SFCLClient(url) as c:
        got = record_hooks(c)
        seen = []
        c.on("snapshot_triggered")(lambda s: seen.append(s.token_index))  # decorator form
        stream = c.stream_messages([{"role": "user", "content": "hello"}], 10, system="be brief")
        evs = list(stream)
        assert "".join(e.text for e in evs if isinstance(e, TextDelta)) == "".join(words[:10])
        assert stream.text == "".join(words[:10]) and len(stream.snapshots) == 2
        assert evs[-1] == Stop("max_tokens", {"input_tokens": len(engine.requests[-1].prompt_ids),
                                              "output_tokens": 10},
                               {"mode": "triggered", "lookups": 2,
                                "triggers": {"entity_low_confidence": 2}, "top_anchors": []})
        assert engine.encoded[-1] == ([{"role": "user", "content": "hello"}], "be brief")
        assert [s.token_index for s in stream.snapshots] == [3, 7] == seen
        assert got["text"] == [e for e in evs if isinstance(e, TextDelta)]
        assert got["snapshot_triggered"] == stream.snapshots and got["stop"] == [evs[-1]]
        # chat route: system becomes a system message; full reply ends with "stop"
        evs = list(c.stream_chat("hello", system="sys", temperature=0.5, snapshot_mode="always"))
        assert engine.encoded[-1][0][0] == {"role": "system", "content": "sys"}
        assert engine.requests[-1].params.temperature == 0.5
        assert evs[-1].stop_reason == "stop" and evs[-1].usage["output_tokens"] == len(words)
        assert sum(isinstance(e, Snapshot) for e in evs) == len(words)
        assert len(got["stop"]) == 2 and got["error"] == []
        r = c.create_message("hello", 5, route="chat", snapshot_mode="off")
        assert (r.text, r.stop_reason, r.snapshots, len(r.attempts)) == ("".join(words[:5]), "length", [], 1)
        with pytest.raises(ValueError):
            c.on("snapshot", print)


def test_async_both_routes_with_async_hooks(serve):
    url, engine = serve()
    words = engine.tokens()

    async def main():
        got = []

        async def on_snap(s):
            await asyncio.sleep(0)
            got.append(s)
        async with AsyncSFCLClient(url) as c:
            c.on("snapshot_triggered", on_snap)
            stops = []
            c.on("stop", stops.append)
            async with c.stream_messages("hi", 8) as s:
                evs = [e async for e in s]
            chat = await c.stream_chat("hi", 8, snapshot_mode="always").result()
            res = await c.create_message("hi", 8, snapshot_mode="always")
        return evs, chat, res, got, stops

    evs, chat, res, got, stops = asyncio.run(main())
    assert "".join(e.text for e in evs if isinstance(e, TextDelta)) == "".join(words[:8])
    assert isinstance(evs[-1], Stop) and evs[-1].stop_reason == "max_tokens"
    assert chat.text == res.text == "".join(words[:8]) and chat.stop_reason == "length"
    assert len(chat.snapshots) == len(res.snapshots) == 8
    assert len(got) == 2 + 8 + 8 and len(stops) == 3


def test_context_entropy_matches_hand_computation(serve):
    reply = "one two two three three three four four four four"
    url, engine = serve(FakeEngine(reply=reply, snapshot_every=5))
    with SFCLClient(url) as c:
        # triggered: words of the text received before each snapshot (FakeEngine sends a token's
        # text before its snapshot, so the window ends with the snapshot's token)
        snaps = c.stream_messages("q", 50).result().snapshots
        assert [(s.token_index, s.entropy_basis, s.entropy_window) for s in snaps] == [
            (4, "words", 5), (9, "words", 10)]
        assert snaps[0].context_entropy == pytest.approx(bits([1, 2, 2]))  # one two two three three
        assert snaps[1].context_entropy == pytest.approx(bits([1, 2, 3, 4]))
        # always: exact tokens i-W..i-1 from the earlier snapshots
        snaps = c.stream_chat("q", 50, snapshot_mode="always").result().snapshots
        assert snaps[0].entropy_basis == "tokens" and snaps[0].context_entropy == 0.0
        assert snaps[9].entropy_window == 9 and snaps[9].context_entropy == pytest.approx(bits([1, 2, 3, 3]))
        toks = [s.token for s in snaps]
        for s in snaps:
            hand = Counter(toks[max(0, s.token_index - 32):s.token_index]).values()
            assert s.context_entropy == pytest.approx(bits(hand) if hand else 0.0)
    with SFCLClient(url, window=4) as c:
        snaps = c.stream_messages("q", 50).result().snapshots
        assert snaps[0].context_entropy == pytest.approx(1.0)  # two two three three
        assert snaps[1].context_entropy == 0.0  # four x4
        snaps = c.stream_messages("q", 50, snapshot_mode="always").result().snapshots
        assert snaps[9].context_entropy == pytest.approx(bits([1, 3]))  # three four four four


def test_retry_policy_regenerates(serve):
    url, engine = serve(ScriptedEngine(replies=(DISTINCT, REPEAT)))
    policy = RetryPolicy(max_entropy=3.8, min_confidence=0.9, max_retries=1, retry_temperature=0.7)
    with SFCLClient(url) as c:
        retried = []
        c.on("stop", retried.append)
        r = c.create_message("q", 100, route="chat", temperature=0.2, seed=5, retry=policy)
    assert len(r.attempts) == 2 and r.regenerated and r.policy_ok and not r.violations
    first, last = r.attempts
    assert first.text == DISTINCT and last.text == REPEAT == r.text and len(retried) == 2
    assert first.violations and first.violations[0].token_index == 15
    assert first.violations[0].context_entropy == pytest.approx(4.0)  # 16 distinct words > 3.8
    assert all(s.context_entropy == 0.0 for s in last.snapshots)
    assert (first.temperature, first.seed, last.temperature, last.seed) == (0.2, 5, 0.7, 6)
    p0, p1 = engine.requests[0].params, engine.requests[1].params
    assert (p0.temperature, p0.seed, p1.temperature, p1.seed) == (0.2, 5, 0.7, 6)
    assert [policy.classify(s) for s in first.snapshots[:4]] == ["ok", "ok", "ok", "regenerate"]
    with SFCLClient(url) as c, pytest.warns(SFCLStreamWarning, match="greedy"):
        c.create_message("q", 3, temperature=0, retry=RetryPolicy())
    # the stable reading of the seed design: low entropy with high confidence
    stable = Snapshot(1, 0.95, "t", ["t"], 3, "x", [], 1.5)
    assert policy.classify(stable) == "stable" and not policy.violates(stable)
    assert policy.violates(Snapshot(1, 0.89, "t", ["t"], 3, "x", [], 3.9))


def test_retry_policy_exhausted_and_abort_early_async(serve):
    url, engine = serve(ScriptedEngine(replies=(DISTINCT + " " + DISTINCT,), token_delay_s=0.01))

    async def main():
        async with AsyncSFCLClient(url) as c:
            exhausted = await c.create_message("q", 30, retry=RetryPolicy(max_retries=2))
            early = await c.create_message("q", 60, retry=RetryPolicy(max_retries=1, abort_early=True))
        return exhausted, early

    exhausted, early = asyncio.run(main())
    assert len(exhausted.attempts) == 3 and not exhausted.policy_ok
    assert all(a.violations and not a.aborted for a in exhausted.attempts)
    assert exhausted.stop_reason == "max_tokens"
    a0, a1 = early.attempts
    assert a0.aborted and a0.stop_reason is None and len(a0.violations) == 1
    assert not a1.aborted and a1.stop_reason == "max_tokens" and a1.violations  # last: read in full
    req = engine.requests[3]  # the aborted one: the server stopped generating
    deadline = time.monotonic() + 5
    while not req.closed and time.monotonic() < deadline:
        time.sleep(0.02)
    assert req.closed and not req.finished and req.generated < 60


def test_http_errors_are_typed(serve):
    url, _ = serve(api_key="sekrit")
    with SFCLClient(url) as c:
        with pytest.raises(SFCLAPIError) as e:
            list(c.stream_messages("hi", 5))
        assert (e.value.status, e.value.type, e.value.retry_after) == (401, "authentication_error", None)
        with pytest.raises(SFCLAPIError) as e:
            c.create_message("hi", 5, route="chat")
        assert (e.value.status, e.value.code) == (401, "invalid_api_key")
    with SFCLClient(url, api_key="sekrit") as c:
        assert c.create_message("hi", 3).stop_reason == "max_tokens"
        with pytest.raises(SFCLAPIError) as e:
            list(c.stream_messages("hi", 0))
        assert (e.value.status, e.value.type) == (400, "invalid_request_error")
        assert "max_tokens" in e.value.message
        with pytest.raises(SFCLAPIError) as e:
            list(c.stream_chat("hi", 5, temperature="hot"))
        assert (e.value.status, e.value.param) == (400, "temperature")
    url, _ = serve(FakeEngine(busy=True, retry_after_s=3))
    with SFCLClient(url) as c:
        with pytest.raises(SFCLAPIError) as e:
            list(c.stream_messages("hi", 5))
        assert (e.value.status, e.value.type, e.value.retry_after) == (529, "overloaded_error", 3.0)
        with pytest.raises(SFCLAPIError) as e:
            list(c.stream_chat("hi", 5))
        assert (e.value.status, e.value.code, e.value.retry_after) == (429, "overloaded", 3.0)

    async def busy_async():
        async with AsyncSFCLClient(url) as c:
            with pytest.raises(SFCLAPIError) as e:
                await c.create_message("hi", 5)
            return e.value
    assert asyncio.run(busy_async()).status == 529


def test_stream_error_event_hook_and_create_message_raises(serve):
    url, _ = serve(FakeEngine(error_after=3))
    with SFCLClient(url) as c:
        errors = []
        c.on("error", errors.append)
        evs = list(c.stream_messages("hi", 20))
        assert [type(e) for e in evs] == [TextDelta] * 3 + [Error]
        assert evs[-1] == Error("api_error", "scripted engine failure")
        evs = list(c.stream_chat("hi", 20))
        assert evs[-1] == Error("server_error", "scripted engine failure", "api_error")
        assert errors == [Error("api_error", "scripted engine failure"), evs[-1]]
        with pytest.raises(SFCLAPIError) as e:
            c.create_message("hi", 20)
        assert (e.value.status, e.value.type) == (None, "api_error")
        assert e.value.attempts[0].text == "The quick brown "


# ---------------------------------------------------------------------------------------------
# against the real server (`sfcl serve` subprocess on the bundled model, NDA anchors)


@pytest.mark.slow
def test_real_server_snapshots_via_client(server, nda_library):  # noqa: F811
    url, _ = server
    question = "What is a notice period in a contract?"
    with SFCLClient(url, timeout=120) as c:
        hooked = []
        c.on("snapshot_triggered", hooked.append)
        stream = c.stream_messages(question, 12, temperature=0, snapshot_mode="always")
        res = stream.result()
        assert res.text.strip() and res.stop_reason in ("max_tokens", "end_turn")
        n = res.usage["output_tokens"]
        assert res.usage["input_tokens"] > 5 and [s.token_index for s in res.snapshots] == list(range(n))
        assert hooked == res.snapshots
        for s in res.snapshots:
            assert 0 <= s.anchor_id < nda_library.n_anchors and 0 <= s.confidence <= 1
            assert s.top[0].anchor_id == s.anchor_id and s.top[0].span["text"]
            assert s.trigger == "always" and s.entropy_basis == "tokens"
            window = [t.token for t in res.snapshots[max(0, s.token_index - 32):s.token_index]]
            assert s.context_entropy == pytest.approx(context_entropy(window))
        toks = "".join(s.token for s in res.snapshots if not s.token.startswith("<|"))
        assert "\ufffd" in toks or toks == res.text
        # a policy every snapshot violates: exactly one regeneration, reported
        with pytest.warns(SFCLStreamWarning, match="greedy"):  # temperature 0: same text again
            forced = c.create_message(question, 4, temperature=0, snapshot_mode="always",
                                      retry=RetryPolicy(max_entropy=-1.0, min_confidence=2.0))
        assert len(forced.attempts) == 2 and not forced.policy_ok
        assert forced.attempts[0].text == forced.text == res.text[:len(forced.text)]

    async def chat():
        async with AsyncSFCLClient(url + "/v1", timeout=120) as c:
            return await c.stream_chat(question, 12, temperature=0, snapshot_mode="triggered").result()

    got = asyncio.run(chat())
    assert got.text == res.text  # greedy: same text on both routes
    assert got.usage["output_tokens"] == n and got.snapshots_summary["mode"] == "triggered"
    for s in got.snapshots:
        assert 0 <= s.anchor_id < nda_library.n_anchors and s.trigger != "always"
