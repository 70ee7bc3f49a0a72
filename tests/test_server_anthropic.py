"""POST /v1/messages against FakeEngine, through a real uvicorn server and the anthropic SDK."""

from __future__ import annotations

import json
import logging
import time

import anthropic
import httpx
import pytest
from httpx_sse import connect_sse

from sfcl.server.sse import format_frame, named_event
from sfcl.snapshot.mechanisms import DEFAULT_STEER
from sfcl.server.testing import FakeEngine, parse_sse

MODEL = "fake-model"
USER = [{"role": "user", "content": "Tell me a story about a fox"}]


def client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="test-key", max_retries=0, timeout=10)


def raw_stream(url: str, body: dict, headers: dict | None = None) -> tuple[int, list[dict]]:
    with httpx.Client(timeout=10) as c:
        with c.stream("POST", url + "/v1/messages", json=body, headers=headers or {}) as r:
            return r.status_code, parse_sse(r.read().decode("utf-8"))


def wait_for(pred, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def test_sdk_stream_gets_text_and_usage(serve):
    url, eng = serve()
    with client(url) as c:
        with c.messages.stream(model=MODEL, max_tokens=100, messages=USER) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
    assert text == eng.reply
    assert final.stop_reason == "end_turn"
    assert final.usage.input_tokens == len(eng.encode_chat(USER)) == 9
    assert final.usage.output_tokens == len(eng.tokens())
    assert final.id.startswith("msg_") and final.model == MODEL


def test_raw_stream_event_order_and_snapshots(serve):
    url, eng = serve()
    body = {"model": MODEL, "max_tokens": 100, "messages": USER, "stream": True}
    status, frames = raw_stream(url, body)
    assert status == 200
    names = [f["event"] for f in frames]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta", "snapshot_triggered"}
    datas = [json.loads(f["data"]) for f in frames]
    assert all(d["type"] == f["event"] for d, f in zip(datas, frames))

    start = datas[0]["message"]
    assert start["usage"] == {"input_tokens": len(eng.encode_chat(USER)), "output_tokens": 0}
    assert start["content"] == [] and start["stop_reason"] is None and start["role"] == "assistant"
    assert datas[1] == {"type": "content_block_start", "index": 0,
                        "content_block": {"type": "text", "text": ""}}
    text = "".join(d["delta"]["text"] for d in datas if d["type"] == "content_block_delta")
    assert text == eng.reply
    assert datas[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert datas[-2]["usage"] == {"output_tokens": len(eng.tokens())}

    snaps = [(f, d) for f, d in zip(frames, datas) if d["type"] == "snapshot_triggered"]
    assert len(snaps) == len(eng.tokens()) // eng.snapshot_every
    for n, (f, d) in enumerate(snaps):
        assert f["id"] == str(n) == str(d["snapshot_id"])
        assert d["status"] == "snapshot_triggered"
        for key in ("anchor_id", "confidence", "trigger", "triggers", "token_index", "token",
                    "top", "lookup_ms"):
            assert key in d, key
        assert 0.0 <= d["confidence"] <= 1.0 and d["trigger"] in d["triggers"]
        assert d["top"][0]["anchor_id"] == d["anchor_id"]
        assert set(d["top"][0]) == {"anchor_id", "score", "kind", "span"}
        assert set(d["top"][0]["span"]) == {"doc_id", "start", "end", "text"}
    # a snapshot follows the delta of its token
    first_snap = names.index("snapshot_triggered")
    assert datas[first_snap]["token_index"] == eng.snapshot_every - 1
    assert names[first_snap - 1] == "content_block_delta"


def test_raw_stream_has_id_line_via_httpx_sse(serve):
    url, _ = serve()
    body = {"model": MODEL, "max_tokens": 100, "messages": USER, "stream": True}
    with httpx.Client(timeout=10) as c, connect_sse(c, "POST", url + "/v1/messages",
                                                     json=body) as es:
        assert es.response.headers["content-type"].startswith("text/event-stream")
        snaps = [sse for sse in es.iter_sse() if sse.event == "snapshot_triggered"]
    assert snaps and snaps[0].id == "0" and snaps[0].json()["snapshot_id"] == 0


def test_create_non_streaming(serve):
    url, eng = serve()
    with client(url) as c:
        msg = c.messages.create(model=MODEL, max_tokens=100, messages=USER,
                                system="You are terse.")
    assert msg.content[0].text == eng.reply
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.usage.input_tokens == len(eng.encode_chat(USER, "You are terse."))
    assert eng.encoded[-1] == (USER, "You are terse.")
    r = httpx.post(url + "/v1/messages", json={"model": "default", "max_tokens": 100,
                                               "messages": USER})
    body = r.json()
    assert r.status_code == 200 and body["type"] == "message" and body["model"] == MODEL
    assert r.headers["request-id"] == body["id"]
    sfcl = body["sfcl"]
    assert sfcl["snapshots"]["lookups"] == len(sfcl["snapshot_events"]) > 0
    assert sfcl["snapshot_events"][0]["type"] == "snapshot_triggered"


def test_max_tokens_and_stop_sequence(serve):
    url, eng = serve()
    with client(url) as c:
        msg = c.messages.create(model=MODEL, max_tokens=3, messages=USER)
        assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3
        assert msg.content[0].text == "The quick brown "
        msg = c.messages.create(model=MODEL, max_tokens=100, messages=USER,
                                stop_sequences=["lazy"])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "lazy"
    assert msg.content[0].text == "The quick brown fox jumps over the "
    assert eng.requests[-1].params.stop == ["lazy"]


def test_content_blocks_system_blocks_and_merged_turns(serve):
    url, eng = serve()
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]},
                {"role": "user", "content": "c"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "d"}]
    r = httpx.post(url + "/v1/messages", json={
        "model": MODEL, "max_tokens": 5, "messages": messages,
        "system": [{"type": "text", "text": "sys"}], "temperature": 0.2, "top_p": 0.9,
        "metadata": {"user_id": "u1"}, "steer": True})
    assert r.status_code == 200, r.text
    sent, system = eng.encoded[-1]
    assert system == "sys"
    assert sent == [{"role": "user", "content": "a\nb\nc"}, {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": "d"}]
    p = eng.requests[-1].params
    assert (p.max_tokens, p.temperature, p.top_p, p.steer) == (5, 0.2, 0.9, DEFAULT_STEER)


def test_snapshot_mode_header_overrides_body(serve):
    url, eng = serve()
    body = {"model": MODEL, "max_tokens": 100, "messages": USER, "stream": True,
            "snapshot_mode": "off"}
    _, frames = raw_stream(url, body)
    assert not any(f["event"] == "snapshot_triggered" for f in frames)
    assert eng.requests[-1].params.snapshot_mode == "off"
    _, frames = raw_stream(url, body, headers={"x-sfcl-snapshot": "always"})
    snaps = [f for f in frames if f["event"] == "snapshot_triggered"]
    assert len(snaps) == len(eng.tokens())
    assert eng.requests[-1].params.snapshot_mode == "always"
    _, frames = raw_stream(url, {**body, "snapshot_mode": None})  # app default: triggered
    assert eng.requests[-1].params.snapshot_mode == "triggered"


def test_snapshots_unavailable(serve):
    url, eng = serve(FakeEngine(snapshots_available=False))
    r = httpx.post(url + "/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": USER})
    assert r.status_code == 200 and eng.requests[-1].params.snapshot_mode == "off"
    r = httpx.post(url + "/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": USER},
                   headers={"x-sfcl-snapshot": "always"})
    assert r.status_code == 400 and "x-sfcl-snapshot" in r.json()["error"]["message"]


def test_keepalive_ping_while_engine_is_silent(serve):
    eng = FakeEngine(reply="slow words here", start_delay_s=0.3, token_delay_s=0.25)
    url, _ = serve(eng, ping_interval_s=0.1)
    body = {"model": MODEL, "max_tokens": 10, "messages": USER, "stream": True}
    status, frames = raw_stream(url, body)
    assert status == 200
    names = [f["event"] for f in frames]
    # the stream starts before the engine's Started event, with the prompt length we know
    assert json.loads(frames[0]["data"])["message"]["usage"]["input_tokens"] == 9
    assert names.count("ping") >= 4
    first_delta = names.index("content_block_delta")
    assert "ping" in names[first_delta:names.index("content_block_stop")]
    assert all(json.loads(f["data"]) == {"type": "ping"} for f in frames if f["event"] == "ping")
    assert names[-1] == "message_stop"


def test_mid_stream_error_event(serve):
    url, eng = serve(FakeEngine(error_after=3, error_type="overloaded_error",
                                error_message="engine fell over"))
    body = {"model": MODEL, "max_tokens": 100, "messages": USER, "stream": True}
    status, frames = raw_stream(url, body)
    assert status == 200
    assert frames[-1]["event"] == "error"
    assert json.loads(frames[-1]["data"]) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "engine fell over"}}
    assert "message_stop" not in [f["event"] for f in frames]
    with client(url) as c, pytest.raises(anthropic.APIStatusError) as exc:
        with c.messages.stream(model=MODEL, max_tokens=100, messages=USER) as s:
            for _ in s.text_stream:
                pass
    assert "engine fell over" in str(exc.value)


def test_error_event_non_streaming(serve):
    url, _ = serve(FakeEngine(error_after=2, error_type="api_error"))
    r = httpx.post(url + "/v1/messages", json={"model": MODEL, "max_tokens": 50, "messages": USER})
    assert r.status_code == 500
    assert r.json() == {"type": "error", "error": {"type": "api_error",
                                                   "message": "scripted engine failure"}}


def test_client_disconnect_closes_engine_stream(serve):
    eng = FakeEngine(reply="word " * 300, token_delay_s=0.02)
    url, _ = serve(eng)
    body = {"model": MODEL, "max_tokens": 400, "messages": USER, "stream": True}
    with httpx.Client(timeout=10) as c, c.stream("POST", url + "/v1/messages", json=body) as r:
        for line in r.iter_lines():
            if "content_block_delta" in line:
                break
    assert wait_for(lambda: eng.requests and eng.requests[0].closed)
    req = eng.requests[0]
    assert not req.finished and req.generated < 300


def test_client_disconnect_non_streaming(serve):
    eng = FakeEngine(reply="word " * 300, token_delay_s=0.02)
    url, _ = serve(eng)
    body = {"model": MODEL, "max_tokens": 400, "messages": USER}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/messages", json=body, timeout=0.3)
    assert wait_for(lambda: eng.requests and eng.requests[0].closed)
    assert not eng.requests[0].finished


def test_request_log_line(serve):
    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    url, _ = serve()
    grab = Grab()
    logging.getLogger("sfcl.requests").addHandler(grab)
    try:
        r = httpx.post(url + "/v1/messages", json={"model": MODEL, "max_tokens": 5,
                                                   "messages": USER})
        httpx.post(url + "/v1/messages", json={"model": MODEL, "messages": USER})
    finally:
        logging.getLogger("sfcl.requests").removeHandler(grab)
    lines = [json.loads(x) for x in records]
    ok = next(x for x in lines if x["id"] == r.json()["id"])
    assert ok["route"] == "/v1/messages" and ok["status"] == 200
    assert (ok["prompt_tokens"], ok["completion_tokens"]) == (9, 5)
    assert ok["snapshots"] == 1 and ok["ttft_ms"] is not None and ok["duration_ms"] >= 0
    assert any(x["status"] == 400 for x in lines)


def test_format_frame_matches_sse_starlette():
    ev = named_event("snapshot_triggered", {"a": 1}, id=3)
    assert ev.encode().decode() == format_frame({"type": "snapshot_triggered", "a": 1},
                                                event="snapshot_triggered", id=3)
    assert format_frame(comment="ping") == ": ping\n\n"
