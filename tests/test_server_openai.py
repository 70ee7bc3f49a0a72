"""POST /v1/chat/completions against FakeEngine, through a real uvicorn server and the openai SDK."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from sfcl.server.testing import FakeEngine, parse_sse

MODEL = "fake-model"
USER = [{"role": "user", "content": "Tell me a story about a fox"}]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="test-key", max_retries=0, timeout=10)


def raw_stream(url: str, body: dict, headers: dict | None = None) -> tuple[int, str]:
    with httpx.Client(timeout=10) as c:
        with c.stream("POST", url + "/v1/chat/completions", json=body,
                      headers=headers or {}) as r:
            return r.status_code, r.read().decode("utf-8")


def chunks_of(text: str) -> list[dict]:
    return [json.loads(f["data"]) for f in parse_sse(text)
            if f["data"] is not None and f["data"] != "[DONE]"]


def test_sdk_stream_text_and_usage(serve):
    url, eng = serve()
    with client(url) as c:
        stream = c.chat.completions.create(model=MODEL, messages=USER, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == eng.reply
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices
              and ch.choices[0].finish_reason]
    assert finish == ["stop"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage.prompt_tokens == len(eng.encode_chat(USER))
    assert usage.completion_tokens == len(eng.tokens())
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_raw_stream_format(serve):
    url, eng = serve()
    body = {"model": MODEL, "messages": USER, "stream": True,
            "stream_options": {"include_usage": True}}
    status, text = raw_stream(url, body)
    assert status == 200
    lines = [ln for ln in text.split("\n") if ln]
    assert not any(ln.startswith(("event:", "id:")) for ln in lines)
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = chunks_of(text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(ch["object"] == "chat.completion.chunk" and ch["model"] == MODEL for ch in chunks)
    assert len({ch["id"] for ch in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    snaps = [ch for ch in chunks if "sfcl_snapshot" in ch]
    assert len(snaps) == len(eng.tokens()) // eng.snapshot_every
    for n, ch in enumerate(snaps):
        assert ch["choices"] == [{"index": 0, "delta": {}, "logprobs": None,
                                  "finish_reason": None}]
        s = ch["sfcl_snapshot"]
        assert s["snapshot_id"] == n and s["status"] == "snapshot_triggered"
        assert {"anchor_id", "confidence", "trigger", "triggers", "token_index", "token", "top",
                "lookup_ms"} <= set(s)
    final = [ch for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] == "stop"
    assert final[0]["sfcl"]["snapshots"]["lookups"] == len(snaps)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 22


def test_stream_without_usage_has_no_usage_chunk(serve):
    url, _ = serve()
    _, text = raw_stream(url, {"model": MODEL, "messages": USER, "stream": True,
                               "max_tokens": 2})
    chunks = chunks_of(text)
    assert all(ch["choices"] for ch in chunks) and "usage" not in chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_create_non_streaming(serve):
    url, eng = serve()
    with client(url) as c:
        resp = c.chat.completions.create(
            model=MODEL, seed=7, temperature=1.5, top_p=0.5,
            messages=[{"role": "developer", "content": "Be brief."},
                      {"role": "user", "content": [{"type": "text", "text": "Tell"},
                                                   {"type": "text", "text": "me"}]}])
    assert resp.choices[0].message.content == eng.reply
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == len(eng.tokens())
    assert resp.usage.prompt_tokens == 7
    messages, system = eng.encoded[-1]
    assert messages == [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Tell\nme"}] and system is None
    p = eng.requests[-1].params
    assert (p.seed, p.temperature, p.top_p) == (7, 1.5, 0.5)
    # default max_tokens: the rest of the context window
    assert p.max_tokens == eng.max_model_len - 7
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": USER})
    body = r.json()
    assert body["object"] == "chat.completion" and r.headers["x-request-id"] == body["id"]
    assert body["sfcl"]["snapshots"]["lookups"] == len(body["sfcl"]["snapshot_events"]) > 0


def test_length_and_stop(serve):
    url, eng = serve()
    with client(url) as c:
        resp = c.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=3)
        assert resp.choices[0].finish_reason == "length"
        assert resp.choices[0].message.content == "The quick brown "
        resp = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=4)
        assert resp.usage.completion_tokens == 4
        resp = c.chat.completions.create(model=MODEL, messages=USER, stop="lazy")
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.content == "The quick brown fox jumps over the "
    assert eng.requests[-1].params.stop == ["lazy"]


def test_snapshot_header_off(serve):
    url, eng = serve()
    _, text = raw_stream(url, {"model": MODEL, "messages": USER, "stream": True,
                               "snapshot_mode": "always"}, headers={"x-sfcl-snapshot": "off"})
    assert not any("sfcl_snapshot" in ch for ch in chunks_of(text))
    assert eng.requests[-1].params.snapshot_mode == "off"


def test_keepalive_comment(serve):
    url, _ = serve(FakeEngine(reply="slow words", token_delay_s=0.25), ping_interval_s=0.05)
    status, text = raw_stream(url, {"model": MODEL, "messages": USER, "stream": True})
    assert status == 200
    assert ": ping" in text.split("\n")
    assert text.rstrip().endswith("data: [DONE]")
    assert "event:" not in text


def test_mid_stream_error(serve):
    url, _ = serve(FakeEngine(error_after=3, error_message="engine fell over"))
    status, text = raw_stream(url, {"model": MODEL, "messages": USER, "stream": True})
    assert status == 200
    frames = parse_sse(text)
    last = json.loads(frames[-1]["data"])
    assert last["error"]["message"] == "engine fell over"
    assert last["error"]["type"] == "server_error"
    assert "[DONE]" not in text
    with client(url) as c, pytest.raises(openai.APIError) as exc:
        for _ in c.chat.completions.create(model=MODEL, messages=USER, stream=True):
            pass
    assert "engine fell over" in str(exc.value)


def test_client_disconnect_closes_engine_stream(serve):
    eng = FakeEngine(reply="word " * 300, token_delay_s=0.02)
    url, _ = serve(eng)
    body = {"model": MODEL, "messages": USER, "stream": True}
    with httpx.Client(timeout=10) as c, c.stream("POST", url + "/v1/chat/completions",
                                                 json=body) as r:
        for line in r.iter_lines():
            if '"content":"word' in line:
                break
    deadline = time.monotonic() + 3
    while not (eng.requests and eng.requests[0].closed) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert eng.requests[0].closed and not eng.requests[0].finished


def test_models_and_health(serve):
    url, eng = serve(api_key="sekrit")
    with openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0) as c:
        models = c.models.list()
        assert [m.id for m in models.data] == [MODEL]
        assert c.models.retrieve(MODEL).id == MODEL
    r = httpx.get(url + "/health")  # open without the key
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert r.json()["model"] == MODEL
    assert httpx.get(url + "/v1/models").status_code == 401
