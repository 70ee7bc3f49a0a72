"""The JSON request log (sfcl.server.request_log.RequestLog): a client that disconnects mid-stream is
logged with the tokens generated before it left, not 0."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from sfcl.server.request_log import RequestLog
from sfcl.server.testing import FakeEngine

USER = [{"role": "user", "content": "hi"}]


def test_token_seen_counts_up_to_the_last_token_index():
    rlog = RequestLog("id", "/v1/messages")
    rlog.token_seen(0)
    rlog.token_seen(4)
    rlog.token_seen(2)  # a snapshot about an earlier token never lowers the count
    assert rlog.completion_tokens == 5


@pytest.fixture
def request_lines():
    lines: list[dict] = []

    class Grab(logging.Handler):
        def emit(self, record):
            lines.append(json.loads(record.getMessage()))

    grab = Grab()
    logging.getLogger("sfcl.requests").addHandler(grab)
    yield lines
    logging.getLogger("sfcl.requests").removeHandler(grab)


def _last_line(request_lines: list[dict]) -> dict:
    """The newest request-log line, waiting up to 10 s for the first one (a line is written when
    the server notices the request has ended)."""
    deadline = time.monotonic() + 10
    while not request_lines and time.monotonic() < deadline:
        time.sleep(0.02)
    assert request_lines, "no request log line"
    return request_lines[-1]


@pytest.mark.parametrize("route,is_text", [
    ("/v1/messages", lambda line: line == "event: content_block_delta"),
    ("/v1/chat/completions", lambda line: line.startswith("data: {") and '"content":"word' in line)])
def test_disconnected_stream_logs_tokens_generated_so_far(serve, request_lines, route, is_text):
    eng = FakeEngine(reply="word " * 300, token_delay_s=0.02)
    url, _ = serve(eng)
    body = {"model": "default", "max_tokens": 400, "messages": USER, "stream": True}
    received = 0
    with httpx.Client(timeout=10) as c, c.stream("POST", url + route, json=body) as r:
        for line in r.iter_lines():
            received += is_text(line)  # one text delta (one word token) per frame
            if received == 5:
                break
    line = _last_line(request_lines)
    assert line["status"] == 499 and line["stop_reason"] is None
    generated = eng.requests[0].generated
    assert generated < 300  # the request really was cut short
    # at least what the client got; at most what the engine made (one may be in flight, unread)
    assert 5 <= line["completion_tokens"] <= generated, (line, generated)


def test_disconnected_non_streaming_request_logs_tokens(serve, request_lines):
    eng = FakeEngine(reply="word " * 300, token_delay_s=0.02)
    url, _ = serve(eng)
    body = {"model": "default", "max_tokens": 400, "messages": USER}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/messages", json=body, timeout=0.5)
    line = _last_line(request_lines)
    assert line["status"] == 499
    assert 0 < line["completion_tokens"] <= eng.requests[0].generated < 300


def test_a_rejected_streaming_request_is_logged_as_a_stream(serve, request_lines):
    """A streaming request refused after its body validated (an unknown model: a 404 before any
    frame) is logged with ``"stream": true``; a body that does not validate logs false."""
    url, _ = serve(FakeEngine())
    body = {"model": "no-such-model", "max_tokens": 4, "messages": USER, "stream": True}
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=10).status_code == 404
    assert httpx.post(url + "/v1/messages", json={**body, "max_tokens": "4"}, timeout=10).status_code == 400
    assert httpx.post(url + "/v1/messages", json={**body, "model": "default", "stream": False},
                      timeout=10).status_code == 200
    got = [(line["status"], line["stream"]) for line in request_lines]
    assert got == [(404, True), (400, False), (200, False)], request_lines


def test_a_non_streaming_client_that_leaves_is_aborted_within_the_disconnect_poll(serve, request_lines):
    """BUG (found by a tester): a non-streaming request noticed its client gone only every ping
    interval (5 s here), generating for nobody meanwhile; now within DISCONNECT_POLL_S (0.25 s).
    At 20 ms a token, 5 s is ~250 tokens; the bound below leaves 2 s of slack."""
    from sfcl.server.generation import DISCONNECT_POLL_S

    assert DISCONNECT_POLL_S <= 0.5
    eng = FakeEngine(reply="word " * 400, token_delay_s=0.02)
    url, _ = serve(eng, ping_interval_s=5.0)
    body = {"model": "default", "max_tokens": 400, "messages": USER}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/messages", json=body, timeout=0.3)
    assert _last_line(request_lines)["status"] == 499
    assert eng.requests[0].generated < 125, eng.requests[0].generated


def test_openai_lines_add_the_finish_reason_the_client_received(serve, request_lines):
    """``stop_reason`` is the engine's (Anthropic's names) on both routes; an OpenAI line adds the
    ``finish_reason`` its client got, streamed or not; an Anthropic line has none."""
    url, _ = serve(FakeEngine(reply="word " * 50))
    body = {"model": "default", "max_tokens": 3, "messages": USER}
    got = httpx.post(url + "/v1/chat/completions", json=body, timeout=10).json()
    assert got["choices"][0]["finish_reason"] == "length"
    with httpx.Client(timeout=10) as c, c.stream("POST", url + "/v1/chat/completions",
                                                 json={**body, "stream": True}) as r:
        frames = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert [f["choices"][0]["finish_reason"] for f in frames if f["choices"]][-1] == "length"
    httpx.post(url + "/v1/messages", json=body, timeout=10)
    deadline = time.monotonic() + 10
    while len(request_lines) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    by_route = [(line["route"], line["stream"], line["stop_reason"], line.get("finish_reason")) for line in request_lines]
    assert by_route == [("/v1/chat/completions", False, "max_tokens", "length"),
                        ("/v1/chat/completions", True, "max_tokens", "length"),
                        ("/v1/messages", False, "max_tokens", None)], request_lines


@pytest.mark.parametrize("stream", [False, True])
def test_failed_requests_log_the_message_the_client_got(serve, request_lines, stream):
    """``error`` is the type in the route's names, ``error_message`` the message sent: for an HTTP
    error (an unknown model) and for an engine error mid-generation."""
    url, _ = serve(FakeEngine(reply="word " * 50, error_after=2, error_message="scripted engine failure"))
    body = {"model": "no-such-model", "max_tokens": 8, "messages": USER, "stream": stream}
    r = httpx.post(url + "/v1/messages", json=body, timeout=10)
    assert r.status_code == 404
    sent = r.json()["error"]["message"]
    line = _last_line(request_lines)
    assert (line["status"], line["error"], line["error_message"]) == (404, "not_found_error", sent)
    request_lines.clear()
    httpx.post(url + "/v1/chat/completions", json={**body, "model": "default"}, timeout=10)
    line = _last_line(request_lines)
    assert line["error_message"] == "scripted engine failure" and line["error"], line
    assert line["stop_reason"] is None and "finish_reason" not in line


@pytest.mark.parametrize("route", ["/v1/messages", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_aborted_generation_is_logged_as_the_error_the_client_got(serve, request_lines, route, stream):
    """An engine that ends a request with Finished(stop_reason="aborted"): the client gets an error,
    and the log line has that error and no stop_reason or finish_reason (a tester's find: the
    streamed line had recorded "aborted" / "stop" as if it had finished)."""
    from sfcl.engine.events import Finished, Started, TextDelta

    class Aborting(FakeEngine):
        async def _run(self, prompt_ids, params, request_id):
            yield Started(request_id=request_id or "x", prompt_tokens=len(prompt_ids))
            yield TextDelta("a ", 0)
            yield Finished(stop_reason="aborted", stop_sequence=None, prompt_tokens=len(prompt_ids),
                           completion_tokens=1, snapshot_summary={"mode": "off", "lookups": 0, "triggers": {},
                                                                  "top_anchors": []}, ttft_ms=1.0)

    url, _ = serve(Aborting())
    r = httpx.post(url + route, json={"model": "default", "max_tokens": 20, "messages": USER, "stream": stream},
                   timeout=10)
    assert "aborted by the server" in r.text
    line = _last_line(request_lines)
    assert line["stop_reason"] is None and "finish_reason" not in line, line
    assert line["error"] and line["error_message"] == "generation was aborted by the server", line


def test_a_non_streaming_client_that_leaves_is_logged_with_its_snapshots(serve, request_lines):
    """A tester's find: the snapshot count was taken only when the generation ended, so a client
    that left before was logged with none."""
    eng = FakeEngine(reply="word " * 300, token_delay_s=0.02, snapshot_every=2)
    url, _ = serve(eng)
    body = {"model": "default", "max_tokens": 400, "messages": USER, "snapshot_mode": "always"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/messages", json=body, timeout=0.5)
    line = _last_line(request_lines)
    assert line["status"] == 499 and line["snapshots"] > 0, line
